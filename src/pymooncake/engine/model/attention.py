"""Paged attention over the block-table KV cache (vLLM PagedAttention's layout, in PyTorch).

All tokens of a step are flattened into one ``[T, ...]`` batch. Each layer first writes the
step's new K/V into the paged cache at ``slot_mapping`` (slot = block_id * block_size +
offset), then every sequence attends over its context read back through its block table.
Decode tokens (one query each) are batched into one padded SDPA call; prefill chunks run one
SDPA call each (causal; with a mask when a cached or earlier-chunk prefix precedes them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional as F


@dataclass(slots=True)
class PrefillSeq:
    """One prefill chunk in the flattened step batch.

    ``q_start``/``q_len`` index the step's token axis; ``ctx_len`` is the number of tokens
    attended (prefix already in the cache + this chunk). ``ctx_slots`` (``[ctx_len]`` int64)
    is ``None`` when the chunk is the whole context (no prefix): then K/V are used directly.
    ``mask`` is ``[q_len, ctx_len]`` bool (True = attend) when ``ctx_slots`` is set.
    """

    q_start: int
    q_len: int
    ctx_len: int
    ctx_slots: torch.Tensor | None
    mask: torch.Tensor | None


@dataclass(slots=True)
class AttentionMetadata:
    """Everything attention needs for one step; built once by the runner, shared by layers.

    ``slot_mapping``: ``[T]`` int64 cache slots for the step's new tokens.
    ``decode_index``: ``[Bd]`` int64 token indices of decode tokens (one per sequence).
    ``decode_slots``: ``[Bd, max_ctx]`` int64 context slots, padded with slot 0.
    ``decode_mask``: ``[Bd, 1, 1, max_ctx]`` bool, False on padding.
    """

    slot_mapping: torch.Tensor
    prefills: list[PrefillSeq]
    decode_index: torch.Tensor | None
    decode_slots: torch.Tensor | None
    decode_mask: torch.Tensor | None


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store new ``k, v`` ``[T, kv_heads, head_dim]`` into caches ``[num_blocks, block_size,
    kv_heads, head_dim]`` at ``slot_mapping``."""
    kv_heads, head_dim = k.shape[1], k.shape[2]
    k_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float) -> torch.Tensor:
    """Attention output ``[T, heads, head_dim]`` for queries ``q`` ``[T, heads, head_dim]``.

    ``k, v`` are this step's new keys/values (already written to the cache by
    ``write_kv``); prefix K/V are read from ``k_cache``/``v_cache`` through the slots.
    """
    num_tokens, num_heads, head_dim = q.shape
    kv_heads = k.shape[1]
    gqa = num_heads != kv_heads
    out = torch.empty_like(q)
    kc = k_cache.view(-1, kv_heads, head_dim)
    vc = v_cache.view(-1, kv_heads, head_dim)
    for seq in meta.prefills:
        s, n = seq.q_start, seq.q_len
        qs = q[s:s + n].transpose(0, 1).unsqueeze(0)
        if seq.ctx_slots is None:
            ks = k[s:s + n].transpose(0, 1).unsqueeze(0)
            vs = v[s:s + n].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale,
                                               enable_gqa=gqa)
        else:
            ks = kc[seq.ctx_slots].transpose(0, 1).unsqueeze(0)
            vs = vc[seq.ctx_slots].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=seq.mask, scale=scale,
                                               enable_gqa=gqa)
        out[s:s + n] = o[0].transpose(0, 1)
    if meta.decode_index is not None:
        assert meta.decode_slots is not None and meta.decode_mask is not None
        qd = q[meta.decode_index].unsqueeze(2)  # [Bd, heads, 1, D]
        kd = kc[meta.decode_slots].transpose(1, 2)  # [Bd, kv_heads, ctx, D]
        vd = vc[meta.decode_slots].transpose(1, 2)
        o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask,
                                           scale=scale, enable_gqa=gqa)
        out[meta.decode_index] = o.squeeze(2)
    return out
