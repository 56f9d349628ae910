"""The simulator with a CPP prefill group (docs/cpp.md): the same ``policy.with_cpp`` as the
live Conductor sends long prompts to the group, short ones to the single node."""

from __future__ import annotations

import dataclasses

import pytest

from pymooncake.conductor import policy
from pymooncake.conductor.policy.cpp import CppCostModel, cpp_prefill_s
from pymooncake.sim.config import SimConfig
from pymooncake.sim.runner import Simulator, simulate

CFG = dict(num_prefill=1, num_decode=1, model="llama3-70b", gpu="A800", cpp_groups=1,
           cpp_stages=4, cpp_chunk_tokens=4096, cpp_min_tokens=8192)


def test_long_to_group_short_to_single_with_pipeline_time(make_trace) -> None:
    trace = make_trace([(1000.0, 32768, 2, tuple(range(64))),
                        (1000.0 + 200_000, 2048, 2, (1000, 1001, 1002, 1003))])
    cfg = SimConfig(scenario="pd-global", **CFG)
    sim = Simulator(trace, cfg)
    assert sim.prefill_policy.__name__ == "place_prefill_global_cache_with_cpp"
    res = sim.run()
    long, short = res.requests
    assert (long.prefill_node, short.prefill_node) == ("cpp0", "p0")
    model = CppCostModel(4, 4096, sim.est.prefill, cfg.cpp_hop_s, 0.0, 8192, edge_tokens=0)
    assert long.prefill_gpu_s == pytest.approx(cpp_prefill_s(model, 32768, 0))
    # about a quarter of one node's time plus fill and drain
    assert long.prefill_gpu_s < 0.5 * sim.cm.prefill_s(32768, 0)


def test_without_groups_the_policy_is_the_plain_one(make_trace) -> None:
    cfg = SimConfig(scenario="pd-global", **dict(CFG, cpp_groups=0))
    sim = Simulator(make_trace([(0.0, 1024, 2, (1, 2))]), cfg)
    assert sim.prefill_policy is policy.place_prefill_global_cache


def test_bad_cpp_config() -> None:
    with pytest.raises(ValueError, match="cpp_stages"):
        SimConfig(**dict(CFG, cpp_stages=1))
    with pytest.raises(ValueError, match="P/D scenario"):
        SimConfig(scenario="colocated", **CFG)
    assert dataclasses.replace(SimConfig(**CFG), cpp_groups=0).cpp_groups == 0


def test_simulate_runs_with_group(make_trace) -> None:
    reqs = []
    for i in range(8):
        n = 16384 if i % 2 else 1024
        reqs.append((i * 500.0, n, 4, tuple(range(i * 100, i * 100 + n // 512))))
    res = simulate(make_trace(reqs), SimConfig(scenario="pd-global", **CFG))
    assert [r.prefill_node for r in res.requests] == ["p0", "cpp0"] * 4


def test_cli_cpp_groups(tmp_path) -> None:
    import json
    import subprocess
    import sys
    lines = [json.dumps({"timestamp": i * 500, "input_length": n, "output_length": 4,
                         "hash_ids": list(range(i * 100, i * 100 + n // 512))})
             for i, n in enumerate([1024, 16384, 1024, 16384])]
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(lines) + "\n")
    base = [sys.executable, "-m", "pymooncake", "sim", "run", str(trace), "--prefill", "1",
            "--decode", "1"]
    csv_path = tmp_path / "r.csv"
    r = subprocess.run(base + ["--cpp-groups", "1", "--cpp-stages", "4", "--cpp-min-tokens",
                               "8192", "--json", "--csv", str(csv_path)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["num_requests"] == 4
    # the report names the CPP config and counts the prompts the groups prefilled (the
    # per-request CSV says where each one went)
    import csv
    with open(csv_path) as f:
        nodes = [row["prefill_node"] for row in csv.DictReader(f)]
    assert nodes.count("cpp0") == 2
    assert (doc["cpp_groups"], doc["cpp_stages"], doc["cpp_min_tokens"]) == (1, 4, 8192)
    assert doc["num_prefilled_by_cpp"] == nodes.count("cpp0")
    r = subprocess.run(base + ["--cpp-groups", "1"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and "num_prefilled_by_cpp" in r.stdout, r.stderr
    for flags in (["--cpp-stages", "2"], ["--cpp-min-tokens", "100"]):
        r = subprocess.run(base + flags, capture_output=True, text=True, timeout=60)
        assert r.returncode == 2, r.stderr
        assert f"{flags[0]} describes CPP prefill groups: add --cpp-groups" in r.stderr
    r = subprocess.run(base + ["--cpp-groups", "1", "--cpp-stages", "1"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "--cpp-stages must be an integer >= 2" in r.stderr
