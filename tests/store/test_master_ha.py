"""Store master HA on a real etcd with real master processes (issue 17 items 1-2, BUG-58,
BUG-61): kill -9 under puts, a frozen leader that resumes, corrupt and overlapping
journal records, a gap in the journal, unfinished puts across a fail-over."""

from __future__ import annotations

import asyncio
import signal
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator

import msgpack
import pytest

from pymooncake.bench.failover import (
    Child,
    ha_master,
    ha_status,
    pattern,
    run_once,
    transfer_config,
    wait_leader,
)
from pymooncake.metadata import open_metadata
from pymooncake.rpc import RpcError, SyncRpcClient
from pymooncake.store.errors import ErrorCode, StoreError
from pymooncake.store.master.ha import HaKeys

from .procs import free_port

KiB, MiB = 1 << 10, 1 << 20


@pytest.fixture
def md_url() -> Iterator[str]:
    """The Transfer Engine's metadata: outlives every master."""
    from pymooncake.metadata.http import MetadataHttpServer

    server = MetadataHttpServer("127.0.0.1", 0).start()
    yield server.url
    server.stop()


@pytest.fixture
def procs() -> Iterator[list]:
    """Masters (``Child``) and Store clients, stopped after the test: the clients first,
    while a master still leads (a client closed with no leader left waits out its
    fail-over search, ~15 s, to unmount its segment)."""
    made: list = []
    yield made
    for p in sorted(reversed(made), key=lambda p: isinstance(p, Child)):
        try:
            if isinstance(p, Child):
                p.kill(signal.SIGCONT)
                p.kill(signal.SIGTERM)
            else:
                p.close()
        except Exception:  # noqa: BLE001 - best-effort cleanup
            pass


def _cluster() -> str:
    return f"t-{uuid.uuid4().hex[:10]}"


def _client(procs: list, master: str, md_url: str, segment: int = 16 * MiB):
    from pymooncake.store.client import StoreClient

    c = StoreClient(master, md_url, global_segment_size=segment,
                    transfer_config=transfer_config(), heartbeat_interval_s=0.2).start()
    procs.append(c)
    return c


def _md(etcd_url: str, fn):  # noqa: ANN001, ANN202
    """Run ``await fn(md)`` against etcd in a fresh loop."""
    async def main():  # noqa: ANN202
        md = open_metadata(etcd_url)
        try:
            return await fn(md)
        finally:
            await md.close()
    return asyncio.run(main())


def _journal(etcd_url: str, cluster: str) -> dict[int, bytes]:
    keys = HaKeys.of(cluster)
    kvs = _md(etcd_url, lambda md: md.get_prefix(keys.log))
    return {int(kv.key[len(keys.log):]): kv.value for kv in kvs}


def _append(etcd_url: str, cluster: str, raw: bytes) -> int:
    """Append ``raw`` as the next journal entry, as a broken writer would (unfenced)."""
    keys = HaKeys.of(cluster)

    async def go(md) -> int:  # noqa: ANN001
        kv = await md.get(keys.head)
        seq = int(kv.value) + 1
        await md.put(keys.entry(seq), raw)
        await md.put(keys.head, str(seq).encode())
        return seq
    return _md(etcd_url, go)


