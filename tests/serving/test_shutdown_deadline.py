"""A role's shutdown after SIGTERM is bounded (``cli.role_common.run_until_signal``): a
process whose shutdown is stuck in a wait exits with status 1 once the grace period is over
and names where it was stuck (every thread's stack on stderr), instead of outliving the
parent that waits for it; a prompt shutdown exits 0 and prints no stack."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.timeout(60)

SCRIPT = """
import asyncio, sys, time
from pymooncake.cli.role_common import run_until_signal

async def serve():
    try:
        print("ready", flush=True)
        await asyncio.sleep(600)
    finally:
        if sys.argv[1] == "stuck":
            stuck_in_shutdown()

def stuck_in_shutdown():
    time.sleep(60)

sys.exit(run_until_signal(serve, grace_s=1.0))
"""


def _run(mode: str) -> tuple[int, float, str]:
    p = subprocess.Popen([sys.executable, "-c", SCRIPT, mode], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        t0 = time.monotonic()
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=30)
        return p.returncode, time.monotonic() - t0, err
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_stuck_shutdown_exits_after_the_grace_period_naming_the_wait() -> None:
    rc, took, err = _run("stuck")
    assert rc == 1
    assert 1.0 <= took < 10.0, took
    assert "stuck_in_shutdown" in err, err[-2000:]


def test_prompt_shutdown_exits_zero_without_a_stack() -> None:
    rc, took, err = _run("prompt")
    assert rc == 0, err
    assert took < 5.0
    assert "Thread" not in err and "stuck_in_shutdown" not in err, err
