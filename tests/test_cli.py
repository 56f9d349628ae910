"""CLI conventions: --help everywhere, exit status 2 with one line on bad arguments."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pymooncake.cli.main import build_parser, main


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pymooncake", *args],
                          capture_output=True, text=True, check=False, timeout=120)


def test_top_level_help() -> None:
    out = run_cli("--help")
    assert out.returncode == 0
    assert "usage: pymooncake" in out.stdout


def _main_rc(args: list[str]) -> int:
    """``main(args)`` in process: its return value, or argparse's exit status."""
    try:
        return main(args)
    except SystemExit as e:
        return int(e.code or 0)


@pytest.mark.parametrize("args", [["--no-such-flag"], ["no-such-command"], []])
def test_bad_arguments_exit_2_with_one_line(args: list[str], capsys) -> None:
    # the entry point itself for the first; the others in process (no interpreter start)
    if args == ["--no-such-flag"]:
        out = run_cli(*args)
        rc, err = out.returncode, out.stderr
    else:
        rc, err = _main_rc(args), capsys.readouterr().err
    assert rc == 2
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("pymooncake: error:")


def _all_subcommands() -> list[list[str]]:
    """Every leaf command path, e.g. ['trace', 'stats']."""
    paths: list[list[str]] = []

    def walk(parser, prefix):  # noqa: ANN001
        for action in parser._actions:
            if action.__class__.__name__ == "_SubParsersAction":
                for name, child in action.choices.items():
                    walk(child, [*prefix, name])
                return
        if prefix:
            paths.append(prefix)

    walk(build_parser(), [])
    return paths


def test_every_subcommand_has_help(capsys) -> None:
    # in one process, on the parser `main` builds (test_top_level_help runs the entry point)
    parser = build_parser()
    for path in _all_subcommands():
        with pytest.raises(SystemExit) as exit_:
            parser.parse_args([*path, "--help"])
        out = capsys.readouterr()
        assert exit_.value.code == 0, (path, out.err)
        assert "usage:" in out.out, path


def test_bench_serving_cpu_accounting_reads_proc_stat() -> None:
    """``bench serving`` charges each cluster process its utime + stime from /proc: for this
    process it agrees with getrusage (both count clock ticks) after a second of busy work."""
    import os
    import resource
    import time

    from pymooncake.cli.cluster import _proc_cpu_s
    end = time.process_time() + 1.0
    while time.process_time() < end:
        sum(i * i for i in range(1000))
    ru = resource.getrusage(resource.RUSAGE_SELF)
    got = _proc_cpu_s(os.getpid())
    assert got is not None and got >= 1.0
    assert got == pytest.approx(ru.ru_utime + ru.ru_stime, abs=0.05)
    assert _proc_cpu_s(2 ** 22 + 12345) is None      # beyond pid_max: no such process


def test_bench_serving_aggregates_repeats_as_means_with_per_repeat_values() -> None:
    from pymooncake.cli.bench_serving import _aggregate
    a = {"num_requests": 300, "ttft_mean_s": 0.2, "ttft_p99_s": 1.0, "token_hit_ratio": 0.08,
         "stage_mean_s": {"queue": 0.1, "prefill": 0.08}, "cluster_cpu_s": {"total": 30.0}}
    b = {"num_requests": 300, "ttft_mean_s": 0.3, "ttft_p99_s": 1.4, "token_hit_ratio": 0.08,
         "stage_mean_s": {"queue": 0.2, "prefill": 0.1}, "cluster_cpu_s": {"total": 34.0}}
    assert _aggregate([a]) is a
    got = _aggregate([a, b])
    assert got["num_requests"] == 300 and isinstance(got["num_requests"], int)
    assert got["ttft_mean_s"] == pytest.approx(0.25)
    assert got["ttft_p99_s"] == pytest.approx(1.2)
    assert got["stage_mean_s"] == pytest.approx({"queue": 0.15, "prefill": 0.09})
    assert got["cluster_cpu_s"]["total"] == pytest.approx(32.0)
    assert got["repeats"] == 2
    assert got["per_repeat"]["ttft_mean_s"] == [0.2, 0.3]
    assert got["per_repeat"]["tbt_mean_s"] == [None, None]
