"""Mixture-of-experts decoder: Qwen2-MoE and Mixtral layouts over the paged KV cache.

Attention, norms and RoPE are the Llama-family blocks of ``llama.py`` (Qwen2-MoE has QKV
bias, Mixtral none). Each MoE layer has a router (``gate``: ``[num_experts, hidden]``),
``num_experts`` SwiGLU experts of ``moe_intermediate_size`` and, for Qwen2-MoE, a shared
expert scaled by ``sigmoid(shared_expert_gate(x))``. Routing follows Hugging Face: softmax
in float32 over all experts, top-k, then the top-k weights renormalised to sum to 1 when
``norm_topk_prob`` (always for Mixtral; Qwen2-MoE's config field).

The routed experts run through an ``ExpertBackend``: by default the layer's own experts
(``LocalExperts``); ``engine.ep`` installs one that dispatches the token rows to expert-
parallel rank processes and combines their results. Rows reach a backend sorted by expert
(``x_sorted [N, hidden]`` with ``counts [num_experts]``, ``N = T * top_k``), so a backend
computes each expert over one contiguous slice.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from pymooncake.engine.model.attention import AttentionMetadata
from pymooncake.engine.model.layers import Linear, SwiGLU, rope_cos_sin, rope_inv_freq
from pymooncake.engine.model.llama import DecoderLayer, LayerCallback, LlamaModel, ModelConfig

MOE_ARCHITECTURES: dict[str, str] = {
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "MixtralForCausalLM": "mixtral",
}


@dataclass(frozen=True, slots=True)
class MoEConfig:
    """Shape of a MoE model (the fields of a HF ``config.json``).

    ``moe_layers`` lists the decoder layers with a sparse MoE block (the others have a
    dense SwiGLU of ``intermediate_size``); empty means every layer.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_experts: int
    top_k: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    norm_topk_prob: bool = True
    shared_expert_intermediate_size: int = 0
    """0: no shared expert (Mixtral)."""
    moe_layers: tuple[int, ...] = ()
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default=())
    qk_norm: bool = False
    """Always False (the Llama ``Attention`` reads it)."""

    def __post_init__(self) -> None:
        if self.architecture not in MOE_ARCHITECTURES:
            raise ValueError(f"architecture {self.architecture!r} is not a supported MoE; "
                             f"use one of {sorted(MOE_ARCHITECTURES)}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"need 1 <= top_k ({self.top_k}) <= num_experts "
                             f"({self.num_experts})")

    def is_moe_layer(self, i: int) -> bool:
        return not self.moe_layers or i in self.moe_layers

    def attention_config(self) -> ModelConfig:
        """The Llama-family config the attention blocks are built from."""
        return ModelConfig(architecture="Qwen2ForCausalLM", vocab_size=self.vocab_size,
                           hidden_size=self.hidden_size,
                           intermediate_size=self.intermediate_size,
                           num_layers=self.num_layers, num_heads=self.num_heads,
                           num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                           rms_norm_eps=self.rms_norm_eps, rope_theta=self.rope_theta,
                           attention_bias=self.attention_bias)

    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any], source: str = "config.json") -> MoEConfig:
        """Build from a parsed HF ``config.json`` (Qwen2-MoE or Mixtral). Raises
        ``ValueError`` starting with ``source`` for an unsupported architecture or a
        missing field."""
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in MOE_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(f"{source}: architectures {archs} not supported; supported: "
                             f"{sorted(MOE_ARCHITECTURES)}")
        try:
            hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
            n_layers = int(cfg["num_hidden_layers"])
            eos = cfg.get("eos_token_id")
            eos_list = eos if isinstance(eos, list) else ([] if eos is None else [eos])
            common = dict(vocab_size=int(cfg["vocab_size"]), hidden_size=hidden,
                          num_layers=n_layers, num_heads=heads,
                          num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                          head_dim=int(cfg.get("head_dim") or hidden // heads),
                          rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                          rope_theta=float(cfg.get("rope_theta", 10000.0)),
                          tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                          bos_token_id=cfg.get("bos_token_id"),
                          eos_token_ids=tuple(int(e) for e in eos_list))
            if MOE_ARCHITECTURES[arch] == "mixtral":
                inter = int(cfg["intermediate_size"])
                return cls(architecture=arch, intermediate_size=inter,
                           moe_intermediate_size=inter,
                           num_experts=int(cfg["num_local_experts"]),
                           top_k=int(cfg["num_experts_per_tok"]), norm_topk_prob=True,
                           attention_bias=False, **common)  # type: ignore[arg-type]
            step = int(cfg.get("decoder_sparse_step", 1)) or 1
            dense = set(cfg.get("mlp_only_layers") or [])
            moe = tuple(i for i in range(n_layers) if i not in dense and (i + 1) % step == 0)
            return cls(architecture=arch, intermediate_size=int(cfg["intermediate_size"]),
                       moe_intermediate_size=int(cfg["moe_intermediate_size"]),
                       num_experts=int(cfg["num_experts"]),
                       top_k=int(cfg["num_experts_per_tok"]),
                       norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                       shared_expert_intermediate_size=int(
                           cfg.get("shared_expert_intermediate_size", 0)),
                       moe_layers=() if len(moe) == n_layers else moe,
                       attention_bias=bool(cfg.get("qkv_bias", True)),
                       **common)  # type: ignore[arg-type]
        except KeyError as e:
            raise ValueError(f"{source}: missing field {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise ValueError(f"{source}: {e}") from None


class ExpertBackend(Protocol):
    """Computes the routed experts of one MoE layer.

    ``run(layer, x_sorted [N, hidden], counts [num_experts] list of ints)`` returns
    ``(y_sorted [N, hidden], missing [N] bool or None)``: ``y`` row ``i`` is the expert's
    unweighted SwiGLU output for row ``i`` (rows of expert ``e`` are the ``counts[e]`` rows
    after those of experts ``< e``); ``missing`` marks rows whose expert could not be
    computed (their ``y`` is zero), or is None when all were. A backend may raise
    instead (``engine.ep``'s ``ExpertsUnavailable``)."""

    def run(self, layer: int, x_sorted: torch.Tensor,
            counts: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]: ...


def run_expert_slices(experts: Mapping[int, SwiGLU] | nn.ModuleList, x_sorted: torch.Tensor,
                      groups: list[tuple[int, int]]) -> torch.Tensor:
    """``y [N, hidden]`` for ``x_sorted [N, hidden]`` whose rows are ``groups`` of
    ``(expert id, number of rows)`` in order. Raises ``KeyError`` for an expert not held."""
    y = torch.empty_like(x_sorted)
    start = 0
    for e, n in groups:
        if n:
            y[start:start + n] = experts[e].forward(x_sorted[start:start + n])
        start += n
    return y


class LocalExperts:
    """One layer's own experts (single process): an ``ExpertBackend``."""

    def __init__(self, experts: nn.ModuleList) -> None:
        self.experts = experts

    def run(self, layer: int, x_sorted: torch.Tensor,
            counts: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        return run_expert_slices(self.experts, x_sorted, list(enumerate(counts))), None


class SparseMoeBlock(nn.Module):
    """Router + experts (+ shared expert). ``forward(x [T, hidden]) -> [T, hidden]``."""

    def __init__(self, cfg: MoEConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_experts, self.top_k, self.norm_topk_prob = (cfg.num_experts, cfg.top_k,
                                                             cfg.norm_topk_prob)
        self.gate = Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = nn.ModuleList(SwiGLU(cfg.hidden_size, cfg.moe_intermediate_size)
                                     for _ in range(cfg.num_experts))
        self.shared_expert = (SwiGLU(cfg.hidden_size, cfg.shared_expert_intermediate_size)
                              if cfg.shared_expert_intermediate_size else None)
        self.shared_expert_gate = (Linear(cfg.hidden_size, 1, bias=False)
                                   if cfg.shared_expert_intermediate_size else None)
        self.backend: ExpertBackend | None = None
        self.degraded_rows: set[int] = set()
        """Token rows (of the last forward) that lost an expert and were renormalised."""

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(topk_weights [T, k] in x.dtype, topk_ids [T, k] int64)`` as HF computes them."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        w, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            w = w / w.sum(dim=-1, keepdim=True)
        return w.to(x.dtype), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t, h = x.shape
        w, ids = self.route(x)
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        x_sorted = x[order // self.top_k].contiguous()
        backend = self.backend or LocalExperts(self.experts)
        y_sorted, missing = backend.run(self.layer_idx, x_sorted, counts)
        y = torch.empty_like(y_sorted)
        y[order] = y_sorted
        y = y.view(t, self.top_k, h)
        if missing is not None and bool(missing.any()):  # degraded top-k: drop, renormalise
            lost = torch.empty_like(missing)
            lost[order] = missing
            lost = lost.view(t, self.top_k)
            self.degraded_rows = set(torch.nonzero(lost.any(-1)).view(-1).tolist())
            w = w.masked_fill(lost, 0.0)
            w = w / w.sum(-1, keepdim=True).clamp_min(torch.finfo(w.dtype).tiny)
        out = (y * w.unsqueeze(-1)).sum(1)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


class MoEDecoderLayer(DecoderLayer):
    """``DecoderLayer`` (its attention, norms and forward) with the MLP of a MoE layer
    replaced by ``SparseMoeBlock``."""

    def __init__(self, cfg: MoEConfig, layer_idx: int) -> None:
        super().__init__(cfg.attention_config(), layer_idx)
        if cfg.is_moe_layer(layer_idx):
            self.mlp: nn.Module = SparseMoeBlock(cfg, layer_idx)


class MoEForCausalLM(nn.Module):
    """A MoE decoder + LM head with ``LlamaForCausalLM``'s interface, so ``Engine`` runs it.

    ``forward(input_ids [T] int64, positions [T] int64, meta, kv_caches)`` returns the final
    hidden states ``[T, hidden]``; ``compute_logits(hidden [N, hidden])`` float32 logits
    ``[N, vocab]`` (float64 in the fp64 mode). ``set_expert_backend`` routes every MoE
    layer's experts through a backend (``None``: the model's own experts).
    """

    use_fused_path = False

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg, MoEDecoderLayer)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(cfg.head_dim, cfg.rope_theta, None),
                             persistent=False)

    def moe_blocks(self) -> list[SparseMoeBlock]:
        return [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, SparseMoeBlock)]

    def set_expert_backend(self, backend: ExpertBackend | None) -> None:
        for block in self.moe_blocks():
            block.backend = backend

    def degraded_rows(self) -> set[int]:
        """Token rows of the last forward that ran with a degraded top-k (any layer)."""
        return set().union(*(b.degraded_rows for b in self.moe_blocks()))

    def fused_path_ready(self) -> bool:
        return False

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[torch.Tensor], before_layer: LayerCallback | None = None,
                after_layer: LayerCallback | None = None) -> torch.Tensor:
        for block in self.moe_blocks():
            block.degraded_rows = set()
        x = self.model.embed_tokens.forward(input_ids)
        cos, sin = self._cos_sin(positions, x.dtype)
        for i, layer in enumerate(self.model.layers):
            if before_layer is not None:
                before_layer(i)
            x = layer.forward(x, cos, sin, kv_caches[i], meta)
            if after_layer is not None:
                after_layer(i)
        return self.model.norm.forward(x)

    def _cos_sin(self, positions: torch.Tensor,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_cos_sin(positions, self.inv_freq, dtype)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head.forward(hidden)
        return logits if logits.dtype == torch.float64 else logits.float()
