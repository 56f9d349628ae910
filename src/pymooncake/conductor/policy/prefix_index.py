"""Block key → holders, and the prefix match of a request against every holder (Algorithm 1).

A holder is a prefill instance (its local DRAM/HBM cache) or a store segment owner. The index
is fed by KV events (insert/evict) — from workers live, from the simulator's cache model in
simulation — and answers ``match``, Algorithm 1's ``FindBestPrefixMatch`` plus each
instance's own prefix length. It is the one mutable state holder of ``conductor.policy``; it
does no I/O and reads no clock.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from pymooncake.conductor.policy.types import BlockKeyLike, InstanceId, PrefixMatch


class PrefixIndex:
    """Which holders have which block keys.

    Only prefix *order* matters for a match: a key counts for a holder only if every earlier
    key of the request is also held by that holder (the keys are chained, DESIGN.md §3).
    """

    __slots__ = ("_holders",)

    def __init__(self) -> None:
        self._holders: dict[BlockKeyLike, set[InstanceId]] = {}

    def insert(self, holder: InstanceId, keys: Iterable[BlockKeyLike]) -> None:
        """KV event: ``holder`` now holds ``keys``."""
        h = self._holders
        for k in keys:
            s = h.get(k)
            if s is None:
                h[k] = {holder}
            else:
                s.add(holder)

    def evict(self, holder: InstanceId, keys: Iterable[BlockKeyLike]) -> None:
        """KV event: ``holder`` dropped ``keys`` (unknown keys are ignored)."""
        h = self._holders
        for k in keys:
            s = h.get(k)
            if s is not None:
                s.discard(holder)
                if not s:
                    del h[k]

    def holders(self, key: BlockKeyLike) -> frozenset[InstanceId]:
        """Holders of ``key`` (empty when nobody holds it)."""
        return frozenset(self._holders.get(key, ()))

    def num_replicas(self, key: BlockKeyLike) -> int:
        """How many holders have ``key``."""
        s = self._holders.get(key)
        return len(s) if s else 0

    def __len__(self) -> int:
        return len(self._holders)

    def match(self, keys: Sequence[BlockKeyLike], instance_ids: Sequence[InstanceId], *,
              remote: bool = True) -> PrefixMatch:
        """Prefix match of ``keys`` for each of ``instance_ids`` and over all holders.

        Args:
            keys: the request's block keys in order.
            instance_ids: prefill instances, in the order of ``ClusterView.prefill``.
            remote: also report the best holder over every holder (global pool); ``False``
                for a local-cache-only cluster (``best_holder`` then stays ``None``).

        Returns:
            ``PrefixMatch`` with ``local_blocks`` aligned with ``instance_ids``. Ties for the
            best holder go to the earliest of ``instance_ids``, then to the smallest name.
        """
        counts: dict[InstanceId, int] = {}
        alive: set[InstanceId] | None = None
        n = 0
        h = self._holders
        for k in keys:
            s = h.get(k)
            if not s:
                break
            nxt = set(s) if alive is None else alive & s
            if alive is not None:
                for gone in alive - nxt:
                    counts[gone] = n
            if not nxt:
                alive = nxt
                break
            alive = nxt
            n += 1
        if alive:
            for a in alive:
                counts[a] = n
        local = tuple(counts.get(i, 0) for i in instance_ids)
        if not remote or not counts:
            return PrefixMatch(local_blocks=local)
        best_holder: InstanceId | None = None
        best_n = 0
        for i in instance_ids:           # ties: the earliest instance
            c = counts.get(i, 0)
            if c > best_n:
                best_holder, best_n = i, c
        for holder in sorted(set(counts) - set(instance_ids)):   # then other holders by name
            if counts[holder] > best_n:
                best_holder, best_n = holder, counts[holder]
        if best_holder is None:
            return PrefixMatch(local_blocks=local)
        return PrefixMatch(local_blocks=local, best_blocks=best_n, best_holder=best_holder)


def shared_prefix_blocks(keys: Sequence[BlockKeyLike],
                         in_flight: Iterable[Sequence[BlockKeyLike]]) -> int:
    """The most leading blocks of ``keys`` that one of ``in_flight`` (the block keys of
    prompts placed on an instance whose prefill has not finished) starts with: blocks the
    instance will hold once that prefill computes them (no KV event has announced them yet),
    which a request queued behind it finds there. 0 when ``in_flight`` is empty."""
    best = 0
    for other in in_flight:
        n = 0
        for a, b in zip(keys, other, strict=False):
            if a != b:
                break
            n += 1
        best = max(best, n)
    return best


def with_pending(match: PrefixMatch, pending: Sequence[int]) -> PrefixMatch:
    """``match`` with each instance's ``local_blocks[i]`` raised to ``pending[i]`` (aligned
    with ``match.local_blocks``; from ``shared_prefix_blocks``): a prefix still being
    computed on an instance counts as held there, since a request placed there runs after
    it. ``best_blocks``/``best_holder`` are left as they are (a remote holder must hold the
    keys now).

    Raises:
        ValueError: ``pending`` is not aligned with ``match.local_blocks``.
    """
    if len(pending) != len(match.local_blocks):
        raise ValueError(f"pending has {len(pending)} entries for "
                         f"{len(match.local_blocks)} instances")
    if all(p <= h for p, h in zip(pending, match.local_blocks, strict=True)):
        return match
    return PrefixMatch(local_blocks=tuple(max(p, h) for p, h in
                                          zip(pending, match.local_blocks, strict=True)),
                       best_blocks=match.best_blocks, best_holder=match.best_holder)
