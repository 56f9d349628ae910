"""Discrete-event core of the simulator: a heap-ordered virtual clock.

Events at equal times run in the order they were scheduled (a sequence number breaks ties),
so a run is a deterministic function of its inputs and seed.
"""

from __future__ import annotations

import heapq
from typing import Any

# Event kinds, in the request's order of travel (DESIGN.md §1).
ARRIVAL = 0
PREFILL_DONE = 1
KV_ARRIVE = 2
DECODE_WAKE = 3
SAMPLE = 4
ENGINE_STEP = 5
"""A step of a node stepped like the engine (``sim.engine_node``) ends (or it wakes up)."""

EVENT_NAMES = {ARRIVAL: "arrival", PREFILL_DONE: "prefill_done", KV_ARRIVE: "kv_arrive",
               DECODE_WAKE: "decode_wake", SAMPLE: "sample", ENGINE_STEP: "engine_step"}


class EventQueue:
    """Min-heap of ``(time_s, seq, kind, payload)``; ``now_s`` is the time of the last pop."""

    __slots__ = ("_heap", "_seq", "now_s", "num_popped")

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, int, Any]] = []
        self._seq = 0
        self.now_s = 0.0
        self.num_popped = 0

    def push(self, time_s: float, kind: int, payload: Any = None) -> None:
        """Schedule ``kind`` at ``time_s``; raises ``ValueError`` for a time in the past."""
        if time_s < self.now_s:
            raise ValueError(f"event {EVENT_NAMES.get(kind, kind)} at {time_s} s is before "
                             f"now ({self.now_s} s)")
        self._seq += 1
        heapq.heappush(self._heap, (time_s, self._seq, kind, payload))

    def pop(self) -> tuple[float, int, Any]:
        """Pop the earliest event, advance ``now_s`` to it, return ``(time, kind, payload)``."""
        t, _, kind, payload = heapq.heappop(self._heap)
        self.now_s = t
        self.num_popped += 1
        return t, kind, payload

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)
