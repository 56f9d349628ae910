"""``bench vllm-prefix`` without vLLM: parameter checks, the summary and the CLI's errors."""

from __future__ import annotations

import statistics
import subprocess
import sys

import pytest

from pymooncake.bench.vllm_prefix import (
    VllmBenchError,
    format_human,
    run_vllm_prefix,
    summarize,
)

REQS = ([{"kind": "hit", "ttft_s": t, "cached_tokens": 1920} for t in (0.5, 0.9, 0.7)]
        + [{"kind": "miss", "ttft_s": t, "cached_tokens": 0} for t in (3.0, 2.0, 4.0)]
        + [{"kind": "plain", "ttft_s": t, "cached_tokens": 0} for t in (2.5, 3.5)]
        + [{"kind": "fill", "ttft_s": 9.0, "cached_tokens": 0}])


def test_summary_medians_and_ratios() -> None:
    s = summarize(REQS)
    assert s["hit"] == {"median_ms": pytest.approx(700), "min_ms": pytest.approx(500),
                        "max_ms": pytest.approx(900), "n": 3, "cached_tokens": [1920]}
    assert s["miss"]["median_ms"] == pytest.approx(3000)
    assert s["plain"]["median_ms"] == pytest.approx(statistics.median([2500, 3500]))
    assert s["hit_over_miss"] == pytest.approx(0.7 / 3.0)
    assert s["hit_over_plain"] == pytest.approx(0.7 / 3.0)
    assert s["miss_over_plain"] == pytest.approx(1.0)
    assert "fill" not in s
    doc = {"config": {"model": "smollm2", "dtype": "float32", "prompt_tokens": 2048,
                      "prefix_tokens": 1920, "block_size": 128, "repeats": 3},
           "machine": {"cpu_model": "X", "loadavg_start": (1.0, 0, 0),
                       "loadavg_end": (2.0, 0, 0)}, "summary": s}
    text = format_human(doc)
    assert "hit/miss: 0.233" in text and "1920" in text


def test_bad_parameters_and_missing_venv_are_named(tmp_path) -> None:
    with pytest.raises(VllmBenchError, match="multiple of 32"):
        run_vllm_prefix(block_size=100, vllm_python=str(tmp_path / "py"))
    with pytest.raises(VllmBenchError, match="--prefix-tokens 2048 must be in"):
        run_vllm_prefix(prefix_tokens=2048, vllm_python=str(tmp_path / "py"))
    with pytest.raises(VllmBenchError, match="make vllm-connector"):
        run_vllm_prefix(vllm_python=str(tmp_path / "py"))


def test_cli_missing_venv_is_one_line(tmp_path) -> None:
    r = subprocess.run([sys.executable, "-m", "pymooncake", "bench", "vllm-prefix",
                        "--vllm-python", str(tmp_path / "python")],
                       capture_output=True, text=True, check=False, timeout=120)
    assert r.returncode == 2
    assert len(r.stderr.strip().splitlines()) == 1 and "make vllm-connector" in r.stderr
