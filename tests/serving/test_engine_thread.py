"""The worker builds its engine on the thread that then runs it (``EngineWorker.
_engine_thread``): one OpenMP pool per process (see its docstring for the measurement)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from pymooncake.engine.worker.base import EngineWorker, WorkerConfig


class _Probe(EngineWorker):
    def __init__(self, fail: bool = False) -> None:
        super().__init__(WorkerConfig(instance_id="w", role="colocated",
                                      conductor="127.0.0.1:1", model="tiny"))
        self.seen: list[tuple[str, int]] = []
        self.fail = fail

    def start_resources(self) -> None:
        self.seen.append(("build", threading.get_ident()))
        if self.fail:
            raise RuntimeError("no model here")

    def _engine_main(self) -> None:
        self.seen.append(("run", threading.get_ident()))


def _drive(w: _Probe) -> None:
    async def main() -> None:
        w.loop = asyncio.get_running_loop()
        started = w.loop.create_future()
        go = threading.Event()
        t = threading.Thread(target=w._engine_thread, args=(started, go))
        t.start()
        try:
            await started
        finally:
            go.set()
            await asyncio.to_thread(t.join, 10)
    asyncio.run(main())


def test_engine_is_built_and_run_on_the_same_thread_not_the_event_loops() -> None:
    w = _Probe()
    _drive(w)
    assert [s for s, _ in w.seen] == ["build", "run"]
    assert w.seen[0][1] == w.seen[1][1] != threading.get_ident()


def test_a_failed_build_reaches_serve_and_the_engine_never_runs() -> None:
    w = _Probe(fail=True)
    with pytest.raises(RuntimeError, match="no model here"):
        _drive(w)
    assert [s for s, _ in w.seen] == ["build"]
