"""A Store holder keeps its segment and objects when the master leader freezes past a short
client TTL (issue 17; found by a newcomer check, 2026-12-03): the holder's heartbeat to the
frozen leader waited the whole RPC timeout (5 s), longer than ``--client-ttl 2``, so the
new leader — which gave restored clients one TTL from its promotion — dropped the live
holder's segment and every object on it (an ``unseg`` and a ``del`` per key in the
journal). Now a heartbeat times out after about its interval and fails over, and a
promoted leader gives restored clients a second TTL."""

from __future__ import annotations

import signal
import time

from pymooncake.bench.failover import ha_master, pattern, transfer_config, wait_leader
from pymooncake.store.client import StoreClient
from pymooncake.store.client_background import heartbeat_timeout_s

from .test_master_ha import KiB, MiB, _cluster, _get, md_url, procs  # noqa: F401 - fixtures


def test_heartbeat_timeout_is_about_the_interval_and_never_above_the_rpc_timeout() -> None:
    assert heartbeat_timeout_s(1.0, 5.0) == 1.0
    assert heartbeat_timeout_s(0.1, 5.0) == 0.5
    assert heartbeat_timeout_s(10.0, 5.0) == 5.0


def test_holder_keeps_its_objects_when_the_leader_freezes_past_a_short_client_ttl(
        etcd_url: str, md_url: str, procs: list) -> None:  # noqa: F811
    cluster = _cluster()
    ms = [ha_master(etcd_url, cluster, 1.0, "--client-ttl", "2") for _ in range(3)]
    procs += ms
    old = wait_leader(ms)
    master = f"{etcd_url}/{cluster}"
    # the holder with the client defaults the store-server uses (heartbeat 1 s, RPC 5 s)
    holder = StoreClient(master, md_url, global_segment_size=16 * MiB,
                         transfer_config=transfer_config()).start()
    procs.append(holder)
    user = StoreClient(master, md_url, global_segment_size=0,
                       transfer_config=transfer_config()).start()
    procs.append(user)
    keys = [f"k/{i}" for i in range(20)]
    for i, k in enumerate(keys):
        user.put(k, pattern(i, 4 * KiB))
    old.kill(signal.SIGSTOP)
    try:
        new = wait_leader([m for m in ms if m is not old], timeout_s=10.0)
        time.sleep(5.0)  # frozen past its lease and 2 TTLs of the new leader
    finally:
        old.kill(signal.SIGCONT)
    assert wait_leader(ms, timeout_s=10.0) is new
    got = {k: _get(user, k) for k in keys}
    bad = {k: v for k, v in got.items() if v != pattern(keys.index(k), 4 * KiB)}
    assert not bad, f"{len(bad)} of {len(keys)} objects lost or wrong: {sorted(bad.items())[:3]}"
