"""Store status codes: Mooncake's ``ErrorCode`` numbers, and ``StoreError``.

The numbers are those of the open-source Mooncake Store (``mooncake-store/include/types.h``,
observed through its Python API: ../shared/MOONCAKE.md "Error codes"). Each code maps to
exactly one generic status of the field cases (``OK``, ``NOT_FOUND``, ``NOT_READY``,
``LEASE_EXPIRED``, ``ALREADY_EXISTS``, ``NO_SPACE``, ``INVALID_ARGUMENT``, ``STALE_HANDLE``);
codes with no counterpart there map to ``IN_USE`` (a lease or pin protects the object),
``UNAVAILABLE`` (a peer or the master cannot be reached) or ``INTERNAL``.
"""

from __future__ import annotations

import enum


class ErrorCode(enum.IntEnum):
    """Mooncake's store error codes (negative ints in its Python API)."""

    OK = 0
    INTERNAL_ERROR = -1
    BUFFER_OVERFLOW = -10
    SEGMENT_NOT_FOUND = -101
    SEGMENT_ALREADY_EXISTS = -102
    CLIENT_NOT_FOUND = -103
    NO_AVAILABLE_HANDLE = -200
    INVALID_VERSION = -300
    INVALID_KEY = -400
    WRITE_FAIL = -500
    INVALID_PARAMS = -600
    ILLEGAL_CLIENT = -601
    INVALID_WRITE = -700
    INVALID_READ = -701
    INVALID_REPLICA = -702
    REPLICA_IS_NOT_READY = -703
    OBJECT_NOT_FOUND = -704
    OBJECT_ALREADY_EXISTS = -705
    OBJECT_HAS_LEASE = -706
    LEASE_EXPIRED = -707
    TRANSFER_FAIL = -800
    CHECKSUM_MISMATCH = -801
    RPC_FAIL = -900
    RPC_TIMEOUT = -901
    ETCD_OPERATION_ERROR = -1000
    ETCD_KEY_NOT_EXIST = -1001
    ETCD_TRANSACTION_FAIL = -1002
    ETCD_CTX_CANCELLED = -1003
    UNAVAILABLE_IN_CURRENT_STATUS = -1010
    NOT_SUPPORTED = -1012

    @property
    def status(self) -> str:
        """The generic status name of ../shared/cases/CASES.md this code maps to."""
        return _GENERIC.get(self, "INTERNAL")


_GENERIC: dict[ErrorCode, str] = {
    ErrorCode.OK: "OK",
    ErrorCode.OBJECT_NOT_FOUND: "NOT_FOUND",
    ErrorCode.SEGMENT_NOT_FOUND: "NOT_FOUND",
    ErrorCode.CLIENT_NOT_FOUND: "NOT_FOUND",
    ErrorCode.REPLICA_IS_NOT_READY: "NOT_READY",
    ErrorCode.LEASE_EXPIRED: "LEASE_EXPIRED",
    ErrorCode.OBJECT_ALREADY_EXISTS: "ALREADY_EXISTS",
    ErrorCode.SEGMENT_ALREADY_EXISTS: "ALREADY_EXISTS",
    ErrorCode.NO_AVAILABLE_HANDLE: "NO_SPACE",
    ErrorCode.INVALID_KEY: "INVALID_ARGUMENT",
    ErrorCode.INVALID_PARAMS: "INVALID_ARGUMENT",
    ErrorCode.BUFFER_OVERFLOW: "INVALID_ARGUMENT",
    ErrorCode.ILLEGAL_CLIENT: "INVALID_ARGUMENT",
    ErrorCode.INVALID_VERSION: "STALE_HANDLE",
    ErrorCode.INVALID_REPLICA: "STALE_HANDLE",
    ErrorCode.OBJECT_HAS_LEASE: "IN_USE",
    ErrorCode.TRANSFER_FAIL: "UNAVAILABLE",
    ErrorCode.RPC_FAIL: "UNAVAILABLE",
    ErrorCode.RPC_TIMEOUT: "UNAVAILABLE",
    ErrorCode.UNAVAILABLE_IN_CURRENT_STATUS: "UNAVAILABLE",
    ErrorCode.CHECKSUM_MISMATCH: "INTEGRITY_ERROR",
}


RETRYABLE_CODES: frozenset[ErrorCode] = frozenset({
    ErrorCode.NO_AVAILABLE_HANDLE, ErrorCode.REPLICA_IS_NOT_READY, ErrorCode.RPC_TIMEOUT,
    ErrorCode.UNAVAILABLE_IN_CURRENT_STATUS})


class StoreError(Exception):
    """A store operation failed with ``code`` (an ``ErrorCode``); ``message`` says why.

    ``status`` is the generic case status (``NOT_FOUND``, ``NO_SPACE``, ...). Over RPC the
    master sends ``RpcError(code=ErrorCode.name, message, data={"code": int})``;
    ``StoreError.from_rpc`` turns it back.
    """

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(f"{code.name} ({int(code)}): {message}")
        self.code = ErrorCode(code)
        self.message = message

    @property
    def status(self) -> str:
        return self.code.status

    @property
    def retryable(self) -> bool:
        """True when the same call may succeed later without any change by the caller:
        no room *yet* (eviction or a spill to SSD is making room), an object still being
        written or moved, a timed-out RPC. A put rejected with ``NO_SPACE`` should be
        retried after a short back-off, not dropped (case BUG-62)."""
        return self.code in RETRYABLE_CODES

    @classmethod
    def from_rpc(cls, err: object) -> StoreError:
        """Map an ``RpcError`` (any ``code``/``message``/``data``) to a ``StoreError``."""
        code_name = getattr(err, "code", "")
        message = getattr(err, "message", str(err))
        if isinstance(code_name, str) and code_name in ErrorCode.__members__:
            return cls(ErrorCode[code_name], message)
        if code_name == "TIMEOUT":
            return cls(ErrorCode.RPC_TIMEOUT, message)
        if code_name == "CONNECTION":
            return cls(ErrorCode.RPC_FAIL, message)
        if code_name == "INVALID_ARGUMENT":
            return cls(ErrorCode.INVALID_PARAMS, message)
        return cls(ErrorCode.INTERNAL_ERROR, f"{code_name}: {message}")
