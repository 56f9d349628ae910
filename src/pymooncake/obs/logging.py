"""Logging set-up: ``logger = init_logger(__name__)``, lazy ``%s`` arguments, no print."""

from __future__ import annotations

import logging
import os

_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_configured = False


def init_logger(name: str) -> logging.Logger:
    """Return the logger for ``name``; the first call configures the root handler once.

    The level comes from ``PYMOONCAKE_LOG_LEVEL`` (default ``WARNING``).
    """
    global _configured
    if not _configured:
        level = os.environ.get("PYMOONCAKE_LOG_LEVEL", "WARNING").upper()
        root = logging.getLogger("pymooncake")
        if not root.handlers:
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter(_FORMAT))
            root.addHandler(handler)
        root.setLevel(getattr(logging, level, logging.WARNING))
        _configured = True
    return logging.getLogger(name)
