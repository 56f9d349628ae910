"""Re-replication planning, pure (issue 17): which objects a pass copies, in what order,
to which segment, within its byte budget; the replica target survives the journal."""

from __future__ import annotations

from pymooncake.store.config import MasterConfig, ReplicateConfig
from pymooncake.store.master.core import MasterCore
from pymooncake.store.master.journal import (
    SKIP_MALFORMED,
    MetaIndex,
    encode_entry,
    restore,
    take_changes,
)
from pymooncake.store.master.objects import Replica
from pymooncake.store.master.rereplication import plan
from pymooncake.store.protocol import TIER_SSD

KiB = 1 << 10
MiB = 1 << 20
R2 = ReplicateConfig(replica_num=2)


def _core(hosts: list[str], journaled: bool = False) -> MasterCore:
    core = MasterCore(MasterConfig(seed=3))
    if journaled:
        core.objects.changed, core.segments_changed = set(), set()
    for i, h in enumerate(hosts):
        core.mount_segment(f"c{i}", f"s{i}", h, (i + 1) << 32, 4 * MiB, 0.0)
    return core


def _put(core: MasterCore, key: str, size: int, now: float, cfg=R2) -> None:
    obj = core.start_write("c0", key, size, cfg, now)
    core.put_end("c0", key, obj.generation, now)


def _segments(core: MasterCore, key: str) -> set[str]:
    return {r.segment for r in core.objects.get(key).replicas}


def test_a_dropped_segment_plans_copies_to_a_new_holder_on_another_host() -> None:
    core = _core(["h0", "h1", "h1", "h2"])  # s1, s2 share a host
    for i in range(6):
        _put(core, f"k{i}", 64 * KiB, float(i))
    assert all(core.objects.get(f"k{i}").replica_target == 2 for i in range(6))
    assert plan(core, MiB).copies == {} and not core.replicas_lost
    lost = [f"k{i}" for i in range(6) if "s0" in _segments(core, f"k{i}")]
    assert lost
    core._drop_segment("s0")
    assert core.replicas_lost
    p = plan(core, MiB)
    assert p.under_replicated == len(lost) and not p.more
    planned = {k: seg for seg, keys in p.copies.items() for k in keys}
    assert sorted(planned) == sorted(lost)
    for k, seg in planned.items():
        held = _segments(core, k)
        assert seg not in held and seg != "s0"
        host_of = {s.name: s.host for s in core.pool.segments.values()}
        # another host when one is free of the object's replicas
        assert host_of[seg] not in {host_of[s] for s in held}


def test_budget_hard_pins_first_then_recent_and_ssd_only_skipped() -> None:
    core = _core(["h0", "h1", "h2"])
    _put(core, "old", 256 * KiB, 1.0)
    _put(core, "recent", 256 * KiB, 5.0)
    _put(core, "pinned", 256 * KiB, 0.5, ReplicateConfig(replica_num=2, hard_pin=True))
    for k in ("old", "recent", "pinned"):  # the same two segments lose one each
        obj = core.objects.get(k)
        obj.replicas = obj.replicas[:1]
    p = plan(core, 300 * KiB)  # room for one object
    assert [k for keys in p.copies.values() for k in keys] == ["pinned"] and p.more
    p = plan(core, 600 * KiB, skip=frozenset({"pinned"}))
    assert [k for keys in p.copies.values() for k in keys] == ["recent", "old"]
    assert p.under_replicated == 3
    # an object whose only copy is on SSD has no DRAM replica to copy from: skipped
    obj = core.objects.get("old")
    obj.replicas[0].tier = TIER_SSD
    assert "old" not in {k for keys in plan(core, MiB).copies.values() for k in keys}


def test_replica_target_survives_the_journal_and_old_records_count_as_is() -> None:
    core = _core(["h0", "h1", "h2"], journaled=True)
    _put(core, "two", 64 * KiB, 1.0)
    _put(core, "one", 64 * KiB, 1.0, ReplicateConfig())
    obj = core.objects.get("two")
    obj.replicas = obj.replicas[:1]  # lost one before the fail-over
    core.objects.touch("two")
    idx = MetaIndex()
    ops = take_changes(core)
    for op in ops:  # an older master's records have no "want"
        if op[0] == "obj" and op[1]["key"] == "one":
            del op[1]["want"]
    idx.apply(1, encode_entry(1, ops))
    new = MasterCore(MasterConfig())
    restore(idx, new, 0.0)
    assert new.objects.get("two").replica_target == 2
    assert new.objects.get("one").replica_target == 1
    assert new.replicas_lost  # the new leader checks once
    assert [k for keys in plan(new, MiB).copies.values() for k in keys] == ["two"]
    rec = next(op[1] for op in ops if op[0] == "obj" and op[1]["key"] == "two")
    idx.apply(2, encode_entry(2, [["obj", {**rec, "want": -1}]]))
    assert idx.skipped[-1][:2] == (2, SKIP_MALFORMED) and "want" in idx.skipped[-1][2]
    assert idx.objects["two"]["want"] == 2  # the bad record changed nothing


