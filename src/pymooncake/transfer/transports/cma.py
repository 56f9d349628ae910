"""``cma`` transport: one copy straight into (or out of) a same-host peer's ordinary memory.

Linux cross-memory attach (``process_vm_writev``/``process_vm_readv``, the CMA path of
UCX and Open MPI's shared-memory transports) copies between two processes' address spaces
in one kernel copy. The target needs no ``/dev/shm`` buffer: any range it registered (a
numpy array, a torch tensor, a paged KV cache) is reachable, and the copy runs at memcpy
speed where a mapping of ``/dev/shm`` pages in 4 KiB pages does not (docs/benchmarks.md,
issue 16 session 35). The kernel checks the right to do it (``PTRACE_MODE_ATTACH``: the
same user and no seccomp filter against the calls); where it is refused, peers use
``shm`` or ``tcp`` as before.

The peer does not take part in the copy, so the engine guards what the target's own
checks guard on ``tcp`` (:class:`CmaAnchor`, :class:`CmaPeer`):

* **the right process**: every engine with ``cma`` publishes the address of a 24-byte
  anchor in its memory, 16 random bytes then a generation word. A peer is used only after
  reading those 16 bytes back through the pid it published (another pid namespace, a
  reused pid or a process that is not the peer cannot answer them);
* **memory still registered**: the generation grows before the owner withdraws any range
  (``unregister_memory``, ``close``) and is published with its descriptor. Before each
  group of copies the initiator reads the anchor again; a generation other than the one
  in its descriptor fails those requests (a withdrawn range is never written) and drops
  the cached descriptor, so the next submission is routed from a fresh one.

A copy that races the owner's withdrawal of the same range is the caller's error, as with
every transport (Mooncake: memory must stay registered while transfers to it are in flight).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import secrets
import struct
import threading
from collections.abc import Callable

from pymooncake.obs.logging import init_logger
from pymooncake.transfer.batch import TransferOp

logger = init_logger(__name__)

ANCHOR_BYTES = 24
_TOKEN_BYTES = 16
_GEN = struct.Struct("<Q")


class CmaError(OSError):
    """A cross-memory copy failed; ``str()`` names the peer and the reason."""


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _bind() -> tuple[Callable[..., int], Callable[..., int]] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        fns = libc.process_vm_writev, libc.process_vm_readv
    except (OSError, AttributeError):
        return None
    for fn in fns:
        fn.argtypes = [ctypes.c_int, ctypes.POINTER(_Iovec), ctypes.c_ulong,
                       ctypes.POINTER(_Iovec), ctypes.c_ulong, ctypes.c_ulong]
        fn.restype = ctypes.c_ssize_t
    return fns


_CALLS = _bind()


def supported() -> bool:
    """The C library has ``process_vm_writev``/``readv`` (Linux ≥ 3.2, glibc ≥ 2.15)."""
    return _CALLS is not None


def copy(pid: int, op: TransferOp, local_addr: int, remote_addr: int, length: int) -> None:
    """WRITE: ``length`` bytes from ``local_addr`` here to ``remote_addr`` in process ``pid``;
    READ: the other way. A partial copy is continued (the kernel stops at 1,024 pages per
    call on some kernels). Raises :class:`CmaError` with the errno (``ESRCH``: no such
    process; ``EPERM``: not allowed; ``EFAULT``: a range not mapped on either side).
    Releases the GIL while the kernel copies (ctypes)."""
    if _CALLS is None:
        raise CmaError(errno.ENOSYS, "process_vm_writev/readv are not available")
    fn = _CALLS[0] if op is TransferOp.WRITE else _CALLS[1]
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


class CmaAnchor:
    """This engine's anchor: 16 random bytes and a generation word, at a fixed address."""

    def __init__(self) -> None:
        self._buf = ctypes.create_string_buffer(ANCHOR_BYTES)
        self.token = secrets.token_bytes(_TOKEN_BYTES)
        ctypes.memmove(self._buf, self.token, _TOKEN_BYTES)
        self.addr = ctypes.addressof(self._buf)
        self.generation = 0

    def bump(self) -> None:
        """Before a range is withdrawn: copies checked against an older descriptor fail."""
        self.generation += 1
        ctypes.memmove(self.addr + _TOKEN_BYTES, _GEN.pack(self.generation), _GEN.size)


class CmaPeer:
    """A peer reached by ``cma``: its pid, anchor and the generation its descriptor had."""

    __slots__ = ("segment", "pid", "anchor_addr", "token", "generation", "_stale")

    def __init__(self, segment: str, pid: int, anchor_addr: int, token: bytes,
                 generation: int, stale: Callable[[str], None]) -> None:
        self.segment, self.pid = segment, pid
        self.anchor_addr, self.token, self.generation = anchor_addr, token, generation
        self._stale = stale

    def read_anchor(self) -> tuple[bytes, int]:
        """The peer's token and generation, read through its pid; raises :class:`CmaError`."""
        got = ctypes.create_string_buffer(ANCHOR_BYTES)
        copy(self.pid, TransferOp.READ, ctypes.addressof(got), self.anchor_addr, ANCHOR_BYTES)
        raw = got.raw
        return raw[:_TOKEN_BYTES], _GEN.unpack_from(raw, _TOKEN_BYTES)[0]

    def check(self) -> str:
        """``""`` when the peer is the process its descriptor names and has withdrawn
        nothing since; else the reason (and the cached descriptor is dropped)."""
        try:
            token, gen = self.read_anchor()
        except CmaError as e:
            reason = f"segment {self.segment!r}: {e}"
        else:
            if token != self.token:
                reason = (f"segment {self.segment!r}: pid {self.pid} is no longer its "
                          "process (anchor token differs)")
            elif gen != self.generation:
                reason = (f"segment {self.segment!r} withdrew memory since its descriptor "
                          f"was read (generation {self.generation} -> {gen}); resubmit")
            else:
                return ""
        self._stale(self.segment)
        return reason


class CmaPeers:
    """Which peers ``cma`` reaches, each probed once per descriptor (token read back)."""

    def __init__(self, stale: Callable[[str], None]) -> None:
        self._stale = stale
        self._lock = threading.Lock()
        self._peers: dict[tuple[str, int, int, str, int], CmaPeer | None] = {}

    def peer(self, segment: str, pid: int, anchor_addr: int, token_hex: str,
             generation: int) -> CmaPeer | None:
        """The peer when its anchor reads back as published, else ``None`` (remembered:
        a refused peer is not asked again for the same descriptor generation)."""
        key = (segment, pid, anchor_addr, token_hex, generation)
        with self._lock:
            if key in self._peers:
                return self._peers[key]
        found: CmaPeer | None = None
        try:
            token = bytes.fromhex(token_hex)
        except ValueError:
            token = b""
        if supported() and pid > 0 and anchor_addr > 0 and len(token) == _TOKEN_BYTES:
            cand = CmaPeer(segment, pid, anchor_addr, token, generation, self._stale)
            try:
                got, gen = cand.read_anchor()
            except CmaError as e:
                got, gen = b"", -1
                logger.info("cma to segment %r refused (%s); using shm/tcp", segment, e)
            if got == token and gen != generation:  # our descriptor is older than the peer
                self._stale(segment)
                return None
            if got == token:
                found = cand
            elif gen >= 0:
                logger.info("cma to segment %r: pid %d does not hold its anchor; using "
                            "shm/tcp", segment, pid)
        with self._lock:
            if len(self._peers) > 4096:  # descriptors of peers long gone
                self._peers.clear()
            self._peers[key] = found
        return found
