"""P2PStore: one process's peer in the P2P checkpoint store (the I/O shell).

Mooncake's P2P Store (mooncake-p2p-store: ``Register``, ``GetReplica``, ``Unregister``,
``DeleteReplica``, ``List``): a payload is published as metadata only, and every node that
gets a replica serves it to the others, so a checkpoint spreads like a BitTorrent swarm
with no central data server. Here the payload memory is registered with this process's
:class:`~pymooncake.transfer.TransferEngine` and shards move with its READs; the manifest
and holder records live in the one metadata service (``embedded://``, ``http://``,
``etcd://``). Holder records are kept under one lease of ``holder_ttl_s``: a peer that
dies stops being advertised within that time.
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Coroutine, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from pymooncake.metadata import MetadataStore, open_metadata
from pymooncake.obs.logging import init_logger
from pymooncake.p2p import payload as pl
from pymooncake.p2p.manifest import (
    DEFAULT_SHARD_BYTES,
    MANIFEST_PREFIX,
    Holder,
    Manifest,
    P2PError,
    P2PExists,
    P2PNotFound,
    build_manifest,
    check_name,
    holders_prefix,
    manifest_key,
    name_from_manifest_key,
)
from pymooncake.p2p.puller import MAX_PARALLEL, Puller, PullOptions, PullStats
from pymooncake.p2p.records import HolderRecords
from pymooncake.transfer import TransferConfig, TransferEngine

logger = init_logger(__name__)
T = TypeVar("T")


@dataclass(slots=True)
class Replica:
    """What :meth:`P2PStore.get_replica` returns."""

    manifest: Manifest
    stats: PullStats
    path: Path | None = None
    """The directory the files were written to (file payloads)."""
    buffers: dict[str, Any] | None = None
    """Entry name → the buffer holding it (tensor payloads)."""


@dataclass(slots=True)
class PayloadInfo:
    """One line of :meth:`P2PStore.list`."""

    name: str
    total_bytes: int
    num_entries: int
    num_shards: int
    holders: int
    """Live holder records (any shards)."""
    complete_holders: int
    manifest_id: str = ""


@dataclass(slots=True)
class _Held:
    manifest: Manifest
    payload: pl.Payload
    record: Holder
    addrs: list[int]
    target: pl.Target | None = None
    root: Path | None = None
    complete: bool = False


def _default_config(host: str) -> TransferConfig:
    # A dead holder should cost about a second, not the engine's default ~30 s bound.
    return TransferConfig(host=host, max_retries=1, connect_timeout_s=1.0,
                          path_retry_interval_s=0.2, slice_timeout_s=10.0)


class P2PStore:
    """A P2P Store peer: register payloads, get replicas, serve what it holds.

    ``metadata`` is a URL for :func:`~pymooncake.metadata.open_metadata` or a store;
    ``host`` the address peers reach this process's Transfer Engine at. Use as a context
    manager or call :meth:`close`; everything this peer holds is served until then.
    ``holder_ttl_s``: seconds a dead peer stays advertised. Every method (the constructor
    too) raises :class:`~pymooncake.metadata.MetadataError` or ``TimeoutError`` when the
    metadata service cannot be reached; the constructor raises ``OSError`` when the
    Transfer Engine's port cannot be bound.
    """

    def __init__(self, metadata: MetadataStore | str = "embedded://", *,
                 host: str = "127.0.0.1", holder_ttl_s: float = 5.0,
                 transfer_config: TransferConfig | None = None,
                 segment: str | None = None) -> None:
        if not holder_ttl_s > 0:
            raise ValueError(f"holder_ttl_s must be > 0 seconds, got {holder_ttl_s}")
        self.metadata = open_metadata(metadata) if isinstance(metadata, str) else metadata
        self.segment = segment or (f"p2p-{socket.gethostname()}-{os.getpid()}-"
                                   f"{uuid.uuid4().hex[:6]}")
        self.holder_ttl_s = holder_ttl_s
        self.engine = TransferEngine(self.segment, self.metadata,
                                     config=transfer_config or _default_config(host))
        self._held: dict[str, _Held] = {}
        self._records = HolderRecords(self.metadata, self.segment, holder_ttl_s,
                                      self._record_value, lambda: list(self._held))
        self._closed = False
        try:
            self.engine.start()
            self._records.start()
        except BaseException:
            self.close()
            raise

    def _run(self, coro: Coroutine[Any, Any, T], timeout_s: float = 15.0) -> T:
        return self._records.run(coro, timeout_s)

    def _record_value(self, name: str) -> bytes | None:
        held = self._held.get(name)
        return None if held is None else held.record.encode()

    def _hold(self, manifest: Manifest, payload: pl.Payload, have: int) -> _Held:
        addrs = []
        try:
            for b in payload.buffers:
                addrs.append(self.engine.register_memory(b) if b is not None else 0)
        except BaseException:
            for a in addrs:
                if a:
                    self.engine.unregister_memory(a)
            raise
        rec = Holder(self.segment, manifest.manifest_id, list(addrs), have,
                     host=self.engine.config.host)
        held = _Held(manifest, payload, rec, addrs, complete=have.bit_count() ==
                     len(manifest.shards))
        self._held[manifest.name] = held
        return held

    # ------------------------------------------------------------------ API
    def register(self, name: str, files: Sequence[str | os.PathLike[str]] | None = None,
                 tensors: Mapping[str, Any] | None = None, *,
                 shard_bytes: int = DEFAULT_SHARD_BYTES) -> Manifest:
        """Publish ``files`` (paths; directories are walked) or ``tensors`` (name → torch CPU
        tensor / writable buffer) under ``name``: metadata only, no bytes move. This peer
        serves them (in place) until :meth:`delete_replica`, :meth:`unregister` or
        :meth:`close`. ``shard_bytes``: shard size in bytes.

        Idempotent for identical content; raises :class:`P2PExists` when ``name`` holds
        other content, ``FileNotFoundError``, ``TypeError``/``ValueError`` for bad input,
        :class:`~pymooncake.metadata.MetadataError` when the service is unreachable.
        """
        check_name(name)
        if (files is None) == (tensors is None):
            raise ValueError("give exactly one of files= or tensors=")
        if isinstance(files, (str, os.PathLike)):
            files = [files]
        payload = pl.open_files(list(files)) if files is not None else pl.open_tensors(tensors
                                                                                       or {})
        manifest = build_manifest(name, "files" if files is not None else "tensors",
                                  payload.entries, [payload.view(i) for i in
                                                    range(len(payload.entries))], shard_bytes)
        held = self._held.get(name)
        if held is not None:
            payload.close()
            if held.manifest.manifest_id != manifest.manifest_id:
                raise P2PExists(f"this peer already holds {name!r} with other content")
            return held.manifest
        if not self._run(self.metadata.create(manifest_key(name), manifest.encode())):
            existing = self.manifest(name)
            if existing.manifest_id != manifest.manifest_id:
                payload.close()
                raise P2PExists(f"{name!r} is already registered with other content "
                                f"(manifest {existing.manifest_id}); unregister it first")
        self._hold(manifest, payload, (1 << len(manifest.shards)) - 1)
        self._records.publish(name)
        return manifest

    def manifest(self, name: str) -> Manifest:
        """The published manifest of ``name``; raises :class:`P2PNotFound`."""
        kv = self._run(self.metadata.get(manifest_key(check_name(name))))
        if kv is None:
            raise P2PNotFound(f"no payload named {name!r} is registered")
        return Manifest.decode(kv.value)

    def holders(self, name: str) -> list[Holder]:
        """Live holder records of ``name`` (this peer's included), for its current manifest;
        raises :class:`P2PNotFound`."""
        mid = self.manifest(name).manifest_id
        out = []
        for kv in self._run(self.metadata.get_prefix(holders_prefix(name))):
            try:
                h = Holder.decode(kv.value)
            except ValueError:
                continue
            if h.manifest_id == mid:
                out.append(h)
        return out

    def get_replica(self, name: str, into: str | os.PathLike[str] | Mapping[str, Any] | None
                    = None, options: PullOptions | None = None) -> Replica:
        """Pull ``name`` from every current holder in parallel and become a holder.

        ``into``: the directory for a file payload (files appear there only once every shard
        is verified; partial files are ``*.p2p-part``; on failure they are removed, and so
        are the directories this pull created, if empty); for a tensor
        payload a mapping name → writable buffer of the entry's size, or ``None`` to get new
        tensors. Each shard is advertised as soon as it is verified. Raises
        :class:`P2PNotFound` (unknown or unregistered name), :class:`NoHolderError` (no live
        holder serves verified bytes for some shard for ``options.stall_timeout_s``),
        ``ValueError`` for a bad ``into``, ``OSError`` when the files cannot be created
        there (``NotADirectoryError``: ``into`` is a file), :class:`P2PError` otherwise.
        """
        opts = options or PullOptions()
        if not 1 <= opts.parallel <= MAX_PARALLEL or opts.per_holder < 1:
            raise ValueError(f"parallel must be in 1..{MAX_PARALLEL} and per_holder >= 1, got "
                             f"{opts.parallel} and {opts.per_holder}")
        manifest = self.manifest(name)
        if name in self._held:
            held = self._held[name]
            if held.complete and held.manifest.manifest_id == manifest.manifest_id:
                return self._replica(held, PullStats())
            raise P2PError(f"this peer already holds {name!r} (delete_replica first)")
        target = pl.Target()
        if manifest.kind == "files":
            if into is None or isinstance(into, Mapping):
                raise ValueError(f"{name!r} is a file payload: give a directory as into=")
            payload, target = pl.create_files(manifest, Path(into))
        else:
            if into is not None and not isinstance(into, Mapping):
                raise ValueError(f"{name!r} is a tensor payload: into= must be a mapping "
                                 "name -> buffer, or None")
            payload = pl.destination_buffers(manifest, into)
        try:
            held = self._hold(manifest, payload, 0)
        except BaseException:
            pl.remove_parts(target)
            raise
        held.target = target
        held.root = Path(into) if manifest.kind == "files" else None  # type: ignore[arg-type]
        if opts.share:
            self._records.publish(name)
        puller = Puller(engine=self.engine, metadata=self.metadata, run=self._run,
                        segment=self.segment, manifest=manifest, record=held.record,
                        views=[payload.view(i) for i in range(len(manifest.entries))],
                        addrs=held.addrs,
                        publish=lambda: self._records.publish_soon(name), opts=opts)
        try:
            stats = puller.run_pull()
            pl.finish_files(target)
        except BaseException:
            self._withdraw(name)
            pl.remove_parts(target)
            raise
        held.complete = True
        if opts.share:  # the complete record is out before this returns (a list() right
            self._records.publish(name)  # after sees it; queued puts may still be in flight)
        else:
            self._withdraw(name)
        return self._replica(held, stats)

    @staticmethod
    def _replica(held: _Held, stats: PullStats) -> Replica:
        m = held.manifest
        if m.kind == "files":
            return Replica(m, stats, path=held.root)
        return Replica(m, stats, buffers={e.path: b for e, b in
                                          zip(m.entries, held.payload.buffers, strict=True)})

    def _withdraw(self, name: str) -> None:
        """Forget ``name`` (no record is put any more), delete the record, then unregister
        the memory: peers stop being sent here before the memory goes."""
        held = self._held.pop(name, None)
        if held is None:
            return
        self._records.withdraw(name)
        for a in held.addrs:
            if a:
                self.engine.unregister_memory(a)
        # The maps are unmapped when garbage-collected (a view may still be exported).

    def delete_replica(self, name: str) -> bool:
        """Stop holding ``name`` here (withdraw the record, unregister the memory; files
        on disk stay). ``True`` when this peer held it."""
        held = name in self._held
        self._withdraw(name)
        return held

    def unregister(self, name: str) -> bool:
        """Withdraw ``name`` from the store: delete its manifest and every holder record
        (all peers stop being advertised; pulls in progress end with P2PNotFound).
        ``True`` when it was registered."""
        check_name(name)
        existed = self._run(self.metadata.delete(manifest_key(name)))
        self._withdraw(name)
        for kv in self._run(self.metadata.get_prefix(holders_prefix(name))):
            self._run(self.metadata.delete(kv.key))
        return bool(existed)

    def list(self, prefix: str = "") -> list[PayloadInfo]:
        """Registered payloads whose name starts with ``prefix``, sorted by name."""
        out = []
        for kv in self._run(self.metadata.get_prefix(MANIFEST_PREFIX)):
            name = name_from_manifest_key(kv.key)
            if not name.startswith(prefix):
                continue
            try:
                m = Manifest.decode(kv.value)
                hs = self.holders(name)
            except (ValueError, P2PNotFound):
                continue
            full = (1 << len(m.shards)) - 1
            out.append(PayloadInfo(name, m.total_bytes, len(m.entries), len(m.shards),
                                   len(hs), sum(h.have == full for h in hs), m.manifest_id))
        return sorted(out, key=lambda i: i.name)

    def close(self) -> None:
        """Withdraw every holder record (revoke the lease), stop the Transfer Engine."""
        if self._closed:
            return
        self._closed = True
        self._records.revoke()
        self.engine.close()
        for held in self._held.values():
            held.payload.close()
        self._held.clear()
        self._records.close()

    def __enter__(self) -> P2PStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

