"""Faults injected into a P/D cluster on namespaced hosts while a replay runs (issue 17
Build item 5): the Store master leader killed or frozen with SIGSTOP past its lease (HA
on etcd), a prefill worker killed
mid-request, the Conductor partitioned from a decode host (its bridge port down: frames
dropped silently, like ``tc netem loss 100%``, which the CI kernel lacks). A cut decode
host's requests fail with a clean 503 once the Conductor misses its load reports (3 s):
``conductor.worker_loss`` fails them and aborts their prefill, whose KV write the prefill
worker then gives up at once (``engine.kv_writes``), so its other requests move on.

Every test asserts, over every request of its replay: none hung (each ended within the
bound), none returned a wrong token (each served one equals a colocated engine's greedy
output: a corrupt KV byte would change it), every failure was a clean one (an HTTP error
or an error event closing the stream); and the cluster still serves afterwards.

Hosts: h1 runs the Store master(s) and the Conductor, h2 and h3 the workers; a real etcd
on the bridge is the Transfer Engine's metadata (and the HA masters' election). The
tests share two clusters (``pd_cluster.Clusters``), one at a time: each test leaves the
cluster whole again or has the next one start a fresh cluster.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from pymooncake.rpc import RpcError, SyncRpcClient
from pymooncake.rpc.messages import SetTarget

from .conftest import Replay, ok, one_request, prompts, reference
from .netns import Hosts, missing
from .pd_cluster import Clusters, _health, _rpc, _wait

pytestmark = pytest.mark.integration

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def clusters() -> Iterator[Clusters]:
    why = missing()
    if why:
        pytest.skip(why)
    cs = Clusters()
    try:
        yield cs
    finally:
        cs.close()


def _serves_on(url: str, ps: list[list[int]], refs: list[list[int]], n: int = 4) -> None:
    for i in range(n):
        r = one_request(url, ps[i % len(ps)], MAX_TOKENS, 30)
        assert ok(r), ("the cluster does not serve after the fault", r)
        assert r["ids"] == refs[i % len(ps)]


# -- faults 1 and 2: the Store master leader killed / frozen (HA, two masters) ----------

def test_master_leader_killed_under_replay_keeps_serving_and_loses_no_object(clusters):
    with clusters.use("ha") as c:
        _leader_killed(c)


def _leader_killed(c: dict[str, Any]) -> None:
    h, url, leader = c["h"], c["url"], c["leader"]
    ip1 = h.ip(1)
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
    c["masters"].remove(old)                     # two masters again for the next test
    c["masters"].append(c["new_master"]())


def test_master_leader_frozen_past_its_lease_steps_down_without_split_brain(clusters):
    with clusters.use("ha") as c:
        _leader_frozen(c)


def _leader_frozen(c: dict[str, Any]) -> None:
    h, url, leader = c["h"], c["url"], c["leader"]
    ip1 = h.ip(1)
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

def test_prefill_worker_killed_mid_request_is_replaced_or_fails_cleanly(clusters):
    # the HA cluster's workers (its masters play no part here); prefill-a is not started
    # again (its segment name stays claimed ~10 s): the next test gets a fresh cluster
    with clusters.use("ha", restores=False) as c:
        _prefill_killed(c["url"])


def _prefill_killed(url: str) -> None:
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

def _only_cut_host_failed(replay: Replay, h: Hosts, host: int, name: str) -> None:
    """Every failed request was one of the cut host's, and failed cleanly: a 503
    ``worker_failed`` (or an error event ending its stream) naming that host or worker."""
    for r in replay.results:
        if ok(r):
            continue
        text = (r.get("body") or "") + repr(r["errors"])
        assert r["status"] in (200, 503) and (name in text or h.ip(host) in text), \
            ("a request failed that was not on the cut host", r)
        if r["status"] == 503:
            assert "worker_failed" in text, r


def test_decode_host_partitioned_gets_clean_errors_and_the_rest_serve(clusters):
    # the next test is not given this cluster: after the partition, load state left on
    # it (a run got a 429 there) would change what the next test measures
    with clusters.use("pd", restores=False) as c:
        _partitioned(c["h"], c["url"])


def _partitioned(h: Hosts, url: str) -> None:
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
    _only_cut_host_failed(replay, h, 3, "decode-b")
    hit = [r for r in replay.results if r["t0"] <= cut <= r["t1"]]
    # a hung request would wait out the 30 s KV write timeout; a healthy one on decode-a
    # can take several seconds on the loaded 2-core machine (CI: 8 s was too tight)
    late = [round(r["t1"] - cut, 2) for r in hit if r["t1"] - cut >= 12.0]
    assert not late, f"requests outlived the partition bound (s after the cut): {late}"
    during = [r for r in replay.results if r["t0"] >= cut]
    assert sum(ok(r) for r in during) >= 8, replay.summary()   # the rest kept serving
    after = [r for r in replay.results if r["t0"] > gone]
    assert after and all(ok(r) for r in after), [r for r in after if not ok(r)][:3]
    _serves_on(url, ps, refs, n=8)          # healed: decode-b may be back; all still exact


def _parked_prefill(h: Hosts, url: str, prompt: list[int]) -> tuple[Any, dict[str, Any]]:
    """Play the Conductor for one request: a ``target_follows`` prefill on prefill-a that
    ends before its ``KVTarget`` comes (it is parked) and the receive buffer decode-b
    reserved for it. Returns the target and the prefill RPC's outcome (filled once the
    prefill RPC, run on a thread, answers: ``"t1"`` and ``"error"`` or ``"result"``)."""
    from pymooncake.rpc.codec import from_wire
    from pymooncake.rpc.messages import DecodeTask, KVTarget, PrefillTask, SamplingOptions
    ws = {w["instance_id"]: w for w in _health(url)["workers"]}
    sampling = SamplingOptions(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outcome: dict[str, Any] = {}

    def prefill() -> None:
        c = SyncRpcClient(h.ip(2), ws["prefill-a"]["rpc_port"], 60.0)
        try:
            outcome["result"] = c.call("prefill", PrefillTask(
                "parked-1", tuple(prompt), sampling, None, False, target_follows=True))
        except (RpcError, OSError) as e:
            outcome["error"] = repr(e)
        finally:
            outcome["t1"] = time.monotonic()
            c.close()
    outcome["thread"] = threading.Thread(target=prefill, daemon=True)
    outcome["thread"].start()
    c = SyncRpcClient(h.ip(3), ws["decode-b"]["rpc_port"], 10.0)
    try:
        target = from_wire(KVTarget, c.call("prepare_decode", DecodeTask(
            "parked-1", tuple(prompt), sampling, len(prompt) // 16)))
    finally:
        c.close()
    time.sleep(1.0)         # its prompt is in the prefix cache: the prefill is over, parked
    assert "t1" not in outcome, ("a target_follows prefill answered before its target",
                                 outcome)
    return target, outcome


def test_decode_host_cut_during_its_kv_write_does_not_stall_other_requests(clusters):
    """The race above, forced: cut h3 while a long prompt's KV is on its way to decode-b;
    requests for decode-a must still be answered well within the bound. One write towards
    the cut host is forced for sure: a parked prefill (done before its ``KVTarget`` came)
    gets decode-b's receive buffer only after the cut and ships its whole prompt then."""
    with clusters.use("pd", restores=False) as c:
        _cut_during_write(c["h"], c["url"])


