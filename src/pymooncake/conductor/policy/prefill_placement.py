"""Prefill placement: Mooncake FAST'25 Algorithm 1 (least TTFT over prefill instances) and the
alternatives it is compared with in Figure 5 (random, round-robin, least-load, local-cache-aware).

Every policy has the same signature ``(req, view, match, est, cfg) -> Placement | Rejection``
and is pure: the live Conductor and the simulator call these very function objects.
``Placement.decode_instance`` is left ``None`` here; ``decode_placement`` fills it.
"""

from __future__ import annotations

from collections.abc import Callable

from pymooncake.conductor.policy.estimators import Estimators
from pymooncake.conductor.policy.types import (
    ClusterView,
    Placement,
    PolicyConfig,
    PrefillInstanceState,
    PrefixMatch,
    Rejection,
    RequestInfo,
)

PrefillPolicy = Callable[[RequestInfo, ClusterView, PrefixMatch, Estimators, PolicyConfig],
                         "Placement | Rejection"]

_MASK64 = (1 << 64) - 1


def queue_s(inst: PrefillInstanceState, now_s: float, job_s: float | None = None) -> float:
    """``EstimatePrefillQueueTime``: remaining time of the running prefill + the queued ones.

    On a ``shortest_first`` instance a job predicted to take ``job_s`` seconds waits only
    for the queued ones predicted no longer than itself (ties: they came first).
    """
    running = max(0.0, inst.busy_until_s - now_s)
    if inst.shortest_first and inst.queued_prefills_s and job_s is not None:
        return running + sum(t for t in inst.queued_prefills_s if t <= job_s)
    return running + inst.queued_prefill_s


def delay_imposed_s(inst: PrefillInstanceState, job_s: float) -> float:
    """How much a job of ``job_s`` seconds placed on ``inst`` delays the requests already
    there: on a ``shortest_first`` instance it runs before every queued one predicted
    longer than itself, each of which then starts ``job_s`` later; on a FIFO instance it
    runs last and delays nobody."""
    if not inst.shortest_first:
        return 0.0
    return job_s * sum(1 for t in inst.queued_prefills_s if t > job_s)


