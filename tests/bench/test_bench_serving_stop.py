"""``bench serving`` stopped by SIGTERM takes its replay client with it, as it takes the
cluster's processes (``cli.cluster.PARENT_ENV``): a newcomer who killed a running bench
found the ``pymooncake replay`` child still running a minute later, adopted by init.
Real processes: the bench, a one-worker colocated cluster and the replay."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("torch")


def _descendants(pid: int) -> dict[int, str]:
    """Live descendants of ``pid``: pid → command line (Linux ``/proc``)."""
    parents: dict[int, int] = {}
    cmds: dict[int, str] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat", "rb") as f:
                stat = f.read()
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        parents[int(d)] = int(stat.rsplit(b")", 1)[1].split()[1])
        cmds[int(d)] = cmd
    out, frontier = {}, [pid]
    while frontier:
        p = frontier.pop()
        for c, pp in parents.items():
            if pp == p and c not in out:
                out[c] = cmds[c]
                frontier.append(c)
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False


def test_sigterm_to_bench_serving_stops_the_replay_client_too():
    bench = subprocess.Popen(
        [sys.executable, "-m", "pymooncake", "bench", "serving", "--configs",
         "colocated-cache", "--prefill", "1", "--decode", "0", "--limit", "300", "--json"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    replay = None
    try:
        deadline = time.monotonic() + 120
        while replay is None and time.monotonic() < deadline:
            assert bench.poll() is None, "bench serving exited before its replay started"
            replay = next((p for p, cmd in _descendants(bench.pid).items()
                           if " replay " in f" {cmd} " and "--url" in cmd), None)
            time.sleep(0.2)
        assert replay is not None, "no replay child within 120 s"
        time.sleep(3)   # the replay is sending requests (stopped at once, it may not linger)
        children = list(_descendants(bench.pid))
        assert replay in children
        bench.send_signal(signal.SIGTERM)
        bench.wait(30)
        deadline = time.monotonic() + 15
        while any(_alive(p) for p in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [p for p in children if _alive(p)]
        assert not left, f"still running after the bench was stopped: {left}"
    finally:
        if bench.poll() is None:
            bench.kill()
        for p in _descendants(bench.pid) if bench.poll() is None else []:
            os.kill(p, signal.SIGKILL)
        if replay is not None and _alive(replay):
            os.kill(replay, signal.SIGKILL)
