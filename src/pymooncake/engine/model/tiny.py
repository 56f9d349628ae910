"""The embedded default model ``tiny``: seeded random Llama-style weights, byte tokenizer.

4 layers, hidden 256, 8 query heads over 2 KV heads (GQA), head_dim 32, SwiGLU 688, vocab
259 (bytes + BOS/EOS/PAD). Weights come from ``torch.Generator`` with a fixed seed, so every
machine builds bit-identical weights with no download. The init scales keep activations
O(1) and give peaked logits (std ≈ 4) so greedy choices are rarely near-ties.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import blake3
import msgpack
import torch
from torch import nn

from pymooncake.engine.model.llama import LlamaForCausalLM, ModelConfig
from pymooncake.engine.model.tokenizer import ByteTokenizer

TINY_SEED = 0


def tiny_config(num_layers: int = 4) -> ModelConfig:
    """The ``tiny`` model's shape (``num_layers`` may be changed for tests)."""
    return ModelConfig(architecture="LlamaForCausalLM", vocab_size=ByteTokenizer.VOCAB_SIZE,
                       hidden_size=256, intermediate_size=688, num_layers=num_layers,
                       num_heads=8, num_kv_heads=2, head_dim=32, rms_norm_eps=1e-5,
                       rope_theta=10000.0, bos_token_id=ByteTokenizer.BOS,
                       eos_token_ids=(ByteTokenizer.EOS,))


def tiny_weight_revision(cfg: Any, seed: int) -> str:
    """The weight revision of a seeded model (any config dataclass: this tiny model's, the
    tiny MoE's): BLAKE3 of (seed, config fields)."""
    fields = {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(cfg).items()}
    blob = msgpack.packb({"seed": seed, "config": fields}, use_bin_type=True, default=str)
    return "seeded-" + blake3.blake3(blob).hexdigest()


def seed_weights(model: nn.Module, seed: int,
                 rule: Callable[[str, torch.Tensor, torch.Generator], bool] | None = None) -> None:
    """Fill ``model``'s parameters from ``seed`` in sorted name order (deterministic across
    machines): norms ~1, biases small, embeddings N(0, 1), the LM head scaled for decisive
    logits, other matrices N(0, 1/fan_in). ``rule(name, param, gen)`` may fill a parameter
    itself first (returns True when it did)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if rule is not None and rule(name, p, gen):
                continue
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.02 * torch.randn(p.shape, generator=gen))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            elif name == "lm_head.weight":
                p.copy_(4.0 / math.sqrt(p.shape[1]) * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1]))


def build_tiny_model(cfg: ModelConfig | None = None, seed: int = TINY_SEED,
                     dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    """A ``LlamaForCausalLM`` with seeded weights (deterministic across machines)."""
    model = LlamaForCausalLM(cfg or tiny_config())
    seed_weights(model, seed)
    return model.to(dtype).eval()