def _cut_during_write(h: Hosts, url: str) -> None:
    ps = prompts(6, per=2, shared=1200, tail=40)
    refs = reference(ps, MAX_TOKENS)
    replay = Replay(url, ps, refs, threads=3, bound_s=12.0).start()
    caught = False
    try:
        replay.wait_served(3)
        target, parked = _parked_prefill(h, url, ps[0])
        pre = {w["instance_id"]: w for w in _health(url)["workers"]}["prefill-a"]
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not caught:
            caught = any(v[1] == "decode-b" for v in _health(url)["requests"].values())
        h.cut(3)
        cut = time.monotonic()
        c = SyncRpcClient(h.ip(2), pre["rpc_port"], 30.0)
        try:        # the parked prefill's write to the cut host starts now
            assert c.call("set_target", SetTarget("parked-1", target)) is True
        finally:
            c.close()
        set_target_s = time.monotonic() - cut
        replay.wait_served(6, after=cut, timeout_s=15.0)
        parked["thread"].join(15.0)
    finally:
        replay.stop()
        h.heal(3)
    assert caught
    # the engine thread of prefill-a shipped the parked prompt without waiting for the
    # cut host; that request alone fails, cleanly, by its KV write deadline (10 s)
    assert set_target_s < 2.5, f"set_target waited {set_target_s:.1f} s for the cut host"
    assert "error" in parked and "decode-b" in parked["error"], parked
    assert parked["t1"] - cut < 12.0, parked
    replay.check()      # bound 12 s: nothing waits out a 30 s KV timeout
    _only_cut_host_failed(replay, h, 3, "decode-b")
    # the rest kept being served all along: decode-b's writes left the prefill worker's
    # step loop (deferred, their blocks pinned) instead of stalling it until the Conductor
    # aborts them (3 s) or a KV write deadline (10 s) — layer-wise writes and a parked
    # prompt's one batch alike (a CI run stalled two until cut + 10.08 s); measured
    # ~0.1-1.0 s each on a shared 2-core machine, bound 2.5 s
    served = [r for r in replay.results if ok(r) and r["t1"] > cut]
    assert len(served) >= 6, replay.summary()
    slow = [(r["t0"] - cut, r["t1"] - cut) for r in served if r["t1"] - max(r["t0"], cut) > 2.5]
    assert not slow, f"requests for decode-a stalled behind decode-b's KV write: {slow}"
    _serves_on(url, ps, refs)
