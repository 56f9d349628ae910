"""Issue 17, storage holders rejoin, with real processes (a master and store servers on
127.0.0.1, clients here): a store server killed with SIGKILL and started again on the same
``--ssd-path`` verifies its SSD files, deletes the corrupt and cut ones (and reports them
on its ready line), and registers the intact ones with the master again, whether its
previous segment is still mounted (taken over at once) or was already dropped for silence
(the objects are re-created); nothing is counted twice. Replicas that fail the checksum on
read are reported to the master and dropped, so later reads go elsewhere."""

from __future__ import annotations

import time
import urllib.request
from pathlib import Path

import pytest

from pymooncake.store.config import ReplicateConfig
from pymooncake.store.errors import StoreError
from pymooncake.store.tiers.ssd import file_name

from .procs import MiB, free_port
from .test_store_processes import pattern, status_of, wait_until

pytestmark = pytest.mark.integration

KiB = 1024
SIZE = 256 * KiB
N = 24  # 6 MiB of values into a 2 MiB segment: about two thirds spill to SSD


def _server(cl, ssd: Path, dram: int = 2 * MiB, *flags: str):
    """A store server on ``ssd``; restarted ones get room for every value read back (a
    load from SSD into a full segment waits for read leases to lapse)."""
    return cl.store_server(dram, "--ssd-path", str(ssd), "--ssd-capacity", str(64 * MiB),
                           *flags)


def _spill(cl, ssd: Path):
    """A store server with an SSD tier, N values put through a client without a segment,
    and the keys whose spill files are on disk once the spills have settled."""
    server = _server(cl, ssd)
    c = cl.client()
    vals = {f"s{i:02d}": pattern(i, SIZE) for i in range(N)}
    for k, v in vals.items():
        c.put(k, v)
    seen: list[int] = []

    def settled() -> bool:  # the master's SSD bytes match the files, twice in a row
        n = len(list(ssd.rglob("*.obj")))
        seen.append(n if c.stats()["ssd_used_bytes"] == n * SIZE else -1)
        return len(seen) > 1 and seen[-1] == seen[-2] >= 8
    assert wait_until(settled, 15.0, 0.3)
    by_name = {file_name(k): k for k in vals}
    on_ssd = {by_name[f.name]: f for f in ssd.rglob("*.obj")}
    return server, c, vals, on_ssd


