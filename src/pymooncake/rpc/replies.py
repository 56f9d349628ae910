"""Decoding a response frame: the reply envelope and its result or error (both clients)."""

from __future__ import annotations

from typing import Any

import msgspec

from pymooncake.rpc.codec import NIL, Reply, decoder, field_error, unpack_body
from pymooncake.rpc.errors import ErrorCode, RpcError

_REPLY = decoder(Reply)


def reply_of(body: bytes | memoryview) -> Reply:
    """The response envelope of a frame body; ``ValueError`` when it is none."""
    try:
        return _REPLY.decode(body)
    except msgspec.DecodeError as e:
        raise ValueError(f"malformed response frame of {len(body)} bytes: {e}") from None


def result_of(msg: Reply, reply_type: Any = None) -> Any:
    """The result of a response (decoded as ``reply_type`` when given, every field
    checked), or the ``RpcError`` it carries."""
    err = msg.e
    if err is not None:
        if not isinstance(err, dict):
            raise RpcError(ErrorCode.MALFORMED_FRAME, f"malformed error response: {err!r:.80}")
        raise RpcError(str(err.get("c", ErrorCode.INTERNAL)), str(err.get("s", "")), err.get("d"))
    raw = msg.r
    try:
        if reply_type is None:
            return unpack_body(raw) if len(raw) else None
        return decoder(reply_type).decode(raw if len(raw) else NIL)
    except msgspec.DecodeError as e:
        raise RpcError(ErrorCode.MALFORMED_FRAME,
                       field_error(e, getattr(reply_type, "__name__", "result"))) from None
    except ValueError as e:
        raise RpcError(ErrorCode.MALFORMED_FRAME, str(e)) from None
