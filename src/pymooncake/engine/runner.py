"""Model runner: step inputs (flattened tokens, positions, slots, block tables), the forward
pass with per-layer hooks, and the logits of the rows that sample."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from pymooncake.engine import kernels
from pymooncake.engine.hooks import LayerHooks, ScheduledSeq, StepContext
from pymooncake.engine.kv.kv_cache_manager import KVCacheManager
from pymooncake.engine.kv.kv_tensors import KVTensors
from pymooncake.engine.model.attention import AttentionMetadata, DecodeGroup, PrefillSeq
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
        self.use_kernels = kv.dtype == torch.float32 and kernels.available()
        """Attention by the C kernels, reading the paged cache in place (float32: decode
        rows and prefill chunks); otherwise PyTorch SDPA, decode over the
        ``DecodeWorkspace`` (or a per-step gather)."""
        self.workspace: DecodeWorkspace | None = (
            DecodeWorkspace(kv) if use_decode_workspace and not self.use_kernels else None)
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
            elif self.use_kernels:  # the C kernel reads the context in place
                ctx = start + n
                prefills.append(PrefillSeq(t, n, ctx, None, None, torch.as_tensor(
                    block_ids[:-(-ctx // bs)], dtype=torch.int64)))
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
            meta.decode_index = torch.as_tensor(decode_rows, dtype=torch.int64)
            ctx_t = torch.as_tensor(decode_ctx, dtype=torch.int64)
            meta.decode_positions = ctx_t - 1
            if self.use_kernels:
                width = max(map(len, decode_tables))
                meta.decode_tables = torch.as_tensor(
                    [bids + [0] * (width - len(bids)) for bids in decode_tables],
                    dtype=torch.int64)
                meta.decode_ctx_lens = ctx_t
            elif self.workspace is not None:
                ids_in_order = tuple(seqs[i].request_id for i in decode_seq_index)
                meta.decode_groups = self.workspace.prepare(ids_in_order, decode_ctx,
                                                            decode_tables)
            else:
                max_ctx = max(decode_ctx)
                max_blocks = -(-max_ctx // bs)
                table = [bids[:max_blocks] + [0] * (max_blocks - len(bids[:max_blocks]))
                         for bids in decode_tables]
                meta.decode_block_table = torch.as_tensor(table, dtype=torch.int64).view(-1)
                meta.decode_bias = padding_bias(decode_ctx, max_ctx, self.kv.dtype)
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


def padding_bias(ctx_lens: list[int], width: int, dtype: torch.dtype) -> torch.Tensor:
    """``[1, len(ctx_lens), 1, width]``: 0 where a row's position < its context, -inf after."""
    pos = torch.arange(width, dtype=torch.int64)
    ctx_t = torch.as_tensor(ctx_lens, dtype=torch.int64)
    return torch.zeros(1, len(ctx_lens), 1, width, dtype=dtype).masked_fill_(
        (pos[None, :] >= ctx_t[:, None])[None, :, None, :], float("-inf"))


MIN_BUCKET_TOKENS = 64
"""Smallest context capacity of a decode workspace bucket (tokens)."""


def bucket_capacity(ctx: int) -> int:
    """The workspace bucket of a context of ``ctx`` tokens: the next power of two >= ctx,
    at least ``MIN_BUCKET_TOKENS``. A row wastes less than half its bucket."""
    return max(MIN_BUCKET_TOKENS, 1 << max(0, ctx - 1).bit_length())


class _Bucket:
    """Rows of one context capacity: per layer ``[2, kv_heads, rows, cap, head_dim]``; rows
    ``0..len(ids)-1`` are in use, in ``ids`` order (kept compact)."""

    __slots__ = ("cap", "tensors", "ids")

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.tensors: list[torch.Tensor] = []
        self.ids: list[str] = []

    @property
    def num_rows(self) -> int:
        return self.tensors[0].shape[2] if self.tensors else 0


