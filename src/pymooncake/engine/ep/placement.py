"""EPLB-style expert placement and replica routing: pure functions, no I/O.

``plan_placement`` gives every expert of a layer one copy and spends the remaining slots
on redundant copies of the most-loaded experts (load per copy, greedy), then places the
copies heaviest first, each on the least-loaded rank that does not already hold that
expert (DeepSeek's EPLB, its global policy without node groups). ``assign_rows`` spreads
the token rows over the live copies; ``missing_experts`` names the experts a set of
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


SPLIT_MIN_ROWS = 64
"""An expert's rows are split over its copies only in chunks of at least this many rows;
fewer go whole to one copy (a split costs a second GEMM and often a second rank in the
layer call, which waits for the slowest)."""


def assign_rows(layer: dict[int, tuple[int, ...]], counts: Sequence[int], alive: set[int],
                split_min: int = SPLIT_MIN_ROWS,
                ) -> tuple[dict[int, list[tuple[int, int, int]]], list[int]]:
    """Spread each expert's rows over its live copies.

    ``counts[e]`` rows of expert ``e`` follow those of experts ``< e``. Returns
    ``(per rank: [(expert, first row, number of rows)], experts with rows but no live
    copy)``. An expert with at least ``2 * split_min`` rows is cut into contiguous,
    near-equal chunks over up to ``rows // split_min`` live copies (a hot expert's load
    spreads over its replicas); a smaller one goes whole to the live copy with the fewest
    rows so far in this call (ties: a rank already in the call, then placement order), so
    replicas share the load across experts.
    """
    out: dict[int, list[tuple[int, int, int]]] = {}
    load: dict[int, int] = {}
    missing = []
    start = 0
    for e, n in enumerate(counts):
        if n:
            live = [r for r in layer.get(e, ()) if r in alive]
            if not live:
                missing.append(e)
            else:
                k = max(1, min(len(live), n // max(split_min, 1)))
                if k == 1:
                    r = min(live, key=lambda r: (load.get(r, 0), r not in out, live.index(r)))
                    chunks = [(r, n)]
                else:
                    base, extra = divmod(n, k)
                    chunks = [(r, base + (1 if j < extra else 0)) for j, r in enumerate(live[:k])]
                off = start
                for r, m in chunks:
                    out.setdefault(r, []).append((e, off, m))
                    load[r] = load.get(r, 0) + m
                    off += m
        start += n
    return out, missing
