"""Paged attention over the block-table KV cache (vLLM PagedAttention's idea, in PyTorch).

Per layer the cache is ``[2, kv_heads, num_blocks, block_size, head_dim]`` (K, V). All
tokens of a step are flattened into one ``[T, ...]`` batch. Each layer first writes the
step's new K/V at their slots (slot = block_id * block_size + offset), then every sequence
attends over its context gathered through its block table, whole blocks at a time. Decode
tokens (one query each) are batched into one padded computation; prefill chunks run one SDPA
call each (causal; with a mask when a cached or earlier-chunk prefix precedes them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional as F

from pymooncake.engine import kernels
from pymooncake.engine.model.layers import EXACT_ALIGN, EXACT_CTX_CHUNK, exact_pointwise


@dataclass(slots=True)
class PrefillSeq:
    """One prefill chunk in the flattened step batch.

    ``q_start``/``q_len`` index the step's token axis; ``ctx_len`` is the number of tokens
    attended (prefix already in the cache + this chunk). ``ctx_blocks`` (``[num_blocks]``
    int64 block ids covering ``ctx_len``) is ``None`` when the chunk is the whole context
    (no prefix): then K/V are used directly. ``mask`` is ``[q_len, ctx_len]`` bool (True =
    attend) when ``ctx_blocks`` is set.
    """

    q_start: int
    q_len: int
    ctx_len: int
    ctx_blocks: torch.Tensor | None
    mask: torch.Tensor | None
    kernel_blocks: torch.Tensor | None = None
    """``[ceil(ctx_len / block_size)]`` int64 block ids when the C kernel attends in place
    (``kernels.prefill_attention``, float32); ``None`` keeps the SDPA path."""


@dataclass(slots=True)
class AttentionMetadata:
    """Everything attention needs for one step; built once by the runner, shared by layers.

    ``slot_mapping``: ``[T]`` int64 slot (block id * block_size + offset) of each new token.
    ``decode_index``: ``[Bd]`` int64 token indices of decode tokens (one per sequence).
    ``decode_block_table``: ``[Bd * max_blocks]`` int64 block ids, row-major, padded with 0.
    ``decode_bias``: ``[1, Bd, 1, max_blocks * block_size]`` float, 0 or -inf on padding.
    """

    slot_mapping: torch.Tensor
    prefills: list[PrefillSeq]
    decode_index: torch.Tensor | None = None
    decode_block_table: torch.Tensor | None = None
    decode_bias: torch.Tensor | None = None
    decode_groups: list[DecodeGroup] | None = None
    """The decode batch split by workspace bucket (``runner.DecodeWorkspace``: the batch's
    K/V contiguous per sequence, a derived copy of the paged cache); ``None`` gathers from
    the paged cache every step (``decode_block_table``/``decode_bias``)."""
    decode_positions: torch.Tensor | None = None
    """``[Bd]`` int64 position of each decode token (its context length - 1)."""
    decode_tables: torch.Tensor | None = None
    """``[Bd, W]`` int64 block tables (rows padded with 0) when the C kernel reads the
    paged cache in place (``kernels.paged_decode``); then ``decode_ctx_lens`` is set too."""
    decode_ctx_lens: torch.Tensor | None = None
    """``[Bd]`` int64 context length of each decode row (incl. this step's token)."""


@dataclass(slots=True)
class DecodeGroup:
    """The decode rows of one workspace bucket (indices are into the step's decode rows).

    ``tensors``: per layer ``[2, kv_heads, rows_allocated, cap, head_dim]``; rows
    ``0..num_rows-1`` belong to ``index`` (decode rows, in row order). ``bias``
    ``[1, num_rows, 1, width]`` masks each row past its context. ``append_index`` /
    ``append_slots``: decode rows whose new K/V go to ``row * cap + position``; ``fills``:
    ``(row, block ids)`` rows refilled from the paged cache (joined or moved bucket).
    """

    tensors: list[torch.Tensor]
    num_rows: int
    index: torch.Tensor
    bias: torch.Tensor
    append_index: torch.Tensor
    append_slots: torch.Tensor
    fills: list[tuple[int, torch.Tensor]]


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             meta: AttentionMetadata) -> None:
    """Store new ``k, v`` ``[T, kv_heads, head_dim]`` at the step's slots of a layer's
    ``[2, kv_heads, num_blocks, block_size, head_dim]`` cache (one ``index_copy_``)."""
    two, h, nb, bs, d = kv_cache.shape
    kv_cache.view(two, h, nb * bs, d).index_copy_(
        2, meta.slot_mapping, torch.stack((k, v)).transpose(1, 2))


