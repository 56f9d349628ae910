"""Prefill-side reuse from the global Mooncake Store: the ``KVLoadSource`` that loads prefix
blocks missing from the local paged cache, and the put of new full blocks.

Store object key of a block: ``kv/<namespace digest[:16]>/<block key>``; the value is the
block's ``export_block_bytes`` (all layers, ``[layer, K/V, kv_head, block_size,
head_dim]``). A request may turn Store reuse off (``disable``), for the local-cache-only
policies.

Loads are asynchronous (issue 16 item 3; vLLM's external-KV contract): the first
``get_num_matched_tokens`` of a request hands its lookup to the fetch thread
(``kv_fetch.StoreFetcher``: one replica plan of the request's next block keys, stopping
at the first miss so a match is a prefix, then ranged reads layer group by layer group into
registered staging slots) and answers ``None`` — "waiting for remote KV": the scheduler
keeps the request waiting and steps the others — until the load is far enough:

- ``layerwise`` (default): the lookup is done and nothing else is in the step (the
  request computes while its layers still arrive: ``before_layer(l)`` waits for ``l``'s
  group, Mooncake FAST'25 §3.1 step 1 "layer by layer"; nobody else waits with it), or
  every layer has landed (then a running batch never waits on the network);
- ``async``: every layer has landed;
- ``sync``: the old behaviour, the engine thread waits for the whole load (benchmarks).

``before_layer`` copies layer ``l`` of the staged blocks into the request's fresh paged
blocks. Puts take ``bytes``, contiguous CPU tensors, or blocks ``stage_for_put`` copied
out of the paged cache straight into staging slots (then written with
``batch_put_from``: one copy from the paged cache to the Store).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from pymooncake.engine.hooks import KVLoadError, NullHooks, StepContext
from pymooncake.engine.kv_fetch import BlockFetch, StoreFetcher
from pymooncake.engine.kv_pacing import LOAD_SHARE, LoadPacer
from pymooncake.obs.logging import init_logger
from pymooncake.store.errors import ErrorCode

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


LOAD_MODES = ("layerwise", "async", "sync")
"""``StoreKVLoader`` modes (see the module docstring)."""
LOAD_TIMEOUT_S = 30.0
"""Longest ``before_layer`` waits for a layer group before the load fails (s)."""
TIMELINES_KEPT = 64
"""Finished loads whose ``BlockFetch`` (timeline) ``StoreKVLoader.timelines`` keeps."""


class StoreKVLoader(NullHooks):
    """Loads reusable prefix blocks from the Store into a prefill engine's paged cache.

    ``staging_blocks``: block slots of the registered staging buffer (loads and puts share
    it; a load's blocks beyond the free slots are read as ``bytes``). ``mode``: one of
    ``LOAD_MODES``. ``load_share``: the share of a core the fetch thread may use while
    the engine steps a decoding batch that waits for no load (``kv_pacing.LOAD_SHARE``,
    0.1; 1 = unpaced). Raises
    ``ValueError`` for an unknown mode or a share outside ``(0, 1]``.
    """

    def __init__(self, store: StoreClient, kv: KVTensors, namespace_digest: str,
                 staging_blocks: int = 64, mode: str = "layerwise",
                 load_timeout_s: float = LOAD_TIMEOUT_S,
                 load_share: float = LOAD_SHARE) -> None:
        if mode not in LOAD_MODES:
            raise ValueError(f"StoreKVLoader mode {mode!r}: use one of {', '.join(LOAD_MODES)}")
        self.store = store
        self.kv = kv
        self.ns = namespace_digest
        self.mode = mode
        self.load_timeout_s = load_timeout_s
        self._staging_blocks = staging_blocks
        self._staging: torch.Tensor | None = None
        self._staging_addr = 0
        self._free_slots: list[int] = []
        self._fetches: dict[str, BlockFetch] = {}
        """request id → its load (in flight, landed, or failed: then it answers 0)."""
        self.timelines: OrderedDict[str, BlockFetch] = OrderedDict()
        """The last ``TIMELINES_KEPT`` loads that ran in a step (benchmarks, tests)."""
        self._disabled: set[str] = set()
        self._hints: dict[str, int] = {}
        self._lock = threading.Lock()
        self._others_in_step = False
        self._step_imports: list[list[Any]] = []
        """Per load of the step: [request id, fetch, blocks, destination ids, source]."""
        self.num_loaded_blocks = 0
        self.num_put_blocks = 0
        self.clock: StageClock | None = None
        """Where ``store_lookup``, ``store_load`` and ``cache_load`` windows go
        (``engine.worker.stages``)."""
        self.pacer = LoadPacer(load_share)
        self.fetcher = StoreFetcher(store, kv, self._take_slots, self._give_slots,
                                    lambda s: self._staging_addr + s * kv.block_nbytes,
                                    self._slot_view, self._mark_lookup, self.pacer)

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
        self._drop(request_id)

    def close(self) -> None:
        """Stop the fetch thread (loads in flight are abandoned)."""
        self.fetcher.close()

    def _drop(self, request_id: str) -> None:
        f = self._fetches.pop(request_id, None)
        if f is not None:
            self.fetcher.cancel(f)

    def _mark_lookup(self, request_id: str, t0: float, t1: float) -> None:
        if self.clock is not None:
            self.clock.mark(request_id, "store_lookup", t0, t1)

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

    def _slot_view(self, slot: int) -> torch.Tensor:
        k = self.kv
        assert self._staging is not None
        raw = self._staging[slot * k.block_nbytes:(slot + 1) * k.block_nbytes]
        return raw.view(k.dtype).view(k.num_layers, 2, k.num_kv_heads, 1, k.block_size,
                                      k.head_dim)

    # -- KVLoadSource -------------------------------------------------------------------
    def set_running_batch(self, num_scheduled: int) -> None:
        """The scheduler's count of requests already in the step being built: a
        ``layerwise`` load starts computing early only into an otherwise empty step."""
        self._others_in_step = num_scheduled > 0

    def get_num_matched_tokens(self, req: Request, num_local_computed_tokens: int
                               ) -> int | None:
        """Tokens after ``num_local_computed_tokens`` the Store has loaded (whole blocks),
        or None while the lookup or the load is still in flight (ask again next step)."""
        rid = req.request_id
        if rid in self._disabled:
            return 0
        bs = self.kv.block_size
        first = num_local_computed_tokens // bs
        # at least one token is computed (CASES BUG-09): the last prompt token's block is
        # never loaded, so every block fetched here is loaded once the request runs
        keys = req.block_keys[first:(req.num_tokens - 1) // bs]
        if not keys or self._hints.get(rid, len(req.block_keys)) <= first:
            return 0
        f = self._fetches.get(rid)
        if f is not None and f.first_block != first:
            self._drop(rid)  # fetched for another starting block: not used
            f = None
        if f is None:
            # a request that will not start before its whole load (a busy engine, or not
            # the layerwise mode) gets every layer in one round of reads, not one per group
            f = self._fetches[rid] = self.fetcher.submit(
                rid, first, [store_key(self.ns, k) for k in keys],
                layerwise=self.mode == "layerwise" and not self._others_in_step)
        with self.fetcher.cond:
            if self.mode == "sync":  # the engine thread waits for the whole load
                self.pacer.engine_waits()
                self.fetcher.cond.wait_for(lambda: f.done, self.load_timeout_s)
            failed = f.error is not None
        if failed:
            self.fetcher.cancel(f)  # its slots back; the entry stays: no second lookup
            return 0
        with self.fetcher.cond:
            if f.num_blocks is None:
                return None
            # layerwise into an otherwise empty step: from the lookup on (the step's
            # before_layer(l) waits for l's group; nobody else waits with it)
            ready = f.all_landed or (self.mode == "layerwise" and not self._others_in_step)
            return f.num_blocks * bs if ready else None

    def wait_progress(self, timeout_s: float) -> None:
        """Engine thread with nothing to step but loads in flight: sleep until a load makes
        progress (or ``timeout_s``), instead of spinning on the scheduler."""
        self.pacer.engine_waits()
        with self.fetcher.cond:
            self.fetcher.cond.wait(timeout_s)

    def start_step(self, ctx: StepContext, kv: KVTensors) -> None:
        """Per load of the step: where its layers come from and go to (index tensors built
        once, not per layer). A step that decodes and loads nothing paces the fetch thread;
        one that loads waits for it (unpaced); one of prefills only leaves it unpaced."""
        if ctx.loads:
            self.pacer.engine_waits()
        elif any(s.num_new_tokens == 1 and s.num_computed_tokens > 0 for s in ctx.seqs):
            self.pacer.batch_step()  # a decode batch: its TBT is what pacing protects
        self._step_imports = []
        for ld in ctx.loads:
            f = self._fetches.get(ld.request_id)
            n = len(ld.block_ids)
            if (f is None or f.first_block != ld.first_token // kv.block_size
                    or f.num_blocks is None or f.num_blocks < n):
                f = None  # fails in before_layer(0), where the runner ends the step
            self._step_imports.append(
                [ld.request_id, f, n, torch.as_tensor(ld.block_ids, dtype=torch.int64), None])

    def _source(self, rid: str, f: BlockFetch, n: int) -> slice | torch.Tensor | None:
        """Where the load's blocks sit in the staging (a slot range or index), or None
        when some were read as ``bytes``. Raises ``KVLoadError`` when group 0 found fewer
        blocks intact than the step loads."""
        if len(f.views) < n:
            raise KVLoadError(f"request {rid}: {len(f.views)} store blocks arrived intact, "
                              f"{n} planned", (rid,))
        if len(f.slots) < n:
            return None
        s0 = f.slots[0]
        return (slice(s0, s0 + n) if f.slots[:n] == list(range(s0, s0 + n))
                else torch.as_tensor(f.slots[:n], dtype=torch.int64))

    def before_layer(self, layer: int, ctx: StepContext, kv: KVTensors) -> None:
        for item in self._step_imports:
            rid, f, n, dst, src = item
            if f is None:
                raise KVLoadError(f"request {rid}: store blocks missing", (rid,))
            err = f.wait_layer(layer, self.load_timeout_s)
            if err is not None:
                raise KVLoadError(f"request {rid}: {err}", (rid,))
            if layer == 0:  # group 0 is in: the blocks (and slots) are final
                src = item[4] = self._source(rid, f, n)
            t0 = time.time()
            if src is not None:  # [n, 2, H, bs, D] of the staging → [2, H, n, bs, D]
                data = self._staging_by_slot()[src, layer].permute(1, 2, 0, 3, 4)
                kv.buffer[layer].index_copy_(2, dst, data)
            else:
                kv.import_layer(layer, dst.tolist(),
                                torch.cat([b[layer] for b in f.views[:n]], dim=2))
            if self.clock is not None:
                self.clock.mark(rid, "cache_load", t0, time.time())

    def _staging_by_slot(self) -> torch.Tensor:
        """The staging buffer as ``[slot, layer, 2, kv_head, block_size, head_dim]``."""
        k = self.kv
        assert self._staging is not None
        return self._staging.view(k.dtype).view(self._staging_blocks, k.num_layers, 2,
                                                k.num_kv_heads, k.block_size, k.head_dim)

    def end_step(self, ctx: StepContext, kv: KVTensors) -> None:
        for ld in ctx.loads:
            self.num_loaded_blocks += len(ld.block_ids)
            f = self._fetches.get(ld.request_id)
            if f is not None:
                w = f.read_window()
                if self.clock is not None and w is not None:
                    self.clock.mark(ld.request_id, "store_load", *w)
                self.timelines[ld.request_id] = f
                while len(self.timelines) > TIMELINES_KEPT:
                    self.timelines.popitem(last=False)
            self._drop(ld.request_id)

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
        # Put first: ``put_start`` refuses a key the Store already has with
        # OBJECT_ALREADY_EXISTS in the same round trip and writes nothing for it. Only
        # those keys are then asked with ``batch_exist``, which says whether the Store
        # really holds them: a write still in progress (another client's, which may
        # yet fail) or replicas only on a segment this client knows is bad are not held
        # (docs/store.md, "exist agrees with get"), and it refreshes the held ones' LRU.
        if not block_keys:
            return []
        skeys = [store_key(self.ns, k) for k in block_keys]
        nb = self.kv.block_nbytes
        idx = range(len(block_keys))
        from_slots = [i for i in idx if isinstance(block_bytes[i], StagedBlock)]
        others = [i for i in idx if not isinstance(block_bytes[i], StagedBlock)]
        stored: list[str] = []
        held: list[str] = []
        exists: list[int] = []   # indices put_start refused as OBJECT_ALREADY_EXISTS
        try:
            if from_slots:
                errs = self.store.batch_put_from(
                    [skeys[i] for i in from_slots],
                    [self._staging_addr + block_bytes[i].slot * nb for i in from_slots],  # type: ignore[union-attr]
                    [nb] * len(from_slots))
                _sort_puts(block_keys, from_slots, errs, stored, exists)
            if others:
                values = [block_bytes[i] for i in others]
                values = [v.view(torch.uint8).reshape(-1).numpy()
                          if isinstance(v, torch.Tensor) else v for v in values]
                errs = self.store.batch_put([skeys[i] for i in others], values)
                _sort_puts(block_keys, others, errs, stored, exists)
            if exists:
                answers = self.store.batch_exist([skeys[i] for i in exists])
                held = [block_keys[i] for i, x in zip(exists, answers, strict=True)
                        if x is True]
        except Exception as e:  # noqa: BLE001 - master unreachable: only reuse is lost
            logger.warning("store put failed: %s", e)
        self.num_put_blocks += len(stored)
        return held + stored


def _sort_puts(keys: Sequence[str], idx: Sequence[int], errs: Sequence[object],
               stored: list[str], exists: list[int]) -> None:
    """Sort one ``batch_put*`` answer: ``None`` → ``stored`` (the key); OBJECT_ALREADY_EXISTS
    → ``exists`` (the index: held or not, ``batch_exist`` tells); other errors (no space,
    a failed write) → neither."""
    for i, e in zip(idx, errs, strict=True):
        if e is None:
            stored.append(keys[i])
        elif getattr(e, "code", None) == ErrorCode.OBJECT_ALREADY_EXISTS:
            exists.append(i)