def _damage(files: list[Path]) -> None:
    """Flip a payload byte of the first file, cut the second in half."""
    raw = bytearray(files[0].read_bytes())
    raw[-100] ^= 0xFF
    files[0].write_bytes(bytes(raw))
    with open(files[1], "r+b") as f:
        f.truncate(files[1].stat().st_size // 2)


def test_restarted_server_rejoins_with_its_intact_ssd_objects(cluster_factory,
                                                              tmp_path) -> None:
    cl = cluster_factory("--default-kv-lease-ttl", "1000")
    ssd = tmp_path / "ssd"
    server, c, vals, on_ssd = _spill(cl, ssd)
    bad = sorted(on_ssd)[:2]
    good = set(on_ssd) - set(bad)
    server.kill()  # SIGKILL: DRAM gone, the segment still mounted at the master
    _damage([on_ssd[k] for k in bad])
    again = _server(cl, ssd, 8 * MiB)
    rec = again.info["ssd_recovery"]
    assert again.info["holder"] == server.info["holder"]
    assert again.info["segment"] != server.info["segment"]
    assert rec["registered"] == len(good) and rec["refused"] == 0
    assert rec["removed_bad"] == 2
    assert {name for name, _ in rec["skipped"]} == {file_name(k) for k in bad}
    st = c.stats()  # the dead life's segment was taken over at once, not after client_ttl
    assert st["num_segments"] == 1 and st["num_objects"] == len(good)
    assert st["ssd_used_bytes"] == len(good) * SIZE
    assert sorted(c.list_keys()) == sorted(good)
    assert {f.name for f in ssd.rglob("*.obj")} == {file_name(k) for k in good}
    for k, v in vals.items():
        if k in good:
            assert c.get(k) == v, k
        else:  # corrupt, cut, or only in the lost DRAM: never served
            assert status_of(c.get, k) == "NOT_FOUND", k
    # once more: the same objects, counted once
    again.kill()
    third = _server(cl, ssd, 8 * MiB)
    assert third.info["ssd_recovery"]["registered"] == len(good)
    st = c.stats()
    assert st["num_segments"] == 1 and st["num_objects"] == len(good)
    assert st["ssd_used_bytes"] == len(good) * SIZE
    assert all(c.get(k) == vals[k] for k in good)
    # a second live server on the same --ssd-path never takes the live one's directory
    # or identity (case BUG-29): its own tier-N, a new holder, nothing offered
    other = cl.client(global_segment_size=2 * MiB, ssd_path=str(ssd), ssd_capacity=MiB)
    assert str(other.ssd.path) != third.info["ssd_dir"]
    assert other.holder != third.info["holder"]
    assert other.recovery == {"registered": 0, "refused": 0, "skipped": [],
                              "removed_bad": 0}
    assert c.stats()["num_objects"] == len(good)
    assert all(c.get(k) == vals[k] for k in good)


def test_rejoin_after_the_segment_was_dropped_recreates_only_untouched_keys(
        cluster_factory, tmp_path) -> None:
    cl = cluster_factory("--default-kv-lease-ttl", "1000", "--client-ttl", "1")
    ssd = tmp_path / "ssd"
    server, c, vals, on_ssd = _spill(cl, ssd)
    removed, rewritten, *kept = sorted(on_ssd)
    server.kill()
    assert wait_until(lambda: c.stats()["num_segments"] == 0, 10.0)  # dropped for silence
    assert c.list_keys() == []
    cl.client(global_segment_size=4 * MiB)  # DRAM only: holds the rewrite
    assert status_of(c.remove, removed) == "NOT_FOUND"  # and it stays removed
    new = pattern(99, SIZE // 2)
    c.put(rewritten, new)
    again = _server(cl, ssd, 8 * MiB)
    rec = again.info["ssd_recovery"]
    assert rec["registered"] == len(kept) and rec["refused"] == 2
    assert rec["skipped"] == [] and rec["removed_bad"] == 0
    assert all(c.get(k) == vals[k] for k in kept)
    assert status_of(c.get, removed) == "NOT_FOUND"
    assert c.get(rewritten) == new
    assert {f.name for f in ssd.rglob("*.obj")} == {file_name(k) for k in kept}
    st = c.stats()
    assert st["ssd_used_bytes"] == len(kept) * SIZE and st["num_objects"] == len(kept) + 1
    # --no-ssd-recover: start empty, the previous files deleted, nothing offered
    again.kill()
    empty = _server(cl, ssd, 2 * MiB, "--no-ssd-recover")
    assert empty.info["ssd_recovery"]["registered"] == 0
    assert list(ssd.rglob("*.obj")) == [] and c.list_keys() == [rewritten]


def _metric(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
    for line in text.decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def _flip(holder, key: str, size: int) -> None:
    rep = next(r for r in holder.replica_list(key).replicas
               if r.segment == holder.segment_name)
    holder._local_view(rep.addr, size)[size // 2] ^= 0xFF


def test_a_replica_failing_its_checksum_is_reported_and_dropped(cluster_factory) -> None:
    mport = free_port()
    cl = cluster_factory("--metrics-port", str(mport))
    server = cl.store_server(8 * MiB)
    holder = cl.client(global_segment_size=4 * MiB)
    reader = cl.client()
    two, lone = pattern(1, 300 * KiB), pattern(2, 300 * KiB)
    holder.put("two", two, ReplicateConfig(replica_num=2,
                                           preferred_segment=holder.segment_name))
    holder.put("lone", lone, ReplicateConfig(preferred_segment=holder.segment_name))
    _flip(holder, "two", len(two))
    _flip(holder, "lone", len(lone))
    assert holder.get("two") == two  # its own copy first: corrupt, falls over, reported
    segs = [r.segment for r in reader.replica_list("two").replicas]
    assert segs == [server.info["segment"]]  # every reader now goes to the good one
    assert reader.get("two") == two
    assert _metric(mport, "pymooncake_store_bad_replicas_total") == 1.0
    # a reader without a segment: its second read of the holder's copy goes through the
    # Transfer Engine into its staging buffer (it tries the replicas in a random order)
    holder.put("two2", two, ReplicateConfig(replica_num=2,
                                            preferred_segment=holder.segment_name))
    _flip(holder, "two2", len(two))
    for _ in range(40):
        assert reader.get("two2") == two
        if len(reader.replica_list("two2").replicas) == 1:
            break
    assert [r.segment for r in reader.replica_list("two2").replicas] == [
        server.info["segment"]]
    assert _metric(mport, "pymooncake_store_bad_replicas_total") == 2.0
    # the last replica is never dropped by a report: the key keeps failing by name
    for _ in range(2):
        with pytest.raises(StoreError) as ei:
            reader.get("lone")
        assert ei.value.status == "INTEGRITY_ERROR" and "'lone'" in str(ei.value)
    assert [r.segment for r in reader.replica_list("lone").replicas] == [holder.segment_name]
    time.sleep(0.2)
    assert _metric(mport, "pymooncake_store_bad_replicas_total") == 2.0
