"""pymooncake.p2p: the P2P Store, checkpoint distribution over the Transfer Engine.

Mooncake's P2P Store (docs/p2p.md): ``register`` publishes a payload's metadata only (shard
list, sizes, BLAKE3 checksums, holders); ``get_replica`` pulls shards from every current
holder in parallel, rarest first from the least-loaded holder, verifies each and serves it
to others at once; the seed is only the first holder. Public API::

    from pymooncake.p2p import P2PStore, PullOptions
    with P2PStore("etcd://10.0.0.1:2379", host="10.0.0.2") as p2p:
        p2p.register("llama-8b", ["/models/llama-8b"])          # on the seed
        p2p.get_replica("llama-8b", "/models/llama-8b")         # on every receiver
        p2p.list(); p2p.delete_replica("llama-8b"); p2p.unregister("llama-8b")

CLI: ``pymooncake p2p register|get|list|unregister``; ``pymooncake bench p2p``.
"""

from __future__ import annotations

from pymooncake.p2p.manifest import (
    DEFAULT_SHARD_BYTES,
    Entry,
    Holder,
    Manifest,
    NoHolderError,
    P2PError,
    P2PExists,
    P2PNotFound,
    Shard,
)
from pymooncake.p2p.puller import PullOptions, PullStats
from pymooncake.p2p.store import P2PStore, PayloadInfo, Replica

__all__ = [
    "DEFAULT_SHARD_BYTES", "Entry", "Holder", "Manifest", "NoHolderError", "P2PError",
    "P2PExists", "P2PNotFound", "P2PStore", "PayloadInfo", "PullOptions", "PullStats",
    "Replica", "Shard",
]
