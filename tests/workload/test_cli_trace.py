"""``pymooncake trace ...`` and ``pymooncake bench identity`` as a user runs them."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

from pymooncake.workload import load_trace

from .conftest import req, shared_trace


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pymooncake", *args], capture_output=True,
                          text=True, timeout=120, check=False)


def test_stats_json_on_shared_conversation_trace() -> None:
    p = cli("trace", "stats", str(shared_trace("conversation")), "--json")
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    assert d["num_requests"] == 12_031
    assert round(d["mean_input_length"]) == 12_035
    assert round(d["mean_output_length"]) == 343
    assert d["num_skipped"] == 0
    assert 3500 < d["duration_s"] < 3600 and 0 < d["cache_ratio"] < 1


def test_stats_default_is_bundled_trace_human_summary() -> None:
    p = cli("trace", "stats")
    assert p.returncode == 0, p.stderr
    assert "requests         12,031" in p.stdout
    assert "mean 12,035" in p.stdout and "mean 343" in p.stdout
    assert "cache ratio      37.4% token-weighted" in p.stdout


def test_broken_line_exits_1_with_file_and_line(write_jsonl) -> None:  # noqa: ANN001
    path = write_jsonl([req(0, 10, 1, [1]), req(1, 10, -4, [1]), req(2, 10, 1, [1])])
    p = cli("trace", "stats", str(path), "--json")
    assert p.returncode == 1
    assert p.stdout == ""
    assert p.stderr.splitlines() == [
        f"pymooncake: error: {path}:2: output_length must be an int in [0, 2147483647], got -4"]


def test_skip_invalid_reports_count(write_jsonl) -> None:  # noqa: ANN001
    path = write_jsonl([req(0, 10, 1, [1]), "{oops", req(1, 10, 1, [1, 2]),
                        req(2, 10, 1, [1])])
    d = json.loads(cli("trace", "stats", str(path), "--json", "--skip-invalid").stdout)
    # "{oops" and 2 hash ids for 10 tokens of 512-token blocks
    assert (d["num_requests"], d["num_skipped"]) == (2, 2)
    human = cli("trace", "stats", str(path), "--skip-invalid").stdout
    assert "(2 invalid lines skipped)" in human
    d8 = json.loads(cli("trace", "stats", str(path), "--json", "--skip-invalid",
                        "--block-size", "8").stdout)
    assert (d8["num_requests"], d8["num_skipped"], d8["block_size"]) == (3, 1, 8)


def test_missing_file_and_bad_block_size(tmp_path: Path) -> None:
    p = cli("trace", "stats", str(tmp_path / "none.jsonl"))
    assert p.returncode == 1 and p.stderr.strip().endswith("none.jsonl: no such file")
    p = cli("trace", "stats", "--block-size", "0")
    assert p.returncode == 2 and len(p.stderr.splitlines()) == 1


def test_head_and_scale_write_loadable_traces(tmp_path: Path, write_jsonl) -> None:  # noqa: ANN001
    src = write_jsonl([req(0, 10, 1, [1]), req(1000, 10, 1, [2]), req(3000, 10, 1, [3])])
    out = tmp_path / "head.jsonl.gz"
    assert cli("trace", "head", str(src), "-n", "2", "-o", str(out)).returncode == 0
    with gzip.open(out, "rt") as f:
        assert [json.loads(x)["hash_ids"] for x in f] == [[1], [2]]
    win = cli("trace", "head", str(src), "--start-s", "0.5", "--end-s", "5")
    assert [json.loads(x)["timestamp"] for x in win.stdout.splitlines()] == [500, 2500]
    scaled = tmp_path / "fast.jsonl"
    assert cli("trace", "scale", "4", str(src), "-o", str(scaled)).returncode == 0
    assert [r.timestamp_ms for r in load_trace(scaled)] == [0, 250, 750]
    bad = cli("trace", "scale", "0", str(src))
    assert bad.returncode == 2 and "factor" in bad.stderr


@pytest.mark.parametrize("args", [["--tokens", "4096", "--block-size", "16", "--repeat", "1"]])
def test_bench_identity_json(args: list[str]) -> None:
    p = cli("bench", "identity", *args, "--json")
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    assert d["num_keys"] == 256 and d["keys_per_s"] > 0
