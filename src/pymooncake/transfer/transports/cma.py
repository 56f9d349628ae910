"""``cma`` transport: one copy straight into (or out of) a same-host peer's ordinary memory.

Linux cross-memory attach (``process_vm_writev``/``process_vm_readv``, the CMA path of
UCX and Open MPI's shared-memory transports) copies between two processes' address spaces
in one kernel copy. The target needs no ``/dev/shm`` buffer: any range it registered (a
numpy array, a torch tensor, a paged KV cache) is reachable, which only ``tcp`` reached
before (docs/benchmarks.md, issue 16 session 35).

Who may: the kernel's ptrace access check (``PTRACE_MODE_ATTACH_REALCREDS``): the same
uid and gid and a permitted capability set holding all of the target's, or
``CAP_SYS_PTRACE``; a dumpable target; and no seccomp filter against the calls, which
container runtimes often add. Under Yama's ``ptrace_scope`` 1 (Ubuntu's default) only an
ancestor may, so an engine that offers ``cma`` sets ``prctl(PR_SET_PTRACER_ANY)`` as Open
MPI does: for the rest of the process's life, any process that passes those checks may
attach to it, as without Yama. Where the first probe of a peer is refused, the peer is
reached over ``shm`` or ``tcp``; a refusal after that fails the requests.

The peer does not take part in a copy, so its own record decides what may be copied, as
its server's checks do on ``tcp`` (BUG-64). Every engine offering ``cma`` keeps an
*anchor* in its memory (:class:`CmaAnchor`) and publishes its address and token:

* 16 random bytes and a digest of the segment name. A peer is used for a segment only
  after both read back through the pid of the descriptor found under that name, so
  another pid namespace, a reused pid, a process that is not the segment's owner, or a
  descriptor stored under another name cannot be copied through. The initiator holds a
  pidfd of that process from then on and checks it before every copy, so once the
  process has exited its pid is not written even if reused (the only window left is
  between that check and the system call, which takes the bare pid);
* the address of a *snapshot* of the owner's registered ranges: an immutable buffer
  (generation, count, ranges) swapped in with one aligned 8-byte store whenever
  ``register_memory`` or ``unregister_memory`` changes them, and emptied for good by
  ``close``. Before each run of copies to a peer the initiator reads the snapshot (again
  only when its generation changed, re-reading the pointer afterwards so that a snapshot
  replaced meanwhile is read again) and checks every request against that copy, whatever
  the descriptor says: a range withdrawn, or one a forged descriptor adds, is refused
  ``INVALID_ARGUMENT`` with nothing copied either way.

A copy that races the owner's withdrawal of the same range (submitted before
``unregister_memory`` returned) is the caller's error, as with every transport (Mooncake:
memory must stay registered while transfers to it are in flight).
"""

from __future__ import annotations

import collections
import ctypes
import ctypes.util
import errno
import hashlib
import operator
import os
import secrets
import select
import struct
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from pymooncake.obs.logging import init_logger
from pymooncake.transfer.batch import TransferOp

logger = init_logger(__name__)

TOKEN_BYTES = 16
ADDRESS_LIMIT = 1 << 64
_HEAD = struct.Struct("<16s16sQ")
"""token, name digest, address of the current snapshot."""
_SNAP = struct.Struct("<QQ")
"""generation, number of ranges; then the ranges."""
_RANGE = struct.Struct("<QQ")
MAX_RANGES = 1 << 16
KEEP_SNAPSHOTS = 8
"""Snapshots kept allocated after being replaced (a reader that still reads one sees the
pointer changed and reads again)."""
_READ_TRIES = 64
_PR_SET_PTRACER = 0x59616D61
_PR_SET_PTRACER_ANY = ctypes.c_ulong(ADDRESS_LIMIT - 1)
PASS_ON = (errno.ESRCH, errno.EPERM)
"""Copy errors that fail the rest of a run to the same peer (the process, not a range)."""


class CmaError(OSError):
    """A cross-memory copy failed; ``str()`` names the pid, the range and the reason."""


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _bind() -> tuple[ctypes.CDLL, Callable[..., int], Callable[..., int]] | None:
    if not hasattr(os, "pidfd_open"):
        return None
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
    """``process_vm_writev``/``readv`` (Linux ≥ 3.2) and pidfds (Linux ≥ 5.3) exist."""
    return _LIBC is not None


