"""Replicas found corrupt on read are reported to the master (issue 17).

A read whose copy fails the object's checksum falls back to the next replica at once
(``client_get``). The failed replica is then read once more — in place when it lies in
this client's own segment, else into this client's own staging buffer, which no other
thread writes — and only when that second read fails the checksum too is it reported
(``report_bad_replica``): a ``get_into`` destination changed by another thread during the
copy must not cost a good replica. The master drops it, so later reads by every client
go elsewhere. A replica that cannot be read again (peer down) is not reported: that is
the liveness path's business (``bad_segment_ttl_s``, ``client_ttl``).
"""

from __future__ import annotations

import contextlib
from typing import Any

from pymooncake.obs.logging import init_logger
from pymooncake.store.checksum import verify, verify_at
from pymooncake.store.client_master import MasterOps
from pymooncake.store.client_memory import MemoryOps
from pymooncake.store.datapath import Move
from pymooncake.store.errors import StoreError
from pymooncake.store.protocol import BadReplicaRequest, ReplicaDesc

logger = init_logger(__name__)


class BadReplicaOps(MasterOps, MemoryOps):
    """``_report_bad`` for ``GetOps``."""

    def _report_bad(self, p: Any) -> None:
        """Confirm and report ``p.bad`` (replicas of plan ``p`` whose copy failed the
        checksum) to the master; never raises (the read's own answer stands)."""
        bad, p.bad = p.bad, []
        if p.checksum is None:  # stored without a checksum: no replica can pass
            return
        confirmed = []
        for rep in bad:
            try:
                if self._still_corrupt(rep, p.size, p.checksum):
                    confirmed.append(rep.replica_id)
            except Exception as e:  # noqa: BLE001 - no verdict, no report
                logger.debug("second read of %r on %s failed: %s", p.key, rep.segment, e)
        if not confirmed:
            return
        logger.warning("%r: replica(s) %s failed the checksum twice; reported to the master",
                       p.key, confirmed)
        with contextlib.suppress(StoreError):
            self._master("report_bad_replica", BadReplicaRequest(
                self.client_id, p.key, p.generation, tuple(confirmed)))

    def _still_corrupt(self, rep: ReplicaDesc, size: int, checksum: bytes) -> bool:
        """Whether a second read of ``rep`` fails the checksum (False: intact, or it could
        not be read)."""
        view = self._local_view(rep.addr, size)
        if view is not None:
            return not verify(view, checksum)
        self._started_dp("read")
        addr, _, release = self._stage(size)
        try:
            (r,) = self._dp.run([Move(False, addr, rep.segment, rep.addr, size)])
            return r.ok and not verify_at(addr, size, checksum)
        finally:
            release()
