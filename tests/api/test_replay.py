"""``pymooncake replay`` against a real HTTP server process, on the real conversation trace."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from pymooncake.workload import bundled_trace_path, load_trace, take_first


@pytest.mark.integration
def test_replay_reports_exact_token_counts_and_hits(server_url: str, tmp_path) -> None:
    n, scale = 30, 32
    out = subprocess.run(
        [sys.executable, "-m", "pymooncake", "replay", "--url", server_url, "--limit", str(n),
         "--time-scale", "200", "--length-scale", str(scale), "--json",
         "--output", str(tmp_path / "r.csv")],
        capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    s = json.loads(out.stdout)
    reqs = take_first(load_trace(bundled_trace_path()), n).requests
    fits = [r for r in reqs if math.ceil(r.input_length / scale)
            + math.ceil(r.output_length / scale) <= 2048]      # server context is 2048
    assert s["num_requests"] == n
    assert s["num_served"] == len(fits) and s["num_failed"] == n - len(fits)
    assert s["num_rejected"] == 0
    assert s["prompt_tokens"] == sum(math.ceil(r.input_length / scale) for r in fits)
    assert s["completion_tokens"] == sum(math.ceil(r.output_length / scale) for r in fits)
    assert 0 < s["token_hit_ratio"] < 1 and s["cached_tokens"] > 0
    assert s["ttft_mean_s"] > 0 and s["tbt_mean_s"] is not None
    for key in ("ttft_p50_s", "ttft_p99_s", "tbt_p99_s", "slo_attainment",
                "request_hit_ratio"):
        assert key in s
    rows = (tmp_path / "r.csv").read_text().splitlines()
    assert len(rows) == n + 1


def test_replay_bad_arguments() -> None:
    for args in (["--length-scale", "7"], ["--limit", "0"], ["--time-scale", "-1"]):
        out = subprocess.run([sys.executable, "-m", "pymooncake", "replay", "--url",
                              "http://127.0.0.1:9", *args], capture_output=True, text=True,
                             timeout=60, check=False)
        assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    out = subprocess.run([sys.executable, "-m", "pymooncake", "replay", "--url",
                          "http://127.0.0.1:9", "--limit", "2", "--timeout", "2"],
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 1 and "no response" in out.stderr