def name_digest(segment: str) -> bytes:
    """BLAKE2b-128 of the segment name, as the anchor holds it."""
    return hashlib.blake2b(segment.encode(), digest_size=16).digest()


def in_address_space(addr: int, length: int) -> bool:
    """``[addr, addr+length)`` lies within a 64-bit address space (computed on Python
    ints: a numpy ``uint64`` sum would wrap). ``TypeError`` for a non-integer."""
    addr, length = operator.index(addr), operator.index(length)
    return addr >= 0 and length >= 0 and addr + length <= ADDRESS_LIMIT


def copy(pid: int, op: TransferOp, local_addr: int, remote_addr: int, length: int) -> None:
    """WRITE: ``length`` bytes from ``local_addr`` here to ``remote_addr`` in process ``pid``;
    READ: the other way. A short copy is continued from where it stopped. Raises
    :class:`CmaError` with the errno (``ESRCH``: no such process; ``EPERM``: not allowed;
    ``EFAULT``: a range not mapped on either side; ``EINVAL``: a range outside the address
    space). The GIL is released meanwhile."""
    if _LIBC is None:
        raise CmaError(errno.ENOSYS, "process_vm_writev/readv or pidfds are not available")
    if not (in_address_space(local_addr, length) and in_address_space(remote_addr, length)):
        raise CmaError(errno.EINVAL, f"range of {length} bytes at {remote_addr:#x} or "
                                     f"{local_addr:#x} is outside the address space")
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
    """This engine's anchor: token, name digest and a pointer to its ranges' snapshot.

    ``addr`` and ``token`` go into the segment descriptor."""

    def __init__(self, segment: str) -> None:
        self.token = secrets.token_bytes(TOKEN_BYTES)
        self._head = ctypes.create_string_buffer(_HEAD.size)
        self.addr = ctypes.addressof(self._head)
        ctypes.memmove(self.addr, _HEAD.pack(self.token, name_digest(segment), 0), _HEAD.size)
        self._pointer = ctypes.c_uint64.from_address(self.addr + 32)  # 8-byte aligned
        self._snapshots: collections.deque[ctypes.Array[ctypes.c_char]] = collections.deque()
        self._lock = threading.Lock()
        self.generation = 0
        self.closed = False
        self.publish(tuple)
        if _LIBC is not None and _LIBC[0].prctl(_PR_SET_PTRACER, _PR_SET_PTRACER_ANY,
                                                0, 0, 0) != 0:
            err = ctypes.get_errno()
            if err != errno.EINVAL:  # EINVAL: no Yama, nothing to allow
                logger.warning("prctl(PR_SET_PTRACER_ANY) failed: %s; same-host peers "
                               "may be refused cma", os.strerror(err))

    def publish(self, ranges: Callable[[], Iterable[tuple[int, int]]],
                close: bool = False) -> None:
        """Make ``ranges()`` (``(addr, length)`` pairs) the memory peers may copy to or
        from, before this returns; with ``close``, none, for good. ``ranges`` is called
        under this anchor's lock, so of concurrent changes the last snapshot is taken
        after the last change."""
        with self._lock:
            if self.closed:
                return
            self.closed = close
            rs = () if close else tuple(ranges())
            self.generation += 1
            snap = ctypes.create_string_buffer(
                _SNAP.pack(self.generation, len(rs)) + b"".join(_RANGE.pack(a, n)
                                                                for a, n in rs))
            self._snapshots.append(snap)
            self._pointer.value = ctypes.addressof(snap)  # one aligned store: the swap
            while len(self._snapshots) > KEEP_SNAPSHOTS:
                self._snapshots.popleft()


@dataclass(frozen=True, slots=True)
class CmaTable:
    """One snapshot of a peer's registered ranges, as read."""

    pointer: int
    generation: int
    ranges: tuple[tuple[int, int], ...]

    def covers(self, addr: int, length: int) -> bool:
        """``[addr, addr+length)`` lies in one of the ranges."""
        return in_address_space(addr, length) and any(
            a <= addr and addr + length <= a + n for a, n in self.ranges)


_NO_TABLE = CmaTable(0, 0, ())


