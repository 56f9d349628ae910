"""Edge inputs found by a newcomer's check: bounded lengths, empty traces, pipes, scaling."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pymooncake.workload import load_trace, scale_arrivals
from pymooncake.workload.trace import MAX_LENGTH_TOKENS, TraceError


def cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pymooncake", *args], capture_output=True,
                          text=True, timeout=120, check=False)


@pytest.mark.parametrize("field", ["input_length", "output_length"])
def test_absurd_lengths_name_file_and_line(tmp_path, field) -> None:
    lines = ['{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}']
    bad = {"timestamp": 1, "input_length": 10, "output_length": 1, "hash_ids": [1]}
    bad[field] = 10**23
    lines.append(str(bad).replace("'", '"'))
    path = tmp_path / "huge.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(TraceError) as e:
        load_trace(path)
    assert e.value.line == 2 and field in str(e.value) and str(MAX_LENGTH_TOKENS) in str(e.value)
    out = cli("trace", "stats", str(path))
    assert out.returncode == 1
    assert out.stderr.strip() == f"pymooncake: error: {e.value}"


def test_empty_or_all_invalid_trace_is_an_error(tmp_path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    out = cli("trace", "stats", str(empty))
    assert out.returncode == 1 and "no valid requests" in out.stderr
    junk = tmp_path / "junk.jsonl"
    junk.write_text("nope\n{}\n")
    out = cli("trace", "stats", "--skip-invalid", str(junk))
    assert out.returncode == 1 and "no valid requests (2 invalid lines skipped)" in out.stderr


def test_scaling_past_the_timestamp_bound_is_refused(tmp_path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text('{"timestamp": 1000, "input_length": 5, "output_length": 1, '
                    '"hash_ids": [1]}\n')
    trace = load_trace(path)
    with pytest.raises(ValueError, match="use a factor >= "):
        scale_arrivals(trace, 1e-300)
    assert scale_arrivals(trace, 0.5).requests[0].timestamp_ms == 2000


def test_output_into_a_closed_pipe_is_quiet(tmp_path) -> None:
    proc = subprocess.run(
        f"{sys.executable} -m pymooncake trace head -n 2000 | head -c 10 > /dev/null",
        shell=True, capture_output=True, text=True, timeout=120, check=False)
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr


@pytest.mark.parametrize("args", [["trace"], ["bench"], []])
def test_missing_sub_command_is_one_line(args) -> None:
    out = cli(*args)
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and "missing command (choose from" in out.stderr
