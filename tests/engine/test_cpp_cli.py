"""``pymooncake cpp run`` and ``pymooncake bench cpp`` end to end on the tiny model."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("torch")


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pymooncake", *args], capture_output=True,
                          text=True, check=False, timeout=120)


def test_cpp_run_json() -> None:
    out = _cli("cpp", "run", "--model", "tiny", "--prompt-len", "300", "--chunk-tokens",
               "128", "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["stages"] == [[0, 2], [2, 4]] and doc["prompt_tokens"] == 300
    assert doc["ttft_s"] > 0 and len(doc["hop_send_s"][0]) == 3


def test_bench_cpp_tiny() -> None:
    out = _cli("bench", "cpp", "--model", "tiny", "--prompt-len", "400", "--sweep", "200",
               "--chunk-tokens", "128", "--edge-tokens", "64", "--repeats", "1", "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert [r["prompt_tokens"] for r in doc["results"]] == [200, 400]
    assert all(r["first_token_same"] for r in doc["results"])
    assert doc["headline"]["prompt_tokens"] == 400 and "cost_model" in doc


@pytest.mark.parametrize("args", [["--stages", "0"], ["--cores", "0,1,2"],
                                  ["--edge-tokens", "-1"]])
def test_cpp_run_bad_arguments(args: list[str]) -> None:
    out = _cli("cpp", "run", "--model", "tiny", *args)
    assert out.returncode == 2
    assert out.stderr.strip().startswith("pymooncake: error:")
