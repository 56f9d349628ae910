"""A ``--model`` that cannot be loaded stops every command with one line and exit 1 (README:
an input file that cannot be read), before ``serve`` starts any process: a missing path, a
file that is not GGUF, a GGUF cut inside its header and one cut inside its tensor data.
Real child processes of the installed CLI."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pymooncake.engine.model.registry import smollm2_path

pytestmark = pytest.mark.integration


def _cases(tmp: Path) -> dict[str, tuple[Path, str]]:
    src = smollm2_path()
    out = {"missing": (tmp / "nope.gguf", "no such"),
           "not-gguf": (tmp / "notes.txt", "not a GGUF file")}
    out["not-gguf"][0].write_text("just text\n")
    if src is not None:
        data = src.read_bytes()
        for name, n, what in (("cut-header", 1_000_000, "header is truncated"),
                              ("cut-data", 60_000_000, "truncated: tensor")):
            p = tmp / f"{name}.gguf"
            p.write_bytes(data[:n])
            out[name] = (p, what)
    return out


@pytest.mark.parametrize("cmd", [["serve", "--port", "0"], ["generate", "--prompt", "hi"],
                                 ["prefill", "--id", "p0", "--conductor", "127.0.0.1:9"]])
def test_unloadable_model_is_one_line_and_exit_1(tmp_path, cmd, capsys):
    """The not-GGUF file runs the real entry point in a fresh Python; the others call
    ``main(argv)`` in this process (same exit code, stdout and stderr, no torch import each)."""
    from pymooncake.cli.main import main
    for name, (path, what) in _cases(tmp_path).items():
        argv = [*cmd, "--model", str(path)]
        if name == "not-gguf":
            r = subprocess.run([sys.executable, "-m", "pymooncake", *argv],
                               capture_output=True, text=True, timeout=120, check=False)
            rc, out, err = r.returncode, r.stdout, r.stderr
        else:
            capsys.readouterr()
            rc = main(argv)
            out, err = capsys.readouterr()
        assert rc == 1, (name, err)
        assert out == "", name
        assert err.count("\n") == 1 and what in err and str(path.name) in err, (name, err)
