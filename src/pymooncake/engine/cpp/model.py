"""One pipeline stage's share of a Llama-family model: a contiguous range of its layers.

``StageModel`` keeps layers ``[start, stop)`` of a ``LlamaForCausalLM`` (the other layers are
dropped, and with them their weights and oneDNN-packed copies), the token embedding on the
first stage and the final norm + LM head on the last. Between stages travels the residual
stream ``x`` ``[T, hidden]`` *before* layer ``start``'s input RMSNorm, so that the
concatenation of the stages computes exactly what ``LlamaForCausalLM.forward`` computes.

The float32 fused step runs its layers through ``engine.model.fused.forward_layers``, the
single worker's own per-layer code, so a stage's K/V and hidden states are those of a
single worker with the same prefill chunks. Other dtypes run the layers' module path
(``DecoderLayer.forward``).
"""

from __future__ import annotations

import torch
from torch import nn

from pymooncake.engine.model import fused
from pymooncake.engine.model.attention import AttentionMetadata
from pymooncake.engine.model.llama import LlamaForCausalLM


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
        return fused.forward_layers(self.model, list(self.layers), self.start, x, positions,
                                    meta, kv_caches,
                                    self.model.model.norm.weight if self.last else None)

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
