"""Prefill placement with chunked-pipeline (CPP) prefill groups in the pool (FAST'25 §5.1).

A CPP group is one prefill instance of the view whose ``PrefillInstanceState.cpp`` holds its
cost model (``policy.cpp.CppCostModel``). ``with_cpp(base)`` wraps any prefill policy of
``PREFILL_POLICIES``:

1. ``base`` places the request among the single workers only (the CPP groups removed from
   the view and the prefix match), exactly as without groups;
2. the group with the least predicted TTFT (its queue + ``cpp_prefill_s``) is compared with
   that placement by ``policy.cpp.use_cpp``: the prompt goes to the group only when its
   uncached part (after the prefix the single worker would reuse) is at least the group's
   ``min_prompt_tokens`` (the measured break-even, ``--cpp-min-tokens``) and the group's
   predicted TTFT is smaller. Short prompts never go to a group while a single worker is
   registered;
3. with no single worker at all, every prompt goes to the least-TTFT group (it is the only
   prefill capacity there is).

The group's stages reuse no prefix (they compute the whole prompt; docs/cpp.md), so its
prefill is predicted from token 0 and the part a single worker would reuse is added to the
group's side of the comparison. The single worker's time in ``use_cpp`` is the placement's
own predicted TTFT: the group's ``single`` estimator is replaced by ``est.prefill``, the
predictor every other placement uses (profile-fitted, refit online), so both sides of the
comparison come from one model of a worker. Pure: no I/O, no clock (DESIGN.md §2).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from pymooncake.conductor.policy.cpp import CppCostModel, cpp_prefill_s, use_cpp
from pymooncake.conductor.policy.estimators import Estimators, PrefillEstimator
from pymooncake.conductor.policy.prefill_placement import PrefillPolicy, queue_s
from pymooncake.conductor.policy.types import (
    ClusterView,
    Placement,
    PolicyConfig,
    PrefixMatch,
    Rejection,
    RequestInfo,
)

CPP_WIRE_FIELDS = ("num_stages", "chunk_tokens", "edge_tokens", "hop_s", "overhead_s",
                   "min_prompt_tokens")
"""The ``CppCostModel`` fields a CPP instance registers (``WorkerInfo.cpp_json``); its
``single`` estimator is the Conductor's own."""


def cpp_model_to_wire(model: CppCostModel) -> dict[str, Any]:
    """The registered part of ``model`` (``CPP_WIRE_FIELDS``) as a plain dict."""
    return {k: getattr(model, k) for k in CPP_WIRE_FIELDS}


def cpp_model_from_wire(d: Mapping[str, Any]) -> CppCostModel:
    """``CppCostModel`` from ``cpp_model_to_wire``'s dict. Raises ``ValueError`` naming a
    missing or invalid field."""
    missing = [k for k in CPP_WIRE_FIELDS if k not in d]
    if missing:
        raise ValueError(f"CPP cost model lacks {', '.join(missing)}")
    try:
        kw = {k: (float(d[k]) if k.endswith("_s") else int(d[k])) for k in CPP_WIRE_FIELDS}
    except (TypeError, ValueError):
        raise ValueError(f"CPP cost model fields must be numbers, got {dict(d)!r}") from None
    return CppCostModel(**kw)  # type: ignore[arg-type]


def _cpp_option(req: RequestInfo, view: ClusterView, i: int, single: PrefillEstimator
                ) -> tuple[float, float, float, CppCostModel]:
    """``(ttft, queue_s, prefill_s, model)`` of ``view.prefill[i]`` (a group) for ``req``."""
    inst = view.prefill[i]
    assert inst.cpp is not None
    model = dataclasses.replace(inst.cpp, single=single)
    t = cpp_prefill_s(model, req.num_prompt_tokens, 0)
    q = queue_s(inst, view.now_s, t)
    return q + t, q, t, model


def place_prefill_cpp(req: RequestInfo, view: ClusterView, match: PrefixMatch,
                      est: Estimators, cfg: PolicyConfig, base: PrefillPolicy
                      ) -> Placement | Rejection:
    """``base``'s placement, or the best CPP group where ``use_cpp`` says it pays (module
    docstring). Same contract as every ``PrefillPolicy``."""
    groups = [i for i, p in enumerate(view.prefill) if p.cpp is not None]
    if not groups:
        return base(req, view, match, est, cfg)
    opts = {i: _cpp_option(req, view, i, est.prefill) for i in groups}
    g = min(groups, key=lambda i: (opts[i][0], i))
    ttft, q, t, model = opts[g]
    group = Placement(view.prefill[g].instance_id, None, 0, 0, None, q, 0.0, t)
    singles = [i for i, p in enumerate(view.prefill) if p.cpp is None]
    if not singles:
        return group
    local = match.local_blocks
    sub_view = dataclasses.replace(view, prefill=tuple(view.prefill[i] for i in singles))
    # a group as the best holder stays one: its blocks also went to the Store
    sub_match = PrefixMatch(tuple(local[i] if i < len(local) else 0 for i in singles),
                            match.best_blocks, match.best_holder)
    p = base(req, sub_view, sub_match, est, cfg)
    if isinstance(p, Rejection):
        return p
    n = req.num_prompt_tokens
    prefix = min(p.prefix_blocks * cfg.block_size_tokens, n)
    single_queue = p.predicted_ttft_s - est.prefill.prefill_s(n, prefix)
    # use_cpp predicts the group from ``prefix``; the group computes from token 0
    cpp_queue = q + t - cpp_prefill_s(model, n, prefix)
    return group if use_cpp(n, prefix, model, single_queue, cpp_queue) else p


def with_cpp(base: PrefillPolicy) -> PrefillPolicy:
    """``base`` extended to CPP groups (``place_prefill_cpp``); a view without groups gets
    ``base``'s decision unchanged."""
    def policy(req: RequestInfo, view: ClusterView, match: PrefixMatch, est: Estimators,
               cfg: PolicyConfig) -> Placement | Rejection:
        return place_prefill_cpp(req, view, match, est, cfg, base)
    policy.__name__ = f"{getattr(base, '__name__', 'policy')}_with_cpp"
    policy.__doc__ = with_cpp.__doc__
    return policy
