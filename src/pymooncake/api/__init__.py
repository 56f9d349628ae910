"""pymooncake.api (see DESIGN.md §2)."""
