"""A prefill worker's Store put thread (``engine.worker.store_puts.StorePuts``) waits while
the engine computes without polling (issue 16: a 5 ms poll woke it 200 times a second),
goes as soon as the engine thread says it is idle, still goes after ``defer_max_s`` of a
busy engine, batches what queued meanwhile, and writes what is queued on ``close``."""

from __future__ import annotations

import threading
import time

from pymooncake.engine.worker.store_puts import StorePuts


class FakeLoader:
    """``put_blocks`` records each batch (keys, values, when) and signals ``done``."""

    def __init__(self) -> None:
        self.batches: list[tuple[list[str], list[object], float]] = []
        self.discarded: list[object] = []
        self.done = threading.Event()

    def put_blocks(self, keys: list[str], data: list[object]) -> list[str]:
        self.batches.append((list(keys), list(data), time.monotonic()))
        self.done.set()
        return list(keys)

    def discard_staged(self, values: list[object]) -> None:
        self.discarded.extend(values)


class Engine:
    """``busy()`` as the worker passes it; counts how often the put thread asks."""

    def __init__(self, busy: bool) -> None:
        self.is_busy = busy
        self.asked = 0

    def busy(self) -> bool:
        self.asked += 1
        return self.is_busy


def make(engine: Engine, defer_max_s: float) -> tuple[StorePuts, FakeLoader, list[str]]:
    loader = FakeLoader()
    reported: list[str] = []
    puts = StorePuts(loader, engine.busy, lambda: False, reported.extend, "test-put",
                     defer_max_s=defer_max_s)
    return puts, loader, reported


def test_put_waits_for_idle_without_polling_then_goes_with_what_queued() -> None:
    eng = Engine(busy=True)
    puts, loader, reported = make(eng, defer_max_s=60.0)
    try:
        puts.put(["a", "b"], [1, 2])
        puts.put(["b", "c"], [3, 4])              # "b" again: its staged value goes back
        assert not loader.done.wait(0.3)          # the engine computes: nothing put
        assert eng.asked <= 2                     # asked once, then asleep (no 5 ms poll)
        eng.is_busy = False
        t0 = time.monotonic()
        puts.idle()                               # what the engine thread calls
        assert loader.done.wait(10.0)
        assert time.monotonic() - t0 < 10.0       # woken by idle, not by defer_max_s
        assert [b[:2] for b in loader.batches] == [(["a", "b", "c"], [1, 2, 4])]
        assert loader.discarded == [3]
        assert reported == ["a", "b", "c"]
    finally:
        puts.close()


def test_put_goes_when_the_engine_is_idle_already() -> None:
    eng = Engine(busy=False)
    puts, loader, reported = make(eng, defer_max_s=60.0)
    try:
        puts.put(["x"], [7])
        assert loader.done.wait(10.0)
        assert loader.batches[0][:2] == (["x"], [7]) and reported == ["x"]
    finally:
        puts.close()


def test_put_goes_after_defer_max_while_the_engine_stays_busy() -> None:
    eng = Engine(busy=True)
    puts, loader, _ = make(eng, defer_max_s=0.2)
    try:
        t0 = time.monotonic()
        puts.put(["k"], [1])
        assert loader.done.wait(10.0)
        assert loader.batches[0][2] - t0 >= 0.2 - 0.01
        assert eng.asked <= 2
    finally:
        puts.close()


def test_close_writes_a_deferred_put_at_once() -> None:
    eng = Engine(busy=True)
    puts, loader, reported = make(eng, defer_max_s=60.0)
    puts.put(["k1", "k2"], [1, 2])
    t0 = time.monotonic()
    puts.close(timeout_s=10.0)
    assert time.monotonic() - t0 < 10.0
    assert loader.batches[0][:2] == (["k1", "k2"], [1, 2]) and reported == ["k1", "k2"]