class CmaPeer:
    """A peer reached by ``cma``: its pid (and a pidfd of it), anchor and last table."""

    __slots__ = ("segment", "pid", "anchor_addr", "token", "digest", "_stale", "_table",
                 "_lock", "_pidfd", "_poll", "on_exit")

    def __init__(self, segment: str, pid: int, anchor_addr: int, token: bytes,
                 stale: Callable[[str], None]) -> None:
        self.segment, self.pid, self.anchor_addr, self.token = segment, pid, anchor_addr, token
        self.digest = name_digest(segment)
        self._stale = stale
        self.on_exit: Callable[[CmaPeer], None] = lambda peer: None
        """Called when :meth:`table` finds the process gone (``CmaPeers`` forgets it)."""
        self._table = _NO_TABLE
        self._lock = threading.Lock()
        self._pidfd = -1
        self._poll: select.poll | None = None

    def open(self) -> str:
        """Take a pidfd of the pid, then check that it holds this segment's anchor:
        ``""``, or why not (nothing kept open then)."""
        try:
            self._pidfd = os.pidfd_open(self.pid)
        except OSError as e:
            return f"segment {self.segment!r}: pid {self.pid}: {e.strerror}"
        try:
            token, digest, _ = self._head()
        except CmaError as e:
            self.close()
            return f"segment {self.segment!r}: {e}"
        if token != self.token or digest != self.digest:
            self.close()
            return (f"segment {self.segment!r}: pid {self.pid} does not hold its anchor "
                    "(another process, or a descriptor not its owner's)")
        self._poll = select.poll()
        self._poll.register(self._pidfd, select.POLLIN)
        return ""

    def alive(self) -> bool:
        """The process checked by :meth:`open` has not exited (its pid is still its own)."""
        poll = self._poll
        if poll is None:
            return False
        try:
            return not poll.poll(0)
        except (OSError, ValueError):  # closed with the engine
            return False

    def close(self) -> None:
        if self._pidfd >= 0:
            os.close(self._pidfd)
            self._pidfd, self._poll = -1, None

    def _head(self) -> tuple[bytes, bytes, int]:
        """The anchor as the peer holds it now: token, name digest, snapshot address."""
        return _HEAD.unpack(_read(self.pid, self.anchor_addr, _HEAD.size))

    def _still(self, ptr: int, gen: int) -> bool:
        """The anchor still points at ``ptr``, which still holds generation ``gen``."""
        return (self._head()[2] == ptr
                and _SNAP.unpack(_read(self.pid, ptr, _SNAP.size))[0] == gen)

    def table(self) -> tuple[str, CmaTable]:
        """The owner's registered ranges now: ``("", table)``, or ``(why not, empty)``.
        Two reads when nothing changed since the last call; the snapshot too when it did."""
        try:
            for _ in range(_READ_TRIES):
                if not self.alive():
                    self.on_exit(self)
                    return (f"segment {self.segment!r}: pid {self.pid} has exited"), _NO_TABLE
                token, digest, ptr = self._head()
                if token != self.token or digest != self.digest:
                    self._stale(self.segment)
                    return (f"segment {self.segment!r}: pid {self.pid} no longer holds its "
                            "anchor"), _NO_TABLE
                try:
                    gen, count = _SNAP.unpack(_read(self.pid, ptr, _SNAP.size))
                    last = self._table
                    if (ptr, gen) == (last.pointer, last.generation):
                        return "", last
                    raw = (_read(self.pid, ptr + _SNAP.size, count * _RANGE.size)
                           if count <= MAX_RANGES else b"")
                    if not self._still(ptr, gen):
                        continue  # replaced (maybe freed) while we read it: read again
                    if count > MAX_RANGES:
                        return (f"segment {self.segment!r}: its anchor lists {count} "
                                "ranges"), _NO_TABLE
                except CmaError as e:
                    if e.errno == errno.EFAULT:  # a snapshot freed meanwhile: read again
                        continue
                    raise
                table = CmaTable(ptr, gen, tuple(_RANGE.iter_unpack(raw)))
                with self._lock:
                    if gen > self._table.generation:
                        self._table = table
                return "", table
            return f"segment {self.segment!r}: its registered ranges kept changing", _NO_TABLE
        except CmaError as e:
            return f"segment {self.segment!r}: {e}", _NO_TABLE
