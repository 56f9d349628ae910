"""pymooncake.rpc (see DESIGN.md §2)."""
