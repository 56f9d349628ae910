"""pymooncake.obs (see DESIGN.md §2)."""
