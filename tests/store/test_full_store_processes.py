"""A full memory tier with SSD offload, with real master and store-server processes:
puts rejected while eviction drains memory are retryable and are retried until all are
stored, and a batch read of mostly-spilled keys is served whole (case BUG-62)."""

from __future__ import annotations

import time

from pymooncake.store.errors import StoreError

from .procs import MiB
from .test_store_processes import pattern


def test_bug_62_batch_puts_under_eviction_are_retried_and_all_read_back(
        cluster_factory, tmp_path) -> None:
    cl = cluster_factory("--eviction-high-watermark-ratio", "0.9", "--eviction-ratio", "0.1",
                         "--default-kv-lease-ttl", "2000")
    cl.store_server(64 * MiB, "--ssd-path", str(tmp_path / "ssd"), "--ssd-capacity",
                    str(1 << 30))
    c = cl.client(local_buffer_size=64 * MiB)
    vals = {f"{p}{i:02d}": pattern(100 * n + i, MiB)
            for n, p in enumerate("ABC") for i in range(40)}
    rejected = 0
    for prompt in "ABC":  # one batch per prompt, back to back
        keys = [k for k in vals if k[0] == prompt]
        deadline = time.monotonic() + 60.0
        while keys:
            res = c.batch_put(keys, [vals[k] for k in keys])
            failed = [k for k, r in zip(keys, res, strict=True) if isinstance(r, StoreError)]
            for k, r in zip(keys, res, strict=True):
                if isinstance(r, StoreError):  # reported per key, and retryable
                    assert r.status == "NO_SPACE" and r.retryable, (k, r)
            rejected += len(failed)
            keys = failed
            assert time.monotonic() < deadline, f"{len(keys)} puts never found room"
    assert sorted(c.list_keys()) == sorted(vals)  # all 120 stored, none dropped
    assert c.stats()["ssd_used_bytes"] >= 40 * MiB  # most of them went to SSD
    keys = list(vals)
    got = c.batch_get(keys)  # one call over 120 keys, most of them only on SSD
    for k, g in zip(keys, got, strict=True):
        assert not isinstance(g, StoreError), (k, g)
        assert g == vals[k], k
