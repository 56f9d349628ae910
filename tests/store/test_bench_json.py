"""``pymooncake bench store --json`` prints a JSON list of rows (the issue's contract)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.store.procs import ROOT

REQUIRED = ("op", "size_bytes", "mode", "throughput_bytes_per_s", "p50_s", "p99_s",
            "verified", "mooncake_throughput_bytes_per_s")


def _bench_store(*args: str, timeout: float = 150) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", "pymooncake", "bench", "store", *args],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


def test_bench_store_json_is_a_list_of_rows():
    r = _bench_store("--size", "4K", "--size", "64K", "--count", "4", "--mode", "embedded",
                     "--metadata-ops", "400", "--metadata-clients", "2", "--no-mooncake",
                     "--rpc-poll", "5e-5", "--json")
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
    r = _bench_store("--size", "4K", "--count", "1", "--no-mooncake", "--rpc-poll", "0.5",
                     timeout=60)
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "--rpc-poll 0.5: must be in [0, 0.01] seconds" in r.stderr


def test_bench_store_metadata_only_sweeps_depths_in_order():
    """``--metadata-only`` with ``--metadata-clients`` 2, 1, 3, 1: only the side-by-side
    metadata rows, one set per depth, in the order given (2, 1, 3: neither sort), a
    repeated depth once; every answer checked; ``ops`` = the calls each side made per op
    kind: 201 // 2 × 2 = 200 at depth 2, 201 at depths 1 and 3 (× 16 keys for
    ``batch_is_exist``)."""
    r = _bench_store("--metadata-only", "--metadata-ops", "201", "--metadata-clients", "2",
                     "--metadata-clients", "1", "--metadata-clients", "3",
                     "--metadata-clients", "1", "--no-mooncake", "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads(r.stdout)
    assert {x["mode"] for x in rows} == {"metadata_ops"}
    ops = ["is_exist", "batch_is_exist", "get_size", "remove"]
    assert [(x["num_clients"], x["op"]) for x in rows] == [
        (n, o) for n in (2, 1, 3) for o in ops]
    for x in rows:
        assert x["verified"] is True and x["ops_per_s"] > 0 and x["ratio"] is None
        calls = 200 if x["num_clients"] == 2 else 201
        assert x["ops"] == (calls * 16 if x["op"] == "batch_is_exist" else calls), x


def test_bench_store_metadata_only_human_output_has_no_put_get_table():
    r = _bench_store("--metadata-only", "--metadata-ops", "100", "--metadata-clients", "1",
                     "--no-mooncake")
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.strip().splitlines()
    assert [ln.split()[1] for ln in lines] == ["is_exist", "batch_is_exist", "get_size",
                                               "remove"], r.stdout
    assert all(ln.startswith("metadata ") and "(1 in flight)" in ln for ln in lines)


def test_bench_store_refuses_bad_metadata_flags():
    """Each refusal names the flag and the value; nothing runs (exit 2)."""
    cases = [
        (["--metadata-only", "--metadata-clients", "0"], "--metadata-clients 0 leaves nothing"),
        (["--metadata-only", "--metadata-ops", "0"], "--metadata-ops 0 leaves nothing"),
        (["--metadata-only", "--size", "4K"], "--size and --mode do not apply"),
        (["--metadata-only", "--mode", "remote"], "--size and --mode do not apply"),
        (["--metadata-ops", "-5"], "--metadata-ops -5: must be >= 0"),
        (["--metadata-clients", "-1"], "--metadata-clients -1: must be in 1..64"),
        (["--metadata-clients", "65"], "--metadata-clients 65: must be in 1..64"),
        (["--metadata-clients", "2", "--metadata-clients", "0"],
         "--metadata-clients 0 (skip) cannot be given with other depths"),
    ]
    for extra, why in cases:
        r = _bench_store("--no-mooncake", *extra, timeout=60)
        assert r.returncode == 2, (extra, r.returncode, r.stderr[-2000:])
        assert why in r.stderr, (extra, r.stderr[-2000:])


def test_store_meta_run_refuses_bad_arguments_before_starting_anything():
    import pytest

    from pymooncake.bench import store_meta

    for kw, name in (({"clients": 0}, "clients=0"), ({"ops": 0}, "ops=0"),
                     ({"batch": 0}, "batch=0"), ({"repeat": 0}, "repeat=0"),
                     ({"clients": 2.0}, "clients=2.0")):
        with pytest.raises(ValueError, match=name):
            store_meta.run(**{"ops": 10, "clients": 1, "batch": 16, "repeat": 1,
                              "with_mooncake": False, **kw})


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
