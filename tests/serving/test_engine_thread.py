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


def test_posts_and_engine_results_reach_the_loop_in_order_with_one_wake_up() -> None:
    """``post`` from the engine thread: callbacks queued before the loop runs go in one
    ``call_soon_threadsafe`` (one self-pipe write), and an ``on_engine`` result keeps its
    place among the posts around it (a token post never overtakes the answer to the
    command that registered its stream); a failing callback does not stop the others."""
    w = _Probe()
    order: list[str] = []

    async def main() -> None:
        loop = w.loop = asyncio.get_running_loop()
        wakes = 0
        real = loop.call_soon_threadsafe

        def counting(*a, **k):  # noqa: ANN002, ANN003, ANN202
            nonlocal wakes
            wakes += 1
            return real(*a, **k)

        loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
        fut = w.on_engine(lambda: order.append("cmd") or 42)
        # what _engine_main does, here on the loop's own thread so that the loop cannot
        # drain between the posts (post is thread-safe; call_soon_threadsafe works here)
        w.post(lambda: order.append(f"before {fut.done()}"))
        w._cmds.get_nowait()()
        w.post(lambda: 1 / 0)
        w.post(lambda: order.append(f"after {fut.done()}"))
        assert await fut == 42
        assert wakes == 1
        w.post(lambda: order.append("later"))   # the queue was drained: a new wake-up
        await asyncio.sleep(0.01)
        assert wakes == 2

    asyncio.run(main())
    assert order == ["cmd", "before False", "after True", "later"]
