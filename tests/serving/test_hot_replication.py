"""Live hot-block replication on a real cluster (master, Conductor, 2 prefill + 1 decode
workers on 127.0.0.1, tiny model): a block reused ``--hot-min-accesses`` times gains a
replica on the other prefill instance's Store segment (asked of the master itself), within
the byte budget, and a later request placed on that instance reuses it; with
``--no-hot-replication`` nothing is copied."""

from __future__ import annotations

import signal

import pytest

from pymooncake.rpc.client import SyncRpcClient
from tests.serving.conftest import complete, health, metric_value, wait_for, wait_store_blocks

pytestmark = pytest.mark.timeout(90)

BS = 16
BLOCKS = 8
PROMPT = [(7 * i + 3) % 250 + 1 for i in range(BS * BLOCKS + 3)]   # 8 full blocks
BLOCK_BYTES = 2 * 4 * 2 * 32 * 4 * BS     # tiny model fp32: 2048 B per token, 16 tokens
BUDGET_BLOCKS = 5


def master_segments(master_addr: str) -> dict[str, list[str]]:
    host, port = master_addr.rsplit(":", 1)
    c = SyncRpcClient(host, int(port))
    try:
        keys = [k for k in c.call("list_keys", {}) if k.startswith("kv/")]
        segs = c.call("replica_segments", {"keys": keys})
    finally:
        c.close()
    return {k: s for k, s in zip(keys, segs, strict=True) if s is not None}


def placements(url: str, instance: str) -> float:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for smp in fam.samples:
            if (smp.name == "pymooncake_conductor_placements_total"
                    and smp.labels.get("prefill_instance") == instance):
                return smp.value
    return 0.0


def test_hot_block_gains_replica_within_budget_and_serves(make_cluster) -> None:
    budget = BUDGET_BLOCKS * BLOCK_BYTES
    c = make_cluster(num_prefill=2, num_decode=1, extra_conductor_flags=[
        "--hot-min-accesses", "2", "--hot-replication-budget", str(budget)])
    url = c.url
    assert health(url)["hot_replication"]["budget_bytes"] == budget
    r = complete(url, PROMPT, max_tokens=2)
    assert r.status_code == 200, r.text
    wait_store_blocks(url, BLOCKS)
    for _ in range(3):      # reuse 1, 2 (hot: copied), 3 (budget left: 0 or more)
        r = complete(url, PROMPT, max_tokens=2)
        assert r.status_code == 200, r.text
    hot = wait_for(lambda: (lambda h: h if h.get("replicas") else None)(
        health(url)["hot_replication"]), 10.0, "a hot block replicated")
    # the first request placed on prefill-0 (ties: the earliest), which holds every block;
    # the copies went to prefill-1's segment, as many as the budget allows
    assert set(hot["replicas"]) == {"prefill-1"}
    assert 1 <= hot["replicas"]["prefill-1"] <= BLOCKS
    assert hot["replica_bytes"] <= budget
    assert metric_value(url, "pymooncake_conductor_hot_replicated_bytes_total") <= budget
    segs = master_segments(c.master_addr)
    on_p1 = [k for k, s in segs.items() if any(x.startswith("prefill-1-") for x in s)]
    assert len(on_p1) >= hot["replicas"]["prefill-1"]
    copied = metric_value(url, "pymooncake_conductor_hot_replications_total")
    assert copied * BLOCK_BYTES == hot["replica_bytes"] <= budget
    # more reuse: copies go on until the budget is spent, never past it
    for _ in range(3):
        assert complete(url, PROMPT, max_tokens=2).status_code == 200
    hot = health(url)["hot_replication"]
    assert hot["replica_bytes"] <= budget
    assert metric_value(url, "pymooncake_conductor_hot_replicated_bytes_total") <= budget
    # prefill-0 goes away (its segment and the replicas on it with it): the next request
    # is placed on the replica holder and reuses what the Store keeps there
    before = placements(url, "prefill-1")
    c.procs["prefill-0"].send_signal(signal.SIGTERM)
    c.procs["prefill-0"].wait(15)
    wait_for(lambda: "prefill-0" not in {w["instance_id"] for w in health(url)["workers"]},
             10.0, "prefill-0 gone from the cluster view")
    r = complete(url, PROMPT, max_tokens=2)
    assert r.status_code == 200, r.text
    cached = r.json()["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
    assert cached >= BS * hot["replicas"]["prefill-1"] - BS, (cached, hot)
    assert placements(url, "prefill-1") == before + 1


def test_off_copies_nothing(make_cluster) -> None:
    c = make_cluster(num_prefill=2, num_decode=1,
                     extra_conductor_flags=["--no-hot-replication"])
    url = c.url
    assert health(url)["hot_replication"] is None
    assert complete(url, PROMPT, max_tokens=2).status_code == 200
    wait_store_blocks(url, BLOCKS)
    for _ in range(3):
        assert complete(url, PROMPT, max_tokens=2).status_code == 200
    segs = master_segments(c.master_addr)
    assert segs and all(len(s) == 1 for s in segs.values())
    assert metric_value(url, "pymooncake_conductor_hot_replications_total") == 0
