"""Model runner: step inputs (flattened tokens, positions, slots, block tables), the forward
pass with per-layer hooks, and the logits of the rows that sample."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from pymooncake.engine.hooks import LayerHooks, ScheduledSeq, StepContext
from pymooncake.engine.kv.kv_cache_manager import KVCacheManager
from pymooncake.engine.kv.kv_tensors import KVTensors
from pymooncake.engine.model.attention import AttentionMetadata, PrefillSeq
from pymooncake.engine.model.llama import LlamaForCausalLM
from pymooncake.engine.scheduler import SchedulerOutput


class ModelRunner:
    """Executes ``SchedulerOutput`` s on a ``LlamaForCausalLM`` over ``KVTensors``."""

    def __init__(self, model: LlamaForCausalLM, kv: KVTensors, kv_manager: KVCacheManager,
                 hooks: Sequence[LayerHooks] = (), use_decode_workspace: bool = True) -> None:
        self.model = model
        self.kv = kv
        self.kv_manager = kv_manager
        self.block_size = kv.block_size
        self.hooks = list(hooks)
        self.step_id = 0
        self.workspace: DecodeWorkspace | None = (
            DecodeWorkspace(kv) if use_decode_workspace else None)
        self.layer_compute_start_s: list[float] = []
        """``time.monotonic()`` at which each layer of the last step started computing
        (after its ``before_layer`` hooks returned): BUG-39's event timestamps."""

    def prepare(self, out: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor,
                                                     AttentionMetadata, list[int], StepContext]:
        """Inputs of one step. Returns (input_ids [T], positions [T], metadata, indices of
        the sampling rows in scheduled order, hook context)."""
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        prefills: list[PrefillSeq] = []
        decode_rows: list[int] = []
        decode_tables: list[list[int]] = []
        decode_ctx: list[int] = []
        decode_seq_index: list[int] = []
        sample_rows: list[int] = []
        seqs = []
        t = 0
        for s in out.scheduled:
            req, n = s.request, s.num_new_tokens
            start = req.num_computed_tokens
            block_ids = self.kv_manager.get_block_ids(req)
            seqs.append(ScheduledSeq(req.request_id, tuple(block_ids), start, n))
            if start < req.num_prompt_tokens:
                ids.extend(req.all_token_ids[start:start + n])
            else:
                ids.extend(req.output_token_ids[start - req.num_prompt_tokens:
                                                start - req.num_prompt_tokens + n])
            positions.extend(range(start, start + n))
            slots.extend(block_ids[p // bs] * bs + p % bs for p in range(start, start + n))
            if n == 1 and start > 0:
                decode_seq_index.append(len(seqs) - 1)
                decode_rows.append(t)
                decode_tables.append(block_ids)
                decode_ctx.append(start + 1)
            elif start == 0:
                prefills.append(PrefillSeq(t, n, n, None, None))
            else:
                ctx = start + n
                mask = (torch.arange(ctx)[None, :]
                        <= torch.arange(start, ctx)[:, None])
                ctx_blocks = torch.as_tensor(block_ids[:-(-ctx // bs)], dtype=torch.int64)
                prefills.append(PrefillSeq(t, n, ctx, ctx_blocks, mask))
            t += n
            if s.samples:
                sample_rows.append(t - 1)
        pos_t = torch.as_tensor(positions, dtype=torch.int64)
        meta = AttentionMetadata(torch.as_tensor(slots, dtype=torch.int64), prefills)
        if decode_rows:
            max_ctx = max(decode_ctx)
            max_blocks = -(-max_ctx // bs)
            table = [bids[:max_blocks] + [0] * (max_blocks - len(bids[:max_blocks]))
                     for bids in decode_tables]
            meta.decode_block_table = torch.as_tensor(table, dtype=torch.int64).view(-1)
            pos = torch.arange(max_ctx, dtype=torch.int64)
            ctx_t = torch.as_tensor(decode_ctx, dtype=torch.int64)
            meta.decode_bias = torch.zeros(1, len(decode_rows), 1, max_ctx,
                                           dtype=self.kv.dtype).masked_fill_(
                (pos[None, :] >= ctx_t[:, None])[None, :, None, :], float("-inf"))
            meta.decode_index = torch.as_tensor(decode_rows, dtype=torch.int64)
            meta.decode_positions = ctx_t - 1
            if self.workspace is not None:
                ids_in_order = tuple(seqs[i].request_id for i in decode_seq_index)
                ws, rebuild = self.workspace.prepare(ids_in_order, decode_ctx,
                                                     max_blocks * bs)
                meta.decode_workspace, meta.decode_rebuild = ws, rebuild
                cap = ws[0].shape[3]
                meta.decode_workspace_slots = (torch.arange(len(decode_rows)) * cap
                                               + meta.decode_positions)
        ctx = StepContext(self.step_id, tuple(seqs), tuple(out.loads))
        return torch.as_tensor(ids, dtype=torch.int64), pos_t, meta, sample_rows, ctx

    def execute(self, out: SchedulerOutput) -> torch.Tensor:
        """Run one step; returns float32 (float64 in fp64 mode) logits ``[num_sampling, vocab]``
        in scheduled order of the sampling requests.

        Raises ``KVLoadError`` from a ``before_layer`` hook (the step is then void).
        """
        input_ids, positions, meta, sample_rows, ctx = self.prepare(out)
        self.step_id += 1
        self.layer_compute_start_s = []
        for h in self.hooks:
            h.start_step(ctx, self.kv)

        def before(i: int) -> None:
            for h in self.hooks:
                h.before_layer(i, ctx, self.kv)
            self.layer_compute_start_s.append(time.monotonic())

        def after(i: int) -> None:
            for h in self.hooks:
                h.after_layer(i, ctx, self.kv)

        try:
            hidden = self.model(input_ids, positions, meta, self.kv.layer_caches,
                                before if self.hooks else _record(self.layer_compute_start_s),
                                after if self.hooks else None)
        except BaseException:
            if self.workspace is not None:  # a layer may have stopped half-way: refill
                self.workspace.invalidate()
            raise
        finally:
            # also after a failed load: hooks finish or cancel outstanding writes before
            # the scheduler frees (and may reuse) the blocks they target
            for h in self.hooks:
                h.end_step(ctx, self.kv)
        if not sample_rows:
            return torch.empty(0, self.model.config.vocab_size)
        return self.model.compute_logits(hidden[torch.as_tensor(sample_rows)])


def _record(times: list[float]):
    def before(_: int) -> None:
        times.append(time.monotonic())
    return before


class DecodeWorkspace:
    """The running decode batch's K/V, contiguous per sequence, kept across steps.

    A derived copy of the paged cache (which stays the source of truth and is written every
    step): while the decode batch keeps the same requests in the same order and each
    context grows by one token, a step only appends the new token's K/V here, instead of
    gathering every context from the paged blocks again (the gather dominated decode steps
    on CPU). Any change (a request joins, finishes or is preempted; a failed step) refills
    it from the paged cache with one gather per layer.
    """

    def __init__(self, kv: KVTensors) -> None:
        self.kv = kv
        self.tensors: list[torch.Tensor] | None = None
        self._ids: tuple[str, ...] | None = None
        self._ctx: list[int] = []

    def invalidate(self) -> None:
        self._ids = None

    def prepare(self, request_ids: tuple[str, ...], ctx_lens: list[int],
                padded_ctx: int) -> tuple[list[torch.Tensor], bool]:
        """The per-layer workspaces for this decode batch and whether to refill them."""
        kv = self.kv
        rebuild = (request_ids != self._ids
                   or any(c != p + 1 for c, p in zip(ctx_lens, self._ctx, strict=True)))
        cap_seqs = 0 if self.tensors is None else self.tensors[0].shape[2]
        cap_ctx = 0 if self.tensors is None else self.tensors[0].shape[3]
        if self.tensors is None or len(request_ids) > cap_seqs or padded_ctx > cap_ctx:
            seqs = max(len(request_ids), cap_seqs)
            ctx = max(padded_ctx + 16 * kv.block_size, cap_ctx)
            ctx = -(-ctx // kv.block_size) * kv.block_size
            self.tensors = [torch.zeros(2, kv.num_kv_heads, seqs, ctx, kv.head_dim,
                                        dtype=kv.dtype) for _ in range(kv.num_layers)]
            rebuild = True
        self._ids, self._ctx = request_ids, list(ctx_lens)
        return self.tensors, rebuild
