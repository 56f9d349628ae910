"""Prefill-side reuse from the global Mooncake Store: the ``KVLoadSource`` that loads prefix
blocks missing from the local paged cache, and the put of new full blocks.

Store object key of a block: ``kv/<namespace digest[:16]>/<block key>``; the value is the
block's ``export_block_bytes`` (all layers, ``[layer, K/V, kv_head, block_size,
head_dim]``). ``get_num_matched_tokens`` reads the longest run of the request's next block
keys from the Store (stopping at the first miss, so a match is a prefix) and keeps the
bytes until the step loads them layer by layer in ``before_layer`` (Mooncake FAST'25 §3.1
step 1, DESIGN.md §1). A request may turn Store reuse off (``disable``), for the
local-cache-only policies.

Zero copy on the read side: blocks are read with ``batch_get_into`` straight into slots of
one host buffer registered with the Store client once (``staging_blocks`` blocks), and
``before_layer`` imports views of those slots — no ``bytes`` in between. A lookup that
finds no free slots (or a store without ``register_buffer``) reads ``bytes`` instead.
Puts take ``bytes``, contiguous CPU tensors, or blocks ``stage_for_put`` copied out of the
paged cache straight into staging slots (then written with ``batch_put_from``: one copy
from the paged cache to the Store instead of export → ``bytes`` → client staging).
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


class StagedBlock:
    """A block ``StoreKVLoader.stage_for_put`` copied into a registered staging slot."""

    __slots__ = ("slot",)

    def __init__(self, slot: int) -> None:
        self.slot = slot


class StoreKVLoader(NullHooks):
    """Loads reusable prefix blocks from the Store into a prefill engine's paged cache."""

    def __init__(self, store: StoreClient, kv: KVTensors, namespace_digest: str,
                 staging_blocks: int = 64) -> None:
        self.store = store
        self.kv = kv
        self.ns = namespace_digest
        self._staging_blocks = staging_blocks
        self._staging: torch.Tensor | None = None
        self._staging_addr = 0
        self._free_slots: list[int] = []
        self._slots: dict[str, list[int]] = {}
        """request id → staging slots its fetched blocks live in."""
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
        self._release(request_id)

    # -- zero-copy staging ----------------------------------------------------------------
    def _take_slots(self, n: int) -> list[int]:
        """Up to ``n`` free block slots of the registered staging buffer (registered on
        first use); ``[]`` when none is free or the store cannot register memory."""
        with self._lock:
            register = getattr(self.store, "register_buffer", None)
            if self._staging is None and self._staging_blocks > 0 and register is not None:
                buf = torch.empty(self._staging_blocks * self.kv.block_nbytes,
                                  dtype=torch.uint8)
                try:  # once: registering publishes the segment (a metadata round trip)
                    self._staging_addr = register(buf)
                    self._staging = buf
                    self._free_slots = list(range(self._staging_blocks))
                except Exception as e:  # noqa: BLE001 - no staging: bytes reads instead
                    logger.warning("store staging buffer not registered: %s", e)
                    self._staging_blocks = 0
            taken, self._free_slots = self._free_slots[:n], self._free_slots[n:]
            return taken

    def _give_slots(self, slots: list[int]) -> None:
        with self._lock:
            self._free_slots.extend(slots)

    def _release(self, request_id: str) -> None:
        slots = self._slots.pop(request_id, None)
        if slots:
            self._give_slots(slots)

    def _slot_view(self, slot: int) -> torch.Tensor:
        k = self.kv
        assert self._staging is not None
        raw = self._staging[slot * k.block_nbytes:(slot + 1) * k.block_nbytes]
        return raw.view(k.dtype).view(k.num_layers, 2, k.num_kv_heads, 1, k.block_size,
                                      k.head_dim)

    def _read_blocks(self, request_id: str, skeys: list[str]) -> list[torch.Tensor]:
        """The leading run of ``skeys`` the Store returns whole, as block tensors: read
        into free staging slots (zero copy), the blocks beyond them as ``bytes``."""
        nb = self.kv.block_nbytes
        slots = self._take_slots(len(skeys))
        have: list[torch.Tensor] = []
        if slots:
            try:
                res = self.store.batch_get_into(skeys[:len(slots)],
                                                [self._staging_addr + s * nb for s in slots],
                                                [nb] * len(slots))
            except BaseException:
                self._give_slots(slots)
                raise
            for s, r in zip(slots, res, strict=True):
                if r != nb:  # a miss, an error, or a block of the wrong size ends the run
                    if isinstance(r, int):
                        logger.warning("store block for %s unusable: %d B, expected %d",
                                       request_id, r, nb)
                    break
                have.append(self._slot_view(s))
            self._give_slots(slots[len(have):])
            self._slots.setdefault(request_id, []).extend(slots[:len(have)])
            if len(have) < len(slots):
                return have
        rest = skeys[len(have):]
        for v in self.store.batch_get(rest) if rest else []:
            if not isinstance(v, bytes | bytearray):
                break
            try:
                have.append(self._as_tensor(v))
            except ValueError as e:
                logger.warning("store block for %s unusable: %s", request_id, e)
                break
        return have

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
            self._release(rid)  # blocks fetched for another starting block: not used
            t0 = time.time()
            try:
                with span("prefill.store_lookup", request_id=rid, num_blocks=len(keys)):
                    skeys = [store_key(self.ns, k) for k in keys]
                    # metadata first: read only the leading run of blocks the Store holds
                    exists = self.store.batch_exist(skeys)
                    n = next((i for i, x in enumerate(exists) if x is not True), len(exists))
                    have = self._read_blocks(rid, skeys[:n]) if n else []
            except Exception as e:  # noqa: BLE001 - the Store being down only costs reuse
                logger.warning("store lookup for %s failed: %s", rid, e)
                have = []
                self._release(rid)
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
            self._release(ld.request_id)

    # -- put ------------------------------------------------------------------------------
    def stage_for_put(self, block_ids: Sequence[int]) -> list[StagedBlock | torch.Tensor]:
        """On the engine thread: copy blocks out of the paged cache for a later
        ``put_blocks`` — each straight into a registered staging slot (the one copy; the
        put then writes from there with ``batch_put_from``), or, when puts already hold
        half the slots, into a fresh tensor. Slots go back when ``put_blocks`` is done."""
        k = self.kv
        n = len(block_ids)
        self._take_slots(0)  # registers the staging buffer on first use
        with self._lock:
            spare = len(self._free_slots) - self._staging_blocks // 2
        slots = self._take_slots(n) if self._staging_addr and spare >= n else []
        if len(slots) < n:
            self._give_slots(slots)
            return [k.export_blocks([b]) for b in block_ids]
        out: list[StagedBlock | torch.Tensor] = []
        for slot, b in zip(slots, block_ids, strict=True):
            self._slot_view(slot).copy_(k.buffer[:, :, :, b:b + 1])
            out.append(StagedBlock(slot))
        return out

    def discard_staged(self, values: Sequence[object]) -> None:
        """Give back the slots of staged blocks that will not be put (e.g. duplicates)."""
        self._give_slots([v.slot for v in values if isinstance(v, StagedBlock)])

    def put_blocks(self, block_keys: Sequence[str],
                   block_bytes: Sequence[bytes | torch.Tensor | StagedBlock]) -> list[str]:
        """Put blocks not yet in the Store; returns the keys the Store holds after this call
        (those put now and those it already held: a holder's report heals a removal that
        was reported for a key which is in fact still there). A value is a block's
        ``bytes``, a contiguous CPU tensor of it (put without a ``bytes`` copy), or a
        ``stage_for_put`` slot (put with ``batch_put_from``, no copy here; its slot is
        given back whatever happens)."""
        staged = [v.slot for v in block_bytes if isinstance(v, StagedBlock)]
        try:
            return self._put_blocks(block_keys, block_bytes)
        finally:
            self._give_slots(staged)

    def _put_blocks(self, block_keys: Sequence[str],
                    block_bytes: Sequence[bytes | torch.Tensor | StagedBlock]) -> list[str]:
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
        nb = self.kv.block_nbytes
        from_slots = [i for i in todo if isinstance(block_bytes[i], StagedBlock)]
        others = [i for i in todo if not isinstance(block_bytes[i], StagedBlock)]
        stored: list[str] = []
        if from_slots:
            errs = self.store.batch_put_from(
                [skeys[i] for i in from_slots],
                [self._staging_addr + block_bytes[i].slot * nb for i in from_slots],  # type: ignore[union-attr]
                [nb] * len(from_slots))
            stored += [block_keys[i] for i, e in zip(from_slots, errs, strict=True) if e is None]
        if others:
            values = [block_bytes[i] for i in others]
            values = [v.view(torch.uint8).reshape(-1).numpy() if isinstance(v, torch.Tensor)
                      else v for v in values]
            errs = self.store.batch_put([skeys[i] for i in others], values)
            stored += [block_keys[i] for i, e in zip(others, errs, strict=True) if e is None]
        self.num_put_blocks += len(stored)
        return held + stored
