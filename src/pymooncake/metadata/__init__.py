"""pymooncake.metadata (see DESIGN.md §2)."""
