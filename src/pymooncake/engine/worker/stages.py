"""Per-request stage windows measured on a worker, for the Conductor's spans and histograms.

A window is ``(stage, start_unix_s, end_unix_s)`` on this host's wall clock
(``time.time()``), so windows from the prefill and the decode worker of one request line up
on one timeline and their overlap is visible (issue #6 item 7; Mooncake FAST'25 §3.1
overlaps layer ``i``'s P→D write with layer ``i+1``'s compute). Stages a worker reports:

prefill worker  ``queue`` (task received → first step with it), ``store_lookup`` (Store
                metadata and replica plan of its reusable blocks), ``store_load`` (first
                to last Store read of those blocks, layer group by layer group, on the
                loader's fetch thread: it overlaps ``prefill``), ``cache_load`` (first to
                last layer import of those blocks into the paged cache), ``prefill``
                (first step start → last layer of its last step), ``p2d_transfer`` (first
                layer-wise WRITE submitted → last one completed)
decode worker   ``decode_queue`` (KV-ready notice → first step with it), ``decode_load``
                (arrived KV imported into the paged cache), ``decode`` (first step →
                finish)
colocated       ``queue``, ``generate`` (first step → finish) and ``prefill`` (first step
                that computes its prompt → last layer of the last one: decode steps of
                other requests mixed in included, which is the prefill time the Conductor
                has to predict there)

``StageClock`` is a layer hook (``engine.hooks``) plus explicit ``mark`` calls from the
worker; it is thread-safe (the RPC loop marks arrivals, the engine thread the rest).
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

from pymooncake.engine.hooks import NullHooks, StepContext

if TYPE_CHECKING:
    from pymooncake.engine.kv.kv_tensors import KVTensors

Window = tuple[str, float, float]


class StageClock(NullHooks):
    """Windows per request (see module docstring). ``compute_stage`` names the window the
    engine steps of a request extend (``prefill`` or ``decode``); ``queue_stage`` the window
    from ``arrive`` to its first step."""

    def __init__(self, compute_stage: str, queue_stage: str,
                 prompt_stage: str | None = None) -> None:
        self.compute_stage = compute_stage
        self.queue_stage = queue_stage
        self.prompt_stage = prompt_stage
        """Also the window of the steps that compute the request's prompt (more than one new
        token), when set (the colocated worker's ``prefill``)."""
        self._lock = threading.Lock()
        self._arrived: dict[str, float] = {}
        self._windows: dict[str, dict[str, list[float]]] = {}
        self._step_t0 = 0.0
        self._num_layers = 0

    # -- explicit marks ---------------------------------------------------------------------
    def arrive(self, request_id: str, now_s: float | None = None) -> None:
        """The request reached this worker (its queue window starts)."""
        with self._lock:
            self._arrived[request_id] = time.time() if now_s is None else now_s

    def mark(self, request_id: str, stage: str, start_s: float, end_s: float) -> None:
        """Extend ``stage``'s window of the request to cover ``[start_s, end_s]``."""
        with self._lock:
            self._extend(request_id, stage, start_s, end_s)

    def _extend(self, rid: str, stage: str, start_s: float, end_s: float) -> None:
        per = self._windows.setdefault(rid, {})
        w = per.get(stage)
        if w is None:
            per[stage] = [start_s, end_s]
        else:
            w[0] = min(w[0], start_s)
            w[1] = max(w[1], end_s)

    def pop(self, request_id: str) -> tuple[Window, ...]:
        """The request's windows (ordered by start) and forget it."""
        with self._lock:
            arrived = self._arrived.pop(request_id, None)
            per = self._windows.pop(request_id, {})
        out = [(k, w[0], w[1]) for k, w in per.items()]
        comp = per.get(self.compute_stage)
        if arrived is not None and comp is not None:
            out.append((self.queue_stage, arrived, max(arrived, comp[0])))
        return tuple(sorted(out, key=lambda w: (w[1], w[2])))

    def forget(self, request_id: str) -> None:
        with self._lock:
            self._arrived.pop(request_id, None)
            self._windows.pop(request_id, None)

    # -- layer hooks (engine thread) ----------------------------------------------------------
    def start_step(self, ctx: StepContext, kv: KVTensors) -> None:
        self._step_t0 = time.time()
        self._num_layers = kv.num_layers

    def after_layer(self, layer: int, ctx: StepContext, kv: KVTensors) -> None:
        if layer != self._num_layers - 1:
            return
        t1 = time.time()
        with self._lock:
            for s in ctx.seqs:
                self._extend(s.request_id, self.compute_stage, self._step_t0, t1)
                if self.prompt_stage is not None and s.num_new_tokens > 1:
                    self._extend(s.request_id, self.prompt_stage, self._step_t0, t1)
