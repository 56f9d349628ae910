"""Llama-family decoder (Llama 2/3, Mistral-style, Qwen2 with QKV bias, Qwen3 with q/k norm).

Parameter names follow Hugging Face's, except that q/k/v and gate/up projections are fused
(``qkv_proj``, ``gate_up_proj``); ``loader.py`` concatenates the checkpoint tensors.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from pymooncake.engine import kernels
from pymooncake.engine.model import fused
from pymooncake.engine.model.attention import AttentionMetadata, paged_attention, write_kv
from pymooncake.engine.model.layers import (
    Linear,
    RMSNorm,
    SwiGLU,
    apply_rope,
    rope_cos_sin,
    rope_inv_freq,
)

SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Shape and numerics of a Llama-family model (the fields of a HF ``config.json``)."""

    architecture: str
    """One of ``SUPPORTED_ARCHITECTURES`` keys."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] = ()
    """``rope_scaling`` as sorted (key, value) pairs; empty for plain RoPE."""
    attention_bias: bool = False
    """Bias on q/k/v projections (Qwen2; Llama with ``attention_bias``)."""
    qk_norm: bool = False
    """RMSNorm over ``head_dim`` on q and k before RoPE (Qwen3)."""
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default=())

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"architecture {self.architecture!r} is not supported; "
                             f"use one of {sorted(SUPPORTED_ARCHITECTURES)}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelConfig.{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")

    @property
    def rope_scaling_dict(self) -> dict[str, Any]:
        return dict(self.rope_scaling)

    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any], source: str = "config.json") -> ModelConfig:
        """Build from a parsed HF ``config.json``.

        Raises ``ValueError`` whose message starts with ``source`` and names the field: not a
        JSON object, a missing field, a field of the wrong type (``"two"`` for an int, a
        bool or a float where an int is needed), or a value ``ModelConfig`` refuses.
        """
        if not isinstance(cfg, Mapping):
            raise ValueError(f"{source}: must hold a JSON object, got {type(cfg).__name__}")

        def need(name: str) -> Any:
            if name not in cfg:
                raise ValueError(f"{source}: missing field {name!r}")
            return cfg[name]

        def as_int(name: str, value: Any, positive: bool = False) -> int:
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{source}: {name} must be an int, got {value!r}")
            if positive and value <= 0:
                raise ValueError(f"{source}: {name} must be positive, got {value}")
            return value

        def as_float(name: str, value: Any) -> float:
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"{source}: {name} must be a number, got {value!r}")
            if not math.isfinite(value):
                raise ValueError(f"{source}: {name} must be finite, got {value!r}")
            return float(value)

        def as_bool(name: str, value: Any) -> bool:
            if not isinstance(value, bool):
                raise ValueError(f"{source}: {name} must be true or false, got {value!r}")
            return value

        def opt_id(name: str) -> int | None:
            value = cfg.get(name)
            return None if value is None else as_int(name, value)

        archs = cfg.get("architectures") or []
        if not isinstance(archs, list):
            raise ValueError(f"{source}: architectures must be a list, got {archs!r}")
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(f"{source}: architectures {archs} not supported; supported: "
                             f"{sorted(SUPPORTED_ARCHITECTURES)}")
        kind = SUPPORTED_ARCHITECTURES[arch]
        hidden = as_int("hidden_size", need("hidden_size"), True)
        heads = as_int("num_attention_heads", need("num_attention_heads"), True)
        kv_heads = cfg.get("num_key_value_heads")
        head_dim = cfg.get("head_dim")
        rope_field = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
        rope_params = cfg.get(rope_field) or {}
        if not isinstance(rope_params, Mapping):
            raise ValueError(f"{source}: {rope_field} must be an object, got {rope_params!r}")
        theta = cfg.get("rope_theta", rope_params.get("rope_theta", 10000.0))
        scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type == "default":
            scaling = {}
        elif rope_type not in _ROPE_FIELDS:
            raise ValueError(f"{source}: {rope_field}.rope_type {rope_type!r} is not supported; "
                             f"supported: default, {', '.join(_ROPE_FIELDS)}")
        else:
            for key in _ROPE_FIELDS[rope_type]:
                if key not in scaling:
                    raise ValueError(f"{source}: missing field {rope_field}.{key} (needed by "
                                     f"rope_type {rope_type!r})")
                value = as_float(f"{rope_field}.{key}", scaling.get(key))
                if value <= 0:
                    raise ValueError(f"{source}: {rope_field}.{key} must be positive, "
                                     f"got {value}")
            if rope_type == "llama3" and not (float(scaling["high_freq_factor"])
                                              > float(scaling["low_freq_factor"])):
                raise ValueError(f"{source}: {rope_field}.high_freq_factor must be greater "
                                 "than low_freq_factor")
        num_kv = heads if kv_heads is None else as_int("num_key_value_heads", kv_heads, True)
        if heads % num_kv:
            raise ValueError(f"{source}: num_attention_heads ({heads}) must be a multiple of "
                             f"num_key_value_heads ({num_kv})")
        eos = cfg.get("eos_token_id")
        eos_list = eos if isinstance(eos, list) else ([] if eos is None else [eos])
        try:
            return cls(
                architecture=arch,
                vocab_size=as_int("vocab_size", need("vocab_size"), True),
                hidden_size=hidden,
                intermediate_size=as_int("intermediate_size", need("intermediate_size"), True),
                num_layers=as_int("num_hidden_layers", need("num_hidden_layers"), True),
                num_heads=heads,
                num_kv_heads=num_kv,
                head_dim=hidden // heads if head_dim is None
                else as_int("head_dim", head_dim, True),
                rms_norm_eps=as_float("rms_norm_eps", cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=as_float("rope_theta", theta),
                rope_scaling=tuple(sorted(scaling.items())),
                attention_bias=as_bool("attention_bias",
                                       cfg.get("attention_bias", kind == "qwen2")),
                qk_norm=kind == "qwen3",
                tie_word_embeddings=as_bool("tie_word_embeddings",
                                            cfg.get("tie_word_embeddings", False)),
                bos_token_id=opt_id("bos_token_id"),
                eos_token_ids=tuple(as_int("eos_token_id", e) for e in eos_list),
            )
        except ValueError as e:
            msg = str(e)
            raise ValueError(msg if msg.startswith(source) else f"{source}: {msg}") from None


_ROPE_FIELDS: dict[str, tuple[str, ...]] = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor",
               "original_max_position_embeddings"),
}
"""The numeric fields each supported ``rope_scaling`` type needs (``layers.rope_inv_freq``)."""

LayerCallback = Callable[[int], None]

class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int = 0) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = (cfg.num_heads, cfg.num_kv_heads,
                                                            cfg.head_dim)
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size,
                                  bias=cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = cfg.head_dim ** -0.5

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj.forward(x)
        v = qkv[:, self.q_size + self.kv_size:].reshape(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm.forward(qkv[:, :self.q_size].reshape(t, self.num_heads, self.head_dim))
            k = self.k_norm.forward(qkv[:, self.q_size:self.q_size + self.kv_size]
                            .reshape(t, self.num_kv_heads, self.head_dim))
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        else:  # one rotation over the q and k heads together (elementwise: same values)
            qk = qkv[:, :self.q_size + self.kv_size].reshape(
                t, self.num_heads + self.num_kv_heads, self.head_dim)
            qk = apply_rope(qk, cos, sin)
            q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        write_kv(kv_cache, k, v, meta)
        o = paged_attention(q, k, v, kv_cache, meta, self.scale, self.layer_idx)
        return self.o_proj.forward(o.reshape(t, self.q_size))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.self_attn.forward(self.input_layernorm.forward(x), cos, sin, kv_cache, meta)
        return x + self.mlp.forward(self.post_attention_layernorm.forward(x))


class LlamaModel(nn.Module):
    """Embedding, ``num_layers`` decoder layers (``layer_cls(cfg, i)``: ``DecoderLayer``, or
    the MoE's), final norm."""

    def __init__(self, cfg: Any, layer_cls: Callable[[Any, int], nn.Module] = DecoderLayer
                 ) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(layer_cls(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """The decoder plus LM head, computing over the paged KV cache.

    ``forward(input_ids [T] int64, positions [T] int64, meta, kv_caches)`` returns
    the final hidden states ``[T, hidden]``; ``compute_logits(hidden)`` the float32 logits
    ``[N, vocab]``. ``before_layer(i)`` is called before layer ``i`` reads the cache (the
    wait for that layer's loaded KV), ``after_layer(i)`` after it wrote its new K/V.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(cfg.head_dim, cfg.rope_theta,
                                                       cfg.rope_scaling_dict), persistent=False)

    def fused_path_ready(self) -> bool:
        """Whether ``forward`` can take the fused float32 path: C kernels built, every
        linear weight packed for oneDNN (``layers.use_onednn_weights``), no q/k norm."""
        if self.config.qk_norm or not kernels.available():
            return False
        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            if (attn.qkv_proj.packed() is None or attn.o_proj.packed() is None
                    or mlp.down_proj.packed() is None or mlp.gate_up_proj.packed() is None):
                return False
        return True

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[torch.Tensor], before_layer: LayerCallback | None = None,
                after_layer: LayerCallback | None = None) -> torch.Tensor:
        x = self.model.embed_tokens.forward(input_ids)
        if (x.dtype == torch.float32 and self.use_fused_path and kv_caches
                and kv_caches[0].dtype == torch.float32):
            return fused.forward(self, x, positions, meta, kv_caches, before_layer, after_layer)
        cos, sin = self._cos_sin(positions, x.dtype)
        for i, layer in enumerate(self.model.layers):
            if before_layer is not None:
                before_layer(i)
            x = layer.forward(x, cos, sin, kv_caches[i], meta)
            if after_layer is not None:
                after_layer(i)
        return self.model.norm.forward(x)

    use_fused_path = False
    """Set by the engine when ``fused_path_ready()``: float32 steps run ``fused.forward``."""

    def _cos_sin(self, positions: torch.Tensor,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE ``cos, sin`` rows for ``positions`` (int64 ``[T]``) from ``rope_table``."""
        cos_t, sin_t = self.rope_table(positions, dtype)
        return cos_t[positions], sin_t[positions]

    def rope_table(self, positions: torch.Tensor,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole RoPE ``cos, sin`` tables ``[P, 1, head_dim]`` of ``dtype`` (P a multiple
        of 4096 positions, > every one of ``positions``), computed once and
        grown when a position passes P (the same elementwise values as computing the rows
        per step)."""
        need = int(positions.max()) + 1 if positions.numel() else 1
        table = getattr(self, "_rope_table", None)
        if table is None or table[0].shape[0] < need or table[0].dtype != dtype:
            size = -(-need // 4096) * 4096
            table = rope_cos_sin(torch.arange(size), self.inv_freq, dtype)
            self._rope_table = table
        return table

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        w = self.lm_head.weight
        dl = self.__dict__.get("_decode_layers")  # its max_rows: where GEMV rows win
        if (self.use_fused_path and hidden.shape[0] <= (dl.max_rows if dl else 1)
                and hidden.dtype == torch.float32
                and w.is_contiguous() and self.lm_head.bias is None):
            return kernels.gemv(hidden.contiguous(), w)
        logits = self.lm_head.forward(hidden)
        return logits if logits.dtype == torch.float64 else logits.float()
