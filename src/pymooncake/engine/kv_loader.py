"""Prefill-side reuse from the global Mooncake Store: the ``KVLoadSource`` that loads prefix
blocks missing from the local paged cache, and the put of new full blocks.

Store object key of a block: ``kv/<namespace digest[:16]>/<block key>``; the value is the
block's ``export_block_bytes`` (all layers, ``[layer, K/V, kv_head, block_size,
head_dim]``). ``get_num_matched_tokens`` reads the longest run of the request's next block
keys from the Store (stopping at the first miss, so a match is a prefix) and keeps the
bytes until the step loads them layer by layer in ``before_layer`` (Mooncake FAST'25 §3.1
step 1, DESIGN.md §1). A request may turn Store reuse off (``disable``), for the
local-cache-only policies.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from pymooncake.engine.hooks import KVLoadError, NullHooks, StepContext
from pymooncake.obs.logging import init_logger
from pymooncake.obs.tracing import span

if TYPE_CHECKING:
    from pymooncake.engine.kv.kv_tensors import KVTensors
    from pymooncake.engine.request import Request
    from pymooncake.engine.worker.stages import StageClock
    from pymooncake.store.client import StoreClient

logger = init_logger(__name__)


def store_key(namespace_digest: str, block_key: str) -> str:
    """The Store object key of a KV block (namespace-scoped)."""
    return f"kv/{namespace_digest[:16]}/{block_key}"


class StoreKVLoader(NullHooks):
    """Loads reusable prefix blocks from the Store into a prefill engine's paged cache."""

    def __init__(self, store: StoreClient, kv: KVTensors, namespace_digest: str) -> None:
        self.store = store
        self.kv = kv
        self.ns = namespace_digest
        self._fetched: dict[str, tuple[int, list[torch.Tensor]]] = {}
        """request id → (first block index, fetched blocks from there)."""
        self._disabled: set[str] = set()
        self._hints: dict[str, int] = {}
        self._lock = threading.Lock()
        self.num_loaded_blocks = 0
        self.num_put_blocks = 0
        self.clock: StageClock | None = None
        """Where ``store_lookup`` and ``cache_load`` windows go (``engine.worker.stages``)."""

    def disable(self, request_id: str) -> None:
        """No Store reuse for this request (local-cache-only placement)."""
        self._disabled.add(request_id)

    def hint(self, request_id: str, num_blocks: int) -> None:
        """The Conductor's count of the prompt's leading blocks the Store holds: no Store
        round trip when the local cache already covers them (``num_blocks < 0``: unknown)."""
        if num_blocks >= 0:
            self._hints[request_id] = num_blocks

    def forget(self, request_id: str) -> None:
        self._disabled.discard(request_id)
        self._hints.pop(request_id, None)
        self._fetched.pop(request_id, None)

    def _as_tensor(self, data: bytes) -> torch.Tensor:
        k = self.kv
        if len(data) != k.block_nbytes:
            raise ValueError(f"store block of {len(data)} B, expected {k.block_nbytes}")
        t = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(k.dtype)
        return t.view(k.num_layers, 2, k.num_kv_heads, 1, k.block_size, k.head_dim)

    # -- KVLoadSource -------------------------------------------------------------------
    def get_num_matched_tokens(self, req: Request, num_local_computed_tokens: int) -> int:
        rid = req.request_id
        if rid in self._disabled:
            return 0
        bs = self.kv.block_size
        first = num_local_computed_tokens // bs
        keys = req.block_keys[first:]
        if not keys or self._hints.get(rid, len(req.block_keys)) <= first:
            return 0
        cached = self._fetched.get(rid)
        have = cached[1] if cached is not None and cached[0] == first else None
        if have is None:
            have = []
            t0 = time.time()
            try:
                with span("prefill.store_lookup", request_id=rid, num_blocks=len(keys)):
                    skeys = [store_key(self.ns, k) for k in keys]
                    # metadata first: read only the leading run of blocks the Store holds
                    exists = self.store.batch_exist(skeys)
                    n = next((i for i, x in enumerate(exists) if x is not True), len(exists))
                    values = self.store.batch_get(skeys[:n]) if n else []
            except Exception as e:  # noqa: BLE001 - the Store being down only costs reuse
                logger.warning("store lookup for %s failed: %s", rid, e)
                values = []
            for v in values:
                if not isinstance(v, bytes | bytearray):
                    break
                try:
                    have.append(self._as_tensor(v))
                except ValueError as e:
                    logger.warning("store block for %s unusable: %s", rid, e)
                    break
            self._fetched[rid] = (first, have)
            if self.clock is not None:
                self.clock.mark(rid, "store_lookup", t0, time.time())
        return len(have) * bs

    def before_layer(self, layer: int, ctx: StepContext, kv: KVTensors) -> None:
        for ld in ctx.loads:
            entry = self._fetched.get(ld.request_id)
            blocks = entry[1] if entry is not None else None
            if (blocks is None or entry[0] != ld.first_token // kv.block_size
                    or len(blocks) < len(ld.block_ids)):
                raise KVLoadError(f"request {ld.request_id}: store blocks missing",
                                  (ld.request_id,))
            t0 = time.time()
            data = torch.cat([b[layer] for b in blocks[:len(ld.block_ids)]], dim=2)
            kv.import_layer(layer, ld.block_ids, data)
            if self.clock is not None:
                self.clock.mark(ld.request_id, "cache_load", t0, time.time())

    def end_step(self, ctx: StepContext, kv: KVTensors) -> None:
        for ld in ctx.loads:
            self.num_loaded_blocks += len(ld.block_ids)
            self._fetched.pop(ld.request_id, None)

    # -- put ------------------------------------------------------------------------------
    def put_blocks(self, block_keys: Sequence[str], block_bytes: Sequence[bytes]) -> list[str]:
        """Put blocks not yet in the Store; returns the keys the Store holds after this call
        (those put now and those it already held: a holder's report heals a removal that
        was reported for a key which is in fact still there)."""
        if not block_keys:
            return []
        skeys = [store_key(self.ns, k) for k in block_keys]
        try:
            exists = self.store.batch_exist(skeys)
        except Exception as e:  # noqa: BLE001
            logger.warning("store exist failed: %s", e)
            return []
        held = [block_keys[i] for i, x in enumerate(exists) if x is True]
        todo = [i for i, x in enumerate(exists) if x is not True]
        if not todo:
            return held
        errs = self.store.batch_put([skeys[i] for i in todo], [block_bytes[i] for i in todo])
        stored = [block_keys[i] for i, e in zip(todo, errs, strict=True) if e is None]
        self.num_put_blocks += len(stored)
        return held + stored
