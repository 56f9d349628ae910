"""The MoE model against transformers' Qwen2-MoE and Mixtral on the same weights (float64),
the safetensors round trip, and the model inside the engine."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pymooncake.engine.model.attention import AttentionMetadata, PrefillSeq
from pymooncake.engine.model.moe import MoEConfig, MoEForCausalLM
from pymooncake.engine.model.moe_io import (
    build_tiny_moe,
    load_moe_model,
    save_hf_checkpoint,
    tiny_moe_config,
)

transformers = pytest.importorskip("transformers")


def _ours_logits(model: MoEForCausalLM, ids: list[int]) -> torch.Tensor:
    cfg = model.config
    t = len(ids)
    block = 16
    nblocks = -(-t // block)
    dtype = next(model.parameters()).dtype
    caches = [torch.zeros(2, cfg.num_kv_heads, nblocks, block, cfg.head_dim, dtype=dtype)
              for _ in range(cfg.num_layers)]
    meta = AttentionMetadata(torch.arange(t), [PrefillSeq(0, t, t, None, None)])
    hidden = model(torch.tensor(ids), torch.arange(t), meta, caches)
    return model.compute_logits(hidden)


def _hf_model(model: MoEForCausalLM, tmp: Path) -> torch.nn.Module:
    d = save_hf_checkpoint(model, tmp / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(d), dtype=torch.float64, experts_implementation="eager", attn_implementation="eager")
    return hf.eval()


def _mixtral_config() -> MoEConfig:
    c = tiny_moe_config()
    return MoEConfig(architecture="MixtralForCausalLM", vocab_size=c.vocab_size,
                     hidden_size=64, intermediate_size=80, moe_intermediate_size=80,
                     num_experts=4, top_k=2, num_layers=2, num_heads=4, num_kv_heads=2,
                     head_dim=16, norm_topk_prob=True, rms_norm_eps=1e-5, rope_theta=1e6,
                     attention_bias=False)


@pytest.mark.parametrize("cfg", [tiny_moe_config(), _mixtral_config()],
                         ids=["qwen2_moe", "mixtral"])
def test_matches_transformers_reference(cfg: MoEConfig, tmp_path: Path) -> None:
    """Logits of every prompt position equal transformers' (loaded from the checkpoint we
    wrote, HF's own loading and modelling code). Both run float64 weights, but HF's RMSNorm,
    RoPE tables and router softmax compute in float32 (``.to(torch.float32)``), so the
    agreement is float32-level: 1e-5 here (measured max |diff| 2.7e-6 on logits of std 4)."""
    model = build_tiny_moe(cfg, seed=3, dtype=torch.float64)
    hf = _hf_model(model, tmp_path)
    ids = [1, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100, 33, 7, 200, 3]
    ours = _ours_logits(model, ids)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert ours.shape == ref.shape
    torch.testing.assert_close(ours, ref.to(ours.dtype), rtol=1e-5, atol=1e-5)
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_safetensors_round_trip(tmp_path: Path) -> None:
    model = build_tiny_moe()
    d = save_hf_checkpoint(model, tmp_path / "m")
    loaded = load_moe_model(d)
    ids = list(range(5, 40))
    assert torch.equal(_ours_logits(model, ids), _ours_logits(loaded, ids))


def test_tiny_moe_in_engine_is_deterministic() -> None:
    from pymooncake.engine.ep.models import build_engine
    a = build_engine("tiny-moe").generate([[1, 2, 3, 4, 5]], None)
    b = build_engine("tiny-moe").generate([[1, 2, 3, 4, 5]], None)
    assert a[0].output_token_ids == b[0].output_token_ids
    assert len(a[0].output_token_ids) > 0
