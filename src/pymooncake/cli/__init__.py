"""The ``pymooncake`` command: one entry point, one sub-command per component."""
