"""The import layering of DESIGN.md §2 holds (checked by ../shared/tools/check_layers.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHECKER = ROOT.parent / "shared" / "tools" / "check_layers.py"


@pytest.mark.skipif(not CHECKER.exists(), reason=f"{CHECKER} not present beside this checkout")
def test_imports_respect_layers() -> None:
    out = subprocess.run(
        [sys.executable, str(CHECKER), str(ROOT / "src" / "pymooncake")],
        capture_output=True, text=True, check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
