"""A role's shutdown after SIGTERM is bounded (``cli.role_common.run_until_signal``): a
process whose shutdown is stuck in a wait exits with status 1 once the grace period is over
and names where it was stuck (every thread's stack on stderr), instead of outliving the
parent that waits for it; a prompt shutdown exits 0 and prints no stack; a second signal
(Ctrl-C on ``serve``, then its SIGTERM) does not cut the shutdown under way."""

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
        if sys.argv[1] == "slow":
            await asyncio.sleep(0.6)      # an awaited cleanup a second signal must not cut
            print("cleaned up", flush=True)

def stuck_in_shutdown():
    time.sleep(60)

sys.exit(run_until_signal(serve, grace_s=3.0 if sys.argv[1] == "slow" else 1.0))
"""


def _run(mode: str, signals: int = 1) -> tuple[int, float, str, str]:
    p = subprocess.Popen([sys.executable, "-c", SCRIPT, mode], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        t0 = time.monotonic()
        for i in range(signals):
            if i:
                time.sleep(0.2)
            p.send_signal(signal.SIGTERM if i % 2 == 0 else signal.SIGINT)
        out, err = p.communicate(timeout=30)
        return p.returncode, time.monotonic() - t0, out, err
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_stuck_shutdown_exits_after_the_grace_period_naming_the_wait() -> None:
    rc, took, _, err = _run("stuck")
    assert rc == 1
    assert 1.0 <= took < 10.0, took
    assert "stuck_in_shutdown" in err, err[-2000:]


def test_prompt_shutdown_exits_zero_without_a_stack() -> None:
    rc, took, _, err = _run("prompt")
    assert rc == 0, err
    assert took < 5.0
    assert "Thread" not in err and "stuck_in_shutdown" not in err, err


def test_a_second_signal_neither_cuts_the_shutdown_nor_moves_the_deadline() -> None:
    rc, took, out, err = _run("slow", signals=2)
    assert rc == 0, err
    assert "cleaned up" in out
    assert 0.6 <= took < 3.0, took


def test_stop_runs_once_and_first_even_where_the_deadline_cannot_be_armed(monkeypatch) -> None:
    """In-process: a stderr with no file behind it (``faulthandler`` refuses it) still
    stops the process; later signals do nothing."""
    import faulthandler
    import io

    from pymooncake.cli.role_common import on_first_signal
    calls: list[int] = []
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    handler = on_first_signal(lambda: calls.append(1), grace_s=30.0)
    try:
        handler()
        handler()
    finally:
        faulthandler.cancel_dump_traceback_later()
    assert calls == [1]
