"""``pymooncake p2p get --parallel`` and ``serve --p2p-model`` flag checks (issue 19 items 10,
11): the real command, refused at parse time before any metadata service is contacted."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pymooncake.p2p.puller import MAX_PARALLEL


def _run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pymooncake", *argv], capture_output=True,
                          text=True, timeout=60)


@pytest.mark.parametrize("n", ["0", str(MAX_PARALLEL + 1), "100000"])
def test_get_parallel_outside_1_to_64_is_refused(tmp_path, n: str) -> None:
    # an unreachable metadata service: the refusal must come before any connection
    r = _run("p2p", "get", "x", str(tmp_path / "d"), "--parallel", n,
             "--metadata", "http://127.0.0.1:1/metadata")
    assert MAX_PARALLEL == 64
    assert (r.returncode, r.stdout) == (2, "")
    assert r.stderr == (f"pymooncake: error: --parallel must be in 1..64 (shards in flight, "
                        f"one thread each), got {int(n)}\n")
    assert not (tmp_path / "d").exists()


def test_serve_p2p_model_with_model_is_refused() -> None:
    r = _run("serve", "--p2p-model", "junk", "--model", "tiny",
             "--p2p-metadata", "http://127.0.0.1:1/metadata", "--port", "0")
    assert (r.returncode, r.stdout) == (2, "")
    assert r.stderr == ("pymooncake: error: --p2p-model junk and --model tiny conflict: the "
                        "pulled directory is the model; give one of them\n")
