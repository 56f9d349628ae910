"""``cma`` transport: one copy straight into (or out of) a same-host peer's ordinary memory.

Linux cross-memory attach (``process_vm_writev``/``process_vm_readv``, the CMA path of
UCX and Open MPI's shared-memory transports) copies between two processes' address spaces
in one kernel copy. The target needs no ``/dev/shm`` buffer: any range it registered (a
numpy array, a torch tensor, a paged KV cache) is reachable, and the copy runs at memcpy
speed where a mapping of ``/dev/shm`` pages in 4 KiB pages does not (docs/benchmarks.md,
issue 16 session 35).

Who may: the kernel allows it to the same user (``PTRACE_MODE_ATTACH_REALCREDS``) unless a
seccomp filter forbids the calls, as container runtimes often do. Under Yama's
``ptrace_scope`` 1 (Ubuntu's default) only an ancestor may, so an engine that offers
``cma`` declares any process a permitted tracer (``prctl(PR_SET_PTRACER_ANY)``, as Open
MPI does); the uid check still applies. Where the kernel refuses, peers use ``shm`` or
``tcp``.

The peer does not take part in a copy, so its own record decides what may be copied, as
its server's checks do on ``tcp`` (BUG-64). Every engine offering ``cma`` keeps an
*anchor* in its memory (:class:`CmaAnchor`) and publishes its address and token:

* 16 random bytes and a digest of the segment name. A peer is used only after both read
  back through the pid of its descriptor, so another pid namespace, a reused pid, a
  process that is not the segment's owner, or a descriptor naming another segment cannot
  be written through;
* the owner's registered ranges, a table the owner rewrites before ``register_memory``
  or ``unregister_memory`` returns and empties on ``close``, under a generation word
  (a seqlock). Before each run of copies to a peer the initiator reads the generation
  (the table too when it changed) and refuses any request outside the ranges it lists,
  whatever the descriptor says: a withdrawn range, or one a forged descriptor adds, is
  never copied to or from.

A copy that races the owner's withdrawal of the same range is the caller's error, as with
every transport (Mooncake: memory must stay registered while transfers to it are in flight).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import hashlib
import os
import secrets
import struct
import threading
from collections.abc import Callable, Iterable

from pymooncake.obs.logging import init_logger
from pymooncake.transfer.batch import TransferOp

logger = init_logger(__name__)

TOKEN_BYTES = 16
_HEADER = struct.Struct("<16sQQQ16s")
"""token, generation (odd while the table is rewritten), table address, ranges, name digest."""
_RANGE = struct.Struct("<QQ")
MAX_RANGES = 1 << 16
_READ_TRIES = 8
_PR_SET_PTRACER = 0x59616D61
_PR_SET_PTRACER_ANY = ctypes.c_ulong(-1 & 0xFFFFFFFFFFFFFFFF)


class CmaError(OSError):
    """A cross-memory copy failed; ``str()`` names the pid, the range and the reason."""


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _bind() -> tuple[ctypes.CDLL, Callable[..., int], Callable[..., int]] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        fns = libc.process_vm_writev, libc.process_vm_readv
    except (OSError, AttributeError):
        return None
    for fn in fns:
        fn.argtypes = [ctypes.c_int, ctypes.POINTER(_Iovec), ctypes.c_ulong,
                       ctypes.POINTER(_Iovec), ctypes.c_ulong, ctypes.c_ulong]
        fn.restype = ctypes.c_ssize_t
    return libc, fns[0], fns[1]


_LIBC = _bind()


def supported() -> bool:
    """The C library has ``process_vm_writev``/``readv`` (Linux ≥ 3.2, glibc ≥ 2.15)."""
    return _LIBC is not None


def name_digest(segment: str) -> bytes:
    """BLAKE2b-128 of the segment name, as the anchor holds it."""
    return hashlib.blake2b(segment.encode(), digest_size=16).digest()


def copy(pid: int, op: TransferOp, local_addr: int, remote_addr: int, length: int) -> None:
    """WRITE: ``length`` bytes from ``local_addr`` here to ``remote_addr`` in process ``pid``;
    READ: the other way. A short copy is continued from where it stopped. Raises
    :class:`CmaError` with the errno (``ESRCH``: no such process; ``EPERM``: not allowed;
    ``EFAULT``: a range not mapped on either side). The GIL is released meanwhile."""
    if _LIBC is None:
        raise CmaError(errno.ENOSYS, "process_vm_writev/readv are not available")
    fn = _LIBC[1] if op is TransferOp.WRITE else _LIBC[2]
    local, remote = _Iovec(), _Iovec()
    done = 0
    while done < length:
        local.base, local.len = local_addr + done, length - done
        remote.base, remote.len = remote_addr + done, length - done
        n = fn(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        if n <= 0:
            err = ctypes.get_errno() if n < 0 else errno.EIO
            raise CmaError(err, f"cross-memory {op.name.lower()} of {length} bytes with "
                                f"pid {pid} at {remote_addr + done:#x}: {os.strerror(err)}")
        done += n


def _read(pid: int, addr: int, n: int) -> bytes:
    buf = ctypes.create_string_buffer(n)
    copy(pid, TransferOp.READ, ctypes.addressof(buf), addr, n)
    return buf.raw


class CmaAnchor:
    """This engine's anchor: token, name digest and the table of its registered ranges.

    ``addr`` and ``token`` go into the segment descriptor. :meth:`publish` rewrites the
    table; old tables stay allocated for the engine's life, so a peer reading a table
    just replaced never reads freed memory (registrations are few)."""

    def __init__(self, segment: str) -> None:
        self.token = secrets.token_bytes(TOKEN_BYTES)
        self._digest = name_digest(segment)
        self._header = ctypes.create_string_buffer(_HEADER.size)
        self.addr = ctypes.addressof(self._header)
        self._tables: list[ctypes.Array[ctypes.c_char]] = []
        self._lock = threading.Lock()
        self.generation = 0
        self._write(0, 0)
        if _LIBC is not None:  # Yama ptrace_scope 1: let same-user peers attach (not root)
            _LIBC[0].prctl(_PR_SET_PTRACER, _PR_SET_PTRACER_ANY, 0, 0, 0)

    def _write(self, table_addr: int, count: int) -> None:
        ctypes.memmove(self.addr, _HEADER.pack(self.token, self.generation, table_addr, count,
                                               self._digest), _HEADER.size)

    def publish(self, ranges: Callable[[], Iterable[tuple[int, int]]]) -> None:
        """Make ``ranges()`` (``(addr, length)`` pairs) the registered memory peers may copy
        to or from; takes effect before this returns. ``ranges`` is called under this
        anchor's lock, so of concurrent registration changes the last table written is
        read after the last change."""
        with self._lock:
            packed = b"".join(_RANGE.pack(a, n) for a, n in ranges())
            table = ctypes.create_string_buffer(packed, max(1, len(packed)))
            self._tables.append(table)
            self.generation += 1  # odd: being rewritten
            self._write(0, 0)
            self.generation += 1
            self._write(ctypes.addressof(table), len(packed) // _RANGE.size)


class CmaPeer:
    """A peer reached by ``cma``: its pid, its anchor, and its table as last read."""

    __slots__ = ("segment", "pid", "anchor_addr", "token", "digest", "_stale", "_table")

    def __init__(self, segment: str, pid: int, anchor_addr: int, token: bytes,
                 stale: Callable[[str], None]) -> None:
        self.segment, self.pid, self.anchor_addr, self.token = segment, pid, anchor_addr, token
        self.digest = name_digest(segment)
        self._stale = stale
        self._table: tuple[int, tuple[tuple[int, int], ...]] = (-1, ())

    def _header(self) -> tuple[bytes, int, int, int, bytes]:
        return _HEADER.unpack(_read(self.pid, self.anchor_addr, _HEADER.size))

    def identity(self) -> str:
        """``""`` when the pid holds this segment's anchor, else why not (no exception)."""
        try:
            token, *_, digest = self._header()
        except CmaError as e:
            return f"segment {self.segment!r}: {e}"
        if token != self.token or digest != self.digest:
            return (f"segment {self.segment!r}: pid {self.pid} does not hold its anchor "
                    "(another process, or a descriptor not its owner's)")
        return ""

    def refresh(self) -> str:
        """Read the anchor (and the table when it changed): ``""``, or why this peer
        cannot be copied with now, for every request of the run."""
        try:
            for _ in range(_READ_TRIES):
                token, gen, table_addr, count, digest = self._header()
                if token != self.token or digest != self.digest:
                    self._stale(self.segment)
                    return (f"segment {self.segment!r}: pid {self.pid} no longer holds its "
                            "anchor (the process is gone or is another one)")
                if gen & 1:
                    continue  # the owner is rewriting its table
                if gen == self._table[0]:
                    return ""
                if count > MAX_RANGES:
                    return f"segment {self.segment!r}: anchor lists {count} ranges"
                raw = _read(self.pid, table_addr, count * _RANGE.size) if count else b""
                if self._header()[1] == gen:  # not rewritten while we read it
                    self._table = (gen, tuple(_RANGE.iter_unpack(raw)))
                    return ""
            return f"segment {self.segment!r}: its registered ranges kept changing"
        except CmaError as e:
            return f"segment {self.segment!r}: {e}"

    def covers(self, addr: int, length: int) -> bool:
        """``[addr, addr+length)`` lies in one range of the table last read."""
        return any(a <= addr and addr + length <= a + n for a, n in self._table[1])


class CmaPeers:
    """Which peers ``cma`` reaches: each probed once (token and name digest read back)."""

    def __init__(self, stale: Callable[[str], None]) -> None:
        self._stale = stale
        self._lock = threading.Lock()
        self._peers: dict[tuple[str, int, int, str], CmaPeer | str] = {}

    def peer(self, segment: str, pid: int, anchor_addr: int, token_hex: str
             ) -> CmaPeer | str:
        """The peer, or why ``cma`` cannot reach it (remembered for this descriptor, and
        logged once as a warning)."""
        key = (segment, pid, anchor_addr, token_hex)
        with self._lock:
            got = self._peers.get(key)
        if got is not None:
            return got
        out: CmaPeer | str
        if not supported():
            out = "process_vm_writev/readv are not available"
        else:
            peer = CmaPeer(segment, pid, anchor_addr, bytes.fromhex(token_hex), self._stale)
            out = peer.identity() or peer
        if isinstance(out, str):
            logger.warning("cma to segment %r refused: %s", segment, out)
        with self._lock:
            if len(self._peers) > 4096:  # descriptors of peers long gone
                self._peers.clear()
            self._peers[key] = out
        return out
