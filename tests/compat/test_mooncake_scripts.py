"""Mooncake's own public test scripts, unchanged, through the alias (mooncake_scripts.py).
Runs when ``PYMOONCAKE_MOONCAKE_REPO`` names a Mooncake git checkout or git dir (the
scripts are read from it at run time); docs/compat.md has the command and the counts."""

from __future__ import annotations

import os

import pytest

from tests.compat import mooncake_scripts as ms


def test_summary_parser() -> None:
    assert ms.parse("...\nRan 41 tests in 1.3s\n\nOK (skipped=15)\n") == (41, 0, 0, 15)
    assert ms.parse("Ran 3 tests in 1s\n\nFAILED (failures=1, errors=1)\n") == (3, 1, 1, 0)
    assert ms.parse("== 15 passed, 1 failed, 2 skipped in 5.6s ==") == (18, 1, 0, 2)
    assert ms.parse("no summary") == (0, 0, 0, 0)


@pytest.mark.integration
@pytest.mark.slow
def test_mooncake_scripts_pass(tmp_path) -> None:
    repo = os.environ.get("PYMOONCAKE_MOONCAKE_REPO")
    if not repo:
        pytest.skip("set PYMOONCAKE_MOONCAKE_REPO to a Mooncake git checkout (or git dir)")
    for port in (ms.MASTER_PORT, ms.REAL_CLIENT_PORT):
        if ms._port_busy(port):
            pytest.skip(f"port {port} is busy (Mooncake's scripts hard-code it)")
    assert ms.main(["--repo", repo, "--logs", str(tmp_path)]) == 0