def gather_blocks(kv_cache: torch.Tensor, block_ids: torch.Tensor,
                  num_seqs: int) -> torch.Tensor:
    """``[2, kv_heads, num_seqs, num_blocks_per_seq * block_size, head_dim]`` (K and V) from
    a layer cache ``[2, kv_heads, num_blocks, block_size, head_dim]`` and row-major
    ``block_ids``: one gather for K and V together, and no transpose copy."""
    g = kv_cache.index_select(2, block_ids)
    _, h, n, bs, d = g.shape
    return g.view(2, h, num_seqs, (n // num_seqs) * bs, d)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    kv_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, layer: int = 0) -> torch.Tensor:
    """Attention output ``[T, heads, head_dim]`` for queries ``q`` ``[T, heads, head_dim]``.

    ``k, v`` are this step's new keys/values (already written by ``write_kv``); prefix K/V
    are read from the layer's ``kv_cache`` through the block tables.
    """
    if q.dtype == torch.float64:
        return _exact_paged_attention(q, kv_cache, meta, scale)
    num_heads = q.shape[1]
    kv_heads = k.shape[1]
    gqa = num_heads != kv_heads
    if not meta.prefills and meta.decode_index is not None:  # pure decode step
        return _decode(q, k, v, kv_cache, meta, scale, layer)
    out = torch.empty_like(q)
    for seq in meta.prefills:
        s, n = seq.q_start, seq.q_len
        if seq.kernel_blocks is not None:
            kernels.prefill_attention(q[s:s + n], kv_cache, seq.kernel_blocks, seq.ctx_len,
                                      scale, out[s:s + n])
            continue
        qs = q[s:s + n].transpose(0, 1).unsqueeze(0)
        if seq.ctx_blocks is None:
            ks = k[s:s + n].transpose(0, 1).unsqueeze(0)
            vs = v[s:s + n].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale,
                                               enable_gqa=gqa)
        else:
            kvs = gather_blocks(kv_cache, seq.ctx_blocks, 1)[:, :, 0, :seq.ctx_len]
            ks, vs = kvs[0].unsqueeze(0), kvs[1].unsqueeze(0)
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=seq.mask, scale=scale,
                                               enable_gqa=gqa)
        out[s:s + n] = o[0].transpose(0, 1)
    if meta.decode_index is not None:
        idx = meta.decode_index
        out[idx] = _decode(q[idx], k[idx], v[idx], kv_cache, meta, scale, layer)
    return out


