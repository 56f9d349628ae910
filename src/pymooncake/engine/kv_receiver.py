"""P→D KV transfer, receiving side: per-request receive buffers in a registered arena, and
the ``KVLoadSource`` that moves arrived blocks into the decode engine's paged cache.

The arena is one shared-memory buffer registered with the Transfer Engine (same-host
prefill workers write it with one ``memmove`` over ``shm``; others over ``tcp``). A request
admitted by the Conductor gets ``num_blocks × block_nbytes`` bytes of it (``reserve``;
the Conductor asks for ``ceil(prompt / block_size)`` blocks); the prefill worker writes
the prompt's blocks there, the last one partial when the prompt is not a whole number of
blocks (only its first ``prompt % block_size`` token slots are meaningful); ``mark_ready``
says how many blocks arrived and so how many prompt tokens' KV is here (fewer than the
prompt's: the decode engine computes the rest).
When the request is scheduled, the engine asks ``get_num_matched_tokens`` (every prompt token that
arrived: the first step then computes only the token the prefill sampled, a plain decode
step) and loads the blocks into fresh paged blocks in ``before_layer`` (CASES BUG-39: a
layer's KV is in place before its attention runs; a request not ready is never loaded —
the load would raise ``KVLoadError``). Mooncake FAST'25 §3.1 step 4.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from pymooncake.engine.hooks import KVLoadError, NullHooks, StepContext
from pymooncake.obs import metrics
from pymooncake.obs.logging import init_logger
from pymooncake.rpc.messages import KVTarget
from pymooncake.store.tiers.dram_segment import OffsetAllocator

if TYPE_CHECKING:
    from pymooncake.engine.kv.kv_tensors import KVTensors
    from pymooncake.engine.request import Request
    from pymooncake.engine.worker.stages import StageClock
    from pymooncake.transfer import TransferEngine

logger = init_logger(__name__)

KV_CHECKSUM_FAILURES = metrics.counter(
    "pymooncake_decode_kv_checksum_failures_total",
    "P->D transfers whose received KV failed the sender's checksum (each recomputed its "
    "prompt on the decode worker)")

COOL_S = 10.0
"""A receive buffer freed before its KV was ready (an abort, a failed or re-placed prefill)
is given to another request only this long after (s), or sooner when nothing else fits
(``KVReceiver.reserve``): its writer may still be sending. A prefill worker killed
mid-write left TCP frames that the Transfer Engine server still applied after the space
had gone to another request, which then decoded from a few wrong KV bytes (a wrong token
in `tests/faults/test_pd_faults.py`). Under arena pressure the space is reused at once;
there the sender's checksum catches such bytes (``before_layer``: the request recomputes
its prompt; docs/serving.md, "Known limits")."""


@dataclass(slots=True)
class _Slot:
    offset: int
    num_reserved: int
    """Blocks the buffer was laid out for (``KVTarget.num_blocks``)."""
    num_blocks: int
    """Leading blocks that arrived (set by ``mark_ready``)."""
    num_tokens: int = 0
    """Prompt tokens whose KV arrived: ``num_blocks`` blocks, the last one possibly
    partial (set by ``mark_ready``)."""
    ready: bool = False
    digest: int | None = None
    """The prefill side's ``KVSender.digest`` of the ``num_blocks`` blocks, if sent."""


