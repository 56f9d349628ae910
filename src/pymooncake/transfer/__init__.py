"""pymooncake.transfer (see DESIGN.md §2)."""
