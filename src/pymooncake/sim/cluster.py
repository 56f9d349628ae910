"""Modelled instances: prefill nodes with FIFO queues and decode nodes whose continuous batch
is advanced analytically between events (no event per decode token).

Decode analytics: with a constant batch of ``B`` requests and ``C0`` context tokens, step ``k``
takes ``t(k) = o + max(c·B, m0 + (C0 + k·B)·m) + a·(C0 + k·B)`` (the context grows by ``B``
per step; ``a`` is the non-overlapped attention term of a CPU calibration, 0 otherwise), so the
time of ``K`` steps has a closed form and the number of steps done by a time is a short
bisection. A node only has events when its batch changes (a join or a finish). Each constant
stretch is kept as a segment so a finished request's token times — and its TBT — are rebuilt
exactly afterwards.
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_right
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pymooncake.conductor.policy import DecodeEstimator
from pymooncake.sim.cache_model import LruBlockCache


@dataclass(slots=True)
class SimRequest:
    """Mutable record of one request's way through the simulated cluster (seconds, tokens)."""

    index: int
    arrival_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    request_id: str = ""
    prefill_node: str = ""
    decode_node: str = ""
    hit_tokens: int = 0
    remote_hit_tokens: int = 0
    prefill_start_s: float = math.nan
    first_token_s: float = math.nan
    kv_arrive_s: float = math.nan
    finish_s: float = math.nan
    prefill_gpu_s: float = 0.0
    transfer_bytes: int = 0
    rejected: str = ""
    tbt_s: float | None = None
    # decode bookkeeping
    join_step: int = 0
    finish_step: int = 0
    predicted_prefill_s: float = 0.0
    predicted_tbt_s: float = 0.0
    """The policy's TBT prediction at admission (0 when colocated)."""
    planned_transfer_source: str | None = None
    planned_prefix_blocks: int = 0
    cache_keys: tuple[int, ...] = ()
    """Blocks the node's cache takes (KV insert events) when this request's prefill ends."""


@dataclass(slots=True)
class PrefillNode:
    """A prefill instance: FIFO queue, one prefill at a time, its own LRU block cache."""

    name: str
    cache: LruBlockCache
    queue: deque = field(default_factory=deque)
    running: SimRequest | None = None
    predicted_busy_until_s: float = 0.0
    queued_predicted_s: float = 0.0
    busy_s: float = 0.0
    cpp: Any = None
    """``policy.CppCostModel`` of a CPP prefill group (None: one node)."""

    @property
    def num_in_flight(self) -> int:
        return len(self.queue) + (self.running is not None)


