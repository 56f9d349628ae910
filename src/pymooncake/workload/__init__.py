"""pymooncake.workload (see DESIGN.md §2)."""
