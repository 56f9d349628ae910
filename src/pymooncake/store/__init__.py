"""pymooncake.store (see DESIGN.md §2)."""
