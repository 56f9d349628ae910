"""pymooncake.identity (see DESIGN.md §2)."""
