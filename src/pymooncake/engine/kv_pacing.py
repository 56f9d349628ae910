"""Pacing of the Store fetch thread while the engine steps a batch that does not wait for it.

The fetch thread's work (the plan RPC, transfer requests, checksum bookkeeping, copies) is
Python under the same GIL as the engine thread: every slice of it that runs while a decode
step computes makes that step longer (issue 16: "a running decode batch's TBT does not
grow while another request's KV is loaded from the Store"). With a share below 1, while
decoding steps that load nothing keep coming, the fetch thread works in small slices
(``StoreFetcher.slice_blocks`` blocks) and after each one sleeps: a slice that took ``c`` CPU
seconds is followed by ``c * (1 - share) / share`` seconds of sleep, so the load takes at
most ``share`` of the core and a step overlaps at most one small slice. A step that
includes a load (its request waits in ``before_layer``), an engine with nothing to step
but loads (``wait_progress``) or a synchronous load turns pacing off at once (the sleep is
cut short): nobody is left to protect, and the load is what the engine waits for. Steps
of prefills only do not pace it either: their time is TTFT, which a slower load costs too.
"""

from __future__ import annotations

import threading
import time

LOAD_SHARE = 0.1
"""Default share of a core the fetch thread may use while a batch that decodes steps without
it. Measured on a quiet 2-core machine (docs/benchmarks.md, issue 16, `TBT_ROUNDS=8
STORE_LOAD_SHARE=<s> pytest -s tests/store/test_kv_loader_async.py -k tbt`): best-of-8
p99 TBT with / without concurrent loads 1.10-1.20x at 0.1 (5 runs), 1.13-1.22x at 0.25,
1.30-1.48x unpaced (1.0); the price is the joining request's load time (here 135 against
104 ms, a 100 ms plan delay included). ``StoreKVLoader``'s ``load_share`` sets it; 1 turns
pacing off."""
PACE_HOLD_S = 0.05
"""Pacing stays on this long after the last step that loaded nothing started (s): the
engine steps back to back, and the gaps between steps belong to the batch too."""


class LoadPacer:
    """Shared by the engine thread (``batch_step``, ``engine_waits``) and the fetch thread
    (``after_slice``). ``share`` in ``(0, 1]``; ``1`` turns pacing off. Raises
    ``ValueError`` for a share outside it."""

    def __init__(self, share: float = LOAD_SHARE, hold_s: float = PACE_HOLD_S) -> None:
        if not 0 < share <= 1:
            raise ValueError(f"load share {share!r}: must be in (0, 1]")
        self.share = share
        self.hold_s = hold_s
        self._until = 0.0
        self._free = threading.Event()
        self._free.set()
        self.paced_s = 0.0
        """Seconds the fetch thread slept for pacing (all loads)."""

    def batch_step(self) -> None:
        """Engine thread: a step that decodes and waits for no load starts (a step of
        prefills only is not paced for: its time is TTFT, which a slower load costs too)."""
        if self.share < 1:
            self._until = time.monotonic() + self.hold_s
            if self._free.is_set():
                self._free.clear()

    def engine_waits(self) -> None:
        """Engine thread: it waits for a load (or steps one): no pacing from now on."""
        self._until = 0.0
        self._free.set()

    def active(self) -> bool:
        """Whether a decoding batch is being paced for now (fetch thread: read in slices)."""
        return self.share < 1 and time.monotonic() < self._until

    def after_slice(self, cpu_s: float) -> None:
        """Fetch thread, after a slice of work that took ``cpu_s`` CPU seconds: sleep its
        share while a batch steps (cut short when the engine starts waiting for a load)."""
        if self.share >= 1 or cpu_s <= 0 or time.monotonic() >= self._until:
            return
        t0 = time.monotonic()
        self._free.wait(cpu_s * (1 - self.share) / self.share)
        self.paced_s += time.monotonic() - t0
