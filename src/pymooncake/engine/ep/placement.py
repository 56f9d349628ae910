"""EPLB-style expert placement and replica routing: pure functions, no I/O.

``plan_placement`` gives every expert of a layer one copy and spends the remaining slots
on redundant copies of the most-loaded experts (load per copy, greedy), then places the
copies heaviest first, each on the least-loaded rank that does not already hold that
expert (DeepSeek's EPLB, its global policy without node groups). ``assign_rows`` splits an
expert's token rows over its live copies; ``missing_experts`` names the experts a set of
dead ranks leaves without any copy.
"""

from __future__ import annotations

from collections.abc import Sequence

Placement = list[dict[int, tuple[int, ...]]]
"""Per MoE layer (in ``layers`` order): expert id -> ranks holding a copy, primary first."""


def plan_layer(num_experts: int, ranks: Sequence[int], slots_per_rank: int,
               load: Sequence[float] | None = None) -> dict[int, tuple[int, ...]]:
    """Placement of one layer's ``num_experts`` on ``ranks`` with ``slots_per_rank`` copies
    each at most (raised to ``ceil(num_experts / len(ranks))`` when too small to hold every
    expert once). ``load``: tokens routed to each expert recently (uniform when None).
    Raises ``ValueError`` with no ranks."""
    if not ranks:
        raise ValueError("no ranks to place experts on")
    ranks = sorted(ranks)
    slots = max(slots_per_rank, -(-num_experts // len(ranks)))
    w = [max(float(x), 1e-9) for x in (load or [1.0] * num_experts)]
    copies = [1] * num_experts
    for _ in range(min(slots * len(ranks), num_experts * len(ranks)) - num_experts):
        e = max((e for e in range(num_experts) if copies[e] < len(ranks)),
                key=lambda e: (w[e] / copies[e], -e))
        copies[e] += 1
    rank_load = {r: 0.0 for r in ranks}
    free = {r: slots for r in ranks}
    held: dict[int, list[int]] = {e: [] for e in range(num_experts)}
    order = sorted(((w[e] / copies[e], e) for e in range(num_experts) for _ in range(copies[e])),
                   key=lambda t: (-t[0], t[1]))
    for share, e in order:
        cands = [r for r in ranks if free[r] > 0 and r not in held[e]]
        r = min(cands, key=lambda r: (rank_load[r], slots - free[r], r))
        held[e].append(r)
        free[r] -= 1
        rank_load[r] += share
    return {e: tuple(rs) for e, rs in held.items()}


def plan_placement(num_layers: int, num_experts: int, ranks: Sequence[int],
                   slots_per_rank: int, loads: Sequence[Sequence[float]] | None = None,
                   ) -> Placement:
    """``plan_layer`` for each of ``num_layers`` MoE layers (``loads[i]`` per layer)."""
    return [plan_layer(num_experts, ranks, slots_per_rank, loads[i] if loads else None)
            for i in range(num_layers)]


def rank_experts(placement: Placement, rank: int) -> list[tuple[int, int]]:
    """``(layer index, expert)`` pairs ``rank`` holds, sorted."""
    return sorted((i, e) for i, layer in enumerate(placement)
                  for e, rs in layer.items() if rank in rs)


def missing_experts(placement: Placement, alive: set[int]) -> list[tuple[int, int]]:
    """``(layer index, expert)`` pairs with no copy on an ``alive`` rank."""
    return [(i, e) for i, layer in enumerate(placement) for e, rs in sorted(layer.items())
            if not any(r in alive for r in rs)]


def assign_rows(layer: dict[int, tuple[int, ...]], counts: Sequence[int], alive: set[int],
                ) -> tuple[dict[int, list[tuple[int, int, int]]], list[int]]:
    """Split each expert's rows over its live copies.

    ``counts[e]`` rows of expert ``e`` follow those of experts ``< e``. Returns
    ``(per rank: [(expert, first row, number of rows)], experts with rows but no live
    copy)``. Rows of an expert are cut into contiguous, near-equal chunks, one per live
    copy in placement order (a hot expert's load spreads over its replicas).
    """
    out: dict[int, list[tuple[int, int, int]]] = {}
    missing = []
    start = 0
    for e, n in enumerate(counts):
        if n:
            live = [r for r in layer.get(e, ()) if r in alive]
            if not live:
                missing.append(e)
            else:
                k = min(len(live), n)
                base, extra = divmod(n, k)
                off = start
                for j, r in enumerate(live[:k]):
                    m = base + (1 if j < extra else 0)
                    out.setdefault(r, []).append((e, off, m))
                    off += m
        start += n
    return out, missing
