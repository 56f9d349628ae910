"""Payload memory: the seed's files or tensors, a receiver's output files or buffers.

Files are memory-mapped, so the bytes a peer READs come straight from the page cache and
the bytes a receiver pulls land straight in its output files (no staging copy). A seed maps
its files copy-on-write (``MAP_PRIVATE``: registrable, and a peer's stray WRITE can never
change the file on disk); a receiver maps ``<file>.p2p-part`` shared and renames it once
every shard of the payload is verified.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pymooncake.p2p.manifest import Entry, Manifest

PART_SUFFIX = ".p2p-part"


@dataclass(slots=True)
class Payload:
    """Entries with one writable byte view each (``None`` for an empty entry)."""

    entries: list[Entry]
    buffers: list[Any]
    """What is registered with the Transfer Engine (mmap, numpy array, tensor) or None."""
    _maps: list[mmap.mmap] = field(default_factory=list)

    def view(self, i: int) -> memoryview:
        b = self.buffers[i]
        if b is None:
            return memoryview(b"")
        if hasattr(b, "data_ptr") and hasattr(b, "element_size"):   # torch tensor
            return memoryview(b.reshape(-1).view(_torch_uint8()).numpy())
        return memoryview(b).cast("B")

    def close(self) -> None:
        for m in self._maps:
            with contextlib.suppress(BufferError):   # a view is still exported: GC unmaps
                m.close()
        self._maps.clear()


def _torch_uint8() -> Any:
    import torch
    return torch.uint8


def _walk(root: Path) -> list[Path]:
    if root.is_file():
        return [root]
    return sorted(p for p in root.rglob("*") if p.is_file() and not p.is_symlink()
                  and not p.name.endswith(PART_SUFFIX))


def open_files(paths: list[str | os.PathLike[str]]) -> Payload:
    """Map the files (a directory is walked; entry paths are relative to it, a lone file's
    is its name). Raises ``FileNotFoundError`` for a missing path and ``ValueError`` when
    nothing is found or two files would get the same entry path."""
    entries: list[Entry] = []
    files: list[Path] = []
    for p in paths:
        root = Path(p)
        if not root.exists():
            raise FileNotFoundError(f"no such file or directory: {str(root)!r}")
        for f in _walk(root):
            rel = f.name if f == root else f.relative_to(root).as_posix()
            entries.append(Entry(rel, f.stat().st_size))
            files.append(f)
    if not entries:
        raise ValueError(f"no files to register under {[str(p) for p in paths]}")
    dup = {e.path for e in entries if sum(x.path == e.path for x in entries) > 1}
    if dup:
        raise ValueError(f"two files would have the same path in the payload: {sorted(dup)}")
    pl = Payload(entries, [])
    for f, e in zip(files, entries, strict=True):
        if e.size == 0:
            pl.buffers.append(None)
            continue
        with open(f, "rb") as fh:
            m = mmap.mmap(fh.fileno(), e.size, access=mmap.ACCESS_COPY)
        pl._maps.append(m)
        pl.buffers.append(m)
    return pl


def open_tensors(tensors: Mapping[str, Any]) -> Payload:
    """Tensors (torch CPU, contiguous) or writable buffers (numpy, bytearray) by name,
    registered in place. Raises ``TypeError``/``ValueError`` for an unusable value."""
    if not tensors:
        raise ValueError("no tensors to register")
    entries, bufs = [], []
    for name, t in tensors.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"tensor names must be non-empty str, got {name!r}")
        if hasattr(t, "data_ptr") and hasattr(t, "element_size"):
            if getattr(t.device, "type", "cpu") != "cpu" or not t.is_contiguous():
                raise ValueError(f"tensor {name!r} must be a contiguous CPU tensor")
            n = t.numel() * t.element_size()
            entries.append(Entry(name, n, str(t.dtype).removeprefix("torch."),
                                 tuple(t.shape)))
        else:
            arr = np.asarray(memoryview(t)) if not isinstance(t, np.ndarray) else t
            if not arr.flags.c_contiguous or not arr.flags.writeable:
                raise ValueError(f"buffer {name!r} must be C-contiguous and writable")
            n = arr.nbytes
            entries.append(Entry(name, n))
        bufs.append(t if n else None)
    return Payload(entries, bufs)


@dataclass(slots=True)
class Target:
    """Where a file payload is being pulled to: the final paths and the directories the
    pull created (removed again, if still empty, when the pull fails)."""

    finals: list[Path] = field(default_factory=list)
    made_dirs: list[Path] = field(default_factory=list)
    """Created by this pull, parents before children."""


def _make_dirs(d: Path, made: list[Path]) -> None:
    """Create ``d`` and its missing parents, appending each one created to ``made``.
    Raises ``NotADirectoryError`` naming the path when ``d`` or a parent exists as a
    non-directory, ``OSError`` (e.g. ``PermissionError``) when one cannot be created."""
    missing = []
    p = d
    while not p.is_dir():
        if p.exists() or p.is_symlink():
            raise NotADirectoryError(errno.ENOTDIR, "exists and is not a directory", str(p))
        missing.append(p)
        if p.parent == p:
            break
        p = p.parent
    for m in reversed(missing):
        m.mkdir()
        made.append(m)


def create_files(manifest: Manifest, into: Path) -> tuple[Payload, Target]:
    """``<into>/<entry>.p2p-part`` files of the right sizes, mapped shared; returns the
    payload and the :class:`Target` (final paths, directories created). Raises
    ``ValueError`` for an entry path escaping ``into``, ``NotADirectoryError`` when
    ``into`` (or a directory an entry needs) exists as a file, ``IsADirectoryError`` when
    an entry's final path is a directory, and ``OSError`` when a file cannot be created.
    On failure nothing it created is left behind."""
    target = Target()
    pl = Payload(list(manifest.entries), [])
    try:
        _make_dirs(into, target.made_dirs)
        root = into.resolve()
        for e in manifest.entries:
            final = (root / e.path).resolve()
            if root not in final.parents:
                raise ValueError(f"entry path {e.path!r} escapes the target directory")
            if final.is_dir():
                raise IsADirectoryError(errno.EISDIR, "is a directory, the payload has a file "
                                        "there", str(final))
            _make_dirs(final.parent, target.made_dirs)
            target.finals.append(final)
            part = final.with_name(final.name + PART_SUFFIX)
            fd = os.open(part, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.ftruncate(fd, e.size)
                if e.size:
                    m = mmap.mmap(fd, e.size, access=mmap.ACCESS_WRITE)
                    pl._maps.append(m)
                    pl.buffers.append(m)
                else:
                    pl.buffers.append(None)
            finally:
                os.close(fd)
    except BaseException:
        pl.close()
        remove_parts(target)
        raise
    return pl, target


def finish_files(target: Target) -> None:
    """Rename every ``.p2p-part`` to its final name (after every shard was verified)."""
    for f in target.finals:
        os.replace(f.with_name(f.name + PART_SUFFIX), f)


def remove_parts(target: Target) -> None:
    """Remove the ``.p2p-part`` files, then the directories the pull created if they are
    empty (a directory that existed before, or that holds anything else, stays)."""
    for f in target.finals:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f.with_name(f.name + PART_SUFFIX))
    for d in reversed(target.made_dirs):
        with contextlib.suppress(OSError):      # not empty (someone else's file), gone
            d.rmdir()


def destination_buffers(manifest: Manifest, into: Mapping[str, Any] | None) -> Payload:
    """Buffers to pull a tensor payload into: ``into[name]`` for every entry (writable,
    exactly the entry's bytes), or new torch tensors / bytearrays when ``into`` is None.
    Raises ``ValueError`` for a missing name or a size mismatch."""
    bufs: list[Any] = []
    for e in manifest.entries:
        if into is None:
            if e.dtype is not None:
                import torch
                buf: Any = torch.empty(e.shape or (), dtype=getattr(torch, e.dtype))
            else:
                buf = np.empty(e.size, dtype=np.uint8)
        else:
            if e.path not in into:
                raise ValueError(f"no buffer given for entry {e.path!r}")
            buf = into[e.path]
        got = open_tensors({e.path: buf}).entries[0].size
        if got != e.size:
            raise ValueError(f"buffer for {e.path!r} has {got} bytes, the payload {e.size}")
        bufs.append(buf if e.size else None)
    return Payload(list(manifest.entries), bufs)
