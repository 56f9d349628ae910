"""One pipeline stage's share of a Llama-family model: a contiguous range of its layers.

``StageModel`` keeps layers ``[start, stop)`` of a ``LlamaForCausalLM`` (the other layers are
dropped, and with them their weights and oneDNN-packed copies), the token embedding on the
first stage and the final norm + LM head on the last. Between stages travels the residual
stream ``x`` ``[T, hidden]`` *before* layer ``start``'s input RMSNorm, so that the
concatenation of the stages computes exactly what ``LlamaForCausalLM.forward`` computes.

The float32 fused step repeats ``engine.model.fused.forward``'s per-layer calls (C RMSNorm,
RoPE + K/V write, oneDNN GEMMs with residual post-ops, ``paged_attention``): same calls,
same order, so a stage's K/V and hidden states are those of a single worker with the same
prefill chunks. Other dtypes run the layers' module path (``DecoderLayer.forward``).
"""

from __future__ import annotations

import torch
from torch import nn

from pymooncake.engine import kernels
from pymooncake.engine.model.attention import AttentionMetadata, paged_attention
from pymooncake.engine.model.llama import LlamaForCausalLM

MLP_ROWS = 1024
"""Rows per MLP pass (``fused.MLP_ROWS``): longer chunks run their MLP in slices."""


class StageModel:
    """Layers ``[start, stop)`` of ``model`` (which this takes over and prunes).

    ``first``: holds the embedding (``embed``); ``last``: the final norm and LM head
    (``forward`` then returns normed hidden states and ``logits`` works).
    """

    def __init__(self, model: LlamaForCausalLM, start: int, stop: int) -> None:
        n = model.config.num_layers
        if not 0 <= start < stop <= n:
            raise ValueError(f"stage layers [{start}, {stop}) not within [0, {n})")
        self.config = model.config
        self.start, self.stop = start, stop
        self.first, self.last = start == 0, stop == n
        self.fused = bool(model.use_fused_path)
        self.model = model
        self.layers = list(model.model.layers[start:stop])
        model.model.layers = nn.ModuleList(self.layers)  # the rest are freed
        if not self.first and not (self.last and self.config.tie_word_embeddings):
            model.model.embed_tokens = None  # type: ignore[assignment]
        if not self.last:
            model.lm_head = None  # type: ignore[assignment]
        self.dtype = next(iter(self.layers[0].parameters())).dtype

    @property
    def num_layers(self) -> int:
        return self.stop - self.start

    @torch.inference_mode()
    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """``[T, hidden]`` embeddings of ``token_ids`` ``[T]`` int64 (first stage only)."""
        if not self.first:
            raise RuntimeError("only the first stage embeds tokens")
        return self.model.model.embed_tokens.forward(token_ids)

    @torch.inference_mode()
    def forward(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """Run this stage's layers on the residual stream ``x`` ``[T, hidden]``.

        ``kv_caches[j]`` is layer ``start + j``'s paged cache. Returns the residual stream
        after layer ``stop - 1`` (to send to the next stage), or on the last stage the final
        normed hidden states (``LlamaForCausalLM.forward``'s result).
        """
        if len(kv_caches) != self.num_layers:
            raise ValueError(f"{len(kv_caches)} KV caches for {self.num_layers} layers")
        if self.fused and x.dtype == torch.float32 and kv_caches[0].dtype == torch.float32:
            return self._forward_fused(x.contiguous(), positions, meta, kv_caches)
        cos, sin = self.model._cos_sin(positions, x.dtype)
        for layer, cache in zip(self.layers, kv_caches, strict=True):
            x = layer.forward(x, cos, sin, cache, meta)
        return self.model.model.norm.forward(x) if self.last else x

    def _forward_fused(self, x: torch.Tensor, positions: torch.Tensor,
                       meta: AttentionMetadata, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        model = self.model
        model._cos_sin(positions, x.dtype)  # grows the table to cover positions
        cos_t, sin_t = (t.view(t.shape[0], -1) for t in model._rope_table)
        eps = self.config.rms_norm_eps
        t = x.shape[0]
        layers = self.layers
        h = kernels.rms_norm(x, layers[0].input_layernorm.weight, eps)
        for j, layer in enumerate(layers):
            attn = layer.self_attn
            qkv = attn.qkv_proj.forward(h)
            kernels.rope_write(qkv, positions, cos_t, sin_t, kv_caches[j], meta.slot_mapping,
                               attn.num_heads, attn.num_kv_heads)
            qs, ks = attn.q_size, attn.kv_size
            o = paged_attention(qkv[:, :qs].view(t, attn.num_heads, attn.head_dim),
                                qkv[:, qs:qs + ks].view(t, attn.num_kv_heads, attn.head_dim),
                                qkv[:, qs + ks:].view(t, attn.num_kv_heads, attn.head_dim),
                                kv_caches[j], meta, attn.scale, self.start + j)
            x = attn.o_proj.forward_add(o.reshape(t, qs), x)
            norm_w = layer.post_attention_layernorm.weight
            if t <= MLP_ROWS:
                x = layer.mlp.forward_add(kernels.rms_norm(x, norm_w, eps), x)
            else:
                for r in range(0, t, MLP_ROWS):
                    xr = x[r:r + MLP_ROWS]
                    xr.copy_(layer.mlp.forward_add(kernels.rms_norm(xr, norm_w, eps), xr))
            if j + 1 < len(layers):
                h = kernels.rms_norm(x, layers[j + 1].input_layernorm.weight, eps)
        if self.last:
            return kernels.rms_norm(x, model.model.norm.weight, eps)
        return x

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits ``[N, vocab]`` of final hidden rows (last stage only)."""
        if not self.last:
            raise RuntimeError("only the last stage has the LM head")
        return self.model.compute_logits(hidden)


def split_layers(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """Contiguous ``[start, stop)`` layer ranges of ``num_stages`` stages, as even as
    possible (earlier stages get the extra layers)."""
    if not 1 <= num_stages <= num_layers:
        raise ValueError(f"num_stages must be in [1, {num_layers}], got {num_stages}")
    base, extra = divmod(num_layers, num_stages)
    out, start = [], 0
    for i in range(num_stages):
        stop = start + base + (1 if i < extra else 0)
        out.append((start, stop))
        start = stop
    return out


def load_stage_model(model_spec: str, stage: int = 0, num_stages: int = 1,
                     dtype: str = "float32") -> StageModel:
    """Load ``model_spec`` (``Engine.from_model_name``'s ``--model``: ``tiny``,
    ``smollm2``, a GGUF file or HF directory) as the engine prepares it (oneDNN-packed
    weights, fused step when available) and keep stage ``stage`` of ``num_stages``'s layers
    (``split_layers``). Raises ``ModelLoadError`` / ``ValueError``."""
    from pymooncake.engine.config import EngineConfig
    from pymooncake.engine.engine import Engine
    eng = Engine.from_model_name(model_spec, EngineConfig(num_kv_blocks=1, dtype=dtype,
                                                          max_model_len=16))
    model = eng.model
    del eng
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage {stage} not in [0, {num_stages})")
    start, stop = split_layers(model.config.num_layers, num_stages)[stage]
    return StageModel(model, start, stop)
