"""pymooncake.engine (see DESIGN.md §2)."""
