"""The fused float32 step of ``LlamaForCausalLM`` (docs/engine.md, "The fused float32 step").

Same maths as the module path in few calls per layer: RMSNorm and RoPE + the K/V write by
the C kernels (``engine.kernels``), the qkv / o / gate|up / down GEMMs on oneDNN with the
residual adds as post-ops, the SiLU-multiply in C, attention by ``paged_attention`` (the C
kernels read the paged cache in place). A pure decode step of up to
``DecodeLayers.max_rows`` sequences (``kernels.decode_rows_max``) runs each layer as one C call
(``kernels.DecodeLayers``) that streams each ``[out, in]`` weight once for all its rows and
gives every sequence the floats it gets decoded alone. The engine turns it on
(``LlamaForCausalLM.use_fused_path``) when oneDNN is on and the kernels built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from pymooncake.engine import kernels
from pymooncake.engine.model.attention import AttentionMetadata, paged_attention

if TYPE_CHECKING:
    from pymooncake.engine.model.llama import LayerCallback, LlamaForCausalLM

MLP_ROWS = 1024
"""Rows per MLP pass: a 16 x 512-token prefill step runs its MLP GEMMs 1,024 rows at a
time (the ``[rows, intermediate]`` activations stay in cache; on the 2-core AMD EPYC box
16 x 512-token prefill went from ~800 to ~880 tok/s)."""


def gemv_ready(model: LlamaForCausalLM) -> bool:
    """Every weight a one-row step reads is ``[out, in]`` contiguous float32, the layout
    ``kernels.gemv`` streams (not ``layers.use_input_major_weights``')."""
    linears = [model.lm_head] + [m for layer in model.model.layers
                                 for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                           layer.mlp.gate_up_proj, layer.mlp.down_proj)]
    return all(m.weight.is_contiguous() and m.weight.dtype == torch.float32 for m in linears)


def _gemv_ok(model: LlamaForCausalLM) -> bool:
    """``gemv_ready(model)``, checked once per model (the weights' layout is set at load),
    not on every one-row step."""
    ok = model.__dict__.get("_gemv_ok")
    if ok is None:
        ok = model.__dict__["_gemv_ok"] = gemv_ready(model)
    return ok


def _decode_layers(model: LlamaForCausalLM,
                   kv_caches: list[torch.Tensor]) -> kernels.DecodeLayers | None:
    """The model's ``kernels.DecodeLayers`` for these caches (built once per set of caches),
    or None when a layer does not fit its layout (then the per-call path runs)."""
    cached = model.__dict__.get("_decode_layers")
    key = tuple(c.data_ptr() for c in kv_caches)
    if cached is not None and (cached is False or cached.key == key):
        return cached or None
    layers = list(model.model.layers)
    lm = model.lm_head.weight  # its bytes count towards max_rows (compute_logits)
    try:
        dl = kernels.DecodeLayers(layers, kv_caches, model.config.rms_norm_eps,
                                  extra_weight_bytes=lm.numel() * lm.element_size())
    except ValueError:
        model.__dict__["_decode_layers"] = False
        return None
    model.__dict__["_decode_layers"] = dl
    return dl


def forward(model: LlamaForCausalLM, x: torch.Tensor, positions: torch.Tensor,
            meta: AttentionMetadata, kv_caches: list[torch.Tensor],
            before_layer: LayerCallback | None,
            after_layer: LayerCallback | None) -> torch.Tensor:
    """Final hidden states ``[T, hidden]`` float32 of the embedded step ``x`` ``[T, hidden]``
    (the caller's contract is ``LlamaForCausalLM.forward``'s)."""
    t = x.shape[0]
    if t <= kernels.DECODE_ROWS_MAX and _gemv_ok(model):
        dl = (_decode_layers(model, kv_caches) if not meta.prefills
              and meta.decode_tables is not None and meta.decode_ctx_lens is not None
              else None)
        if dl is not None and t <= dl.max_rows:
            return _forward_decode(model, dl, x, positions, meta, before_layer, after_layer,
                                   *rope_tables(model, positions, x.dtype))
        if t == 1:
            return _forward_one_row(model, x, positions, meta, kv_caches, before_layer,
                                    after_layer, *rope_tables(model, positions, x.dtype))
    return forward_layers(model, list(model.model.layers), 0, x, positions, meta, kv_caches,
                          model.model.norm.weight, before_layer, after_layer)


