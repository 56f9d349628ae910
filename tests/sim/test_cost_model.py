"""Cost-model arithmetic against hand-computed values and the paper's Figure 14."""

from __future__ import annotations

import json

import pytest

from pymooncake.sim.cost_model import (
    GPU_PRESETS,
    MODEL_PRESETS,
    CostModel,
    CostModelError,
    calibration_table,
    model_from_hf_config,
    resolve_gpu,
    resolve_model,
)

L3 = MODEL_PRESETS["llama3-70b"]
A800 = GPU_PRESETS["A800"]


def test_kv_bytes_per_token_by_hand() -> None:
    assert L3.kv_bytes_per_token == 2 * 80 * 8 * 128 * 2 == 327_680       # 320 KB
    assert MODEL_PRESETS["llama2-70b"].kv_bytes_per_token == 327_680
    # 128k tokens ≈ 40 GiB (§5.4.1)
    assert 131072 * 327_680 / 2**30 == 40.0


def test_params_by_hand() -> None:
    d, ffn, kv = 8192, 28672, 1024
    per_layer = 2 * d * d + 2 * d * kv + 3 * d * ffn
    assert L3.num_params == 80 * per_layer + 2 * 128256 * d == 70_552_387_584


def test_prefill_flops_eq1_with_prefix() -> None:
    cm = CostModel(L3, A800)
    n, p = 10_000, 4_000
    a, b = 2.0, 2 * (2 * 8192**2 + 2 * 8192 * 1024 + 3 * 8192 * 28672) / 8192**2   # b = 25.5
    assert b == 25.5
    want = 80 * (a * (n * n - p * p) * 8192 + b * (n - p) * 8192**2)
    assert cm.prefill_flops(n, p) == pytest.approx(want, rel=1e-12)
    g = 8 * 312e12
    t = 80 * a * 8192 * (n * n - p * p) / (g * A800.attention_efficiency) \
        + 80 * b * 8192**2 * (n - p) / (g * A800.mfu)
    assert cm.prefill_compute_s(n, p) == pytest.approx(t, rel=1e-12)


def test_calibration_within_2_5_percent_of_figure_14a() -> None:
    rows = calibration_table(CostModel(L3, A800))
    assert len(rows) == 5
    for r in rows:
        assert abs(r["prefill_error"]) < 0.025, r
        assert abs(r["decode128_error"]) < 0.01, r
    # PAPER.md §6 fit: 7.146e-10·n² + 1.1622e-4·n
    cm = CostModel(L3, A800)
    assert cm.prefill_quadratic_s == pytest.approx(7.146e-10, rel=1e-3)
    assert cm.prefill_linear_s == pytest.approx(1.1622e-4, rel=1e-3)


def test_decode_step_and_transfer_by_hand() -> None:
    cm = CostModel(L3, A800, network_bandwidth_bytes_per_s=100e9, transfer_overhead_s=0.002)
    hbm = 8 * 2.039e12 * A800.hbm_efficiency
    mem = (L3.num_params * 2 + 8192 * 327_680) / hbm
    comp = 2 * L3.num_params * 1 / (8 * 312e12 * A800.mfu)
    assert cm.decode_step_s(1, 8192) == pytest.approx(A800.decode_step_overhead_s
                                                       + max(comp, mem), rel=1e-12)
    assert cm.transfer_s(1000) == pytest.approx(1000 * 327_680 / 100e9 + 0.002)
    assert cm.transfer_s(0) == 0.0
    # decode KV capacity: (8·80 GB·0.9 − weights) / 320 KB
    assert cm.kv_capacity_tokens == int((8 * 80e9 * 0.9 - L3.num_params * 2) // 327_680)


def test_hf_config_json(tmp_path) -> None:  # noqa: ANN001
    cfg = {"num_hidden_layers": 80, "hidden_size": 8192, "num_attention_heads": 64,
           "num_key_value_heads": 8, "intermediate_size": 28672, "vocab_size": 128256,
           "torch_dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    m = model_from_hf_config(tmp_path)
    assert m.kv_bytes_per_token == 327_680 and m.num_params == L3.num_params
    assert resolve_model(str(tmp_path / "config.json")).kv_bytes_per_token == 327_680
    del cfg["hidden_size"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CostModelError, match="hidden_size"):
        model_from_hf_config(tmp_path)


def test_unknown_presets() -> None:
    with pytest.raises(CostModelError, match="unknown model 'gpt-9'"):
        resolve_model("gpt-9")
    with pytest.raises(CostModelError, match="unknown GPU 'V100'"):
        resolve_gpu("V100")
    assert resolve_gpu("h200").hbm_bandwidth_bytes_per_s == 4.8e12
    assert resolve_model("LLaMA3-70B") is L3
