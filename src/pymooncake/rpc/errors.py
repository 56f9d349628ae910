"""RPC errors: one exception type carrying a string code, a message and optional data."""

from __future__ import annotations

from typing import Any


class ErrorCode:
    """Codes the RPC layer itself produces; services add their own (e.g. ``NO_SPACE``)."""

    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    """The params did not match the method's message type."""
    UNKNOWN_METHOD = "UNKNOWN_METHOD"
    MALFORMED_FRAME = "MALFORMED_FRAME"
    """The frame was not a msgpack request map, or too large."""
    INTERNAL = "INTERNAL"
    """The handler raised something other than ``RpcError``."""
    TIMEOUT = "TIMEOUT"
    CONNECTION = "CONNECTION"


class RpcError(Exception):
    """A call failed; ``code`` says how (``ErrorCode`` or a service's own code).

    Raised by clients for an error response, and by handlers to send one: the caller gets
    an ``RpcError`` with the same ``code``, ``message`` and ``data``.
    """

    def __init__(self, code: str, message: str, data: Any = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.data = data

    def to_wire(self) -> dict[str, Any]:
        return {"c": self.code, "s": self.message, "d": self.data}


class RpcTimeout(RpcError):
    """No response within the call's timeout (the request may or may not have run)."""

    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.TIMEOUT, message)


class RpcConnectionError(RpcError):
    """The connection could not be opened, or was lost before the response arrived."""

    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.CONNECTION, message)
