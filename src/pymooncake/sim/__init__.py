"""pymooncake.sim (see DESIGN.md §2)."""
