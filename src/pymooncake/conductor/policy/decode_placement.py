"""Decode placement: the least-loaded decode instance whose predicted TBT and KV capacity admit
the request, judged at the moment its prefill will finish (FAST'25 §4, DESIGN.md §7)."""

from __future__ import annotations

import math
from bisect import bisect_right
from dataclasses import replace

from pymooncake.conductor.policy.estimators import Estimators
from pymooncake.conductor.policy.types import (
    ClusterView,
    DecodeInstanceState,
    Placement,
    PolicyConfig,
    Rejection,
    RequestInfo,
)


def predicted_decode_load(inst: DecodeInstanceState, at_s: float,
                          req: RequestInfo) -> tuple[int, int]:
    """``(batch size, context tokens)`` of ``inst`` at ``at_s`` with ``req`` added.

    Running requests predicted to finish by ``at_s`` have left (their share of the context
    goes with them, pro rata); requests already placed on it (incoming) have joined.
    """
    leaving = bisect_right(inst.finish_s, at_s) if inst.finish_s else 0
    remaining = max(inst.num_running - leaving, 0)
    ctx = (inst.num_context_tokens * remaining // inst.num_running) if inst.num_running else 0
    batch = remaining + inst.num_incoming + 1
    ctx += inst.incoming_context_tokens + req.num_prompt_tokens
    return batch, ctx


def predicted_tbt_s(inst: DecodeInstanceState, req: RequestInfo, est: Estimators) -> float:
    """Conservative TBT of ``req`` on ``inst``, as the paper measures it: the mean of the
    longest ``ceil(k/10)`` of its ``k`` token intervals (``obs.slo.tbt_s``).

    Judged over the request's whole decode, not at the moment it joins:

    * batch: every request running now or incoming stays, plus ``req`` — under load a
      request that finishes is replaced by one admitted later, so the batch does not shrink;
    * context: that batch's context at join time grows by one token per request per step for
      ``max_output_tokens`` steps (``+ batch · max_output_tokens``);
    * the first interval (first token → first decode step) waits for the step in progress
      and then runs its own: up to two steps. It is one of the longest ``ceil(k/10)``, so
      ``tbt = step · (top + 1) / top``.

    Returns seconds; 0.0 for ``max_output_tokens <= 1`` (no token intervals, no TBT).
    """
    if req.max_output_tokens <= 1:
        return 0.0
    batch = inst.num_running + inst.num_incoming + 1
    ctx = (inst.num_context_tokens + inst.incoming_context_tokens + req.num_prompt_tokens
           + batch * req.max_output_tokens)
    step = est.decode.step_s(batch, ctx)
    top = math.ceil((req.max_output_tokens - 1) / 10)
    return step * (top + 1) / top


def place_decode(req: RequestInfo, view: ClusterView, placement: Placement, est: Estimators,
                 cfg: PolicyConfig) -> Placement | Rejection:
    """Choose the decode instance for ``placement`` (a prefill placement).

    Candidates are judged at ``now + predicted TTFT``: admissible when the batch fits
    ``max_batch_size``, context + ``max_output_tokens`` fits ``kv_capacity_tokens`` and the
    conservative ``predicted_tbt_s`` (whole decode, longest-10 % intervals) is within
    ``tbt_slo_s``. The smallest predicted batch wins (ties: smaller TBT, then the earliest
    instance). When none is admissible, with early rejection on: ``Rejection("decode_full")``
    when no instance has the batch slot and KV capacity, else ``Rejection("tbt_slo")``;
    with it off, the least-loaded instance regardless.
    """
    if not view.decode:
        return Rejection(reason="no_instance", retry_after_s=1.0)
    at = view.now_s + placement.predicted_ttft_s
    best_key: tuple[int, float, int] | None = None
    any_key: tuple[int, float, int] | None = None
    room = False
    for j, inst in enumerate(view.decode):
        batch, ctx = predicted_decode_load(inst, at, req)
        tbt = predicted_tbt_s(inst, req, est)
        key = (batch, tbt, j)
        if any_key is None or key < any_key:
            any_key = key
        fits = (batch <= inst.max_batch_size
                and ctx + req.max_output_tokens <= inst.kv_capacity_tokens)
        room = room or fits
        if fits and tbt <= cfg.tbt_slo_s and (best_key is None or key < best_key):
            best_key = key
    if best_key is None:
        assert any_key is not None
        if cfg.early_rejection:
            return Rejection(reason="tbt_slo" if room else "decode_full",
                             retry_after_s=max(1.0, placement.predicted_ttft_s),
                             predicted_ttft_s=placement.predicted_ttft_s,
                             predicted_tbt_s=any_key[1])
        best_key = any_key
    return replace(placement, decode_instance=view.decode[best_key[2]].instance_id,
                   predicted_tbt_s=best_key[1])