def exact_attention(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """Causal attention of ``n`` query rows ``q`` ``[n, heads, D]`` over one sequence's
    context ``kc, vc`` ``[kv_heads, ctx, D]``; query ``i`` sits at position ``ctx - n + i``.
    Returns ``[n, heads, D]``.

    The fp64 (batch-invariant) mode's attention. A token's bits depend only on its own
    query, position and context up to its position: not on how many query rows the chunk
    has (a whole prefill, a recomputed last block, a decode step), nor on how long the
    context is past its position, nor on other sequences in the step. Every reduction has a
    fixed shape and order:

    * the context is cut into chunks of ``EXACT_CTX_CHUNK`` positions at fixed absolute
      offsets (zero-padded at the end), and each GEMM is one token's query heads of one KV
      head (GQA group) against one chunk: ``[group, D] @ [D, C]`` for the scores,
      ``[group, C] @ [C, D + 1]`` for ``exp(scores - max) @ [V | 1]`` (the softmax
      denominator is the GEMM's extra column), batched over tokens with a shared operand;
      rows are zero-padded to multiples of ``EXACT_ALIGN`` (64-byte aligned, see there);
    * the row maximum is exact (order-free), ``exp`` runs through ``exact_pointwise``;
    * the chunks' partial outputs are added in chunk order. A chunk wholly past the token's
      position has all-zero weights and adds exact zeros, so a longer context (the cold
      prefill's later tokens) leaves the bits unchanged.

    (A single GEMM over the whole context, or a softmax over it, depends on ``ctx``: MKL's
    dgemm and the vectorised softmax reduce in another order for another length, ~1e-16
    relative, which was BUG-42's fp64 cold/warm mismatch on an AMD EPYC.)
    """
    n, num_heads, d = q.shape
    kv_heads, ctx, _ = kc.shape
    group = num_heads // kv_heads
    c = EXACT_CTX_CHUNK
    chunks = -(-ctx // c)
    pad = chunks * c - ctx
    dq = -(-d // EXACT_ALIGN) * EXACT_ALIGN  # rows padded to 64-byte multiples (zeros)
    dv = -(-(d + 1) // EXACT_ALIGN) * EXACT_ALIGN
    # [kv, chunks, D', C] and [kv, chunks, C, [V | 1 | 0]], each chunk contiguous
    kt = F.pad(kc, (0, dq - d, 0, pad)).view(kv_heads, chunks, c, dq).transpose(2, 3)
    kt = kt.contiguous()
    ones = torch.ones(kv_heads, ctx, 1, dtype=vc.dtype)
    va = F.pad(torch.cat((vc, ones), dim=-1), (0, dv - d - 1, 0, pad)).view(
        kv_heads, chunks, c, dv)
    qh = F.pad(q.view(n, kv_heads, group, d).transpose(0, 1), (0, dq - d)).contiguous()
    scores = torch.empty(kv_heads, chunks, n, group, c, dtype=q.dtype)
    for h in range(kv_heads):  # [kv, n, group, D'] x [D', C] per token
        for j in range(chunks):
            torch.bmm(qh[h], kt[h, j].expand(n, dq, c), out=scores[h, j])
    pos = ctx - n + torch.arange(n)
    cols = torch.arange(chunks * c).view(chunks, 1, 1, c)
    scores.mul_(scale).masked_fill_(cols > pos.view(1, n, 1, 1), float("-inf"))
    top = scores.amax(dim=(1, 4), keepdim=True)  # [kv, 1, n, group, 1]; finite (pos 0)
    weights = exact_pointwise(torch.exp, scores - top)
    out = torch.empty(n, kv_heads, group, d, dtype=q.dtype)
    for h in range(kv_heads):
        acc = torch.bmm(weights[h, 0], va[h, 0].expand(n, c, dv))
        for j in range(1, chunks):
            acc = acc + torch.bmm(weights[h, j], va[h, j].expand(n, c, dv))
        out[:, h] = acc[..., :d] / acc[..., d:d + 1]
    return out.view(n, num_heads, d)


def _exact_paged_attention(q: torch.Tensor, kv_cache: torch.Tensor,
                           meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """``paged_attention`` in the fp64 mode: every prefill chunk and every decode token
    through ``exact_attention`` over its own context, read from the paged cache (the new
    K/V were written there by ``write_kv``)."""
    out = torch.empty_like(q)
    for seq in meta.prefills:
        s, n = seq.q_start, seq.q_len
        if seq.ctx_blocks is None:  # no prefix: the context is this chunk's own slots
            two, h, nb, bs, d = kv_cache.shape
            kvs = kv_cache.view(two, h, nb * bs, d).index_select(
                2, meta.slot_mapping[s:s + n])
        else:
            kvs = gather_blocks(kv_cache, seq.ctx_blocks, 1)[:, :, 0, :seq.ctx_len]
        kc, vc = kvs[0], kvs[1]
        out[s:s + n] = exact_attention(q[s:s + n], kc, vc, scale)
    if meta.decode_index is not None:
        assert meta.decode_block_table is not None and meta.decode_positions is not None
        bd = meta.decode_index.shape[0]
        table = meta.decode_block_table.view(bd, -1)
        bs = kv_cache.shape[3]
        for i, row in enumerate(meta.decode_index.tolist()):
            ctx = int(meta.decode_positions[i]) + 1
            kvs = gather_blocks(kv_cache, table[i, :-(-ctx // bs)], 1)[:, :, 0, :ctx]
            out[row:row + 1] = exact_attention(q[row:row + 1], kvs[0], kvs[1], scale)
    return out


def _decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
            meta: AttentionMetadata, scale: float, layer: int) -> torch.Tensor:
    if meta.decode_tables is not None and meta.decode_ctx_lens is not None:
        return kernels.paged_decode(q, kv_cache, meta.decode_tables, meta.decode_ctx_lens,
                                    scale)
    if meta.decode_groups is None:
        assert meta.decode_block_table is not None and meta.decode_bias is not None
        return _decode_attention(q, kv_cache, meta.decode_block_table, meta.decode_bias, scale)
    if len(meta.decode_groups) == 1 and meta.decode_groups[0].num_rows == q.shape[0]:
        g = meta.decode_groups[0]
        return _decode_group(q[g.index], k, v, kv_cache, g, scale, layer)[
            torch.argsort(g.index)]
    out = torch.empty_like(q)
    for g in meta.decode_groups:
        out[g.index] = _decode_group(q[g.index], k, v, kv_cache, g, scale, layer)
    return out


def _decode_group(qg: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                  g: DecodeGroup, scale: float, layer: int) -> torch.Tensor:
    """One bucket's rows: refill the new ones from the paged cache (their new K/V are
    already there), append this step's K/V to the others, attend."""
    ws = g.tensors[layer]
    two, h, rows, cap, d = ws.shape
    for row, blocks in g.fills:
        kvs = gather_blocks(kv_cache, blocks, 1)[:, :, 0]
        n = min(cap, kvs.shape[2])
        ws[:, :, row, :n] = kvs[:, :, :n]
    if g.append_index.numel():
        ws.view(two, h, rows * cap, d).index_copy_(
            2, g.append_slots,
            torch.stack((k[g.append_index], v[g.append_index])).transpose(1, 2))
    width = g.bias.shape[-1]
    return _attend(qg, ws[0, :, :g.num_rows, :width], ws[1, :, :g.num_rows, :width],
                   g.bias, scale)


def _attend(q: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor, bias: torch.Tensor,
            scale: float) -> torch.Tensor:
    """``q`` ``[Bd, heads, D]`` over ``kb, vb`` ``[kv_heads, Bd, ctx, D]`` + ``bias``."""
    bd, num_heads, head_dim = q.shape
    kv_heads = kb.shape[0]
    # KV heads as the batch axis and sequences as the head axis: the query heads of one KV
    # head (GQA group) are that "head"'s queries, so SDPA needs no K/V repeat
    qh = q.view(bd, kv_heads, num_heads // kv_heads, head_dim).transpose(0, 1)
    o = F.scaled_dot_product_attention(qh, kb, vb, attn_mask=bias, scale=scale)
    return o.transpose(0, 1).reshape(bd, num_heads, head_dim)  # [Bd, heads, D]


def _decode_attention(q: torch.Tensor, kv_cache: torch.Tensor,
                      block_table: torch.Tensor, bias: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """One query per sequence: ``q`` ``[Bd, heads, D]`` → ``[Bd, heads, D]``, K/V gathered
    from the paged cache. The query heads sharing a KV head (GQA) are grouped, so K/V are
    never repeated."""
    bd = q.shape[0]
    kvb = gather_blocks(kv_cache, block_table, bd)  # [2, kv_heads, Bd, ctx, D]
    ctx = bias.shape[-1]
    return _attend(q, kvb[0, :, :, :ctx], kvb[1, :, :, :ctx], bias, scale)
