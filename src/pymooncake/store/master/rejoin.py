"""The master's RPCs of ``recovery`` (issue 17): ``ssd_recover`` (a restarted storage
process re-registers its intact SSD files) and ``report_bad_replica`` (a client read a
replica whose bytes failed the checksum), with their metrics."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pymooncake.obs import metrics
from pymooncake.obs.logging import init_logger
from pymooncake.store.master import recovery
from pymooncake.store.protocol import BadReplicaRequest, SsdRecoverRequest

if TYPE_CHECKING:
    from pymooncake.store.master.service import MasterService

logger = init_logger(__name__)

M_SSD_RECOVERED = metrics.counter(
    "pymooncake_store_ssd_recovered_total",
    "SSD objects a restarted storage process offered again, by result "
    "(registered/refused)", ["result"])
M_BAD_REPLICAS = metrics.counter(
    "pymooncake_store_bad_replicas_total",
    "Replicas dropped because a reader found their bytes failing the checksum")


def register(s: Any, svc: MasterService) -> None:
    """Add the two RPCs to ``svc``'s (gated) registry ``s``."""

    def ssd_recover(p: SsdRecoverRequest) -> list[str]:
        out = svc._call(recovery.register_ssd, svc.core, p.client_id, p.segment, p.holder,
                        list(p.entries), p.final, svc.now_ms())
        ok = sum(1 for r in out if r == recovery.REGISTERED)
        M_SSD_RECOVERED.labels("registered").inc(ok)
        M_SSD_RECOVERED.labels("refused").inc(len(out) - ok)
        if ok or len(out) > ok:
            logger.info("segment %s (holder %s): %d SSD objects registered again, %d "
                        "refused", p.segment, p.holder, ok, len(out) - ok)
        return out

    def report_bad_replica(p: BadReplicaRequest) -> int:
        n = svc._call(recovery.drop_bad_replicas, svc.core, p.key, p.generation,
                      list(p.replica_ids), svc.now_ms())
        if n:
            M_BAD_REPLICAS.inc(n)
            logger.warning("client %s found %d replica(s) of %r failing the checksum: "
                           "dropped", p.client_id, n, p.key)
        return n

    s.register("ssd_recover", ssd_recover, SsdRecoverRequest)
    s.register("report_bad_replica", report_bad_replica, BadReplicaRequest)
