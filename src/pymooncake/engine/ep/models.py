"""Model specs for EP: ``tiny-moe`` (seeded) or a Qwen2-MoE / Mixtral HF directory.

The front builds the whole model (its own experts are skipped for a directory when they
live on ranks); a rank builds only the experts it is told to hold.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from pymooncake.engine.config import EngineConfig
from pymooncake.engine.engine import Engine, make_namespace
from pymooncake.engine.hooks import LayerHooks
from pymooncake.engine.kv.kv_tensors import torch_dtype
from pymooncake.engine.model.layers import SwiGLU
from pymooncake.engine.model.loader import ModelLoadError, weight_revision
from pymooncake.engine.model.moe import MoEConfig, MoEForCausalLM
from pymooncake.engine.model.moe_io import (
    TINY_MOE,
    TINY_MOE_SEED,
    build_tiny_moe,
    load_expert,
    load_moe_model,
    moe_weight_revision,
    read_moe_config,
    tiny_moe_config,
)
from pymooncake.engine.model.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer


def load_front_model(spec: str, dtype: torch.dtype,
                     with_experts: bool = True) -> tuple[MoEForCausalLM, str, Tokenizer | None]:
    """``(model, weight revision, tokenizer)`` for ``spec``. Raises ``ModelLoadError``."""
    if spec == TINY_MOE:
        return (build_tiny_moe(dtype=dtype), moe_weight_revision(tiny_moe_config(), TINY_MOE_SEED),
                ByteTokenizer())
    d = Path(spec)
    if not d.is_dir():
        raise ModelLoadError(f"--model {spec!r}: not 'tiny-moe' and not a model directory")
    model = load_moe_model(d, dtype, load_experts=with_experts)
    try:
        tok: Tokenizer | None = HFTokenizer(d)
    except Exception:  # noqa: BLE001 (no tokenizer: token ids only)
        tok = None
    return model, weight_revision(d), tok


def build_engine(spec: str, config: EngineConfig | None = None, with_experts: bool = True,
                 hooks: Sequence[LayerHooks] = ()) -> Engine:
    """An ``Engine`` running the MoE model of ``spec`` (its experts local unless a backend
    is installed later with ``engine.model.set_expert_backend``). Raises
    ``ModelLoadError``."""
    config = config or EngineConfig(num_kv_blocks=256, max_model_len=2048)
    model, rev, tok = load_front_model(spec, torch_dtype(config.dtype), with_experts)
    ns = make_namespace(f"pymooncake/{spec}" if spec == TINY_MOE else str(Path(spec).resolve()),
                        rev, tok.fingerprint if tok else "none", model,  # type: ignore[arg-type]
                        config)
    return Engine(model, config, ns, tok, hooks=hooks)  # type: ignore[arg-type]


def model_config(spec: str) -> MoEConfig:
    """The ``MoEConfig`` of ``spec``. Raises ``ModelLoadError``."""
    return tiny_moe_config() if spec == TINY_MOE else read_moe_config(spec)


def expert_loader(spec: str, dtype: torch.dtype = torch.float32,
                  ) -> Callable[[int, int], SwiGLU]:
    """``load(layer, expert) -> SwiGLU`` for a rank. Raises ``ModelLoadError``."""
    if spec == TINY_MOE:
        full = build_tiny_moe(dtype=dtype)

        def tiny(layer: int, expert: int) -> SwiGLU:
            return full.model.layers[layer].mlp.experts[expert]
        return tiny
    cfg = read_moe_config(spec)
    return lambda layer, expert: load_expert(spec, cfg, layer, expert, dtype)
