"""Which shard to pull next, and from whom (pure; BitTorrent's rarest-first + least-loaded).

Mooncake's P2P Store lets every node that finished a shard serve it; this module only
decides. Inputs are plain data, randomness comes from the caller's ``random.Random`` (so
receivers that start together pick different shards from the seed).
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Collection, Mapping

from pymooncake.p2p.manifest import Holder


def holder_loads(holders: Mapping[str, Holder], own_inflight: Mapping[str, int],
                 self_segment: str) -> dict[str, int]:
    """Pulls in flight from each holder, as every peer's record says (ours counted live)."""
    load = {seg: 0 for seg in holders}
    for seg, h in holders.items():
        if seg == self_segment:
            continue
        for target, n in h.pulling.items():
            if target in load:
                load[target] += n
    for target, n in own_inflight.items():
        if target in load:
            load[target] += n
    return load


def fetchers(holders: Mapping[str, Holder]) -> Counter[int]:
    """Shard → how many other peers are pulling it now (from their records)."""
    return Counter(s for h in holders.values() for s in h.fetching)


def choose(missing: Collection[int], holders: Mapping[str, Holder],
           load: Mapping[str, int], excluded: Collection[str],
           bad: Collection[tuple[int, str]], rng: random.Random,
           fetching: Mapping[int, int] | None = None) -> tuple[int, str] | None:
    """``(shard, holder segment)`` to pull next, or ``None`` when no missing shard has an
    eligible holder.

    ``missing``: shards this peer lacks and is not pulling. A holder is eligible for a shard
    when it has it, is not in ``excluded`` (recently failed) and ``(shard, holder)`` is not
    in ``bad`` (it served bytes that failed the checksum). Rarest first: the shard with the
    fewest eligible holders, then the fewest other peers ``fetching`` it now; among its
    holders the least-loaded one, then the one holding the fewest shards (complete holders
    stay free for rare shards); ties broken at random.
    """
    fetching = fetching or {}
    best: list[tuple[int, list[str]]] = []
    best_n = (0, 0)
    for s in missing:
        cands = [seg for seg, h in holders.items()
                 if h.has(s) and seg not in excluded and (s, seg) not in bad]
        if not cands:
            continue
        n = (len(cands), fetching.get(s, 0))
        if not best or n < best_n:
            best, best_n = [(s, cands)], n
        elif n == best_n:
            best.append((s, cands))
    if not best:
        return None
    shard, cands = rng.choice(best)
    # Least-loaded; among those, the holder with the fewest shards: a seed (or any
    # complete holder) is the only source of the rare shards, so it is kept for them.
    key = {c: (load.get(c, 0), holders[c].count()) for c in cands}
    least = min(key.values())
    return shard, rng.choice([c for c in cands if key[c] == least])
