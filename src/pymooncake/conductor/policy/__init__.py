"""pymooncake.conductor.policy (see DESIGN.md §2)."""