class KVReceiver(NullHooks):
    """Receive buffers for ``engine`` (a started Transfer Engine) sized ``arena_bytes``."""

    def __init__(self, engine: TransferEngine, kv: KVTensors, arena_bytes: int) -> None:
        self.engine = engine
        self.kv = kv
        self.block_nbytes = kv.block_nbytes
        self._shm = engine.allocate_shared(arena_bytes)
        self._arena = np.frombuffer(self._shm.view(), dtype=np.uint8)
        self._alloc = OffsetAllocator(arena_bytes)
        self.capacity_bytes = arena_bytes
        self.on_release: Callable[[], None] | None = None
        """Called (on the releasing thread) after a buffer is freed: the decode worker
        wakes the requests queued for receive space."""
        self._slots: dict[str, _Slot] = {}
        self._cooling: collections.deque[tuple[float, int, int]] = collections.deque()
        """Buffers freed before their KV was ready: (monotonic free time, offset, bytes),
        oldest first; reused last (``COOL_S``)."""
        self._cooling_bytes = 0
        self._lock = threading.Lock()
        self.num_loaded_blocks = 0
        self.num_corrupt = 0
        """Loads whose bytes failed the sender's digest (each recomputed its prompt)."""
        self.clock: StageClock | None = None
        """Where ``decode_load`` windows go (``engine.worker.stages``)."""

    @property
    def free_bytes(self) -> int:
        """Bytes a ``reserve`` may use: free, or cooling (given out when nothing else fits)."""
        return self._alloc.free_bytes + self._cooling_bytes

    def fits(self, num_blocks: int) -> bool:
        """Whether ``num_blocks`` blocks fit in the empty arena (else they never will)."""
        return num_blocks * self.block_nbytes <= self.capacity_bytes

    def reserve(self, request_id: str, num_blocks: int) -> KVTarget | None:
        """A receive buffer for ``num_blocks`` blocks, or ``None`` when the arena has no
        room for it now."""
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        with self._lock:
            if request_id in self._slots:
                raise ValueError(f"request {request_id!r} already has a receive buffer")
            self._uncool(time.monotonic() - COOL_S)
            off = self._alloc.allocate(num_blocks * self.block_nbytes)
            if off is None and self._cooling:
                self._uncool(float("inf"))      # nothing else fits: reuse them now
                off = self._alloc.allocate(num_blocks * self.block_nbytes)
            if off is None:
                return None
            self._slots[request_id] = _Slot(off, num_blocks, num_blocks)
        return KVTarget(self.engine.segment_name, self._shm.addr + off, num_blocks,
                        self.block_nbytes)

    def mark_ready(self, request_id: str, num_blocks: int,
                   num_prompt_tokens: int | None = None, digest: int | None = None) -> None:
        """The first ``num_blocks`` blocks of a ``num_prompt_tokens``-token prompt are in
        the request's buffer, the last one partial when they reach past the prompt's end
        (``None``: whole blocks). The prefill may send fewer than reserved; the rest is
        recomputed. ``digest``: the sender's ``KVSender.digest`` of those blocks, checked
        once they are loaded (``before_layer``). Raises ``KeyError`` if unknown."""
        with self._lock:
            slot = self._slots[request_id]
            slot.num_blocks = max(0, min(slot.num_reserved, num_blocks))
            slot.digest = digest if slot.num_blocks == num_blocks else None
            arrived = slot.num_blocks * self.kv.block_size
            slot.num_tokens = (arrived if num_prompt_tokens is None
                               else max(0, min(arrived, num_prompt_tokens)))
            slot.ready = True

    def release(self, request_id: str) -> None:
        """Free the request's buffer (loaded, aborted or failed); unknown ids are ignored."""
        with self._lock:
            slot = self._slots.pop(request_id, None)
            if slot is not None and slot.ready:
                self._alloc.free(slot.offset)
            elif slot is not None:   # its writer may still be sending: reused last
                nbytes = slot.num_reserved * self.block_nbytes
                self._cooling.append((time.monotonic(), slot.offset, nbytes))
                self._cooling_bytes += nbytes
        if slot is not None and self.on_release is not None:
            self.on_release()

    def _uncool(self, freed_before: float) -> None:
        """Give the allocator back the cooling buffers freed before ``freed_before``
        (monotonic s). Caller holds the lock."""
        while self._cooling and self._cooling[0][0] < freed_before:
            _, off, nbytes = self._cooling.popleft()
            self._alloc.free(off)
            self._cooling_bytes -= nbytes

    # -- KVLoadSource -------------------------------------------------------------------
    def get_num_matched_tokens(self, req: Request, num_local_computed_tokens: int) -> int:
        slot = self._slots.get(req.request_id)
        if slot is None or not slot.ready:
            return 0
        # the whole prompt when its partial last block came too (not a multiple of the
        # block size then: the scheduler takes it as all the prompt tokens it is)
        return max(0, slot.num_tokens - num_local_computed_tokens)

    def digest(self, request_id: str) -> int:
        """XXH3-64 of the request's arrived blocks as they lie in its buffer: per (layer,
        K/V, KV head) plane, the first ``num_blocks`` blocks' bytes (the order of
        ``KVSender.digest``). Raises ``KeyError`` if unknown."""
        import xxhash

        slot = self._slots[request_id]
        k = self.kv
        plane = slot.num_reserved * k.run_nbytes
        used = slot.num_blocks * k.run_nbytes
        h = xxhash.xxh3_64()
        for i in range(k.num_planes):
            start = slot.offset + i * plane
            h.update(self._arena[start:start + used])
        return h.intdigest()

    def blocks_of(self, request_id: str) -> torch.Tensor:
        """The request's receive buffer as ``[layer, K/V, kv_head, N, block_size, head_dim]``
        (a view, no copy). Raises ``KeyError`` if unknown."""
        slot = self._slots[request_id]
        k = self.kv
        raw = self._arena[slot.offset:slot.offset + slot.num_reserved * k.block_nbytes]
        return torch.from_numpy(raw).view(k.dtype).view(
            k.num_layers, 2, k.num_kv_heads, slot.num_reserved, k.block_size, k.head_dim)

    def before_layer(self, layer: int, ctx: StepContext, kv: KVTensors) -> None:
        for ld in ctx.loads:
            slot = self._slots.get(ld.request_id)
            if slot is None or not slot.ready:
                raise KVLoadError(f"request {ld.request_id}: KV not in the receive buffer",
                                  (ld.request_id,))
            first = ld.first_token // kv.block_size
            n = len(ld.block_ids)
            t0 = time.time()
            # a strided view of the receive buffer: index_copy_ reads it in place (no
            # contiguous staging copy per layer)
            data = self.blocks_of(ld.request_id)[layer, :, :, first:first + n]
            kv.import_layer(layer, ld.block_ids, data)
            if self.clock is not None:
                self.clock.mark(ld.request_id, "decode_load", t0, time.time())
            if layer == 0:
                self.num_loaded_blocks += n
            if layer == kv.num_layers - 1 and slot.digest is not None \
                    and self.digest(ld.request_id) != slot.digest:
                # bytes that are not what the prefill sent (a stale write of a dead
                # writer landed after the space was reused): this step is undone and the
                # request recomputes its prompt; the buffer cools before reuse
                self.num_corrupt += 1
                KV_CHECKSUM_FAILURES.inc()
                slot.ready = False
                logger.warning("request %s: received KV fails its checksum; recomputing "
                               "the prompt", ld.request_id)
                raise KVLoadError(f"request {ld.request_id}: received KV fails its "
                                  "checksum", (ld.request_id,))
            if layer == kv.num_layers - 1:
                # every layer is in the paged cache now: the buffer is free for the next
                # request (held until the request finished, it made the arena the limit
                # of the decode batch; issue 14). A step that fails later recomputes.
                self.release(ld.request_id)

    def close(self) -> None:
        with contextlib.suppress(Exception):  # the engine may be closed already
            self.engine.unregister_memory(self._shm.addr)
