"""``pymooncake bench store --json`` prints a JSON list of rows (the issue's contract)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.store.procs import ROOT

REQUIRED = ("op", "size_bytes", "mode", "throughput_bytes_per_s", "p50_s", "p99_s",
            "verified", "mooncake_throughput_bytes_per_s")


def test_bench_store_json_is_a_list_of_rows():
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-m", "pymooncake", "bench", "store", "--size", "4K",
                        "--size", "64K", "--count", "4", "--mode", "embedded",
                        "--metadata-ops", "400", "--metadata-clients", "2", "--no-mooncake",
                        "--rpc-poll", "5e-5", "--json"],
                       capture_output=True, text=True, timeout=150, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads(r.stdout)
    assert isinstance(rows, list)
    for row in rows:
        assert set(REQUIRED) <= set(row), row
    data = [(x["op"], x["size_bytes"], x["mode"]) for x in rows
            if x["mode"] not in ("master", "metadata_ops")]
    assert data == [("put", 4096, "embedded"), ("get", 4096, "embedded"),
                    ("put", 65536, "embedded"), ("get", 65536, "embedded")]
    for x in rows[:4]:
        assert x["verified"] is True
        assert x["count"] == 4
        assert 0 < x["p50_s"] <= x["p99_s"]
        assert x["throughput_bytes_per_s"] > 0
        assert x["mooncake_throughput_bytes_per_s"] is None  # --no-mooncake
        assert x["ops_per_s"] is None
    master = {x["op"]: x for x in rows if x["mode"] == "master"}
    assert set(master) == {"metadata", "metadata_batch"}
    assert master["metadata"]["batch_keys"] == 1 and master["metadata_batch"]["batch_keys"] == 16
    for x in master.values():
        assert x["ops_per_s"] > 0 and x["num_clients"] == 4
        assert x["size_bytes"] is None and x["p50_s"] is None and x["verified"] is None
    # the side-by-side metadata operations at equal depth (here without the wheel)
    meta = {x["op"]: x for x in rows if x["mode"] == "metadata_ops"}
    assert set(meta) == {"is_exist", "batch_is_exist", "get_size", "remove"}
    for x in meta.values():
        assert x["verified"] is True and x["num_clients"] == 2 and x["ops_per_s"] > 0
        assert x["mooncake_ops_per_s"] is None and x["ratio"] is None
    assert meta["batch_is_exist"]["batch_keys"] == 16 and meta["is_exist"]["batch_keys"] == 1


def test_bench_store_refuses_a_master_poll_out_of_range():
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-m", "pymooncake", "bench", "store", "--size", "4K",
                        "--count", "1", "--no-mooncake", "--rpc-poll", "0.5"],
                       capture_output=True, text=True, timeout=60, env=env, cwd=ROOT)
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "--rpc-poll 0.5: must be in [0, 0.01] seconds" in r.stderr


def test_bench_store_metadata_only_sweeps_depths_in_order():
    """``--metadata-only`` with ``--metadata-clients`` given twice (and once repeated):
    only the side-by-side metadata rows, one set per depth, in the order given, each
    depth once; every answer checked."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-m", "pymooncake", "bench", "store", "--metadata-only",
                        "--metadata-ops", "200", "--metadata-clients", "2",
                        "--metadata-clients", "1", "--metadata-clients", "2", "--no-mooncake",
                        "--json"],
                       capture_output=True, text=True, timeout=150, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads(r.stdout)
    assert {x["mode"] for x in rows} == {"metadata_ops"}
    ops = ["is_exist", "batch_is_exist", "get_size", "remove"]
    assert [(x["num_clients"], x["op"]) for x in rows] == [(2, o) for o in ops] + [
        (1, o) for o in ops]
    for x in rows:
        assert x["verified"] is True and x["ops_per_s"] > 0 and x["ratio"] is None


def test_bench_store_refuses_metadata_only_without_a_depth():
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + env.get("PYTHONPATH", "")
    for extra, why in ((["--metadata-clients", "0"], "--metadata-only needs"),
                       (["--metadata-clients", "-1"], "--metadata-clients -1: must be >= 0"),
                       (["--metadata-ops", "0"], "--metadata-only needs")):
        r = subprocess.run([sys.executable, "-m", "pymooncake", "bench", "store",
                            "--metadata-only", "--no-mooncake", *extra],
                           capture_output=True, text=True, timeout=60, env=env, cwd=ROOT)
        assert r.returncode == 2, (extra, r.returncode, r.stderr[-2000:])
        assert why in r.stderr, (extra, r.stderr[-2000:])


def test_bench_store_segment_holds_every_object_of_a_run():
    """All objects of one size are put before any is read back, so the segment must hold
    them all: 128 × 1 MiB = 128 MiB (the run that lost its first key to eviction when the
    segment was sized for 8 objects: 64 MiB); 16 MiB objects are capped at 256 MiB a run."""
    from pymooncake.bench.store import _objects, _segment_for

    MiB = 1 << 20
    assert _objects(1 * MiB, 128) == 128
    assert _objects(16 * MiB, 128) == 16
    assert _objects(64 << 10, 2) == 4
    assert _segment_for([64 << 10, 1 * MiB], 128) >= 128 * MiB + 16 * MiB
    assert _segment_for([16 * MiB], 128) >= 256 * MiB + 16 * MiB
    assert _segment_for([4 << 10], 4) == 64 * MiB


def test_bench_store_ratio_quartiles_by_hand():
    """The per-round ratios' median and quartiles (inclusive method, as the Transfer Engine
    bench's verdicts): sorted 0.8 0.9 1.0 1.1 1.2 1.3 1.5 — the median is the 4th, the
    first quartile sits halfway between the 2nd and 3rd (position 6 × 0.25 = 1.5), the
    third halfway between the 5th and 6th (6 × 0.75 = 4.5)."""
    from pymooncake.bench.store import ROW_KEYS, ratio_fields

    got = ratio_fields([1.0, 1.2, 0.8, 1.5, 1.1, 1.3, 0.9])
    want = {"ratio": 1.1, "ratio_min": 0.8, "ratio_max": 1.5, "ratio_q1": 0.95,
            "ratio_q3": 1.25}
    assert got.keys() == want.keys() and set(got) <= set(ROW_KEYS)
    for k, v in want.items():
        assert abs(got[k] - v) < 1e-12, (k, got[k])
