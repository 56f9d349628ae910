"""Admission and early rejection (Mooncake FAST'25 §6; CASES.md BUG-51).

``schedule`` is the Conductor's whole decision for one request: saturation shedding →
prefill placement (Algorithm 1 or an alternative) → TTFT check → decode placement with the
decode load predicted for when the prefill finishes (TBT check).

BUG-51 (a stale saturation signal disabled early rejection): nothing here keeps state
between calls. ``saturation`` is computed from the ``ClusterView`` passed in, which the caller
builds fresh for each decision, so the signal can never lag the cluster it describes.
"""

from __future__ import annotations

from pymooncake.conductor.policy.decode_placement import place_decode
from pymooncake.conductor.policy.estimators import Estimators
from pymooncake.conductor.policy.prefill_placement import PrefillPolicy, place_prefill_global_cache
from pymooncake.conductor.policy.types import (
    ClusterView,
    Placement,
    PolicyConfig,
    PrefixMatch,
    Rejection,
    RequestInfo,
)


def saturation(view: ClusterView) -> float:
    """Saturation of the prefill pool: ``min_i num_in_flight_i / concurrency_limit_i`` over the
    instances that have a limit (0.0 when none has one or there are none).

    >= 1.0 means every limited instance is full: a sheddable request would only wait.
    """
    ratios = [p.num_in_flight / p.concurrency_limit for p in view.prefill
              if p.concurrency_limit is not None]
    return min(ratios) if ratios else 0.0


def admit_ttft(placement: Placement, cfg: PolicyConfig) -> Placement | Rejection:
    """Reject when the predicted TTFT exceeds ``ttft_slo_s`` (early rejection on)."""
    ttft = placement.predicted_ttft_s
    if cfg.early_rejection and ttft > cfg.ttft_slo_s:
        return Rejection(reason="ttft_slo", retry_after_s=max(1.0, ttft - cfg.ttft_slo_s),
                         predicted_ttft_s=ttft)
    return placement


def schedule(req: RequestInfo, view: ClusterView, match: PrefixMatch, est: Estimators,
             cfg: PolicyConfig,
             prefill_policy: PrefillPolicy = place_prefill_global_cache,
             *, colocated: bool = False) -> Placement | Rejection:
    """The full decision for ``req``: a ``Placement`` (prefill + decode) or a ``Rejection``.

    Args:
        req, view, match, est, cfg: see ``types``; ``view`` must describe the cluster now.
        prefill_policy: one of ``PREFILL_POLICIES``.
        colocated: the prefill instance also decodes (no decode placement; TTFT check only).

    Returns:
        ``Rejection("saturated")`` for a sheddable request when ``saturation(view) >= 1``
        (regardless of ``early_rejection``: shedding is by priority); ``Rejection("ttft_slo")``
        / ``Rejection("tbt_slo")`` with early rejection on; else the ``Placement``.
    """
    if req.sheddable and saturation(view) >= 1.0:
        return Rejection(reason="saturated", retry_after_s=1.0)
    p = prefill_policy(req, view, match, est, cfg)
    if isinstance(p, Rejection):
        return p
    p = admit_ttft(p, cfg)
    if isinstance(p, Rejection) or colocated:
        return p
    return place_decode(req, view, p, est, cfg)
