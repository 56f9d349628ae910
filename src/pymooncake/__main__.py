"""``python -m pymooncake`` → the ``pymooncake`` command."""

from pymooncake.cli.main import main

raise SystemExit(main())
