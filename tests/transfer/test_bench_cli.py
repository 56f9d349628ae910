"""`pymooncake bench transfer --json` runs and verifies (figures are not asserted)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration

KEYS = {"transport", "size_bytes", "batch", "paths", "throughput_bytes_per_s", "figures",
        "ratios", "cpu_s_per_gib", "socket_connections", "repeats",
        "requests_per_s", "verified", "memcpy_bytes_per_s", "socket_bytes_per_s",
        "mooncake_bytes_per_s"}


@pytest.mark.parametrize("transport", ["local", "shm", "tcp"])
def test_bench_transfer_json(transport: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "pymooncake", "bench", "transfer", "--transport", transport,
         "--size", "65536", "--batch", "4", "--paths", "2", "--min-time-s", "0.05", "--repeat", "1",
         "--no-mooncake", "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert r.keys() >= KEYS
    assert (r["transport"], r["size_bytes"], r["batch"], r["paths"]) == (transport, 65536, 4, 2)
    assert r["verified"] is True
    assert r["mooncake_bytes_per_s"] is None
    assert r["throughput_bytes_per_s"] > 0 and r["socket_bytes_per_s"] > 0


def test_bench_says_so_when_mooncake_is_absent(tmp_path) -> None:  # noqa: ANN001
    # Shadow any installed wheel with a package that fails to import.
    (tmp_path / "mooncake").mkdir()
    (tmp_path / "mooncake" / "__init__.py").write_text("raise ImportError('absent')\n")
    import os

    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run(
        [sys.executable, "-m", "pymooncake", "bench", "transfer", "--transport", "tcp",
         "--size", "65536", "--batch", "2", "--min-time-s", "0.05", "--repeat", "1", "--json"],
        capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert r["mooncake_bytes_per_s"] is None and r["verified"] is True
    assert "not importable" in r["mooncake_note"]


@pytest.mark.parametrize(("flags", "named"), [
    (["--size", "0"], "--size must be positive, got 0"),
    (["--batch", "-1"], "--batch must be positive, got -1"),
    (["--paths", "0"], "--paths must be positive, got 0"),
    (["--repeat", "0"], "--repeat must be positive, got 0"),
    (["--min-time-s", "nan"], "--min-time-s must be positive, got nan"),
])
def test_bench_names_the_offending_flag_and_value(flags: list[str], named: str,
                                                  capsys) -> None:  # noqa: ANN001
    from pymooncake.cli.main import main

    assert main(["bench", "transfer", "--no-mooncake", *flags]) == 2
    err = capsys.readouterr().err
    assert named in err
    others = {"--size", "--batch", "--paths", "--repeat", "--min-time-s"} - {flags[0]}
    assert not any(o in err for o in others)


def test_verdicts_use_every_repeat_and_targets_follow_the_issue() -> None:
    from pymooncake.bench.transfer import targets, verdict

    assert verdict([1.1, 1.3, 1.05], 1.0) == "met"
    assert verdict([0.7, 0.75, 0.79], 0.8) == "missed"
    assert verdict([0.7, 0.9, 1.2], 0.8) == "not distinguishable"  # margin inside spread
    # From 4 repeats on, the quartiles: one outlier does not decide.
    assert verdict([0.5, 1.1, 1.2, 1.3, 1.4], 1.0) == "met"
    assert verdict([0.9, 0.95, 1.05, 1.1], 1.0) == "not distinguishable"
    assert verdict([2.0], 1.0) == "no spread (1 repeat)"
    assert targets("tcp", 4096) == {"mooncake": 1.0}
    assert targets("tcp", 16 << 20) == {"mooncake": 1.2, "socket": 0.8}
    assert targets("shm", 4 << 20) == {"memcpy": 0.8}


def test_the_harness_lives_outside_the_library_package() -> None:
    import importlib.util

    assert importlib.util.find_spec("pymooncake.transfer.bench") is None
    assert importlib.util.find_spec("pymooncake.bench.transfer") is not None
