"""P→D KV transfer, sending side: write a request's prompt KV blocks from the prefill
engine's paged cache into a decode worker's receive buffer with the Transfer Engine.

Zero copy on this side: the whole paged KV tensor (``KVTensors.buffer``, head-major
``[layer, K/V, kv_head, block, block_size, head_dim]``) is registered with the Transfer
Engine once, and WRITE requests go straight from it. The receive buffer of a request with
``N`` blocks is laid out the same way, ``[layer, K/V, kv_head, N, block_size, head_dim]``,
so a run of consecutive block ids is one request per (layer, K/V, KV head), and the
decode side imports one layer as one slice.

Mooncake FAST'25 §3.1 step 3 ships each layer as it finishes: ``LayerwiseKVSender`` is
the prefill engine's per-layer hook doing that; ``KVSender.send`` moves whole blocks at
once (all layers).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from pymooncake.engine.hooks import NullHooks, StepContext
from pymooncake.rpc.messages import KVTarget

if TYPE_CHECKING:
    from pymooncake.engine.kv.kv_tensors import KVTensors
    from pymooncake.engine.worker.stages import StageClock
    from pymooncake.transfer import TransferEngine


class KVTransferError(RuntimeError):
    """A P→D write failed (peer gone, range refused); the request cannot be decoded."""


class KVSender:
    """Writes paged-KV blocks to remote receive buffers. Registers ``kv.buffer`` at init."""

    def __init__(self, engine: TransferEngine, kv: KVTensors) -> None:
        self.engine = engine
        self.kv = kv
        self.base_addr = engine.register_memory(kv.buffer)
        self.bytes_sent = 0

    def requests(self, block_ids: Sequence[int], target: KVTarget,
                 layers: Sequence[int] | None = None, first_block: int = 0) -> list:
        """The WRITE requests moving ``block_ids`` (prompt blocks ``first_block``,
        ``first_block + 1``, … in order) into ``target``. Runs of consecutive block ids are
        one request per (layer, K/V, KV head): both ends are contiguous there."""
        from pymooncake.transfer import TransferOp, TransferRequest

        kv = self.kv
        if target.block_nbytes != kv.block_nbytes:
            raise KVTransferError(f"receive buffer block size {target.block_nbytes} B != this "
                                  f"engine's {kv.block_nbytes} B (different model or layout)")
        if first_block < 0 or first_block + len(block_ids) > target.num_blocks:
            raise KVTransferError(f"blocks [{first_block}, {first_block + len(block_ids)}) do "
                                  f"not fit the receive buffer of {target.num_blocks}")
        run = kv.block_size * kv.head_dim * kv.buffer.element_size()
        runs: list[tuple[int, int, int]] = []   # (first block id, first position, length)
        for j, block_id in enumerate(block_ids):
            if runs and runs[-1][0] + runs[-1][2] == block_id:
                b, pos, n = runs[-1]
                runs[-1] = (b, pos, n + 1)
            else:
                runs.append((block_id, first_block + j, 1))
        src_stride = kv.num_blocks * run
        dst_stride = target.num_blocks * run
        out = []
        for layer in (range(kv.num_layers) if layers is None else layers):
            for kind in (0, 1):
                for h in range(kv.num_kv_heads):
                    plane = (layer * 2 + kind) * kv.num_kv_heads + h
                    for block_id, pos, n in runs:
                        out.append(TransferRequest(
                            TransferOp.WRITE, self.base_addr + plane * src_stride + block_id * run,
                            target.segment, target.addr + plane * dst_stride + pos * run, n * run))
        return out

    def send(self, block_ids: Sequence[int], target: KVTarget,
             layers: Sequence[int] | None = None, timeout_s: float = 30.0) -> int:
        """Write the blocks and wait; returns bytes written. Raises ``KVTransferError``
        naming the first failure (nothing partial is reported as success)."""
        reqs = self.requests(block_ids, target, layers)
        if not reqs:
            return 0
        statuses = self.engine.batch_transfer_sync(reqs, timeout_s=timeout_s)
        for st in statuses:
            if not st.ok:
                raise KVTransferError(f"KV write to {target.segment} failed: "
                                      f"{getattr(st.code, 'value', st.code)}: {st.reason}")
        n = sum(r.length for r in reqs)
        self.bytes_sent += n
        return n


class LayerwiseKVSender(NullHooks):
    """Per-layer hook of a prefill engine: right after layer ``i`` of a step, WRITE layer
    ``i`` of every prompt block that is full after this step and not sent yet, to the
    request's ``KVTarget`` — so layer ``i``'s transfer overlaps layer ``i+1``'s compute
    (Mooncake FAST'25 §3.1 step 3). Blocks reused from the local cache or loaded from the
    Store in this step are sent too (their layer ``i`` is in place by ``after_layer(i)``).

    ``end_step`` waits for the step's writes (the scheduler may free the blocks right
    after); a failed write marks the request failed (``error``), nothing is retried.
    """

    def __init__(self, sender: KVSender, timeout_s: float = 30.0) -> None:
        self.sender = sender
        self.timeout_s = timeout_s
        self._targets: dict[str, KVTarget] = {}
        self.sent_blocks: dict[str, int] = {}
        """Request id → leading blocks whose every layer has been written."""
        self.errors: dict[str, str] = {}
        self.busy_s: dict[str, float] = {}
        """Request id → seconds this hook spent building, submitting and waiting for its
        writes (the part of the P→D transfer that did not overlap compute)."""
        self._step: dict[str, tuple[tuple[int, ...], int, int]] = {}
        self._batches: list[tuple[int, tuple[str, ...]]] = []
        self.clock: StageClock | None = None
        """Where ``p2d_transfer`` windows go (first WRITE submitted → last completed)."""

    def add(self, request_id: str, target: KVTarget) -> None:
        self._targets[request_id] = target
        self.sent_blocks[request_id] = 0

    def pop(self, request_id: str) -> tuple[int, str | None, float]:
        """Forget the request; returns (blocks sent, error or None, busy seconds)."""
        self._targets.pop(request_id, None)
        return (self.sent_blocks.pop(request_id, 0), self.errors.pop(request_id, None),
                self.busy_s.pop(request_id, 0.0))

    def _charge(self, t0: float) -> None:
        dt = time.monotonic() - t0
        for rid in self._step:
            self.busy_s[rid] = self.busy_s.get(rid, 0.0) + dt

    def start_step(self, ctx: StepContext, kv: KVTensors) -> None:
        self._step = {}
        self._batches = []
        bs = kv.block_size
        for s in ctx.seqs:
            target = self._targets.get(s.request_id)
            if target is None or s.request_id in self.errors:
                continue
            full = min((s.num_computed_tokens + s.num_new_tokens) // bs, target.num_blocks)
            first = self.sent_blocks[s.request_id]
            if full > first:
                self._step[s.request_id] = (s.block_ids, first, full)

    def after_layer(self, layer: int, ctx: StepContext, kv: KVTensors) -> None:
        if not self._step:
            return
        t0 = time.monotonic()
        try:
            self._submit_layer(layer)
        finally:
            self._charge(t0)

    def _submit_layer(self, layer: int) -> None:
        reqs = []
        rids = []
        for rid, (block_ids, first, full) in self._step.items():
            target = self._targets[rid]
            try:
                reqs.extend(self.sender.requests(block_ids[first:full], target, (layer,),
                                                 first_block=first))
            except KVTransferError as e:
                self.errors[rid] = str(e)
                continue
            rids.append(rid)
        if not reqs:
            return
        eng = self.sender.engine
        bid = eng.allocate_batch(len(reqs))
        try:
            eng.submit(bid, reqs)
        except Exception as e:  # noqa: BLE001 - the whole batch was refused
            eng.free_batch(bid)
            for rid in rids:
                self.errors[rid] = f"KV write refused: {e}"
            return
        self._batches.append((bid, tuple(rids)))
        self.sender.bytes_sent += sum(r.length for r in reqs)
        if self.clock is not None:
            t = time.time()
            for rid in rids:
                self.clock.mark(rid, "p2d_transfer", t, t)

    def end_step(self, ctx: StepContext, kv: KVTensors) -> None:
        t0 = time.monotonic()
        eng = self.sender.engine
        for bid, rids in self._batches:
            statuses = eng.wait(bid, self.timeout_s)
            bad = next((st for st in statuses if not st.ok), None)
            with contextlib.suppress(Exception):
                eng.free_batch(bid)
            if bad is not None:
                for rid in rids:
                    self.errors.setdefault(rid, f"KV write failed: "
                                           f"{getattr(bad.code, 'value', bad.code)}: "
                                           f"{bad.reason or bad.state}")
        t_end = time.time()
        for rid, (_, _, full) in self._step.items():
            if rid not in self.errors and rid in self.sent_blocks:
                self.sent_blocks[rid] = full
                if self.clock is not None and self._batches:
                    self.clock.mark(rid, "p2d_transfer", t_end, t_end)
        self._charge(t0)
        self._step = {}
        self._batches = []
