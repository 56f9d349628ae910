"""A lone sync request of one tcp slice, without a batch (``batch_transfer_sync`` of
one request): route, run on an idle path in the calling thread (``TcpPaths.run_one``),
final status. Every other case goes the batch way, with its route and the tries made."""

from __future__ import annotations

import time

from pymooncake.transfer import metrics as m
from pymooncake.transfer.batch import BatchId, StatusCode, TransferRequest, TransferStatus
from pymooncake.transfer.batch_table import completed, observe_latency
from pymooncake.transfer.config import TransferConfig
from pymooncake.transfer.paths import TcpPaths
from pymooncake.transfer.routing import Route, Router
from pymooncake.transfer.segment import SegmentDescriptor
from pymooncake.transfer.transports.base import Slice


def sync_one(router: Router, paths: TcpPaths, config: TransferConfig, req: TransferRequest
             ) -> TransferStatus | tuple[list[TransferStatus | Route], Slice | None]:
    """``req``'s final status when it is at most one slice over tcp and an idle path took
    it. Otherwise (another transport or a refusal, more slices, no idle path, a link error
    that leaves tries) ``([its route], the slice already tried or None)`` for the batch
    path, which then routes nothing again and counts those tries."""
    verdict = router.route(req)
    if (isinstance(verdict, TransferStatus) or verdict[0] != "tcp"
            or req.length > config.min_slice_bytes):
        return [verdict], None
    t0 = time.monotonic()
    _, _, desc, local = verdict
    assert isinstance(desc, SegmentDescriptor)
    (s,) = router.slices(BatchId(0), 0, req, local)
    out = paths.run_one(desc, s)
    if out is None:
        return [verdict], (s if s.retries else None)
    code, msg = out
    if code is StatusCode.OK:
        observe_latency("tcp", time.monotonic() - t0)
        return completed(req.length)
    m.failures_total.labels("tcp", code.value).inc()
    return TransferStatus.failed(code, msg)