def _metric(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
    total = 0.0
    for line in text.decode().splitlines():
        if line.startswith(name) and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _get(c, key: str) -> bytes | ErrorCode:  # noqa: ANN001
    try:
        return c.get(key)
    except StoreError as e:
        return e.code


def _wait_applied(follower: Child, leader: Child, timeout_s: float = 15.0) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        lead, fol = ha_status(leader.port), ha_status(follower.port)
        if lead and fol and fol["applied_seq"] == lead["applied_seq"] > 0:
            return int(fol["applied_seq"])
        time.sleep(0.05)
    raise TimeoutError("the follower did not catch up")


# -- item 1 + 2: kill -9 under a stream of puts ------------------------------------------

def test_kill9_leader_under_puts_fails_over_in_under_5s_and_keeps_every_ok_put(
        etcd_url: str) -> None:
    r = run_once(etcd_url, masters=3, lease_ttl_s=2.0, warm_puts=40, after_s=1.0)
    assert r["failover_s"] is not None and r["failover_s"] < 5.0, r
    assert r["ok_puts"] > 40 and r["lost"] == 0, r
    assert r["new_leader"] != r["old_leader"]
    assert r["segments_after"] == 1  # the store-server followed the new leader


# -- item 1: a frozen leader resumes and never accepts a write ---------------------------

def test_frozen_leader_steps_down_and_refuses_every_write_after_its_successor(
        etcd_url: str, md_url: str, procs: list) -> None:
    cluster = _cluster()
    ms = [ha_master(etcd_url, cluster, 2.0, "--metrics-port", str(free_port()))
          for _ in range(2)]
    procs += ms
    old = wait_leader(ms)
    new = next(m for m in ms if m is not old)
    c = _client(procs, f"{etcd_url}/{cluster}", md_url)
    c.put("before", pattern(1, 4 * KiB))
    token = ha_status(old.port)["revision"]
    attempts: list[tuple[float, object]] = []

    def attempt() -> None:  # a writer still talking to the old leader
        rpc = SyncRpcClient("127.0.0.1", old.port, timeout_s=30.0)
        try:
            out: object = rpc.call("put_start", {"client_id": c.client_id,
                                                 "key": f"late-{len(attempts)}",
                                                 "size_bytes": 4096, "config": None})
        except RpcError as e:
            out = e
        finally:
            rpc.close()
        attempts.append((time.monotonic(), out))

    old.kill(signal.SIGSTOP)
    t_stop = time.monotonic()
    queued = [threading.Thread(target=attempt) for _ in range(3)]  # sent while frozen
    for t in queued:
        t.start()
    assert wait_leader([new], timeout_s=10.0) is new
    c.put("after", pattern(2, 4 * KiB))  # the client followed the successor
    time.sleep(max(0.0, t_stop + 3.0 - time.monotonic()))  # frozen > its 2 s lease
    old.kill(signal.SIGCONT)
    for t in queued:
        t.join(35)
    for _ in range(5):  # and after it resumed
        attempt()
        time.sleep(0.1)
    assert len(attempts) == 8
    for _, out in attempts:
        assert isinstance(out, RpcError), f"the old leader accepted a write: {out}"
        assert out.code == "UNAVAILABLE_IN_CURRENT_STATUS"
        assert out.data["leader"] in ("", f"127.0.0.1:{new.port}")
    st = ha_status(old.port)
    assert st["role"] == "follower"
    # its fencing token is dead in etcd: no write of its can land there any more
    keys = HaKeys.of(cluster)
    assert _md(etcd_url, lambda md: md.guarded_write(keys.leader, token,
                                                     [(keys.root + "probe", b"x")])) is None
    assert ha_status(new.port)["role"] == "leader"
    assert c.get("before") == pattern(1, 4 * KiB) and c.get("after") == pattern(2, 4 * KiB)
    assert _metric(_metrics_port(old), "pymooncake_store_ha_step_downs_total") >= 1


def _metrics_port(m: Child) -> int:
    return int(m.args[m.args.index("--metrics-port") + 1])


# -- item 2: a corrupt record is skipped and reported, the rest load ----------------------

def test_corrupt_journal_records_are_skipped_and_reported_while_the_rest_load(
        etcd_url: str, md_url: str, procs: list) -> None:
    cluster = _cluster()
    m1 = ha_master(etcd_url, cluster, 2.0)
    procs.append(m1)
    wait_leader([m1])
    c = _client(procs, f"{etcd_url}/{cluster}", md_url)
    for i in range(20):
        c.put(f"obj-{i}", pattern(i, 8 * KiB))
    keys = HaKeys.of(cluster)
    head = int(_md(etcd_url, lambda md: md.get(keys.head)).value)
    last = msgpack.unpackb(_journal(etcd_url, cluster)[head])
    assert last["ops"][0][1]["key"] == "obj-19" and last["ops"][0][1]["complete"] is True
    _md(etcd_url, lambda md: md.put(keys.entry(head), b"\x00 torn entry"))  # obj-19's end
    _append(etcd_url, cluster, b"\xc1 garbage")
    m1.kill()
    mport = free_port()
    m2 = ha_master(etcd_url, cluster, 2.0, "--metrics-port", str(mport))
    procs.append(m2)
    wait_leader([m2])
    for i in range(19):
        assert c.get(f"obj-{i}") == pattern(i, 8 * KiB)
    # obj-19's only readable record was the torn one: a miss, never other bytes
    assert _get(c, "obj-19") == ErrorCode.OBJECT_NOT_FOUND
    assert ha_status(m2.port)["skipped"] == 2
    assert _metric(mport, 'pymooncake_store_ha_skipped_records_total{reason="undecodable"}') \
        == 2.0
    c.put("obj-19", pattern(19, 8 * KiB))  # and the key can be written again
    assert c.get("obj-19") == pattern(19, 8 * KiB)


# -- BUG-58 -------------------------------------------------------------------------------

def test_bug_58_promoted_standby_drops_only_the_overlapping_records(
        etcd_url: str, md_url: str, procs: list) -> None:
    cluster = _cluster()
    master = f"{etcd_url}/{cluster}"
    ms = [ha_master(etcd_url, cluster, 2.0) for _ in range(2)]
    procs += ms
    m1 = wait_leader(ms)
    m2 = next(m for m in ms if m is not m1)
    c1 = _client(procs, master, md_url, 64 * MiB)
    c2 = _client(procs, master, md_url, 64 * MiB)
    size = 64 * KiB
    c1.batch_put([f"k_{i}" for i in range(150)], [pattern(i, size) for i in range(150)])
    c2.batch_put([f"k_{i}" for i in range(150, 300)],
                 [pattern(i, size) for i in range(150, 300)])
    assert set(c1.list_keys()) == {f"k_{i}" for i in range(300)}
    # step 3: a put-end for k_bad over k_7's offsets, applied by the warm standby
    r7 = c1.replica_list("k_7").replicas[0]
    c1.release_leases(["k_7"])
    bad = {"key": "k_bad", "size": size, "gen": 10**9, "writer": "rogue", "complete": True,
           "replicas": [[10**9, r7.segment, r7.addr, size, "dram", r7.host, True]],
           "hard": False, "soft_ttl_ms": None}
    injected = _append(etcd_url, cluster, msgpack.packb(
        {"v": 1, "seq": ha_status(m1.port)["applied_seq"] + 1, "ops": [["obj", bad]]}))
    # (nothing is written until the kill: the leader's next entry would take its number)
    deadline = time.monotonic() + 10
    while ha_status(m2.port)["applied_seq"] < injected:
        assert time.monotonic() < deadline, "the standby did not apply the injected record"
        time.sleep(0.05)
    m1.kill()  # step 4
    assert wait_leader([m2], timeout_s=10.0) is m2
    # step 5
    for i in range(300):
        got = _get(c1, f"k_{i}")
        if i == 7:
            assert got in (pattern(7, size), ErrorCode.OBJECT_NOT_FOUND)
        else:
            assert got == pattern(i, size), (i, got)
    assert _get(c1, "k_bad") == ErrorCode.OBJECT_NOT_FOUND
    restored = {(r.segment, r.addr) for i in range(300) if i != 7
                for r in c1.replica_list(f"k_{i}").replicas}
    c1.batch_put([f"n_{i}" for i in range(50)], [pattern(1000 + i, size) for i in range(50)])
    for i in range(50):
        for r in c1.replica_list(f"n_{i}").replicas:  # never in a restored object's range
            assert all(not (r.segment == s and abs(r.addr - a) < size) for s, a in restored)
        assert c2.get(f"n_{i}") == pattern(1000 + i, size)
    for i in range(300):
        if i != 7:
            assert c2.get(f"k_{i}") == pattern(i, size)
    # the decision is in the journal, after the injected record: no later promotion
    # brings k_7 or k_bad back
    later = [op for seq, raw in _journal(etcd_url, cluster).items() if seq > injected
             for op in msgpack.unpackb(raw)["ops"]]
    assert ["del", "k_bad"] in later and ["del", "k_7"] in later
    m3 = ha_master(etcd_url, cluster, 2.0)
    procs.append(m3)
    m2.kill()
    assert wait_leader([m3], timeout_s=10.0) is m3
    assert _get(c1, "k_bad") == ErrorCode.OBJECT_NOT_FOUND
    assert _get(c1, "k_7") == ErrorCode.OBJECT_NOT_FOUND
    assert c1.get("k_299") == pattern(299, size) and c1.get("n_49") == pattern(1049, size)


def test_bug_58_gap_in_the_journal_is_never_served_until_the_entry_is_back(
        etcd_url: str, md_url: str, procs: list) -> None:
    cluster = _cluster()
    m1 = ha_master(etcd_url, cluster, 2.0)
    procs.append(m1)
    wait_leader([m1])
    c = _client(procs, f"{etcd_url}/{cluster}", md_url)
    for i in range(20):
        c.put(f"g-{i}", pattern(i, 4 * KiB))
    keys = HaKeys.of(cluster)
    head = int(_md(etcd_url, lambda md: md.get(keys.head)).value)
    missing = head // 2
    saved = _journal(etcd_url, cluster)[missing]
    _md(etcd_url, lambda md: md.delete(keys.entry(missing)))  # variant: a gap
    m1.kill()
    mport = free_port()
    m2 = ha_master(etcd_url, cluster, 2.0, "--metrics-port", str(mport))
    procs.append(m2)
    rpc = SyncRpcClient("127.0.0.1", m2.port, timeout_s=5.0)
    try:
        t_end = time.monotonic() + 5.0  # > catch_up_timeout_s (2 s) + a lease
        while time.monotonic() < t_end:
            with pytest.raises(RpcError) as e:
                rpc.call("exist", {"client_id": "probe", "key": "g-0"})
            assert e.value.code == "UNAVAILABLE_IN_CURRENT_STATUS"
            st = ha_status(m2.port)
            assert st["role"] == "follower" and st["applied_seq"] < missing
            time.sleep(0.2)
        assert _metric(mport, "pymooncake_store_ha_log_gaps_total") >= 1
        _md(etcd_url, lambda md: md.put(keys.entry(missing), saved))  # the entry is back
        assert wait_leader([m2], timeout_s=10.0) is m2
        assert ha_status(m2.port)["applied_seq"] >= head
    finally:
        rpc.close()
    for i in range(20):
        assert c.get(f"g-{i}") == pattern(i, 4 * KiB)


# -- BUG-61 (master side): metadata never durable before its data --------------------------

def test_bug_61_unfinished_put_is_journaled_unpublished_and_retryable_after_failover(
        etcd_url: str, md_url: str, procs: list) -> None:
    cluster = _cluster()
    ms = [ha_master(etcd_url, cluster, 2.0) for _ in range(2)]
    procs += ms
    m1 = wait_leader(ms)
    m2 = next(m for m in ms if m is not m1)
    c = _client(procs, f"{etcd_url}/{cluster}", md_url)
    c.put("done", pattern(5, 4 * KiB))
    h = c.put_start("pending", 4 * KiB)  # allocated; bytes not yet written, no put_end

    def records(key: str) -> list[dict]:
        return [op[1] for _, raw in sorted(_journal(etcd_url, cluster).items())
                for op in msgpack.unpackb(raw)["ops"] if op[0] == "obj" and op[1]["key"] == key]

    assert [r["complete"] for r in records("done")] == [False, True]
    assert [r["complete"] for r in records("pending")] == [False]  # durable, unpublished
    m1.kill()
    assert wait_leader([m2], timeout_s=10.0) is m2
    assert _get(c, "pending") == ErrorCode.OBJECT_NOT_FOUND
    with pytest.raises(StoreError) as e:
        c.put_end("pending", h.generation)
    assert e.value.code == ErrorCode.UNAVAILABLE_IN_CURRENT_STATUS and e.value.retryable
    assert c.get("done") == pattern(5, 4 * KiB)
    c.put("pending", pattern(6, 4 * KiB))  # the retry succeeds with the new leader
    assert c.get("pending") == pattern(6, 4 * KiB)
    assert [r["complete"] for r in records("pending")][-2:] == [False, True]


# -- command line --------------------------------------------------------------------------

@pytest.mark.parametrize(("args", "code", "words"), [
    (["--ha"], 2, "--ha needs --etcd-endpoints"),
    (["--etcd-endpoints", "etcd://127.0.0.1:1"], 2, "without --ha"),
    (["--ha", "--etcd-endpoints", "http://127.0.0.1:1"], 2, "expected etcd://host:port"),
    (["--ha", "--etcd-endpoints", "etcd://127.0.0.1:x"], 2, "bad port"),
    (["--ha", "--etcd-endpoints", "127.0.0.1:1", "--ha-lease-ttl", "0.5"], 2,
     "--ha-lease-ttl 0.5: must be whole seconds"),
    (["--ha", "--etcd-endpoints", f"127.0.0.1:{free_port()}"], 1, "unreachable"),
])
def test_master_ha_flags_fail_with_one_line(capsys, args: list[str], code: int,  # noqa: ANN001
                                            words: str) -> None:
    from tests.store.test_cli_errors import _main, _one_line, _run

    if code == 2:   # usage errors: in-process (the unreachable etcd runs the real command)
        t0 = time.monotonic()
        rc, err = _main(capsys, "master", "--port", "0", *args)
        took = time.monotonic() - t0
    else:
        rc, err, took = _run("master", "--port", "0", *args)
    assert rc == code and words in _one_line(err), err
    assert took < 20


def test_objects_spilled_to_ssd_survive_a_failover(etcd_url: str, md_url: str, procs: list,
                                                   tmp_path) -> None:  # noqa: ANN001
    from pymooncake.store.client import StoreClient

    cluster = _cluster()
    ms = [ha_master(etcd_url, cluster, 2.0, "--eviction-high-watermark-ratio", "0.7",
                    "--default-kv-lease-ttl", "1000") for _ in range(2)]
    procs += ms
    m1 = wait_leader(ms)
    m2 = next(m for m in ms if m is not m1)
    c = StoreClient(f"{etcd_url}/{cluster}", md_url, global_segment_size=4 * MiB,
                    ssd_path=str(tmp_path / "ssd"), ssd_capacity=64 * MiB,
                    transfer_config=transfer_config(), heartbeat_interval_s=0.2).start()
    procs.append(c)
    size = 256 * KiB
    for i in range(40):  # 10 MiB into a 4 MiB segment: most of it goes to SSD
        c.put(f"s-{i}", pattern(i, size))
    deadline = time.monotonic() + 15
    while c.stats()["ssd_used_bytes"] < 20 * size:
        assert time.monotonic() < deadline, c.stats()
        time.sleep(0.1)
    assert sorted(c.list_keys()) == sorted(f"s-{i}" for i in range(40))
    _wait_applied(m2, m1)
    m1.kill()
    assert wait_leader([m2], timeout_s=10.0) is m2
    assert c.stats()["ssd_used_bytes"] >= 20 * size  # SSD replicas restored
    # loaded back from SSD by the new leader where needed; DRAM is full of restored
    # objects that keep their fresh lease one TTL (1 s here): loads may answer the
    # retryable NO_AVAILABLE_HANDLE until then
    for i in range(40):
        deadline = time.monotonic() + 5
        while True:
            got = _get(c, f"s-{i}")
            if got != ErrorCode.NO_AVAILABLE_HANDLE or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert got == pattern(i, size), (i, got)


def test_compat_store_with_an_etcd_master_address_follows_the_leader(
        etcd_url: str, md_url: str, procs: list) -> None:
    from pymooncake.store.compat import MooncakeDistributedStore

    cluster = _cluster()
    ms = [ha_master(etcd_url, cluster, 2.0) for _ in range(2)]
    procs += ms
    m1 = wait_leader(ms)
    s = MooncakeDistributedStore()
    assert s.setup("127.0.0.1", md_url, 16 * MiB, 16 * MiB, "tcp", "",
                   f"{etcd_url}/{cluster}") == 0
    try:
        assert s.put("a", b"hello") == 0 and s.get("a") == b"hello"
        m1.kill()
        assert s.put("b", b"world") == 0  # through the new leader, no new setup
        assert s.get("a") == b"hello" and s.get("b") == b"world"
    finally:
        s.close()
