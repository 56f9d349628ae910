"""The float32 oneDNN linear path (``layers.use_onednn_weights``): same results as
``F.linear`` within float32 tolerance, M-threshold, off-switch, fp64 untouched."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from pymooncake.engine.model import layers
from pymooncake.engine.model.layers import (
    ONEDNN_MIN_ROWS,
    Linear,
    onednn_enabled,
    use_input_major_weights,
    use_onednn_weights,
)

needs_mkldnn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(),
                                  reason="torch built without mkldnn")

# SmolLM2's layer shapes (in, out): qkv, o, gate_up, down, a cut-down LM head; plus odd sizes
SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576), (576, 4099), (37, 259)]


def _model(k: int, n: int, bias: bool) -> nn.Module:
    torch.manual_seed(k * 7 + n)
    m = nn.Sequential(Linear(k, n, bias=bias))
    use_input_major_weights(m)
    return m


@needs_mkldnn
@pytest.mark.parametrize("k,n", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_onednn_matches_f_linear(monkeypatch, k, n, bias):
    monkeypatch.delenv("PYMOONCAKE_ONEDNN", raising=False)
    m = _model(k, n, bias)
    # a biased layer whose width is not a multiple of 16 stays on F.linear (oneDNN's biased
    # kernel took 85 s at 257 x 576 -> 4099): packed or not, the output is checked below
    assert use_onednn_weights(m) == (0 if bias and n % 16 else 1)
    lin = m[0]
    for rows in (1, 2, 3, 16, 64, 257):
        x = torch.randn(rows, k)
        ref = F.linear(x.double(), lin.weight.double(),
                       None if lin.bias is None else lin.bias.double())
        y = lin(x)
        assert y.shape == (rows, n) and y.dtype == torch.float32
        torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-4 * k ** 0.5)
        torch.testing.assert_close(y, F.linear(x, lin.weight, lin.bias),
                                   rtol=1e-5, atol=1e-4 * k ** 0.5)
    x3 = torch.randn(2, 5, k)  # leading dims and a non-contiguous input
    torch.testing.assert_close(lin(x3), F.linear(x3, lin.weight, lin.bias),
                               rtol=1e-5, atol=1e-4 * k ** 0.5)
    xs = torch.randn(40, k)[::2]
    torch.testing.assert_close(lin(xs), F.linear(xs, lin.weight, lin.bias),
                               rtol=1e-5, atol=1e-4 * k ** 0.5)


def _calls(monkeypatch) -> list[int]:
    seen: list[int] = []
    real = torch.ops.mkldnn._linear_pointwise

    def spy(x, *args):
        seen.append(x.shape[0])
        return real(x, *args)

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", spy)
    return seen


@needs_mkldnn
def test_threshold_and_stale_weight(monkeypatch):
    monkeypatch.delenv("PYMOONCAKE_ONEDNN", raising=False)
    m = _model(64, 48, False)
    assert use_onednn_weights(m) == 1
    seen = _calls(monkeypatch)
    lin = m[0]
    lin(torch.randn(ONEDNN_MIN_ROWS - 1, 64))
    assert seen == []
    lin(torch.randn(ONEDNN_MIN_ROWS, 64))
    assert seen == [ONEDNN_MIN_ROWS]
    with torch.no_grad():  # an in-place update makes the packed copy stale: dense path
        lin.weight.mul_(2)
    x = torch.randn(8, 64)
    torch.testing.assert_close(lin(x), F.linear(x, lin.weight))
    assert seen == [ONEDNN_MIN_ROWS]


@pytest.mark.parametrize("value", ["0", "off"])
def test_off_switch(monkeypatch, value):
    monkeypatch.setenv("PYMOONCAKE_ONEDNN", value)
    assert not onednn_enabled()
    m = _model(64, 48, False)
    assert use_onednn_weights(m) == 0
    assert m[0]._onednn_weight is None
    seen = _calls(monkeypatch) if torch.backends.mkldnn.is_available() else []
    x = torch.randn(32, 64)
    torch.testing.assert_close(m[0](x), F.linear(x, m[0].weight), rtol=0, atol=0)
    assert seen == []


def test_no_mkldnn_fallback(monkeypatch):
    monkeypatch.delenv("PYMOONCAKE_ONEDNN", raising=False)
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    assert not layers.onednn_enabled()
    m = _model(64, 48, True)
    assert use_onednn_weights(m) == 0
    x = torch.randn(16, 64)
    torch.testing.assert_close(m[0](x), F.linear(x, m[0].weight, m[0].bias), rtol=0, atol=0)


@needs_mkldnn
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_other_dtypes_not_packed(monkeypatch, dtype):
    monkeypatch.delenv("PYMOONCAKE_ONEDNN", raising=False)
    m = _model(64, 48, False).to(dtype)
    assert use_onednn_weights(m) == 0
    x = torch.randn(16, 64, dtype=dtype)
    ref = (layers.exact_linear(x, m[0].weight) if dtype == torch.float64
           else F.linear(x, m[0].weight))
    torch.testing.assert_close(m[0](x), ref, rtol=0, atol=0)


def test_onednn_rows_buckets():
    # hand-computed: above 64 rows, a multiple of 1/32 of the power of two at or above m
    assert [layers.onednn_rows(m) for m in (1, 7, 64, 65, 100, 128, 129, 257, 1000, 1025,
                                            2047, 2048, 4100)] == \
        [1, 7, 64, 68, 100, 128, 136, 272, 1024, 1088, 2048, 2048, 4352]
    rows = [layers.onednn_rows(m) for m in range(65, 8193)]
    assert all(m <= r <= m * 17 / 16 for m, r in zip(range(65, 8193), rows, strict=True))
    assert rows == sorted(rows)
    assert len(set(rows)) == 7 * 16   # 65-128, ..., 4097-8192: 16 row counts an octave


@needs_mkldnn
def test_bucketed_rows_give_the_same_rows(monkeypatch):
    monkeypatch.delenv("PYMOONCAKE_ONEDNN", raising=False)
    monkeypatch.delenv("PYMOONCAKE_ONEDNN_ROW_BUCKETS", raising=False)
    m = _model(96, 80, False)
    assert use_onednn_weights(m) == 1
    lin = m[0]
    seen = _calls(monkeypatch)
    lin(torch.full((300, 96), 1e30))  # leaves huge values in the staging rows 257-299
    x = torch.randn(257, 96)
    y = lin(x)
    assert seen == [304, 272]           # 300 and 257 rows ran as 304 and 272
    assert y.shape == (257, 80) and y.is_contiguous() and y._base.shape == (272, 80)
    assert torch.isfinite(y).all()
    torch.testing.assert_close(y, F.linear(x, lin.weight), rtol=1e-5, atol=1e-4 * 96 ** 0.5)
    res = torch.randn(257, 80)
    torch.testing.assert_close(lin.forward_add(x, res), F.linear(x, lin.weight) + res,
                               rtol=1e-5, atol=1e-4 * 96 ** 0.5)
    assert seen == [304, 272, 272]
    lin(torch.randn(64, 96))             # decode-sized: its own row count
    assert seen[-1] == 64
    # the staging rows past the real ones were zeroed (no stale 1e30 reaches the GEMM)
    lin(x)
    stage = layers._PAD.bufs[(96, torch.float32)]
    assert stage.shape[0] >= 304 and not stage[257:272].any()


@needs_mkldnn
def test_bucketed_mlp_forward_add(monkeypatch):
    from pymooncake.engine import kernels
    if not kernels.available():
        pytest.skip(f"no C kernels: {kernels.why_unavailable()}")
    monkeypatch.delenv("PYMOONCAKE_ONEDNN", raising=False)
    monkeypatch.delenv("PYMOONCAKE_ONEDNN_ROW_BUCKETS", raising=False)
    torch.manual_seed(3)
    mlp = layers.SwiGLU(96, 200)
    use_input_major_weights(mlp)
    assert use_onednn_weights(mlp) == 2
    x, res = torch.randn(257, 96), torch.randn(257, 96)
    with torch.no_grad():
        ref = mlp.forward(x) + res                        # module path, unpadded
        seen = _calls(monkeypatch)
        y = mlp.forward_add(x, res)
    assert seen == [272, 272]                             # gate|up and down, padded once
    assert y.shape == (257, 96) and y.is_contiguous()
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-4 * 200 ** 0.5)


@needs_mkldnn
def test_staging_buffer_works_in_and_out_of_inference_mode(monkeypatch):
    monkeypatch.delenv("PYMOONCAKE_ONEDNN", raising=False)
    monkeypatch.delenv("PYMOONCAKE_ONEDNN_ROW_BUCKETS", raising=False)
    monkeypatch.setattr(layers, "_PAD", layers.threading.local())   # a fresh buffer
    m = _model(96, 80, False)
    assert use_onednn_weights(m) == 1
    x = torch.randn(101, 96)
    with torch.inference_mode():                          # the engine's forward
        y0 = m[0](x)
    with torch.no_grad():                                 # then a tool's, same thread
        y1 = m[0](x)
    torch.testing.assert_close(y1, y0, rtol=0, atol=0)


@needs_mkldnn
def test_row_bucket_off_switch(monkeypatch):
    monkeypatch.delenv("PYMOONCAKE_ONEDNN", raising=False)
    monkeypatch.setenv("PYMOONCAKE_ONEDNN_ROW_BUCKETS", "0")
    m = _model(96, 80, False)
    assert use_onednn_weights(m) == 1
    seen = _calls(monkeypatch)
    x = torch.randn(257, 96)
    torch.testing.assert_close(m[0](x), F.linear(x, m[0].weight),
                               rtol=1e-5, atol=1e-4 * 96 ** 0.5)
    assert seen == [257]
