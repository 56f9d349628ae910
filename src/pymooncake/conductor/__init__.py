"""pymooncake.conductor (see DESIGN.md §2)."""
