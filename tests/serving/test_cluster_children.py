"""A ``LocalCluster``'s children die with the process that started them (SIGKILL of the
parent: no orphan keeps its ports), set up by each child after exec (``die_with_parent``)
rather than in a ``preexec_fn``, which aborted children of a process running gRPC threads."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from pymooncake.cli.cluster import PARENT_ENV, die_with_parent

SCRIPT = """
import json, sys, time
from pymooncake.cli.cluster import ClusterSpec, LocalCluster
c = LocalCluster(ClusterSpec(port=0, quiet=True, colocated=True, num_prefill=1, num_decode=0))
c.start()
print(json.dumps({n: p.pid for n, p in c.procs.items()}), flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_children_exit_when_the_cluster_process_is_killed() -> None:
    parent = subprocess.Popen([sys.executable, "-c", SCRIPT], stdout=subprocess.PIPE,
                              text=True, start_new_session=True)
    try:
        line = parent.stdout.readline()
        pids = json.loads(line)
        assert set(pids) == {"master", "conductor", "colocated-0"}, pids
        assert all(_alive(p) for p in pids.values())
        parent.kill()
        parent.wait(10)
        deadline = time.monotonic() + 15.0
        while time.monotonic() < deadline and any(_alive(p) for p in pids.values()):
            time.sleep(0.1)
        assert not [n for n, p in pids.items() if _alive(p)], "orphans left running"
    finally:
        if parent.poll() is None:
            parent.kill()
        for p in (pids.values() if "pids" in locals() else ()):
            if _alive(p):
                os.kill(p, signal.SIGKILL)


def test_a_child_whose_parent_is_already_gone_exits(monkeypatch) -> None:
    monkeypatch.setenv(PARENT_ENV, str(os.getppid() + 1 if os.getppid() > 1 else 2))
    with pytest.raises(SystemExit):
        die_with_parent()
    assert PARENT_ENV not in os.environ      # not passed on to its own children
    monkeypatch.setenv(PARENT_ENV, str(os.getppid()))
    die_with_parent()                        # the real parent: keeps running
