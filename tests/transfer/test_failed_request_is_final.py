"""A request reported FAILED is final: none of its slices moves a byte afterwards.

Before, the first failed slice made its request (and the batch) final at once while the
request's other slices were still queued or in flight: a caller told "failed" reused its
memory (the P2P puller pulled the shard again from another holder, verified it, advertised
it) and a late slice of the failed READ then wrote into it.
"""

from __future__ import annotations

import time
import uuid

import numpy as np

from pymooncake.transfer import (
    StatusCode,
    TransferConfig,
    TransferEngine,
    TransferOp,
    TransferRequest,
)

N = 16 << 20


def test_a_failed_read_writes_nothing_after_its_status_is_final() -> None:
    md = f"embedded://final-{uuid.uuid4().hex[:8]}"
    cfg = TransferConfig(num_paths=2, min_slice_bytes=64 << 10, max_slice_bytes=64 << 10,
                         window_slices=2, max_retries=0, path_retry_interval_s=0.05,
                         slice_timeout_s=2.0)
    tag = uuid.uuid4().hex[:6]
    with (TransferEngine(f"tgt-{tag}", md, config=cfg) as tgt,
          TransferEngine(f"ini-{tag}", md, config=cfg) as ini):
        src = np.full(N, 7, dtype=np.uint8)
        dst = np.zeros(N, dtype=np.uint8)
        src_addr, dst_addr = tgt.register_memory(src), ini.register_memory(dst)
        assert tgt.server is not None
        tgt.server.fault_drop_after_slices = 3     # one run of 2 slices fails (no retries left)
        bid = ini.allocate_batch(1)
        ini.submit(bid, [TransferRequest(TransferOp.READ, dst_addr, tgt.name, src_addr, N)])
        [st] = ini.wait(bid, timeout_s=30)
        ini.free_batch(bid)
        assert st.code is StatusCode.CONNECTION_ERROR, st
        dst[:] = 0                  # the caller's memory is its own again
        time.sleep(0.5)
        assert not dst.any(), f"{np.count_nonzero(dst)} bytes written after the final status"
