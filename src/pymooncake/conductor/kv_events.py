"""KV events (insert/evict from workers and the Store) → the policy's ``PrefixIndex``.

Workers report the block keys their local prefix cache gains and loses, and the keys they
put into the global Store (holder ``"store"``); Algorithm 1 reads the index through
``PrefixIndex.match`` (Mooncake FAST'25 §4, STYLE.md: "Conductor = KV indexer fed by KV
events"). Store evictions reach it lazily: a prefill worker that was told the Store held
leading blocks it then could not read reports them as ``store`` removals (the master does
not publish its evictions); a put of a key the Store still holds reports it stored again.
"""

from __future__ import annotations

from pymooncake.conductor.policy import InstanceId, PrefixIndex
from pymooncake.rpc.messages import KVEvents

STORE_HOLDER = InstanceId("store")


def apply_kv_events(index: PrefixIndex, ev: KVEvents) -> None:
    """Apply one batch of events: removals first, then insertions (a key that left and came
    back in the same batch stays held)."""
    holder = InstanceId(ev.holder)
    if ev.removed:
        index.evict(holder, ev.removed)
    if ev.stored:
        index.insert(holder, ev.stored)


def drop_holder(index: PrefixIndex, holder: str, keys: set[str]) -> None:
    """A worker left: forget everything it held."""
    index.evict(InstanceId(holder), keys)
