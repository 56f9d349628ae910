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
    # This front door runs a scripted backend, not the Conductor: /metrics answers but has
    # no stage histogram, so there are no stage figures (and the replay still reports).
    assert s["stage_mean_s"] == {}
    rows = (tmp_path / "r.csv").read_text().splitlines()
    assert len(rows) == n + 1


@pytest.mark.integration
def test_replay_skip_sends_a_later_slice_with_the_same_tokens(server_url: str) -> None:
    n, skip, scale = 30, 22, 32
    out = subprocess.run(
        [sys.executable, "-m", "pymooncake", "replay", "--url", server_url, "--limit", str(n),
         "--skip", str(skip), "--time-scale", "200", "--length-scale", str(scale), "--json"],
        capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    s = json.loads(out.stdout)
    reqs = take_first(load_trace(bundled_trace_path()), n).requests[skip:]
    fits = [r for r in reqs if math.ceil(r.input_length / scale)
            + math.ceil(r.output_length / scale) <= 2048]      # server context is 2048
    assert s["num_requests"] == n - skip
    assert s["num_served"] == len(fits)
    assert s["prompt_tokens"] == sum(math.ceil(r.input_length / scale) for r in fits)


@pytest.mark.integration
def test_replay_where_every_request_fails_exits_1_and_says_why(server_url: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "pymooncake", "replay", "--url", server_url, "--limit", "3",
         "--time-scale", "200", "--model", "no-such-model", "--json"],
        capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 1
    assert json.loads(out.stdout)["num_failed"] == 3
    last = out.stderr.strip().splitlines()[-1]
    assert "3 of 3 requests failed" in last and "HTTP 404" in last, out.stderr


def test_replay_bad_arguments() -> None:
    for args in (["--length-scale", "7"], ["--limit", "0"], ["--time-scale", "-1"],
                 ["--timeout", "0"], ["--vocab-size", "1"], ["--skip", "-1"],
                 ["--limit", "5", "--skip", "5"]):
        out = subprocess.run([sys.executable, "-m", "pymooncake", "replay", "--url",
                              "http://127.0.0.1:9", *args], capture_output=True, text=True,
                             timeout=60, check=False)
        assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    out = subprocess.run([sys.executable, "-m", "pymooncake", "replay", "--url",
                          "http://127.0.0.1:9", "--limit", "2", "--timeout", "2"],
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 1 and "no response" in out.stderr


# Two /metrics snapshots as the Conductor's prometheus_client exposes them (hand-written).
_BEFORE = """\
# HELP pymooncake_conductor_stage_seconds time per request stage (s)
# TYPE pymooncake_conductor_stage_seconds histogram
pymooncake_conductor_stage_seconds_bucket{le="1.0",stage="prefill"} 3.0
pymooncake_conductor_stage_seconds_bucket{le="+Inf",stage="prefill"} 3.0
pymooncake_conductor_stage_seconds_count{stage="prefill"} 3.0
pymooncake_conductor_stage_seconds_sum{stage="prefill"} 1.5
pymooncake_conductor_stage_seconds_bucket{le="1.0",stage="decode"} 0.0
pymooncake_conductor_stage_seconds_bucket{le="+Inf",stage="decode"} 2.0
pymooncake_conductor_stage_seconds_count{stage="decode"} 2.0
pymooncake_conductor_stage_seconds_sum{stage="decode"} 4.0
pymooncake_conductor_stage_seconds_bucket{le="+Inf",stage="schedule"} 3.0
pymooncake_conductor_stage_seconds_count{stage="schedule"} 3.0
pymooncake_conductor_stage_seconds_sum{stage="schedule"} 0.01
# HELP pymooncake_conductor_failed_total placed requests that failed
# TYPE pymooncake_conductor_failed_total counter
pymooncake_conductor_failed_total{stage="prefill"} 7.0
"""
_AFTER = """\
# HELP pymooncake_api_ttft_seconds time to first token (s)
# TYPE pymooncake_api_ttft_seconds histogram
pymooncake_api_ttft_seconds_bucket{le="+Inf"} 9.0
pymooncake_api_ttft_seconds_count 9.0
pymooncake_api_ttft_seconds_sum 99.0
# HELP pymooncake_conductor_stage_seconds time per request stage (s)
# TYPE pymooncake_conductor_stage_seconds histogram
pymooncake_conductor_stage_seconds_bucket{le="1.0",stage="prefill"} 5.0
pymooncake_conductor_stage_seconds_bucket{le="+Inf",stage="prefill"} 5.0
pymooncake_conductor_stage_seconds_count{stage="prefill"} 5.0
pymooncake_conductor_stage_seconds_sum{stage="prefill"} 3.0
pymooncake_conductor_stage_seconds_bucket{le="1.0",stage="decode"} 0.0
pymooncake_conductor_stage_seconds_bucket{le="+Inf",stage="decode"} 2.0
pymooncake_conductor_stage_seconds_count{stage="decode"} 2.0
pymooncake_conductor_stage_seconds_sum{stage="decode"} 4.0
pymooncake_conductor_stage_seconds_bucket{le="+Inf",stage="schedule"} 6.0
pymooncake_conductor_stage_seconds_count{stage="schedule"} 6.0
pymooncake_conductor_stage_seconds_sum{stage="schedule"} 0.016
pymooncake_conductor_stage_seconds_bucket{le="+Inf",stage="p2d_transfer"} 2.0
pymooncake_conductor_stage_seconds_count{stage="p2d_transfer"} 2.0
pymooncake_conductor_stage_seconds_sum{stage="p2d_transfer"} 0.3
# HELP pymooncake_conductor_failed_total placed requests that failed
# TYPE pymooncake_conductor_failed_total counter
pymooncake_conductor_failed_total{stage="prefill"} 9.0
"""


def test_parse_stage_seconds_reads_only_the_stage_histogram() -> None:
    from pymooncake.cli.replay import parse_stage_seconds

    assert parse_stage_seconds(_BEFORE) == {"prefill": (1.5, 3.0), "decode": (4.0, 2.0),
                                            "schedule": (0.01, 3.0)}
    assert parse_stage_seconds("") == {}
    for garbage in ("<html><body>Not Found</body></html>", '{"detail": "Not Found"}'):
        with pytest.raises(ValueError, match="Prometheus"):
            parse_stage_seconds(garbage)


def test_stage_means_are_deltas_between_snapshots() -> None:
    from pymooncake.cli.replay import _human, parse_stage_seconds, stage_means_s, summarize

    means = stage_means_s(parse_stage_seconds(_BEFORE), parse_stage_seconds(_AFTER))
    # prefill (3.0-1.5)/(5-3); schedule (0.016-0.01)/(6-3); p2d_transfer new: 0.3/2;
    # decode had no new observations: left out.
    assert means.keys() == {"prefill", "schedule", "p2d_transfer"}
    assert means["prefill"] == pytest.approx(0.75)
    assert means["schedule"] == pytest.approx(0.002)
    assert means["p2d_transfer"] == pytest.approx(0.15)
    assert stage_means_s({}, {}) == {}
    report = {**summarize([], 1.0, 0.1, 1.0), "stage_mean_s": means}
    assert "stages          p2d_transfer 0.150 s  prefill 0.750 s  schedule 0.002 s" in (
        _human(report))


def test_fetch_stage_seconds_from_a_foreign_server_is_none() -> None:
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from pymooncake.cli.replay import fetch_stage_seconds

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            body = {"/a/metrics": b"<html>no metrics here</html>",
                    "/b/metrics": _AFTER.encode()}.get(self.path)
            self.send_response(404 if body is None else 200)
            self.end_headers()
            self.wfile.write(body or b"not found")

        def log_message(self, *args: object) -> None:
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{srv.server_address[1]}"
        assert fetch_stage_seconds(base + "/a", timeout_s=5) is None    # not Prometheus
        assert fetch_stage_seconds(base + "/none", timeout_s=5) is None  # 404
        assert fetch_stage_seconds(base + "/b", timeout_s=5)["p2d_transfer"] == (0.3, 2.0)
    finally:
        srv.shutdown()
        srv.server_close()
