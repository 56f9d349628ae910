"""Registered memory: buffer → (address, length), the range registry, shared-memory buffers.

Mooncake addresses memory by integer virtual addresses inside registered ranges; so does
pymooncake. Any contiguous object with the buffer protocol (bytearray, mmap, numpy array)
or a contiguous torch CPU tensor (``data_ptr``) can be registered. Memory that the ``shm``
transport should reach from other processes must live in a :class:`SharedBuffer`
(a file in ``/dev/shm`` mapped by both sides, so a peer's copy is the only copy).
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import mmap
import os
import threading
import uuid
from dataclasses import dataclass, field, replace

import numpy as np

SHM_DIR = "/dev/shm"


def buffer_address(buffer: object) -> tuple[int, int, object]:
    """``(address, nbytes, keepalive)`` of a contiguous buffer.

    Raises ``ValueError`` for a non-contiguous or read-only buffer and ``TypeError`` for an
    object that is neither a buffer nor a CPU tensor. A CUDA tensor raises ``ValueError``
    saying to register a host (pinned) staging buffer instead.
    """
    if isinstance(buffer, SharedBuffer):
        return buffer.addr, buffer.length, buffer
    if hasattr(buffer, "data_ptr") and hasattr(buffer, "element_size"):  # torch.Tensor
        device = getattr(buffer, "device", None)
        if getattr(device, "type", "cpu") != "cpu":
            raise ValueError(
                f"cannot register a {device} tensor directly: the tcp/shm transports move host "
                "memory; register a pinned host staging buffer and copy the tensor through it")
        if not buffer.is_contiguous():  # type: ignore[attr-defined]
            raise ValueError("tensor must be contiguous to be registered (call .contiguous())")
        nbytes = buffer.numel() * buffer.element_size()  # type: ignore[attr-defined]
        return int(buffer.data_ptr()), int(nbytes), buffer  # type: ignore[attr-defined]
    try:
        mv = memoryview(buffer)  # type: ignore[arg-type]
    except TypeError as e:
        raise TypeError(f"cannot register {type(buffer).__name__}: it has neither the buffer "
                        "protocol nor data_ptr()") from e
    if not mv.c_contiguous:
        raise ValueError("buffer must be C-contiguous to be registered")
    if mv.readonly:
        raise ValueError("buffer is read-only: peers may WRITE into registered memory, so "
                         "register a writable buffer (bytearray, numpy array, mmap)")
    arr = np.frombuffer(mv.cast("B") if mv.ndim != 1 or mv.format != "B" else mv,
                        dtype=np.uint8)
    return int(arr.ctypes.data), int(arr.nbytes), (buffer, arr)


def view_at(addr: int, length: int) -> memoryview:
    """A writable byte view of ``[addr, addr+length)`` (the caller checked the range)."""
    return memoryview((ctypes.c_ubyte * length).from_address(addr)).cast("B")


@dataclass(frozen=True, slots=True, eq=False)
class MemoryRegion:
    """One registered range ``[addr, addr+length)``; ``shm_name`` when peers can map it.

    ``view`` (set by :meth:`MemoryRegistry.add`) is a byte view of the whole range, so a
    slice's view is a cheap slice of it (:meth:`view_of`) rather than a new ctypes array.
    """

    addr: int
    length: int
    keepalive: object
    shm_name: str | None = None
    view: memoryview | None = field(default=None, repr=False)

    def view_of(self, addr: int, length: int) -> memoryview:
        """A writable view of ``[addr, addr+length)`` inside this region (checked by the
        caller)."""
        v = self.view
        if v is None:
            return view_at(addr, length)
        off = addr - self.addr
        return v[off:off + length]

    @property
    def end(self) -> int:
        return self.addr + self.length

    def contains(self, addr: int, length: int) -> bool:
        return self.addr <= addr and addr + length <= self.end and length >= 0


class MemoryRegistry:
    """Registered ranges of one engine; lookups are lock-free on an immutable snapshot."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._regions: tuple[MemoryRegion, ...] = ()
        self._starts: tuple[int, ...] = ()

    @property
    def regions(self) -> tuple[MemoryRegion, ...]:
        return self._regions

    def add(self, region: MemoryRegion) -> None:
        """Raises ``ValueError`` when the range overlaps one already registered."""
        if region.length <= 0:
            raise ValueError(f"cannot register an empty range at {region.addr:#x}")
        if region.view is None:
            region = replace(region, view=view_at(region.addr, region.length))
        with self._lock:
            for r in self._regions:
                if region.addr < r.end and r.addr < region.end:
                    raise ValueError(
                        f"range [{region.addr:#x}, {region.end:#x}) overlaps registered range "
                        f"[{r.addr:#x}, {r.end:#x}); unregister it first")
            regions = sorted((*self._regions, region), key=lambda r: r.addr)
            self._regions = tuple(regions)
            self._starts = tuple(r.addr for r in regions)

    def remove(self, addr: int) -> MemoryRegion:
        """Remove the range starting at ``addr``; ``KeyError`` when there is none."""
        with self._lock:
            for r in self._regions:
                if r.addr == addr:
                    regions = tuple(x for x in self._regions if x is not r)
                    self._regions = regions
                    self._starts = tuple(x.addr for x in regions)
                    return r
        raise KeyError(f"no registered range starts at {addr:#x}")

    def find(self, addr: int, length: int) -> MemoryRegion | None:
        """The region holding all of ``[addr, addr+length)``, else ``None``."""
        regions, starts = self._regions, self._starts
        i = bisect.bisect_right(starts, addr) - 1
        if i < 0 or length < 0:
            return None
        r = regions[i]
        return r if r.contains(addr, length) else None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


