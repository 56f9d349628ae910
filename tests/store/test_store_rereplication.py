"""Issue 17, re-replication with real processes (a master and three store servers on
127.0.0.1, a client here): objects put with two replicas lose one when a holder is killed
with SIGKILL; once its segment is dropped (``client_ttl``) the master copies each from its
surviving replica to the third server, so a second holder's death loses nothing."""

from __future__ import annotations

import urllib.request

import pytest

from pymooncake.store.config import ReplicateConfig

from .procs import MiB, free_port
from .test_store_processes import pattern, wait_until

pytestmark = pytest.mark.integration

KiB = 1024
SIZE = 128 * KiB
N = 12


def _metric(port: int, line: str) -> float:
    """A sample's value from the master's /metrics (0 when absent: never counted)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
    for row in text.decode().splitlines():
        if row.startswith(line + " "):
            return float(row.split()[-1])
    return 0.0


def test_lost_replicas_are_restored_and_survive_a_second_holder_death(cluster_factory) -> None:
    mport = free_port()
    cl = cluster_factory("--client-ttl", "1", "--metrics-port", str(mport))
    servers = [cl.store_server(8 * MiB) for _ in range(3)]
    seg_of = {s.info["segment"]: s for s in servers}
    c = cl.client()
    vals = {f"r{i:02d}": pattern(i, SIZE) for i in range(N)}
    hard = ReplicateConfig(replica_num=2, hard_pin=True)
    for i, (k, v) in enumerate(vals.items()):
        c.put(k, v, hard if i % 4 == 0 else ReplicateConfig(replica_num=2))
    sums = {k: c.replica_list(k).checksum for k in vals}

    def holders(k: str) -> set[str]:
        return {r.segment for r in c.replica_list(k).replicas if r.status == "COMPLETE"}

    before = {k: holders(k) for k in vals}
    assert all(len(h) == 2 for h in before.values())
    # kill the server holding the most replicas; every object it held loses one
    first = max(seg_of, key=lambda s: sum(s in h for h in before.values()))
    hit = [k for k, h in before.items() if first in h]
    assert hit
    seg_of[first].kill()
    assert wait_until(lambda: c.stats()["num_segments"] == 2, 10.0)
    live = set(seg_of) - {first}
    assert wait_until(lambda: all(holders(k) == live for k in hit), 10.0, 0.1), \
        {k: holders(k) for k in hit}
    for k in vals:  # two replicas again, none on the dead server, the put's checksum
        rl = c.replica_list(k)
        assert len(rl.replicas) == 2 and first not in holders(k)
        assert rl.checksum == sums[k]
    done = 'pymooncake_store_rereplications_total{result="ok"}'
    assert _metric(mport, done) == len(hit)
    assert _metric(mport, 'pymooncake_store_rereplications_total{result="failed"}') == 0
    assert wait_until(lambda: _metric(mport, "pymooncake_store_under_replicated_objects")
                      == 0, 5.0)
    # a second original holder dies: every object is still there, byte for byte
    second = sorted(live)[0]
    seg_of[second].kill()
    assert all(c.get(k) == v for k, v in vals.items())
    assert wait_until(lambda: c.stats()["num_segments"] == 1, 10.0)
    assert sorted(c.list_keys()) == sorted(vals)
    assert all(c.get(k) == v for k, v in vals.items())
    assert all(holders(k) == live - {second} for k in vals)
