"""The store with real processes on 127.0.0.1: a master (hosting the HTTP metadata
server), store servers contributing DRAM, and clients in this process; every byte moves
through the Transfer Engine."""

from __future__ import annotations

import os
import time

import pytest

from pymooncake.store.config import ReplicateConfig
from pymooncake.store.errors import ErrorCode, StoreError
from pymooncake.transfer import TransferConfig

from .procs import MiB

pytestmark = pytest.mark.integration


def pattern(seed: int, n: int) -> bytes:
    return (bytes([seed % 251]) + os.urandom(15)) * (n // 16) + bytes(n % 16)


def test_put_get_two_phase_and_distinct_replicas(cluster_factory) -> None:
    cl = cluster_factory()
    s1 = cl.store_server(8 * MiB)
    s2 = cl.store_server(8 * MiB)
    writer = cl.client()
    reader = cl.client()
    v = pattern(1, 3 * MiB + 5)
    writer.put("k", v, ReplicateConfig(replica_num=2))
    assert reader.get("k") == v
    assert reader.exist("k")
    st = reader.stats()
    assert st["dram_used_bytes"] == 2 * ((len(v) + 63) // 64 * 64)
    segs = {s1.info["segment"], s2.info["segment"]}
    assert {r.segment for r in reader.replica_list("k").replicas} == segs
    # two-phase: a key whose put is not yet ended is invisible to readers
    h = writer.put_start("half", 100)
    assert not reader.exist("half")
    with pytest.raises(StoreError) as ei:
        reader.get("half")
    assert ei.value.status == "NOT_READY"
    writer.put_end("half", h.generation)
    assert reader.exist("half")
    # reads prefer a replica in the reader's own segment
    local = cl.client(global_segment_size=4 * MiB)
    writer.put("loc", v, ReplicateConfig(replica_num=2, preferred_segment=local.segment_name))
    assert local.segment_name in {r.segment for r in local.replica_list("loc").replicas}
    counter = CountingPath(local)
    copies = []
    inner = local._copy_out
    local._copy_out = lambda views, sums: copies.extend(views) or inner(views, sums)
    for _ in range(4):
        assert local.get("loc") == v
    assert counter.by_segment == {} and len(copies) == 4  # all four served locally


def wait_until(pred, timeout_s: float = 10.0, interval_s: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval_s)
    return pred()


def status_of(fn, *args, **kw) -> str:
    try:
        fn(*args, **kw)
    except StoreError as e:
        return e.status
    return "OK"


class CountingPath:
    """Wraps a client's data path to count the moves sent to each segment."""

    def __init__(self, client) -> None:
        self.inner = client._dp.run
        self.by_segment: dict[str, int] = {}
        client._dp.run = self

    def __call__(self, moves):
        for m in moves:
            self.by_segment[m.segment] = self.by_segment.get(m.segment, 0) + 1
        return self.inner(moves)


@pytest.mark.parametrize("transports", ["local,tcp", "local,shm,tcp"])
def test_bug_33_34_replica_fallback_and_dead_segments_unmounted(cluster_factory,
                                                                transports) -> None:
    """Both with tcp only and with the default transports (a killed server's shm file
    stays behind; its replicas must still count as failed)."""
    cl = cluster_factory("--client-ttl", "1.5")
    servers = [cl.store_server(4 * MiB, transports=transports) for _ in range(3)]
    s1 = servers[0].info["segment"]
    tcfg = TransferConfig(transports=tuple(transports.split(",")), max_retries=1,
                          path_retry_interval_s=0.05, connect_timeout_s=1.0,
                          slice_timeout_s=2.0)
    writer = cl.client(transfer_config=tcfg)
    v1, v2 = pattern(1, MiB), pattern(2, MiB)
    writer.put("k1", v1, ReplicateConfig(preferred_segment=s1))
    writer.put("k2", v2, ReplicateConfig(replica_num=2, preferred_segment=s1))
    placed = [r.segment for r in writer.replica_list("k2").replicas]
    assert len(set(placed)) == 2 and s1 in placed
    assert [r.segment for r in writer.replica_list("k1").replicas] == [s1]
    reader = cl.client(transfer_config=tcfg)
    counter = CountingPath(reader)
    servers[0].kill()  # no unmount, no goodbye
    # before the TTL: k2 falls back to its live replica; k1 is a prompt miss
    t0 = time.monotonic()
    for _ in range(3):
        assert reader.get("k2") == v2
    results = [status_of(reader.get, "k1") for _ in range(10)]
    assert results == ["NOT_FOUND"] * 10
    assert time.monotonic() - t0 < 8.0
    # BUG-34: only the first request paid for the dead segment; the rest skipped it
    assert counter.by_segment.get(s1, 0) <= 2
    # after the TTL the dead client's segment is unmounted and k1 is gone
    # (reader.exist("k1") is already False: it knows s1 failed; the writer does not)
    assert not reader.exist("k1") and writer.exist("k1")
    assert wait_until(lambda: not writer.exist("k1"), 10.0)
    assert reader.stats()["num_segments"] == 2
    assert reader.get("k2") == v2
    assert s1 not in {r.segment for r in reader.replica_list("k2").replicas}


def test_eviction_at_watermark_skips_leased_and_pinned(cluster_factory) -> None:
    cl = cluster_factory("--default-kv-lease-ttl", "60000")
    cl.store_server(MiB)
    w = cl.client()
    r = cl.client()
    obj = 64 * 1024
    vals = {f"o{i:02d}": pattern(i, obj) for i in range(15)}
    cfgs = {"o00": ReplicateConfig(hard_pin=True), "o01": ReplicateConfig(soft_pin=True)}
    for i, (k, v) in enumerate(vals.items()):
        if i == 14:
            # 14 × 64 KiB = 0.875 of 1 MiB: under the 0.90 watermark, nothing evicted
            time.sleep(0.3)
            assert len(w.list_keys()) == 14
            assert r.get("o02") == vals["o02"]  # leased by the reader
        w.put(k, v, cfgs.get(k))
    # 15 objects = 0.9375 > 0.90: a pass frees max(5% of 1 MiB, excess) → one object,
    # the least recently used one that is not pinned, leased or unpublished: o03
    assert wait_until(lambda: len(w.list_keys()) == 14, 5.0)
    assert sorted(set(vals) - set(w.list_keys())) == ["o03"]
    for k in w.list_keys():
        assert r.get(k) == vals[k]


def test_no_space_error_without_data_loss(cluster_factory) -> None:
    cl = cluster_factory("--eviction-high-watermark-ratio", "1.0")
    cl.store_server(MiB)
    w = cl.client()
    obj = 256 * 1024
    vals = {f"h{i}": pattern(i, obj) for i in range(4)}
    for k, v in vals.items():
        w.put(k, v, ReplicateConfig(hard_pin=True))
    with pytest.raises(StoreError) as ei:
        w.put("more", pattern(9, obj))
    assert ei.value.code == ErrorCode.NO_AVAILABLE_HANDLE and ei.value.status == "NO_SPACE"
    assert sorted(w.list_keys()) == sorted(vals)
    for k, v in vals.items():
        assert w.get(k) == v
    assert not w.exist("more")


def test_soft_pin_expiry(cluster_factory) -> None:
    cl = cluster_factory("--eviction-high-watermark-ratio", "1.0",
                         "--default-kv-soft-pin-ttl", "2500", "--default-kv-lease-ttl", "100")
    cl.store_server(256 * 1024)
    w = cl.client()
    obj = 64 * 1024
    w.put("pinned", pattern(1, obj), ReplicateConfig(soft_pin=True))
    t_pin = time.monotonic()
    for k in ("a", "b", "c"):
        w.put(k, pattern(2, obj))
    w.put("d", pattern(3, obj))  # full: the oldest *unpinned* object goes
    assert sorted(w.list_keys()) == ["b", "c", "d", "pinned"]
    for k in ("pinned", "b", "c", "d"):  # pinned is now the least recently used;
        w.get(k)                         # reads do not extend its pin
    time.sleep(0.15)  # let the read leases lapse
    w.put("e", pattern(4, obj))
    assert sorted(w.list_keys()) == ["c", "d", "e", "pinned"]
    assert time.monotonic() - t_pin < 2.4, "machine too slow for this pin TTL"
    time.sleep(max(0.0, 2.6 - (time.monotonic() - t_pin)))
    w.put("f", pattern(5, obj))  # the pin lapsed: pinned is just the oldest access
    assert sorted(w.list_keys()) == ["c", "d", "e", "f"]


def test_bug_27_ssd_spill_and_read_back_byte_exact(cluster_factory, tmp_path) -> None:
    # reads lease what they load back into the 10 MiB DRAM; short leases let it turn over
    cl = cluster_factory("--default-kv-lease-ttl", "300")
    cl.store_server(10 * MiB, "--ssd-path", str(tmp_path / "ssd"), "--ssd-capacity",
                    str(100 * MiB))
    w = cl.client()
    vals = {f"obj{i:02d}": pattern(i, MiB) for i in range(20)}
    for k, v in vals.items():
        w.put(k, v)
    st = w.stats()
    assert st["ssd_used_bytes"] >= 9 * MiB  # about half moved to SSD instead of dropped
    keys = w.list_keys()
    assert sorted(keys) == sorted(vals)  # nothing was lost
    r = cl.client()
    for k in keys:
        got = r.get(k)
        assert len(got) == MiB and got == vals[k]
    files = list((tmp_path / "ssd").rglob("*.obj"))
    assert files and all(MiB < f.stat().st_size < MiB + 4096 for f in files)


def test_bad_input_is_refused_and_nothing_is_disturbed(cluster_factory) -> None:
    import socket
    import struct

    import numpy as np

    from pymooncake.rpc import RpcError, SyncRpcClient

    cl = cluster_factory()
    cl.store_server(2 * MiB)
    c = cl.client()
    keep = pattern(7, 1000)
    c.put("keep", keep)
    bad = [
        (lambda: c.put("", b"x"), ErrorCode.INVALID_KEY),
        (lambda: c.put("k" * 4097, b"x"), ErrorCode.INVALID_KEY),
        (lambda: c.put("k", "not bytes"), ErrorCode.INVALID_PARAMS),
        (lambda: c.put("k", 12345), ErrorCode.INVALID_PARAMS),
        (lambda: c.put("k", b""), ErrorCode.INVALID_PARAMS),
        (lambda: c.put("big", b"x" * (3 * MiB)), ErrorCode.INVALID_PARAMS),
        (lambda: c.put_start("k", -5), ErrorCode.INVALID_PARAMS),
        (lambda: c.put_from("k", 0, -1), ErrorCode.INVALID_PARAMS),
        (lambda: c.get(""), ErrorCode.INVALID_KEY),
        (lambda: c.get("k" * 5000), ErrorCode.INVALID_KEY),
        (lambda: c.remove(""), ErrorCode.INVALID_KEY),
    ]
    for fn, code in bad:
        with pytest.raises(StoreError) as ei:
            fn()
        assert ei.value.code == code, ei.value
    for kw in (dict(replica_num=0), dict(replica_num=-2), dict(soft_pin_ttl_ms=5)):
        with pytest.raises(ValueError):
            ReplicateConfig(**kw)
    # an unknown replica config field sent raw over RPC is refused by the master
    raw = SyncRpcClient("127.0.0.1", int(cl.master_addr.split(":")[1]), 5.0)
    with pytest.raises(RpcError) as ei:
        raw.call("put_start", {"client_id": "x", "key": "k", "size_bytes": 10,
                               "config": {"replica_num": 1, "bogus": True}})
    assert ei.value.code == "INVALID_ARGUMENT" and "bogus" in ei.value.message
    with pytest.raises(RpcError):
        raw.call("put_start", {"client_id": "x", "key": "k", "size_bytes": -1})
    raw.close()
    # malformed frames: garbage msgpack, a lying length, a half frame, then hang up
    port = int(cl.master_addr.split(":")[1])
    for payload in (struct.pack(">I", 4) + b"\xc1\xc1\xc1\xc1",
                    struct.pack(">I", 0xFFFFFFF0) + b"x",
                    struct.pack(">I", 100) + b"abc"):
        with socket.create_connection(("127.0.0.1", port), 2.0) as s:
            s.sendall(payload)
    # a buffer too small for get_into
    buf = np.zeros(10, dtype=np.uint8)
    addr = c.register_buffer(buf)
    with pytest.raises(StoreError) as ei:
        c.get_into("keep", addr, 10)
    assert ei.value.code == ErrorCode.INVALID_PARAMS
    # nothing stored, nothing else disturbed, the master still serves
    assert c.list_keys() == ["keep"]
    assert c.get("keep") == keep
    assert c.stats()["num_objects"] == 1


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_bug_15_every_read_path_checks_the_lease_after_the_copy(cluster_factory) -> None:
    import numpy as np

    cl = cluster_factory("--default-kv-lease-ttl", "500")
    clock = FakeClock()
    c = cl.client(clock=clock, global_segment_size=2 * MiB)
    v1, v2 = pattern(1, 4096), pattern(2, 8192)
    own = ReplicateConfig(preferred_segment=c.segment_name)
    c.put("k1", v1, own)
    c.put("k2", v2, own)
    assert {r.segment for r in c.replica_list("k1").replicas} == {c.segment_name}
    inner = c._dp.run
    delay = {"s": 0.0}

    def slow_copy(moves):  # the copy takes `delay` seconds on the client's clock
        out = inner(moves)
        clock.t += delay["s"]
        return out

    c._dp.run = slow_copy
    inner_local = c._copy_out

    def slow_local_copy(views, sums):  # the same for replicas read from the own segment
        out = inner_local(views, sums)
        clock.t += delay["s"]
        return out

    c._copy_out = slow_local_copy
    inner_into = c._copy_into

    def slow_local_copy_into(copies):  # and for own-segment reads into registered memory
        inner_into(copies)
        clock.t += delay["s"]

    c._copy_into = slow_local_copy_into
    buf = np.zeros(2 * 8192, dtype=np.uint8)
    base = c.register_buffer(buf)
    for d, expect in ((0.6, "LEASE_EXPIRED"), (0.4, "OK")):
        delay["s"] = d
        paths = {
            "batch_get local": [x if isinstance(x, bytes) else x
                                for x in c.batch_get(["k1", "k2"], prefer_local=True)],
            "batch_get remote order": c.batch_get(["k1", "k2"], prefer_local=False),
            "get": [c.get("k1") if expect == "OK" else _err(c.get, "k1")],
            "batch_get_into": c.batch_get_into(["k1", "k2"], [base, base + 8192],
                                               [8192, 8192]),
        }
        for name, results in paths.items():
            for r in results:
                if expect == "OK":
                    assert not isinstance(r, StoreError), (name, r)
                else:
                    assert isinstance(r, StoreError) and r.status == "LEASE_EXPIRED", (name, r)
        if expect == "OK":
            assert paths["batch_get local"] == [v1, v2]
            assert paths["get"] == [v1]
            assert bytes(buf[:4096]) == v1 and bytes(buf[8192:]) == v2


def _err(fn, *args):
    try:
        fn(*args)
    except StoreError as e:
        return e
    raise AssertionError("expected an error")


def test_bug_19_concurrent_puts_one_winner(cluster_factory) -> None:
    import threading

    cl = cluster_factory()
    cl.store_server(64 * MiB)
    for num_writers, num_keys in ((2, 8), (8, 2)):
        writers = [cl.client(local_buffer_size=4 * MiB) for _ in range(num_writers)]
        for k in range(num_keys):
            key = f"w{num_writers}-k{k}"
            vals = [bytes([w + 1]) * (4 * MiB) for w in range(num_writers)]
            results: list[str | None] = [None] * num_writers
            barrier = threading.Barrier(num_writers)

            def run(w: int, key: str = key, vals: list = vals, barrier=barrier,
                    results: list = results, writers: list = writers) -> None:
                barrier.wait(5)
                results[w] = status_of(writers[w].put, key, vals[w])

            threads = [threading.Thread(target=run, args=(w,)) for w in range(num_writers)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
            assert sorted(results) == ["ALREADY_EXISTS"] * (num_writers - 1) + ["OK"]
            assert writers[0].exist(key)
            got = writers[-1].get(key)
            assert len(got) == 4 * MiB and got == vals[results.index("OK")]
        for w in writers:
            w.close()
    total_keys = 8 + 2
    st = cl.client().stats()
    assert st["num_objects"] == total_keys
    assert st["dram_used_bytes"] == total_keys * 4 * MiB  # one copy per key


def test_bug_31_master_restart_forgets_and_never_serves_wrong_bytes(cluster_factory,
                                                                     tmp_path) -> None:
    cl = cluster_factory("--default-kv-lease-ttl", "300", separate_metadata=True)
    cl.store_server(2 * MiB, "--ssd-path", str(tmp_path / "ssd"), "--ssd-capacity",
                    str(8 * MiB))
    cl.store_server(2 * MiB)
    c = cl.client()
    old = {f"old{i:03d}": pattern(i, 64 * 1024) for i in range(100)}
    for k, v in old.items():
        c.put(k, v)
    st = c.stats()
    assert st["ssd_used_bytes"] >= 20 * 64 * 1024  # at least 20 of them on the SSD tier
    cl.restart_master()
    assert wait_until(lambda: c.ping() and c.stats()["num_segments"] == 2, 10.0)
    # the remounted SSD tier dropped files nobody can name any more
    assert wait_until(lambda: not list((tmp_path / "ssd").rglob("*.obj")), 5.0)
    for k in old:  # documented: no snapshot, so every old key is a miss, never other bytes
        assert status_of(c.get, k) == "NOT_FOUND"
    new = {f"new{i:03d}": pattern(1000 + i, 30 * 1024) for i in range(100)}
    for k, v in new.items():
        c.put(k, v)
    for k, v in new.items():
        assert c.get(k) == v


def test_one_client_many_threads(cluster_factory) -> None:
    from concurrent.futures import ThreadPoolExecutor

    cl = cluster_factory()
    cl.store_server(16 * MiB)
    c = cl.client(local_buffer_size=MiB, global_segment_size=8 * MiB)

    def work(t: int) -> bool:
        vals = {f"t{t}-{i}": pattern(t * 100 + i, 40_000 + i) for i in range(15)}
        for k, v in vals.items():
            c.put(k, v, ReplicateConfig(replica_num=2))
        return all(c.get(k) == v for k, v in vals.items()) and \
            c.batch_get(list(vals)) == list(vals.values())

    with ThreadPoolExecutor(4) as ex:
        assert all(ex.map(work, range(4)))
    assert len(c.list_keys()) == 60


def test_unreachable_master_fails_cleanly(cluster_factory) -> None:
    import threading

    from pymooncake.store.client import StoreClient
    from pymooncake.store.compat import MooncakeDistributedStore

    from .procs import free_port

    cl = cluster_factory()

    def ours() -> list[str]:
        return [t.name for t in threading.enumerate() if t.name.startswith("store-client")]

    before = ours()
    dead = f"127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    with pytest.raises(StoreError) as ei:
        StoreClient(dead, cl.metadata_url, global_segment_size=MiB, rpc_timeout_s=1.0).start()
    assert ei.value.status == "UNAVAILABLE" and time.monotonic() - t0 < 10
    s = MooncakeDistributedStore()
    assert s.setup("localhost", cl.metadata_url, MiB, MiB, "tcp", "", dead) < 0
    assert s.health_check() == 1
    assert wait_until(lambda: ours() == before, 5.0)  # the client's thread is gone