class DecodeNode:
    """Continuous batching, advanced analytically (see the module docstring)."""

    def __init__(self, name: str, est: DecodeEstimator, max_batch_size: int,
                 kv_capacity_tokens: int) -> None:
        self.name = name
        self.max_batch_size = max_batch_size
        self.kv_capacity_tokens = kv_capacity_tokens
        self.o = est.overhead_s
        self.c = est.per_sequence_s
        self.m0 = est.weight_s
        self.m = est.per_context_token_s
        self.a = est.attention_per_context_token_s
        self.epoch_s = 0.0
        self.step = 0
        self.B = 0
        self.C = 0
        self.kv_reserved = 0
        self.heap: list[tuple[int, int, SimRequest]] = []
        self.waiting: deque[SimRequest] = deque()
        self.version = 0
        self.num_incoming = 0
        self.incoming_ctx = 0
        # segments (parallel lists): first step, start time, K, c·B, m0 + C0·m, B·m, a·C0, a·B
        self.s_step0: list[int] = []
        self.s_t0: list[float] = []
        self.s_k: list[int] = []
        self.s_cb: list[float] = []
        self.s_a: list[float] = []
        self.s_slope: list[float] = []
        self.s_att: list[float] = []
        self.s_att_slope: list[float] = []
        self.s_ends: list[np.ndarray | None] = []
        """Token (step end) times of each segment, built on first use and shared by its batch."""
        self._view_cache: tuple[int, tuple[float, ...]] | None = None

    # --- closed forms -------------------------------------------------------------------
    def _time_of(self, k_steps: int) -> float:
        """Time of the next ``k_steps`` steps with the current batch."""
        if k_steps <= 0 or self.B == 0:
            return 0.0
        cb = self.c * self.B
        a = self.m0 + self.C * self.m
        slope = self.B * self.m
        # first k at which memory dominates compute
        if a >= cb:
            ks = 0
        else:
            ks = math.ceil((cb - a) / slope) if slope > 0 else k_steps
        ks = min(ks, k_steps)
        mem_steps = k_steps - ks
        mem = mem_steps * a + slope * (k_steps * (k_steps - 1) - ks * (ks - 1)) / 2
        att = self.a * (k_steps * self.C + self.B * k_steps * (k_steps - 1) / 2)
        return k_steps * self.o + ks * cb + mem + att

    def _steps_done_by(self, elapsed_s: float, k_max: int) -> int:
        """Largest ``K <= k_max`` with ``time_of(K) <= elapsed_s``."""
        lo, hi = 0, k_max
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._time_of(mid) <= elapsed_s:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def step_time_now(self) -> float:
        if self.B == 0:
            return 0.0
        return self.o + max(self.c * self.B, self.m0 + self.C * self.m) + self.a * self.C

    # --- state changes ------------------------------------------------------------------
    def _advance(self, k_steps: int, done: list[SimRequest]) -> None:
        """Run ``k_steps`` steps with the current batch; finished requests go to ``done``."""
        if k_steps <= 0 or self.B == 0:
            return
        self.s_step0.append(self.step)
        self.s_t0.append(self.epoch_s)
        self.s_k.append(k_steps)
        self.s_cb.append(self.c * self.B)
        self.s_a.append(self.m0 + self.C * self.m)
        self.s_slope.append(self.B * self.m)
        self.s_att.append(self.a * self.C)
        self.s_att_slope.append(self.a * self.B)
        self.s_ends.append(None)
        self.epoch_s += self._time_of(k_steps)
        self.step += k_steps
        self.C += k_steps * self.B
        while self.heap and self.heap[0][0] <= self.step:
            fs, _, r = heapq.heappop(self.heap)
            self.B -= 1
            ctx = r.input_length + 1 + (fs - r.join_step)
            self.C -= ctx
            self.kv_reserved -= r.input_length + r.output_length
            r.finish_s = self.epoch_s
            done.append(r)
        self._view_cache = None

    def sync_to(self, now_s: float, done: list[SimRequest]) -> None:
        """Bring the batch to the first step boundary at or after ``now_s``."""
        if self.B == 0:
            self.epoch_s = max(self.epoch_s, now_s)
            return
        if now_s <= self.epoch_s:
            return
        k_max = self.heap[0][0] - self.step
        k = self._steps_done_by(now_s - self.epoch_s, k_max)
        if k < k_max and self.epoch_s + self._time_of(k) < now_s:
            k += 1  # the step in progress completes first
        self._advance(k, done)

    def next_finish_s(self) -> float | None:
        """Time of the next finish with the current batch (``None`` when idle)."""
        if not self.heap:
            return None
        return self.epoch_s + self._time_of(self.heap[0][0] - self.step)

    def on_wake(self, done: list[SimRequest]) -> None:
        """The scheduled finish time was reached: run up to the next finish."""
        if self.heap:
            self._advance(self.heap[0][0] - self.step, done)

    def can_admit(self, r: SimRequest) -> bool:
        """Room in the batch and in HBM for the request's whole KV (prompt + output).

        An idle node always admits, so a request larger than the node's KV capacity runs
        alone instead of waiting forever.
        """
        if self.B == 0:
            return True
        return (self.max_batch_size > self.B
                and self.kv_reserved + r.input_length + r.output_length
                <= self.kv_capacity_tokens)

    def join(self, r: SimRequest) -> None:
        """Add ``r`` at the current boundary (call ``sync_to`` first)."""
        r.join_step = self.step
        r.finish_step = self.step + r.output_length - 1
        heapq.heappush(self.heap, (r.finish_step, r.index, r))
        self.B += 1
        self.C += r.input_length + 1
        self.kv_reserved += r.input_length + r.output_length
        self._view_cache = None

    def stall(self, duration_s: float) -> None:
        """The batch makes no progress for ``duration_s`` (a colocated prefill runs)."""
        self.epoch_s += duration_s

    def predicted_finish_s(self) -> tuple[float, ...]:
        """Sorted predicted finish times of the running requests (current step time)."""
        if self._view_cache is not None and self._view_cache[0] == self.step:
            return self._view_cache[1]
        st, step, ep = self.step_time_now(), self.step, self.epoch_s
        out = tuple(sorted(ep + (fs - step) * st for fs, _, _ in self.heap))
        self._view_cache = (self.step, out)
        return out

    # --- token times --------------------------------------------------------------------
    def token_intervals(self, r: SimRequest) -> np.ndarray:
        """Intervals (s) between ``r``'s consecutive tokens: first token (prefill end) → the
        end of its first decode step → ... → its last decode step."""
        s_lo, s_hi = r.join_step, r.finish_step
        i = bisect_right(self.s_step0, s_lo) - 1
        pieces: list[np.ndarray] = [np.array([r.first_token_s])]
        step0s, ks, ends = self.s_step0, self.s_k, self.s_ends
        n = len(step0s)
        while i < n and step0s[i] < s_hi:
            st0 = step0s[i]
            e = ends[i]
            if e is None:
                j = np.arange(ks[i], dtype=np.float64)
                e = self.s_t0[i] + np.cumsum(
                    self.o + np.maximum(self.s_cb[i], self.s_a[i] + j * self.s_slope[i])
                    + self.s_att[i] + j * self.s_att_slope[i])
                ends[i] = e
            pieces.append(e[max(s_lo, st0) - st0:min(s_hi, st0 + ks[i]) - st0])
            i += 1
        return np.diff(np.concatenate(pieces))