def mix64(seed: int, n: int) -> int:
    """SplitMix64 of ``(seed, n)``: the random policy's deterministic, stateless draw."""
    z = (seed * 0x9E3779B97F4A7C15 + n + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _option(req: RequestInfo, view: ClusterView, match: PrefixMatch, i: int, est: Estimators,
            cfg: PolicyConfig, remote: bool) -> tuple[float, int, int, float, float, float]:
    """``(ttft, prefix_blocks, transfer_blocks, queue_s, transfer_s, prefill_s)`` of the best
    option on ``view.prefill[i]`` (see ``evaluate_instance``)."""
    inst = view.prefill[i]
    bs = cfg.block_size_tokens
    n = req.num_prompt_tokens
    local = match.local_blocks[i] if i < len(match.local_blocks) else 0
    local_tokens = min(local * bs, n)
    t_prefill = est.prefill.prefill_s(n, local_tokens)
    q = queue_s(inst, view.now_s, t_prefill)
    best = (q + t_prefill, local, 0, q, 0.0, t_prefill)
    b = match.best_blocks
    if (remote and b > local and match.best_holder is not None
            and match.best_holder != inst.instance_id
            and (local == 0 or b / local > cfg.kvcache_balancing_threshold)):
        prefix_tokens = min(b * bs, n)
        t_transfer = est.transfer.transfer_s(prefix_tokens - local_tokens)
        t_pre = est.prefill.prefill_s(n, prefix_tokens)
        if t_transfer + t_pre < t_prefill:
            q2 = queue_s(inst, view.now_s, t_transfer + t_pre)
            best = (q2 + t_transfer + t_pre, b, b - local, q2, t_transfer, t_pre)
    return best


def _placement(view: ClusterView, i: int, match: PrefixMatch,
               opt: tuple[float, int, int, float, float, float]) -> Placement:
    _, prefix, transfer, q, t_transfer, t_prefill = opt
    return Placement(view.prefill[i].instance_id, None, prefix, transfer,
                     match.best_holder if transfer else None, q, t_transfer, t_prefill)


def evaluate_instance(req: RequestInfo, view: ClusterView, match: PrefixMatch, i: int,
                      est: Estimators, cfg: PolicyConfig, *, remote: bool) -> Placement:
    """Algorithm 1's loop body for ``view.prefill[i]``: queue + transfer + prefill.

    Reuse its own prefix; with ``remote`` and a holder whose match exceeds the local one by
    more than ``kvcache_balancing_threshold`` (ratio ``best / local``; any longer match when
    local is 0), also consider fetching the missing blocks from that holder, and keep the
    option with the smaller TTFT. Prefix tokens follow the trace rule
    ``min(blocks · block_size, prompt tokens)``.
    """
    return _placement(view, i, match, _option(req, view, match, i, est, cfg, remote))


def _least_ttft(req: RequestInfo, view: ClusterView, match: PrefixMatch, est: Estimators,
                cfg: PolicyConfig, remote: bool) -> Placement:
    """The instance where the request adds the least to the sum of TTFTs: its own predicted
    TTFT plus ``delay_imposed_s`` on the longer requests a shortest-first queue will run
    after it (FIFO instances: its own TTFT alone, Algorithm 1 as published). Ties: earliest."""
    opts = [_option(req, view, match, i, est, cfg, remote) for i in range(len(view.prefill))]
    best_i = min(range(len(opts)), key=lambda i: (
        opts[i][0] + delay_imposed_s(view.prefill[i], opts[i][4] + opts[i][5]), i))
    return _placement(view, best_i, match, opts[best_i])


def _no_instance() -> Rejection:
    return Rejection(reason="no_instance", retry_after_s=1.0)


def place_prefill_global_cache(req: RequestInfo, view: ClusterView, match: PrefixMatch,
                               est: Estimators, cfg: PolicyConfig) -> Placement | Rejection:
    """Algorithm 1 (global cache-aware): least predicted TTFT, cross-instance reuse allowed.

    On shortest-first instances the comparison also counts the delay the request imposes
    on the longer ones queued there (``_least_ttft``): greedy least-own-TTFT sends every
    short request of a burst to the instance holding a long one (short requests do not wait
    for it there), which then starts last. Ties go to the earliest instance in
    ``view.prefill``.
    """
    if not view.prefill:
        return _no_instance()
    return _least_ttft(req, view, match, est, cfg, True)


def place_prefill_local_cache(req: RequestInfo, view: ClusterView, match: PrefixMatch,
                              est: Estimators, cfg: PolicyConfig) -> Placement | Rejection:
    """Local cache-aware: Algorithm 1 without transfers (FAST'25 §4.1); least TTFT using only
    each instance's own prefix."""
    if not view.prefill:
        return _no_instance()
    return _least_ttft(req, view, match, est, cfg, False)


def place_prefill_least_load(req: RequestInfo, view: ClusterView, match: PrefixMatch,
                             est: Estimators, cfg: PolicyConfig) -> Placement | Rejection:
    """Load balancing: the instance with the least predicted queue time (ties: earliest);
    cache reuse (local, or remote when the cluster has a global pool) is used but not sought."""
    if not view.prefill:
        return _no_instance()
    now = view.now_s
    i = min(range(len(view.prefill)), key=lambda j: (queue_s(view.prefill[j], now), j))
    return evaluate_instance(req, view, match, i, est, cfg, remote=match.best_holder is not None)


def place_prefill_random(req: RequestInfo, view: ClusterView, match: PrefixMatch,
                         est: Estimators, cfg: PolicyConfig) -> Placement | Rejection:
    """Random: instance ``mix64(cfg.seed, req.sequence_number) mod N`` (deterministic)."""
    if not view.prefill:
        return _no_instance()
    i = mix64(cfg.seed, req.sequence_number) % len(view.prefill)
    return evaluate_instance(req, view, match, i, est, cfg, remote=match.best_holder is not None)


def place_prefill_round_robin(req: RequestInfo, view: ClusterView, match: PrefixMatch,
                              est: Estimators, cfg: PolicyConfig) -> Placement | Rejection:
    """Round-robin: instance ``req.sequence_number mod N``."""
    if not view.prefill:
        return _no_instance()
    i = req.sequence_number % len(view.prefill)
    return evaluate_instance(req, view, match, i, est, cfg, remote=match.best_holder is not None)


PREFILL_POLICIES: dict[str, PrefillPolicy] = {
    "random": place_prefill_random,
    "round-robin": place_prefill_round_robin,
    "load": place_prefill_least_load,
    "local-cache": place_prefill_local_cache,
    "global-cache": place_prefill_global_cache,
}
"""Scheduler name (the ``--scheduler``/``--policy`` flag value) → prefill policy."""
