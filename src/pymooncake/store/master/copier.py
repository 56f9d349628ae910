"""The master's replica copies (I/O shell of ``store.master.replication``).

Two RPC methods, served by ``MasterService``:

* ``segment_names`` → the mounted segments' names (where a replica may go);
* ``replica_segments`` ``{"keys": [...]}`` → per key the segments holding a readable DRAM
  replica (``None`` when absent); no lease.
* ``replicate`` ``{"keys": [...], "segment": name}`` → per key ``{"r": bytes copied}``
  (0 when ``segment`` already held it) or ``{"e": [code, message]}``. The master adds one
  replica of each key on ``segment``: ``copy_start`` for all, then one batch of Transfer
  Engine READs from the source replicas into a staging buffer and one batch of WRITEs into
  the new replicas, then ``copy_end`` each. Readers keep reading the old replicas meanwhile.

The copier's Transfer Engine (``store.datapath.DataPath``) is started on first use on
``metadata_url`` (the master's embedded HTTP metadata server, or ``pymooncake master
--metadata``); without one, ``replicate`` answers ``INVALID_PARAMS``. ``prepare()`` (the
``pymooncake master`` command, at start-up) imports its modules beforehand.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import os
from typing import Any

from pymooncake.obs import metrics
from pymooncake.obs.logging import init_logger
from pymooncake.rpc import RpcError
from pymooncake.store.errors import ErrorCode, StoreError
from pymooncake.store.master.replication import copy_end, copy_start, replica_segments

logger = init_logger(__name__)

M_COPIES = metrics.counter("pymooncake_store_replica_copies_total",
                           "replicas the master added to published objects, by result",
                           ["result"])
M_COPY_BYTES = metrics.counter("pymooncake_store_replica_copy_bytes_total",
                               "bytes copied into added replicas")


class ReplicaCopier:
    """``replica_segments`` and ``replicate`` for a ``MasterService`` (module docstring)."""

    def __init__(self, service: Any, metadata_url: str | None = None,
                 host: str = "127.0.0.1") -> None:
        self.service = service
        self.metadata_url = metadata_url
        self.host = host
        self._dp: Any = None
        self._staging: Any = None
        self._staging_addr = 0
        self._lock = asyncio.Lock()

    def prepare(self) -> None:
        """Import what the first copy needs (the Transfer Engine, numpy, the metadata client
        of ``metadata_url``) now, at start-up, rather than inside the first ``replicate``
        (~0.2 CPU-s, mostly httpx, measured in a P/D replay: issue 16, session 24).
        Starts nothing; a no-op without ``metadata_url``."""
        if not self.metadata_url:
            return
        mods = ["numpy", "pymooncake.store.datapath", "pymooncake.transfer"]
        if self.metadata_url.startswith("http://"):
            mods.append("pymooncake.metadata.http_client")
        elif self.metadata_url.startswith("etcd://"):
            mods.append("pymooncake.metadata.etcd")
        for m in mods:
            importlib.import_module(m)

    def register(self, s: Any) -> None:
        s.register("replica_segments", self._replica_segments)
        s.register("segment_names", lambda p: sorted(self.service.core.pool.segments))
        s.register("replicate", self._replicate)

    def close(self) -> None:
        if self._dp is not None:
            with contextlib.suppress(Exception):
                self._dp.close()
            self._dp = None

    # -- handlers -------------------------------------------------------------------------
    @staticmethod
    def _keys(p: Any) -> list[str]:
        keys = p.get("keys") if isinstance(p, dict) else None
        if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
            raise RpcError("INVALID_ARGUMENT", "keys must be a list of str")
        return keys

    def _replica_segments(self, p: Any) -> list[list[str] | None]:
        return replica_segments(self.service.core, self._keys(p))

    async def _replicate(self, p: Any) -> list[dict[str, Any]]:
        keys = self._keys(p)
        segment = p.get("segment")
        if not isinstance(segment, str) or not segment:
            raise RpcError("INVALID_ARGUMENT", "segment must be a segment name")
        if not self.metadata_url:
            raise RpcError(ErrorCode.INVALID_PARAMS.name,
                           "this master copies no replicas: start it with "
                           "--enable-http-metadata-server or --metadata URL")
        async with self._lock:
            return await self._copy(keys, segment)

    async def _copy(self, keys: list[str], segment: str) -> list[dict[str, Any]]:
        svc = self.service
        core = svc.core
        out: list[dict[str, Any]] = [{"r": 0} for _ in keys]
        started: list[tuple[int, Any, Any]] = []   # (index, source, new replica)
        for i, k in enumerate(keys):
            try:
                src, new = copy_start(core, k, segment, svc.now_ms())
                started.append((i, src, new))
            except StoreError as e:
                if e.code != ErrorCode.OBJECT_ALREADY_EXISTS:
                    out[i] = {"e": [int(e.code), e.message]}
                    M_COPIES.labels("refused").inc()
        svc._after()     # evictions made for room: spills, metrics, journal
        if not started:
            return out
        sums = [getattr(core.objects.get(keys[i]), "checksum", None) for i, _, _ in started]
        try:
            oks = await asyncio.to_thread(self._move, [(s, n) for _, s, n in started], sums)
        except Exception as e:  # noqa: BLE001 - every copy of the batch failed
            logger.warning("replica copy to %s failed: %s", segment, e)
            oks = [False] * len(started)
        now = svc.now_ms()
        for (i, _, new), ok in zip(started, oks, strict=True):
            if svc.core is not core:       # HA step-down meanwhile: not ours to finish
                out[i] = {"e": [int(ErrorCode.UNAVAILABLE_IN_CURRENT_STATUS), "stepped down"]}
                continue
            if copy_end(core, keys[i], new.replica_id, ok is True, now):
                out[i] = {"r": new.length}
                M_COPIES.labels("ok").inc()
                M_COPY_BYTES.inc(new.length)
            elif ok is None:  # the source's bytes failed the checksum: nothing copied
                out[i] = {"e": [int(ErrorCode.CHECKSUM_MISMATCH),
                                f"copy of {keys[i]!r}: its source replica failed the "
                                "checksum"]}
                M_COPIES.labels("failed").inc()
            else:
                out[i] = {"e": [int(ErrorCode.TRANSFER_FAIL),
                                f"copy of {keys[i]!r} to {segment!r} failed"]}
                M_COPIES.labels("failed").inc()
        svc._after()
        return out

    # -- bytes (worker thread) --------------------------------------------------------------
    def _data_path(self, nbytes: int) -> tuple[Any, int]:
        import numpy as np

        from pymooncake.store.datapath import DataPath
        from pymooncake.transfer import TransferConfig
        if self._dp is None:
            self._dp = DataPath(f"replicator-{os.getpid()}", str(self.metadata_url),
                                TransferConfig(host=self.host))
        if self._staging is None or self._staging.nbytes < nbytes:
            if self._staging is not None:
                with contextlib.suppress(Exception):
                    self._dp.unregister(self._staging_addr)
            self._staging = np.zeros(max(nbytes, 1 << 20), dtype=np.uint8)
            self._staging_addr = self._dp.register(self._staging)
        return self._dp, self._staging_addr

    def _move(self, pairs: list[tuple[Any, Any]], sums: list[bytes | None]
              ) -> list[bool | None]:
        """READ every source into the staging buffer, verify it against its object's
        checksum (issue 17: a corrupt replica is never copied; ``None`` for those), then
        WRITE it into the new replicas."""
        from pymooncake.store.checksum import verify_at
        from pymooncake.store.datapath import Move
        offs, total = [], 0
        for src, _ in pairs:
            offs.append(total)
            total += src.length
        dp, base = self._data_path(total)
        reads = dp.run([Move(False, base + o, s.segment, s.addr, s.length)
                        for o, (s, _) in zip(offs, pairs, strict=True)])
        ok: list[bool | None] = [r.ok for r in reads]
        for j, (src, _) in enumerate(pairs):
            if ok[j] and not verify_at(base + offs[j], src.length, sums[j]):
                ok[j] = None
        todo = [j for j, good in enumerate(ok) if good]
        writes = dp.run([Move(True, base + offs[j], pairs[j][1].segment, pairs[j][1].addr,
                              pairs[j][1].length) for j in todo])
        for j, r in zip(todo, writes, strict=True):
            ok[j] = r.ok
        return ok