def test_a_bad_replica_report_and_evictions() -> None:
    from pymooncake.store.master.recovery import drop_bad_replicas

    core = _core(["h0", "h1", "h2"])
    _put(core, "k", 64 * KiB, 1.0)
    obj = core.objects.get("k")
    assert drop_bad_replicas(core, "k", obj.generation, [obj.replicas[0].replica_id], 2.0) == 1
    assert core.replicas_lost and obj.replica_count() == 1
    assert [k for keys in plan(core, MiB).copies.values() for k in keys] == ["k"]
    # an eviction that keeps only an SSD copy lowers the target: not a loss to repair
    _put(core, "cold", 64 * KiB, 1.0)
    cold = core.objects.get("cold")
    core._replica_id += 1
    cold.replicas.append(Replica(core._replica_id, cold.replicas[0].segment, -1, 64 * KiB,
                                 TIER_SSD, "h", complete=True))
    core._evict("cold", "test")
    assert cold.replica_count() == 1 and cold.replica_target == 1
    assert "cold" not in {k for keys in plan(core, MiB).copies.values() for k in keys}


class _FakeCopier:
    """The copier's interface as the re-replicator uses it; copies fail for ``bad``."""

    def __init__(self, svc, bad: set[str]) -> None:
        import asyncio

        from pymooncake.store.master.replication import copy_end, copy_start
        self.metadata_url = "http://md"
        self._lock = asyncio.Lock()
        self.calls: list[tuple[str, list[str]]] = []

        async def copy(keys, seg):
            self.calls.append((seg, list(keys)))
            out = []
            for k in keys:
                _, new = copy_start(svc.core, k, seg, 0.0)
                ok = copy_end(svc.core, k, new.replica_id, k not in bad, 0.0)
                out.append({"r": new.length} if ok else {"e": [1, "failed"]})
            return out
        self._copy = copy


def test_passes_restore_within_budget_and_give_up_on_a_failing_key() -> None:
    import asyncio
    from types import SimpleNamespace

    from pymooncake.store.master.rereplicator import MAX_TRIES, ReReplicator

    core = _core(["h0", "h1", "h2"])
    for i in range(5):
        _put(core, f"k{i}", 256 * KiB, float(i))
    lost = [f"k{i}" for i in range(5) if "s0" in _segments(core, f"k{i}")]
    core._drop_segment("s0")
    svc = SimpleNamespace(core=core)
    svc.copier = _FakeCopier(svc, bad={lost[0]})
    rr = ReReplicator(svc, budget_bytes=256 * KiB, interval_s=0.0)

    async def run(passes: int) -> None:
        for i in range(passes):
            rr.poke(float(i))
            if rr._task is not None:
                await rr._task

    asyncio.run(run(20))
    assert all(len(keys) == 1 for _, keys in svc.copier.calls)  # the byte budget
    assert all(core.objects.get(k).replica_count() == 2 for k in lost[1:])
    assert core.objects.get(lost[0]).replica_count() == 1
    assert sum(keys == [lost[0]] for _, keys in svc.copier.calls) == MAX_TRIES
    assert len(svc.copier.calls) == MAX_TRIES + len(lost) - 1 and not rr._again
    core.replicas_lost = True  # a new failure: the key is tried again
    asyncio.run(run(1))
    assert svc.copier.calls[-1][1] == [lost[0]]


def test_without_a_metadata_server_it_warns_only_when_objects_are_under_replicated(
        caplog) -> None:  # noqa: ANN001
    """A master without ``--metadata`` copies nothing; a promotion (which asks for one
    check of every object) with every replica in place says nothing, a dropped holder's
    objects are counted and reported once (newcomer check: the warning came on every
    promotion of an empty cluster)."""
    import logging
    from types import SimpleNamespace

    from pymooncake.store.master.rereplicator import M_UNDER, ReReplicator

    core = _core(["h0", "h1", "h2"])
    for i in range(4):
        _put(core, f"k{i}", 256 * KiB, float(i))
    svc = SimpleNamespace(core=core, copier=SimpleNamespace(metadata_url=""))
    rr = ReReplicator(svc, budget_bytes=1 * MiB, interval_s=0.0)
    with caplog.at_level(logging.WARNING, "pymooncake.store.master.rereplicator"):
        core.replicas_lost = True  # as restore() sets it on promotion
        rr.poke(0.0)
        assert not caplog.records and M_UNDER._value.get() == 0 and not core.replicas_lost
        lost = [f"k{i}" for i in range(4) if "s0" in _segments(core, f"k{i}")]
        core._drop_segment("s0")
        rr.poke(1.0)
        rr.poke(2.0)
        assert len(caplog.records) == 1, caplog.records
        assert caplog.records[0].getMessage().startswith(f"{len(lost)} objects lost replicas")
        assert M_UNDER._value.get() == len(lost) > 0 and rr._task is None


def test_copier_prepare_imports_the_data_path_at_start_up() -> None:
    """``ReplicaCopier.prepare`` (run by ``pymooncake master``) loads what the first copy
    needs — the Transfer Engine and the metadata client of its URL — in a fresh process;
    without a metadata URL it loads nothing."""
    import subprocess
    import sys
    code = (
        "import sys\n"
        "from pymooncake.store.master.copier import ReplicaCopier\n"
        "mods = ('httpx', 'pymooncake.store.datapath', 'pymooncake.metadata.http_client')\n"
        "c = ReplicaCopier(None)\n"
        "c.prepare()\n"
        "print([m in sys.modules for m in mods])\n"
        "c.metadata_url = 'http://127.0.0.1:1/metadata'\n"
        "c.prepare()\n"
        "print([m in sys.modules for m in mods])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout.split("\n")
    assert out[0] == "[False, False, False]" and out[1] == "[True, True, True]"
