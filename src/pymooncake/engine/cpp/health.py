"""``StageWatch``: a CPP group's health watch (issue 19; docs/cpp.md "When a stage fails").

A thread checks every ``interval_s`` that each stage process of a ``CppGroup`` is alive
(``Popen.poll``) and answers a ``cpp.ping`` within ``deadline_s`` (its own client per stage,
so a ping never waits behind a prefill's call). A stage that exited fails at once; one that
misses ``misses`` pings in a row counts as stalled (one late answer on a loaded machine is
not a failure). The group is *healthy* when no stage fails; otherwise ``reason`` names the
first failing stage (index, address, pid, what failed). A stage that exited stays failed
(it is not restarted); a stalled stage (e.g. SIGSTOP) is healthy again once it answers.
The CPP instance reads ``healthy`` before it sends a prompt down the pipeline and while one
is there, and reports ``state()`` to the Conductor with its load
(``WorkerLoad.cpp_state_json``).
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

from pymooncake.rpc import SyncRpcClient
from pymooncake.rpc.errors import RpcError


class StageWatch:
    """Health of ``group``'s stages (module docstring). ``interval_s`` and ``deadline_s``
    are seconds (> 0)."""

    def __init__(self, group: Any, interval_s: float = 1.0, deadline_s: float = 2.0,
                 misses: int = 2) -> None:
        if interval_s <= 0 or deadline_s <= 0 or misses < 1:
            raise ValueError(f"interval_s and deadline_s must be > 0 and misses >= 1, got "
                             f"{interval_s}, {deadline_s}, {misses}")
        self.group, self.interval_s, self.deadline_s = group, interval_s, deadline_s
        self.misses = misses
        self._missed = [0] * len(group.ports)
        self._pings = [SyncRpcClient("127.0.0.1", p, timeout_s=deadline_s)
                       for p in group.ports]
        self._failures: list[str | None] = [None] * len(self._pings)
        self._dead: set[int] = set()
        self.checked_at = 0.0
        """``time.time`` of the last completed check (0: none yet)."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="cpp-watch", daemon=True)

    def start(self) -> StageWatch:
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        for c in self._pings:
            with contextlib.suppress(Exception):
                c.close()

    @property
    def healthy(self) -> bool:
        return not any(self._failures)

    @property
    def reason(self) -> str:
        """The first failing stage's description; empty while healthy."""
        return next((f for f in self._failures if f), "")

    def state(self) -> dict[str, Any]:
        """``{"healthy", "reason", "checked_at", "stages": [{"index", "address", "pid",
        "ok"}]}`` (``/health`` of the Conductor shows it under the instance's ``cpp``)."""
        g = self.group
        return {"healthy": self.healthy, "reason": self.reason, "checked_at": self.checked_at,
                "stages": [{"index": i, "address": f"127.0.0.1:{g.ports[i]}",
                            "pid": g.procs[i].pid if i < len(g.procs) else None,
                            "ok": self._failures[i] is None}
                           for i in range(len(self._pings))]}

    def check(self) -> None:
        """One check of every stage (the thread calls it every ``interval_s``)."""
        for i, client in enumerate(self._pings):
            self._failures[i] = self._check_one(i, client)
        self.checked_at = time.time()

    def _check_one(self, i: int, client: SyncRpcClient) -> str | None:
        label = self.group.stage_label(i)
        procs = self.group.procs
        if i in self._dead:
            return self._failures[i]
        code = procs[i].poll() if i < len(procs) else None
        if code is not None:
            self._dead.add(i)
            return f"CPP {label} exited (status {code})"
        try:
            client.call("cpp.ping", timeout_s=self.deadline_s)
        except RpcError as e:
            self._missed[i] += 1
            if self._missed[i] < self.misses:
                return self._failures[i]
            return (f"CPP {label} did not answer {self._missed[i]} pings in a row "
                    f"({self.deadline_s:g} s each): {e.message}")
        self._missed[i] = 0
        return None

    def _loop(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(Exception):   # a check never kills the watch
                self.check()
            self._stop.wait(self.interval_s)
