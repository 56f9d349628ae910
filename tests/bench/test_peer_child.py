"""The child-process protocol of ``bench peer`` with our engine on ``--model tiny``: real
children (``runner.py`` under this interpreter), pinned to one core, JSON files only. No
test needs the vLLM peer venv."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pymooncake.bench.peer import PeerError, build_prompts, prepare_model, run_child, run_peer

SMALL = dict(batches=(1, 2), prefill_len=16, decode_len=8, decode_tokens=4, greedy_tokens=6,
             copy_bytes=1 << 24)


def test_run_child_ours_tiny(tmp_path) -> None:
    model_dir, vocab, greedy = prepare_model("tiny", tmp_path)
    assert greedy is None  # the tiny model has no HF tokenizer: random greedy prompts
    core = min(os.sched_getaffinity(0))
    prompts = build_prompts(vocab, [1, 2], 16, 8, [[5, 6, 7], [8, 9, 10, 11]])
    spec = {"system": "ours", "repeat": 0, "model": str(model_dir), "core": core,
            "threads": 1, "dtype": "float32", "prefill_len": 16, "batches": [1, 2],
            "decode_len": 8, "decode_tokens": 4, "greedy_tokens": 6, "copy_bytes": 1 << 24,
            "prompts": prompts}
    out = run_child(sys.executable, spec, tmp_path)
    assert out["system"] == "ours" and out["pid"] != os.getpid()
    assert out["affinity"] == [core] and out["affinity_after"] == [core]
    assert out["torch_threads"] == 1 and out["dtype"] == "float32"
    assert set(out["prefill"]) == {"1", "2"} and out["decode"]["2"]["tokens_per_s"] > 0
    assert [len(g) for g in out["greedy"]] == [6, 6]
    assert out["versions"]["pymooncake"] and out["cpu_model"]
    assert out["weight_bytes_per_token"] > 0 and out["copy_bandwidth"]["bytes_per_s"] > 0
    json.dumps(out)  # plain JSON all the way
    # the same spec again gives the same greedy tokens (deterministic child)
    assert run_child(sys.executable, spec, tmp_path)["greedy"] == out["greedy"]


def test_run_child_failure_is_one_line(tmp_path) -> None:
    spec = {"system": "nope", "threads": 1, "core": None}
    with pytest.raises(PeerError, match=r"nope-0 exited with 1: ValueError: unknown system"):
        run_child(sys.executable, spec, tmp_path)


def test_run_peer_ours_only_tiny(tmp_path) -> None:
    doc = run_peer("tiny", repeats=2, peers=[], workdir=str(tmp_path),
                   core=min(os.sched_getaffinity(0)), **SMALL)
    assert list(doc["systems"]) == ["ours"] and doc["ratios"] == {}
    assert doc["figures"]["decode_tokens_per_s"]["2"]["ours"]["n"] == 2
    assert doc["greedy"]["stable_across_repeats"] == {"ours": True}
    assert doc["bandwidth_floor"]["floor_tokens_per_s"] > 0
    assert doc["config"]["orders"] == [["ours"], ["ours"]]


def test_missing_vllm_venv_names_make_target(tmp_path) -> None:
    with pytest.raises(PeerError, match="make peer-vllm"):
        run_peer("tiny", peers=["vllm"], vllm_python=str(tmp_path / "no" / "python"))
    with pytest.raises(PeerError, match="unknown peer"):
        run_peer("tiny", peers=["sglang"])


def test_cli_missing_vllm_venv_one_line(tmp_path) -> None:
    r = subprocess.run([sys.executable, "-m", "pymooncake", "bench", "peer", "--model", "tiny",
                        "--vllm-python", str(tmp_path / "python")],
                       capture_output=True, text=True, check=False, timeout=120)
    assert r.returncode == 1 and r.stdout == ""
    assert len(r.stderr.strip().splitlines()) == 1 and "make peer-vllm" in r.stderr


def test_run_child_on_a_cpu_list_with_two_threads(tmp_path) -> None:
    """``--core 0,1 --threads 2``: the child is pinned to both CPUs and runs 2 torch threads
    (the long-prompt comparison on all the cores, both sides alike)."""
    cpus = sorted(os.sched_getaffinity(0))[:2]
    if len(cpus) < 2:
        pytest.skip("needs 2 CPUs")
    model_dir, vocab, _ = prepare_model("tiny", tmp_path)
    spec = {"system": "ours", "repeat": 0, "model": str(model_dir),
            "core": ",".join(map(str, cpus)), "threads": 2, "dtype": "float32",
            "prefill_len": 40, "batches": [1], "decode_len": 8, "decode_tokens": 4,
            "greedy_tokens": 6, "copy_bytes": 1 << 24,
            "prompts": build_prompts(vocab, [1], 40, 8, [[5, 6, 7]])}
    out = run_child(sys.executable, spec, tmp_path)
    assert out["affinity"] == cpus and out["torch_threads"] == 2
    assert out["prefill"]["1"]["tokens_per_s"] > 0


@pytest.mark.parametrize(("flags", "message"), [
    (["--core", "4096"], "not among this process's CPUs"),
    (["--batches", "1,0"], "batch sizes must be >= 1"),
    (["--threads", "0"], "--threads must be >= 1"),
    (["--prefill-len", "-3"], "--prefill-len must be >= 1"),
    (["--core", "a,b"], "--core: comma-separated non-negative integers"),
    (["--core", "1,"], "--core: comma-separated"),
    (["--core", "0,0"], "names a value twice"),
    (["--core", "3-1"], "empty range"),
    (["--batches", "1,,16"], "--batches: comma-separated"),
    (["--core", "0", "--threads", "2"], "--threads 2: needs as many CPUs"),
    (["--prefill-len", "100000"], "at most 16384 tokens"),
    (["--peers", "foo"], "--peers: one or more of vllm, hf"),
    (["--peers", ""], "--peers: one or more of vllm, hf"),
])
def test_cli_bad_peer_flags_one_line(flags, message) -> None:
    r = subprocess.run([sys.executable, "-m", "pymooncake", "bench", "peer", "--model", "tiny",
                        "--peers", "hf", *flags], capture_output=True, text=True, check=False,
                       timeout=120)
    assert r.returncode == 2 and message in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
