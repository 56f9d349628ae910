"""Helpers shared by the compat store's method groups: Mooncake's return codes from
pymooncake's errors, size strings, free ports, buffer sizes."""

from __future__ import annotations

import logging
import random
import socket
from typing import Any

from pymooncake.obs.logging import init_logger
from pymooncake.store.errors import ErrorCode, StoreError

logger = init_logger(__name__)

OK = int(ErrorCode.OK)
INVALID_PARAMS = int(ErrorCode.INVALID_PARAMS)
NOT_FOUND = int(ErrorCode.OBJECT_NOT_FOUND)
EXISTS = ErrorCode.OBJECT_ALREADY_EXISTS
PORT_RANGE = (12300, 14300)  # Mooncake's range for a client's transfer port


def parse_size(value: Any, name: str) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{name}={value!r}: expected bytes")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{name}={value}: must be >= 0")
        return value
    if isinstance(value, str):
        t = value.strip().upper()
        if t.endswith("%"):
            raise ValueError(f"{name}={value!r}: a percentage is not accepted")
        for suffix, mult in (("TB", 1 << 40), ("GB", 1 << 30), ("MB", 1 << 20),
                             ("KB", 1 << 10), ("T", 1 << 40), ("G", 1 << 30), ("M", 1 << 20),
                             ("K", 1 << 10), ("B", 1)):
            if t.endswith(suffix):
                num = t[: -len(suffix)].strip()
                if not num:
                    break
                return int(float(num) * mult)
        else:
            return int(float(t))
        raise ValueError(f"{name}={value!r}: no number before the unit")
    raise ValueError(f"{name}={value!r}: expected an int or a size string like '16MB'")


def code(e: BaseException) -> int:
    """Mooncake's return code for ``e``; the reason is logged (Mooncake logs its errors,
    the code alone does not say why): a missing or existing key at DEBUG, the rest at
    WARNING."""
    quiet = isinstance(e, StoreError) and e.code in (ErrorCode.OBJECT_NOT_FOUND, EXISTS)
    logger.log(logging.DEBUG if quiet else logging.WARNING, "mooncake compat: %s", e)
    if isinstance(e, StoreError):
        # Mooncake's Python API answers -600 for an empty or oversized key
        return INVALID_PARAMS if e.code == ErrorCode.INVALID_KEY else int(e.code)
    if isinstance(e, ValueError | TypeError):
        return INVALID_PARAMS
    return int(ErrorCode.INTERNAL_ERROR)


def put_code(e: StoreError | None) -> int:
    if e is None or e.code == EXISTS:
        return OK  # Mooncake: a put of an existing key returns 0 and keeps the value
    return code(e)


def free_port() -> int:
    """A TCP port in Mooncake's range that is free now (the engine binds it next)."""
    lo, hi = PORT_RANGE
    for port in random.sample(range(lo, hi), 64):
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
            return port
    return 0


def buffer_nbytes(value: Any) -> int:
    """Bytes in a buffer-protocol value; ``TypeError`` for anything else (as pybind's
    ``Buffer`` argument: a ``str`` is refused)."""
    try:
        return memoryview(value).nbytes
    except TypeError:
        raise TypeError(f"value must support the buffer protocol, got "
                        f"{type(value).__name__}") from None

