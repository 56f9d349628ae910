"""Case BUG-28: objects larger than a slice limit, empty values and bad keys never crash
the client; the process stays up and ordinary traffic goes on.

pymooncake's SSD tier writes an object as one checksummed file (no per-slice limit), and
the Transfer Engine cuts every request into slices of at most ``max_slice_bytes`` (here
4 MiB, the case's slice limit): objects of exactly, just over and 16 x that limit
round-trip byte-exact through DRAM, a spill to SSD and the load back. Documented rules:
an empty value is refused with ``INVALID_ARGUMENT`` (nothing stored); an empty key, a key
over ``MAX_KEY_BYTES`` (4 KiB of UTF-8), a key with a NUL and a key that is not valid
UTF-8 are refused with ``INVALID_ARGUMENT`` before any RPC."""

from __future__ import annotations

import numpy as np
import pytest

from pymooncake.store.client import MAX_KEY_BYTES
from pymooncake.store.errors import StoreError
from pymooncake.store.tiers.ssd import SsdTier
from pymooncake.transfer import TransferConfig

from .procs import MiB
from .test_store_processes import pattern, wait_until

SLICE = 4 * MiB
BAD_KEYS = ["", "k" * (64 * 1024), "a\x00b", "x\ud800y"]


def _put_or_no_space(c, key: str, v: bytes) -> bool:
    try:
        c.put(key, v)
    except StoreError as e:
        assert e.status == "NO_SPACE", e
        return False
    return True


def _status(fn) -> str:
    with pytest.raises(StoreError) as ei:
        fn()
    return ei.value.status


def test_bug_28_ssd_tier_takes_objects_over_the_slice_limit(tmp_path) -> None:
    tier = SsdTier(tmp_path / "ssd", 128 * MiB)
    vals = {"k1": pattern(1, SLICE), "k2": pattern(2, SLICE + 1), "k3": pattern(3, 64 * MiB)}
    for k, v in vals.items():
        tier.put(k, v)
    for k, v in vals.items():
        assert tier.get(k) == v
    tier.close()


@pytest.mark.integration
def test_bug_28_oversized_objects_and_edge_inputs(cluster_factory, tmp_path) -> None:
    # leases long enough for a 64 MiB copy on a loaded machine
    cl = cluster_factory("--default-kv-lease-ttl", "5000")
    cl.store_server(96 * MiB, "--ssd-path", str(tmp_path / "ssd"), "--ssd-capacity",
                    str(256 * MiB))
    c = cl.client(local_buffer_size=8 * MiB, transfer_config=TransferConfig(
        transports=("local", "shm", "tcp"), max_slice_bytes=SLICE, connect_timeout_s=1.0))
    # 1. objects at, just over and far over the slice limit, then pushed out to SSD
    vals = {"k1": pattern(1, SLICE), "k2": pattern(2, SLICE + 1), "k3": pattern(3, 64 * MiB)}
    for k, v in vals.items():
        c.put(k, v)
    for i in range(8):  # fill DRAM: the older objects spill to the SSD tier
        v = pattern(10 + i, 8 * MiB)
        # a full store answers NO_SPACE at once and spills in the background: retry
        assert wait_until(lambda i=i, v=v: _put_or_no_space(c, f"fill{i}", v), 20.0)
    assert wait_until(lambda: c.stats()["ssd_used_bytes"] >= 64 * MiB, 20.0)
    for k in ("k3", "k2", "k1"):  # the largest first: it needs the most DRAM to load
        got = c.get(k)
        assert len(got) == len(vals[k]) and got == vals[k]
    # 2. edge inputs: INVALID_ARGUMENT, nothing stored, nothing crashes
    assert _status(lambda: c.put("k0", b"")) == "INVALID_ARGUMENT"
    assert not c.exist("k0")
    assert len(BAD_KEYS[1].encode()) > MAX_KEY_BYTES
    for key in BAD_KEYS:
        assert _status(lambda key=key: c.put(key, b"x")) == "INVALID_ARGUMENT"
        assert _status(lambda key=key: c.get(key)) == "INVALID_ARGUMENT"
        assert _status(lambda key=key: c.exist(key)) == "INVALID_ARGUMENT"
        assert _status(lambda key=key: c.remove(key)) == "INVALID_ARGUMENT"
    errs = c.batch_put([*BAD_KEYS, "ok-batch"], [b"x"] * len(BAD_KEYS) + [b"y"])
    assert [e.status for e in errs[:-1]] == ["INVALID_ARGUMENT"] * len(BAD_KEYS)
    assert errs[-1] is None
    ex = c.batch_exist([*BAD_KEYS, "ok-batch"])
    assert [e.status for e in ex[:-1]] == ["INVALID_ARGUMENT"] * len(BAD_KEYS)
    assert ex[-1] is True
    got = c.batch_get([*BAD_KEYS, "ok-batch"])
    assert [e.status for e in got[:-1]] == ["INVALID_ARGUMENT"] * len(BAD_KEYS)
    assert got[-1] == b"y"
    # ... and bad zero-copy arguments are refused the same way, never a TypeError
    buf = np.zeros(4096, dtype=np.uint8)
    base = c.register_buffer(buf)
    for addr, size in ((None, 16), ("x", 16), (base, None), (base, -1), (base, True),
                       (base, 0), (base + 4090, 16), (-5, 16), (1.5, 16)):
        assert _status(lambda a=addr, n=size: c.put_from("zc", a, n)) == "INVALID_ARGUMENT"
        if addr == base + 4090:
            continue  # a read checks only the bytes it writes (the object is 1 byte)
        r = c.batch_get_into(["ok-batch"], [addr], [size])
        assert isinstance(r[0], StoreError) and r[0].status == "INVALID_ARGUMENT", (addr, size)
    for bad in ((["a"], [base], [1, 2]), (None, None, None), (["a"], [base, base], [1])):
        assert _status(lambda bad=bad: c.batch_put_from(*bad)) == "INVALID_ARGUMENT"
        assert _status(lambda bad=bad: c.batch_get_into(*bad)) == "INVALID_ARGUMENT"
    assert _status(lambda: c.batch_put(["a", "b"], [b"x"])) == "INVALID_ARGUMENT"
    assert not c.exist("a")
    assert _status(lambda: c.unregister_buffer("nope")) == "INVALID_ARGUMENT"
    assert c.get_into("ok-batch", base, 4096) == 1 and bytes(buf[:1]) == b"y"
    # 3. the client and the cluster are still up: an ordinary 1 KiB object round-trips
    small = pattern(99, 1024)
    c.put("after", small)
    assert c.get("after") == small
    assert cl.client().get("after") == small
