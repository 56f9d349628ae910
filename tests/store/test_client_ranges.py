"""``StoreClient.open_reads``: byte ranges of planned objects read in several rounds
(what a layer-wise KV load does), against a real master and store server."""

from __future__ import annotations

import numpy as np
import pytest

from pymooncake.store.errors import ErrorCode, StoreError

pytestmark = pytest.mark.integration


def test_ranges_of_planned_objects_in_rounds_with_the_lease_checked(cluster_factory) -> None:
    from .procs import MiB

    cl = cluster_factory()
    cl.store_server(16 * MiB)
    now = [0.0]
    c = cl.client(clock=lambda: now[0])  # a client clock the test moves (leases)
    rng = np.random.default_rng(3)
    vals = [rng.integers(0, 256, 3000, dtype=np.uint8).tobytes() for _ in range(2)]
    assert c.batch_put(["a", "b"], vals) == [None, None]
    buf = np.zeros(8192, dtype=np.uint8)
    base = c.register_buffer(buf)

    r = c.open_reads(["a", "missing", "b"])
    assert r.sizes[0] == 3000 and r.sizes[2] == 3000
    assert isinstance(r.sizes[1], StoreError)
    assert r.sizes[1].code == ErrorCode.OBJECT_NOT_FOUND
    # round 1: the heads of a and b; round 2: their tails — as layer groups are read
    assert r.read([(0, 0, 1000, base), (2, 0, 1000, base + 4000)]) == [None, None]
    assert r.read([(0, 1000, 2000, base + 1000), (2, 1000, 2000, base + 5000)]) == [None,
                                                                                    None]
    assert buf[:3000].tobytes() == vals[0] and buf[4000:7000].tobytes() == vals[1]
    miss = r.read([(1, 0, 10, base)])
    assert isinstance(miss[0], StoreError) and miss[0].code == ErrorCode.OBJECT_NOT_FOUND
    # bad ranges are refused before anything is copied, naming what was wrong
    with pytest.raises(StoreError, match=r"outside object 0 of 3000 B") as e:
        r.read([(0, 2999, 2, base)])
    assert e.value.code == ErrorCode.INVALID_PARAMS
    with pytest.raises(StoreError, match="registered") as e:
        r.read([(0, 0, 100, base + 8150)])
    assert e.value.code == ErrorCode.INVALID_PARAMS
    assert r.close()[0] is None

    # a round after the lease lapsed: the copy is not trusted (case BUG-15)
    r2 = c.open_reads(["a"])
    now[0] += 3600.0
    (err,) = r2.read([(0, 0, 100, base)])
    assert isinstance(err, StoreError) and err.code == ErrorCode.LEASE_EXPIRED