class DecodeWorkspace:
    """The running decode batch's K/V, contiguous per sequence, kept across steps.

    A derived copy of the paged cache (which stays the source of truth and is written every
    step): while a request stays in the decode batch and its context grows by one token, a
    step only appends the new token's K/V here, instead of gathering every context from the
    paged blocks again (the gather dominated decode steps on CPU).

    Sequences are kept in buckets by context capacity (powers of two, ``bucket_capacity``);
    each bucket is one SDPA call per layer over its rows. Memory is therefore below twice
    the batch's total context, not batch size x longest context: the single padded
    workspace this replaced grew to ``max_num_seqs x longest context`` (13 GB peak for
    SmolLM2-135M with 50 requests of up to 2,700 tokens, issue 14) and was refilled
    whole whenever the batch changed. Here a request that joins, or outgrows its bucket,
    fills only its own row (one gather of its blocks); one that leaves frees its row (the
    bucket's last row moves into the hole). A bucket's storage grows by doubling its rows
    and is dropped once it is empty.
    """

    def __init__(self, kv: KVTensors) -> None:
        self.kv = kv
        self.buckets: dict[int, _Bucket] = {}
        self._where: dict[str, tuple[int, int]] = {}
        """request id -> (bucket capacity, row)."""
        self._ctx: dict[str, int] = {}
        """Context length of each request's row as of its last step (the row holds
        ``ctx - 1`` tokens before the step's layers write the new one)."""

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for b in self.buckets.values()
                   for t in b.tensors)

    def invalidate(self) -> None:
        """Forget every row (a step failed half-way): the next step refills them."""
        self.buckets.clear()
        self._where.clear()
        self._ctx.clear()

    def _remove(self, rid: str) -> None:
        cap, row = self._where.pop(rid)
        self._ctx.pop(rid, None)
        b = self.buckets[cap]
        last = len(b.ids) - 1
        if row != last:  # keep rows compact: the last row moves into the hole
            moved = b.ids[last]
            for t in b.tensors:
                t[:, :, row] = t[:, :, last]
            b.ids[row] = moved
            self._where[moved] = (cap, row)
        b.ids.pop()
        if not b.ids:
            del self.buckets[cap]

    def _add(self, rid: str, cap: int) -> int:
        kv = self.kv
        b = self.buckets.get(cap)
        if b is None:
            b = self.buckets[cap] = _Bucket(cap)
        row = len(b.ids)
        if row >= b.num_rows:
            rows = max(4, 2 * b.num_rows)
            # zeros, not empty: positions past a row's context are masked with -inf, but
            # 0 x NaN from uninitialised memory would still poison the attention output
            new = [torch.zeros(2, kv.num_kv_heads, rows, cap, kv.head_dim, dtype=kv.dtype)
                   for _ in range(kv.num_layers)]
            for old, t in zip(b.tensors, new, strict=False):
                t[:, :, :row] = old[:, :, :row]
            b.tensors = new
        b.ids.append(rid)
        self._where[rid] = (cap, row)
        return row

    def prepare(self, request_ids: tuple[str, ...], ctx_lens: list[int],
                block_tables: list[list[int]]) -> list[DecodeGroup]:
        """The decode batch (ids, context lengths incl. this step's token, block tables, in
        decode-row order) as one ``DecodeGroup`` per bucket."""
        bs = self.kv.block_size
        now = set(request_ids)
        for rid in [r for r in self._where if r not in now]:
            self._remove(rid)
        fills: dict[str, list[int]] = {}
        for rid, ctx, table in zip(request_ids, ctx_lens, block_tables, strict=True):
            where = self._where.get(rid)
            if where is not None and self._ctx.get(rid) == ctx - 1 and ctx <= where[0]:
                continue  # append this step's token
            if where is not None:
                self._remove(rid)
            self._add(rid, bucket_capacity(ctx))
            fills[rid] = table[:-(-ctx // bs)]
        for rid, ctx in zip(request_ids, ctx_lens, strict=True):
            self._ctx[rid] = ctx
        index = {rid: i for i, rid in enumerate(request_ids)}
        groups = []
        for cap, b in sorted(self.buckets.items()):
            order = [index[r] for r in b.ids]
            ctxs = [ctx_lens[i] for i in order]
            width = max(ctxs)
            app = [(row, ctx_lens[i] - 1) for row, (rid, i) in enumerate(zip(b.ids, order,
                                                                             strict=True))
                   if rid not in fills]
            groups.append(DecodeGroup(
                b.tensors, len(order), torch.as_tensor(order, dtype=torch.int64),
                padding_bias(ctxs, width, self.kv.dtype),
                torch.as_tensor([order[r] for r, _ in app], dtype=torch.int64),
                torch.as_tensor([r * cap + p for r, p in app], dtype=torch.int64),
                [(row, torch.as_tensor(fills[rid], dtype=torch.int64))
                 for row, rid in enumerate(b.ids) if rid in fills]))
        return groups
