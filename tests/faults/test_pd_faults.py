"""Faults injected into a P/D cluster on namespaced hosts while a replay runs (issue 17
Build item 5): the Store master leader killed or frozen with SIGSTOP past its lease (HA
on etcd), a prefill worker killed
mid-request, the Conductor partitioned from a decode host (its bridge port down: frames
dropped silently, like ``tc netem loss 100%``, which the CI kernel lacks).

Every test asserts, over every request of its replay: none hung (each ended within the
bound), none returned a wrong token (each served one equals a colocated engine's greedy
output: a corrupt KV byte would change it), every failure was a clean one (an HTTP error
or an error event closing the stream); and the cluster still serves afterwards.

Hosts: h1 runs the Store master(s) and the Conductor, h2 and h3 the workers; a real etcd
on the bridge is the Transfer Engine's metadata (and the HA masters' election).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import httpx
import pytest

from pymooncake.rpc import RpcError, SyncRpcClient

from .conftest import CONTEXT, Replay, ok, one_request, prompts, reference
from .netns import Hosts

pytestmark = pytest.mark.integration

MAX_TOKENS = 8
# The hang the partition tests reveal (reproduced by the second one about 1 run in 2):
STALL = ("a decode host cut off while a prefill worker writes a request's KV to it stalls "
         "that prefill worker: the write waits the KV sender's whole timeout "
         "(engine/kv_sender.py timeout_s=30 s; slices time out at 5 s and are retried) and "
         "every request queued on the worker, those for the healthy decode host too, waits "
         "~30 s with no answer; the Conductor does not abort the prefill when the decode "
         "worker leaves its view (conductor/service.py _expire_loop fails token streams only)")


def _rpc(host: str, port: int, method: str, timeout_s: float = 2.0) -> Any:
    c = SyncRpcClient(host, port, timeout_s)
    try:
        return c.call(method)
    except (RpcError, OSError):
        return None
    finally:
        c.close()


def _health(url: str) -> dict[str, Any]:
    return httpx.get(url + "/health", timeout=10).json()


def _wait(pred: Any, timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.05)
    raise AssertionError(f"{what} not reached in {timeout_s} s")


def _cluster(h: Hosts, master: str, *, workers: tuple[tuple[int, str, str], ...],
             cond_flags: tuple[str, ...] = ()) -> str:
    """Conductor on h1 plus ``workers`` (host, id, kind); its URL once all registered."""
    ip1 = h.ip(1)
    cond = h.role(1, "conductor", "--host", ip1, "--port", "0", "--worker-port", "0",
                  "--policy", "round-robin", "--global-store", "--model", "tiny",
                  "--context-length", str(CONTEXT), *cond_flags).info
    common = ["--conductor", f"{ip1}:{cond['worker_port']}", "--metadata", h.etcd,
              "--model", "tiny", "--max-model-len", str(CONTEXT), "--num-kv-blocks", "512"]
    for host, name, kind in workers:
        extra = ["--master", master] if kind == "prefill" else []
        h.role(host, kind, "--id", name, "--host", h.ip(host), *extra, *common)
    url = cond["url"]
    _wait(lambda: len(_health(url)["workers"]) == len(workers), 30, "workers registered")
    return url


def _serves_on(url: str, ps: list[list[int]], refs: list[list[int]], n: int = 4) -> None:
    for i in range(n):
        r = one_request(url, ps[i % len(ps)], MAX_TOKENS, 30)
        assert ok(r), ("the cluster does not serve after the fault", r)
        assert r["ids"] == refs[i % len(ps)]


# -- faults 1 and 2: the Store master leader killed / frozen (HA, two masters) ----------

def _ha_cluster(h: Hosts) -> tuple[str, list[Any], Any]:
    """Two HA masters on h1 (lease 2 s), the P/D cluster following their leader: the URL,
    the masters and ``leader()`` (the one that says it leads, or ``None``)."""
    ip1, cid = h.ip(1), "faults"
    masters = [h.role(1, "master", "--host", ip1, "--port", "0", "--ha", "--etcd-endpoints",
                      h.etcd, "--cluster-id", cid, "--ha-lease-ttl", "2") for _ in range(2)]

    def leader() -> Any:
        for m in masters:
            if m.popen.poll() is None:
                st = _rpc(ip1, m.info["port"], "ha_status", 1.0)
                if st and st.get("role") == "leader":
                    return m
        return None

    _wait(leader, 15, "a master leads")
    store = f"{h.etcd}/{cid}"
    url = _cluster(h, store, cond_flags=("--store-master", store),
                   workers=((2, "prefill-a", "prefill"), (3, "prefill-b", "prefill"),
                            (3, "decode-c", "decode")))
    return url, masters, leader


def test_master_leader_killed_under_replay_keeps_serving_and_loses_no_object(hosts):
    h = hosts(3)
    ip1 = h.ip(1)
    url, _masters, leader = _ha_cluster(h)
    old = leader()
    ps = prompts(1)
    refs = reference(ps, MAX_TOKENS)
    replay = Replay(url, ps, refs).start()
    try:
        replay.wait_served(6)
        keys = _wait(lambda: _rpc(ip1, old.info["port"], "list_keys"), 20,
                     "published objects")
        old.signal(signal.SIGKILL)
        killed = time.monotonic()
        new = _wait(lambda: (lambda m: m if m is not old else None)(leader()), 15,
                    "a new leader")
        failover_s = time.monotonic() - killed
        replay.wait_served(6, after=killed + failover_s)
    finally:
        results = replay.stop()
    replay.check()
    assert all(ok(r) for r in results), replay.summary()   # Store faults stay off the path
    assert failover_s < 5.0
    now = set(_rpc(ip1, new.info["port"], "list_keys") or [])
    assert set(keys) <= now, f"published objects lost: {sorted(set(keys) - now)[:5]}"
    _serves_on(url, ps, refs)


def test_master_leader_frozen_past_its_lease_steps_down_without_split_brain(hosts):
    h = hosts(3)
    ip1 = h.ip(1)
    url, _masters, leader = _ha_cluster(h)
    old = leader()
    ps = prompts(2)
    refs = reference(ps, MAX_TOKENS)
    attempts: list[Any] = []

    def attempt() -> None:           # a writer still talking to the frozen leader
        c = SyncRpcClient(ip1, old.info["port"], 30.0)
        try:
            attempts.append(c.call("put_start", {"client_id": "fault-probe",
                                                 "key": f"late-{len(attempts)}",
                                                 "size_bytes": 4096, "config": None}))
        except RpcError as e:
            attempts.append(e)
        finally:
            c.close()

    replay = Replay(url, ps, refs).start()
    try:
        replay.wait_served(6)
        keys = _wait(lambda: _rpc(ip1, old.info["port"], "list_keys"), 20,
                     "published objects")
        old.signal(signal.SIGSTOP)
        frozen = time.monotonic()
        queued = [threading.Thread(target=attempt) for _ in range(3)]   # land at resume
        for t in queued:
            t.start()
        new = _wait(lambda: (lambda m: m if m is not old else None)(leader()), 15,
                    "a successor")
        time.sleep(max(0.0, frozen + 3.0 - time.monotonic()))   # frozen > its 2 s lease
        replay.wait_served(4, after=time.monotonic())            # served by the successor
        old.signal(signal.SIGCONT)
        for t in queued:
            t.join(35)
        for _ in range(3):
            attempt()
        st = _wait(lambda: _rpc(ip1, old.info["port"], "ha_status"), 10, "old answers")
        replay.wait_served(4, after=time.monotonic())
    finally:
        old.signal(signal.SIGCONT)
        results = replay.stop()
    replay.check()
    assert all(ok(r) for r in results), replay.summary()
    assert len(attempts) == 6
    for out in attempts:             # not one write accepted after the successor won
        assert isinstance(out, RpcError), f"the frozen leader accepted a write: {out}"
        assert out.code == "UNAVAILABLE_IN_CURRENT_STATUS", out
    assert st["role"] != "leader"
    assert leader() is new
    now = set(_rpc(ip1, new.info["port"], "list_keys") or [])
    assert set(keys) <= now, f"published objects lost: {sorted(set(keys) - now)[:5]}"
    _serves_on(url, ps, refs)


# -- fault 4: a prefill worker is killed mid-request -----------------------------------

def test_prefill_worker_killed_mid_request_is_replaced_or_fails_cleanly(hosts):
    h = hosts(3)
    ip1 = h.ip(1)
    master = h.role(1, "master", "--host", ip1, "--port", "0").info
    url = _cluster(h, f"{ip1}:{master['port']}",
                   workers=((2, "prefill-a", "prefill"), (3, "prefill-b", "prefill"),
                            (3, "decode-c", "decode")))
    ps = prompts(4, per=2, shared=1200, tail=40)           # long prefills: easy to hit
    refs = reference(ps, MAX_TOKENS)
    replay = Replay(url, ps, refs, threads=3).start()
    mid = False
    try:
        replay.wait_served(3)
        pid = _health(url)["workers"]
        pid = next(w["pid"] for w in pid if w["instance_id"] == "prefill-a")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not mid:   # catch it while it prefills
            mid = any(v[0] == "prefill-a" for v in _health(url)["requests"].values())
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        _wait(lambda: "prefill-a" not in {w["instance_id"] for w in _health(url)["workers"]},
              15, "the dead prefill worker leaves the view")
        replay.wait_served(6, after=time.monotonic())
    finally:
        replay.stop()
    replay.check()
    # the requests in flight at the kill ended (re-placed or a clean error) in the bound
    hit = [r for r in replay.results if r["t0"] <= killed <= r["t1"]]
    assert hit, "no request was running when the worker was killed"
    assert max(r["t1"] for r in hit) - killed < 10.0, "slow to notice the dead worker"
    assert mid, "the kill never caught a request on the killed worker"
    _serves_on(url, ps, refs)


# -- fault 5: the Conductor is partitioned from a decode host --------------------------

@pytest.mark.xfail(strict=False, reason=STALL)
def test_decode_host_partitioned_gets_clean_errors_and_the_rest_serve(hosts):
    h = hosts(3)
    ip1 = h.ip(1)
    master = h.role(1, "master", "--host", ip1, "--port", "0").info
    url = _cluster(h, f"{ip1}:{master['port']}",
                   workers=((2, "prefill-a", "prefill"), (2, "decode-a", "decode"),
                            (3, "decode-b", "decode")))
    ps = prompts(5)
    refs = reference(ps, MAX_TOKENS)
    replay = Replay(url, ps, refs, threads=3).start()
    try:
        replay.wait_served(6)
        h.cut(3)                                # h3 (decode-b) is cut off from everyone
        cut = time.monotonic()
        _wait(lambda: "decode-b" not in {w["instance_id"] for w in _health(url)["workers"]},
              20, "the partitioned decode worker leaves the view")
        gone = time.monotonic()
        replay.wait_served(8, after=gone)
    finally:
        replay.stop()
        h.heal(3)
    replay.check()
    hit = [r for r in replay.results if r["t0"] <= cut <= r["t1"]]
    assert all(r["t1"] - cut < 15.0 for r in hit), "a request outlived the partition bound"
    during = [r for r in replay.results if r["t0"] >= cut]
    assert sum(ok(r) for r in during) >= 8, replay.summary()   # the rest kept serving
    after = [r for r in replay.results if r["t0"] > gone]
    assert after and all(ok(r) for r in after), [r for r in after if not ok(r)][:3]
    _serves_on(url, ps, refs, n=8)          # healed: decode-b may be back; all still exact


@pytest.mark.xfail(strict=False, reason=STALL)
def test_decode_host_cut_during_its_kv_write_does_not_stall_other_requests(hosts):
    """The race above, forced: cut h3 while a long prompt's KV is on its way to decode-b;
    requests for decode-a must still be answered well within the bound."""
    h = hosts(3)
    ip1 = h.ip(1)
    master = h.role(1, "master", "--host", ip1, "--port", "0").info
    url = _cluster(h, f"{ip1}:{master['port']}",
                   workers=((2, "prefill-a", "prefill"), (2, "decode-a", "decode"),
                            (3, "decode-b", "decode")))
    ps = prompts(6, per=2, shared=1200, tail=40)
    refs = reference(ps, MAX_TOKENS)
    replay = Replay(url, ps, refs, threads=3, bound_s=12.0).start()
    caught = False
    try:
        replay.wait_served(3)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not caught:
            caught = any(v[1] == "decode-b" for v in _health(url)["requests"].values())
        h.cut(3)
        cut = time.monotonic()
        replay.wait_served(6, after=cut, timeout_s=15.0)
    finally:
        replay.stop()
        h.heal(3)
    assert caught
    replay.check()      # bound 12 s: nothing waits out a 30 s KV timeout
    _serves_on(url, ps, refs)