def reclaim_stale_shared_buffers(shm_dir: str = SHM_DIR) -> list[str]:
    """Unlink ``pymooncake-<pid>-*`` files whose owning process is gone.

    A process killed with SIGKILL cannot unlink its shared buffers; each new
    ``SharedBuffer`` sweeps up after such processes on the same host, so ``/dev/shm``
    does not fill up. Peers that still map a file keep their mapping (unlinking only
    removes the name). Returns the names removed.
    """
    removed = []
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return removed
    for name in names:
        parts = name.split("-")
        if len(parts) != 3 or parts[0] != "pymooncake" or not parts[1].isdigit():
            continue
        if _pid_alive(int(parts[1])):
            continue
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(shm_dir, name))
            removed.append(name)
    return removed


class SharedBuffer:
    """Host memory in ``/dev/shm`` that same-host peers map for the ``shm`` transport.

    :meth:`view` gives a writable ``memoryview`` (``np.frombuffer(buf.view(), ...)``);
    :attr:`addr` and :attr:`length` give the range.
    :meth:`close` unmaps and unlinks it; views taken from it must be released first.
    """

    def __init__(self, length: int) -> None:
        if length <= 0:
            raise ValueError(f"length must be > 0 bytes, got {length}")
        reclaim_stale_shared_buffers()
        self.name = f"pymooncake-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        path = os.path.join(SHM_DIR, self.name)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, length)
            self._mmap = mmap.mmap(fd, length)
        finally:
            os.close(fd)
        self.length = length
        self._anchor = ctypes.c_ubyte.from_buffer(self._mmap)
        self.addr = ctypes.addressof(self._anchor)

    def __len__(self) -> int:
        return self.length

    def view(self) -> memoryview:
        return memoryview(self._mmap)

    def close(self) -> None:
        if self._mmap.closed:
            return
        del self._anchor
        # Views still exported: leave the mapping to the garbage collector, unlink the name.
        with contextlib.suppress(BufferError):
            self._mmap.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(SHM_DIR, self.name))


class PeerMapping:
    """A peer's shared-memory range mapped into this process."""

    def __init__(self, shm_name: str, length: int) -> None:
        if "/" in shm_name or not shm_name.startswith("pymooncake-"):
            raise ValueError(f"refusing to map unexpected shm name {shm_name!r}")
        fd = os.open(os.path.join(SHM_DIR, shm_name), os.O_RDWR)
        try:
            self._mmap = mmap.mmap(fd, length)
        finally:
            os.close(fd)
        self._anchor = ctypes.c_ubyte.from_buffer(self._mmap)
        self.addr = ctypes.addressof(self._anchor)
        self.length = length

    def close(self) -> None:
        del self._anchor
        with contextlib.suppress(BufferError):
            self._mmap.close()
