"""Case BUG-33/34 with the default transports (``local,shm,tcp``): a store-server killed
with SIGKILL leaves its /dev/shm file behind, and an shm read of it would "succeed" from
the dead process's leftover mapping. Before the master's client TTL, such a replica is a
replica failure: reads fall back to a live replica or miss, writes to it fail, and
``exist``/``batch_exist`` agree with ``get`` once the segment is known to have failed."""

from __future__ import annotations

import glob
import types

from pymooncake.store.config import ReplicateConfig
from pymooncake.store.errors import ErrorCode, StoreError
from pymooncake.transfer import TransferConfig

from .procs import MiB
from .test_store_processes import CountingPath, pattern, status_of

DEFAULT_TRANSPORTS = "local,shm,tcp"


def _shm_client(cl):
    return cl.client(transfer_config=TransferConfig(
        transports=("local", "shm", "tcp"), max_retries=1, path_retry_interval_s=0.05,
        connect_timeout_s=1.0, slice_timeout_s=2.0))


def test_bug_34_dead_segment_with_shm_falls_back_or_misses(cluster_factory) -> None:
    cl = cluster_factory("--client-ttl", "60")  # the whole test runs before the TTL
    dead = cl.store_server(4 * MiB, transports=DEFAULT_TRANSPORTS)
    live = cl.store_server(4 * MiB, transports=DEFAULT_TRANSPORTS)
    s_dead, s_live = dead.info["segment"], live.info["segment"]
    writer = _shm_client(cl)
    only_dead = {f"dead{i}": pattern(10 + i, 256 * 1024) for i in range(3)}
    only_live = {f"live{i}": pattern(20 + i, 256 * 1024) for i in range(3)}
    both = pattern(30, 512 * 1024)
    for k, v in only_dead.items():
        writer.put(k, v, ReplicateConfig(preferred_segment=s_dead))
    for k, v in only_live.items():
        writer.put(k, v, ReplicateConfig(preferred_segment=s_live))
    writer.put("both", both, ReplicateConfig(replica_num=2))
    assert {r.segment for r in writer.replica_list("both").replicas} == {s_dead, s_live}
    for k in only_dead:
        assert [r.segment for r in writer.replica_list(k).replicas] == [s_dead]
    reader = _shm_client(cl)
    # the live path really is shm: a same-host read before the kill succeeds
    assert reader.get("dead0") == only_dead["dead0"]
    # try the dead replica first, so the fallback is exercised, not skipped by chance
    reader._rng = types.SimpleNamespace(
        shuffle=lambda reps: reps.sort(key=lambda r: r.segment != s_dead))
    counter = CountingPath(reader)

    dead.kill()  # SIGKILL: no unmount, no unlink of its /dev/shm file
    assert glob.glob(f"/dev/shm/pymooncake-{dead.popen.pid}-*"), "leftover shm file expected"
    # the master does not know yet: exist answers from its table
    assert reader.exist("dead0") is True

    # fallback: the dead replica is tried first, fails the liveness check, the live one serves
    assert reader.get("both") == both
    assert counter.by_segment.get(s_dead) == 1 and counter.by_segment.get(s_live) == 1
    # keys whose only replica is on the dead segment: a miss, never the leftover bytes
    for k in only_dead:
        e = _error_of(reader.get, k)
        assert e.code == ErrorCode.OBJECT_NOT_FOUND, e
    assert counter.by_segment[s_dead] == 1  # known bad: later reads skip it at once
    for k, v in only_live.items():
        assert reader.get(k) == v
    got = reader.batch_get(["dead1", "live1", "both"])
    assert isinstance(got[0], StoreError) and got[1:] == [only_live["live1"], both]

    # exist agrees with get once the segment is known to have failed (BUG-34)
    assert reader.exist("dead0") is False
    assert reader.batch_exist(["dead0", "dead1", "live0", "both", "nokey"]) == [
        False, False, True, True, False]
    # a client that has not seen the failure still answers from the master's table
    assert writer.exist("dead0") is True

    # writes into the dead segment's leftover mapping fail instead of publishing
    e = _error_of(writer.put, "new-dead", pattern(40, 4096),
                  ReplicateConfig(preferred_segment=s_dead))
    assert e.code == ErrorCode.TRANSFER_FAIL, e
    assert status_of(writer.get, "new-dead") == "NOT_FOUND"


def _error_of(fn, *args) -> StoreError:
    try:
        fn(*args)
    except StoreError as e:
        return e
    raise AssertionError(f"{fn.__name__}{args[:1]} did not fail")