def rope_tables(model: LlamaForCausalLM, positions: torch.Tensor,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's RoPE ``cos, sin`` tables ``[P, head_dim]``, grown to cover ``positions``."""
    cos_t, sin_t = model.rope_table(positions, dtype)
    return cos_t.view(cos_t.shape[0], -1), sin_t.view(sin_t.shape[0], -1)


def forward_layers(model: LlamaForCausalLM, layers: list[Any], first: int, x: torch.Tensor,
                   positions: torch.Tensor, meta: AttentionMetadata,
                   kv_caches: list[torch.Tensor], final_norm: torch.Tensor | None,
                   before_layer: LayerCallback | None = None,
                   after_layer: LayerCallback | None = None) -> torch.Tensor:
    """Run ``layers`` (model layers ``first``, ``first + 1``, ...; ``kv_caches[j]`` is the
    cache of ``layers[j]``) on the residual stream ``x`` ``[T, hidden]`` float32. Returns
    the stream normed by ``final_norm`` (weight ``[hidden]``) after the last layer, or the
    raw stream when ``final_norm`` is None (a pipeline stage before the last: the next
    stage's first layer norms it). Hooks get model layer indices."""
    cos_t, sin_t = rope_tables(model, positions, x.dtype)
    eps = model.config.rms_norm_eps
    t = x.shape[0]
    h = kernels.rms_norm(x, layers[0].input_layernorm.weight, eps)
    for j, layer in enumerate(layers):
        i = first + j
        if before_layer is not None:
            before_layer(i)
        attn = layer.self_attn
        qkv = attn.qkv_proj.forward(h)
        kernels.rope_write(qkv, positions, cos_t, sin_t, kv_caches[j], meta.slot_mapping,
                           attn.num_heads, attn.num_kv_heads)
        qs, ks = attn.q_size, attn.kv_size
        o = paged_attention(qkv[:, :qs].view(t, attn.num_heads, attn.head_dim),
                            qkv[:, qs:qs + ks].view(t, attn.num_kv_heads, attn.head_dim),
                            qkv[:, qs + ks:].view(t, attn.num_kv_heads, attn.head_dim),
                            kv_caches[j], meta, attn.scale, i)
        x = attn.o_proj.forward_add(o.reshape(t, qs), x)
        norm_w = layer.post_attention_layernorm.weight
        if t <= MLP_ROWS:
            x = layer.mlp.forward_add(kernels.rms_norm(x, norm_w, eps), x)
        else:  # rows in chunks: the [rows, intermediate] activations stay in cache
            for r in range(0, t, MLP_ROWS):
                xr = x[r:r + MLP_ROWS]
                xr.copy_(layer.mlp.forward_add(kernels.rms_norm(xr, norm_w, eps), xr))
        if after_layer is not None:
            after_layer(i)
        if j + 1 < len(layers):
            h = kernels.rms_norm(x, layers[j + 1].input_layernorm.weight, eps)
    return kernels.rms_norm(x, final_norm, eps) if final_norm is not None else x


def _forward_decode(model: LlamaForCausalLM, dl: kernels.DecodeLayers, x: torch.Tensor,
                    positions: torch.Tensor, meta: AttentionMetadata,
                    before_layer: LayerCallback | None, after_layer: LayerCallback | None,
                    cos_t: torch.Tensor, sin_t: torch.Tensor) -> torch.Tensor:
    """``forward`` for a pure decode step of ``m <= dl.max_rows`` sequences
    (``x`` ``[m, hidden]``, row r the token of ``meta.decode_tables[r]``): each layer one
    C call (``kernels.DecodeLayers``) that reads every weight once for the m rows; each
    row's floats are those of its sequence decoded alone."""
    dl.set_step(positions.tolist(), meta.slot_mapping.tolist(), meta.decode_tables,
                meta.decode_ctx_lens.tolist(), cos_t, sin_t)
    x = x.contiguous().clone()  # updated in place, layer by layer
    for i in range(len(model.model.layers)):
        if before_layer is not None:
            before_layer(i)
        dl.run(i, x)
        if after_layer is not None:
            after_layer(i)
    return kernels.rms_norm(x, model.model.norm.weight, model.config.rms_norm_eps)


def _forward_one_row(model: LlamaForCausalLM, x: torch.Tensor, positions: torch.Tensor,
                     meta: AttentionMetadata, kv_caches: list[torch.Tensor],
                     before_layer: LayerCallback | None, after_layer: LayerCallback | None,
                     cos_t: torch.Tensor, sin_t: torch.Tensor) -> torch.Tensor:
    """``forward`` for a one-token step without ``kernels.DecodeLayers`` (a one-token
    prefill, or a layer layout it does not take): every linear layer a
    ``kernels.gemv`` streaming the ``[out, in]`` weight once (memory-bound: oneDNN's
    one-row GEMM streams it slower on the 2-core AMD EPYC box), the SiLU-multiply by
    ``kernels.silu_mul``, residual adds folded into the GEMVs."""
    layers = model.model.layers
    eps = model.config.rms_norm_eps
    h = kernels.rms_norm(x, layers[0].input_layernorm.weight, eps)
    for i, layer in enumerate(layers):
        if before_layer is not None:
            before_layer(i)
        attn, mlp = layer.self_attn, layer.mlp
        qkv = kernels.gemv(h, attn.qkv_proj.weight, attn.qkv_proj.bias)
        kernels.rope_write(qkv, positions, cos_t, sin_t, kv_caches[i], meta.slot_mapping,
                           attn.num_heads, attn.num_kv_heads)
        qs, ks = attn.q_size, attn.kv_size
        o = paged_attention(qkv[:, :qs].view(1, attn.num_heads, attn.head_dim),
                            qkv[:, qs:qs + ks].view(1, attn.num_kv_heads, attn.head_dim),
                            qkv[:, qs + ks:].view(1, attn.num_kv_heads, attn.head_dim),
                            kv_caches[i], meta, attn.scale, i)
        x = kernels.gemv(o.reshape(1, qs), attn.o_proj.weight, None, x)
        h = kernels.rms_norm(x, layer.post_attention_layernorm.weight, eps)
        act = kernels.silu_mul(kernels.gemv(h, mlp.gate_up_proj.weight))
        x = kernels.gemv(act, mlp.down_proj.weight, None, x)
        if after_layer is not None:
            after_layer(i)
        norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else model.model.norm
        h = kernels.rms_norm(x, norm.weight, eps)
    return h
