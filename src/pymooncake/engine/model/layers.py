"""Decoder building blocks: RMSNorm, rotary position embedding (incl. Llama 3 scaling), SwiGLU.

The maths follows Hugging Face ``transformers``' Llama implementation so that logits agree
within dtype tolerance (RMSNorm in float32, ``rotate_half`` RoPE, inverse frequencies in
float32).
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x**2) + eps)``, normalised in float32 over the last dim."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float64:
            return exact_rms_norm(x, self.weight, self.eps)
        if x.dtype == torch.float32:  # one fused op, same maths
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_inv_freq(head_dim: int, theta: float,
                  scaling: Mapping[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]`` (float32) for RoPE with optional scaling.

    ``scaling`` is the config's ``rope_scaling`` / ``rope_parameters`` dict. Supported
    ``rope_type``: ``default``, ``linear`` (positions divided by ``factor``) and ``llama3``
    (Llama 3.1's frequency-dependent smoothing). Raises ``ValueError`` for other kinds.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64)
                                .to(torch.float32) / head_dim))
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling["low_freq_factor"])
        high = float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen = old_len / low
        high_wavelen = old_len / high
        wavelen = 2 * math.pi / inv_freq
        out = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * out / factor + smooth * out
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, out)
    raise ValueError(f"rope_scaling type {kind!r} is not supported; "
                     f"supported: {SUPPORTED_ROPE_TYPES}")


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin`` of shape ``[T, 1, head_dim]`` for token positions ``[T]`` (int64)."""
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    if dtype == torch.float64:
        freqs = positions.to(torch.float64)[:, None] * inv_freq.to(torch.float64)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[T, heads, head_dim]`` by ``cos/sin`` ``[T, 1, head_dim]``."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


# -- the fp64 mode: batch-invariant building blocks -------------------------------------
# The fp64 mode is the engine's bit-reproducible mode: a token's logits must be the same
# bits whatever else shares its step (a cold prefill of the whole prompt, a warm one of the
# uncached suffix, a decode batch of any size). BLAS and PyTorch's kernels only promise
# that for identical shapes: a GEMM's reduction order may change with any of M, N, K, and a
# vectorised pointwise op computes a chunk's tail with scalar code. So every op whose bits
# could depend on the shape of the call runs here on fixed shapes: linear layers per token
# (one GEMM shape, rows aligned to EXACT_ALIGN), attention per token on context chunks of
# EXACT_CTX_CHUNK, norms per row, transcendental pointwise ops (exp, SiLU) on blocks of
# EXACT_POINTWISE_BLOCK.

EXACT_ALIGN = 8
"""fp64 mode: every matrix row a GEMM reads or writes is padded (with zeros) to a multiple
of this many elements (64 bytes), so each row starts 64-byte aligned. MKL's dgemm takes
other code paths for other alignments: a row of the 259-wide ``tiny`` LM head gave other
bits at an odd row index than at row 0."""


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


EXACT_CTX_CHUNK = 64
"""Context positions per attention GEMM in the fp64 mode (``attention.exact_attention``):
the context is reduced chunk by chunk at fixed offsets, so a token's bits do not depend on
how long the context is past its position."""

EXACT_POINTWISE_BLOCK = 4096
"""Elements per call of a transcendental pointwise op in the fp64 mode: a multiple of every
SIMD width (so no element takes the scalar tail path, whose ``exp`` may differ from the
vectorised one in the last bit) and below PyTorch's parallel grain (32768), so a block is
never split between threads at a size-dependent offset."""


def exact_pointwise(fn: Callable[[torch.Tensor], torch.Tensor],
                    x: torch.Tensor) -> torch.Tensor:
    """``fn(x)`` for an elementwise ``fn`` (``torch.exp``, ``F.silu``), each element computed
    by the same (vectorised) code whatever ``x``'s size: ``x`` is flattened, zero-padded to
    whole blocks of ``EXACT_POINTWISE_BLOCK`` and ``fn`` runs once per block."""
    flat = x.reshape(-1)
    n = flat.numel()
    pad = (-n) % EXACT_POINTWISE_BLOCK
    blocks = (F.pad(flat, (0, pad)) if pad else flat).view(-1, EXACT_POINTWISE_BLOCK)
    out = torch.empty_like(blocks)
    for i in range(blocks.shape[0]):
        out[i] = fn(blocks[i])
    return out.view(-1)[:n].view(x.shape)


def exact_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, row by row (fp64 mode): each row's sum of squares is one
    contiguous inner reduction of fixed length (PyTorch reduces inner rows independently
    and splits threads only between rows); the rest is elementwise and exact
    (``rsqrt`` = ``1 / sqrt``, correctly rounded in scalar and vector code)."""
    h = x.contiguous()
    ms = (h * h).sum(-1, keepdim=True) / h.shape[-1]
    return weight * (h * torch.rsqrt(ms + eps))


def exact_linear(x: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` for ``x`` ``[T, in]``, batch-invariant (fp64 mode).

    BLAS picks its kernel and reduction order from the GEMM's shape (M = number of rows, a
    GEMV-like path for M = 1, 2), and, for a row inside a GEMM, from the row's index and
    alignment; so one token computed alone could differ in the last bits from the same
    token inside a longer prefill or a decode batch. Here each token is its own GEMM of one
    fixed shape ``[1, in'] @ [in', out']`` (``in``/``out`` zero-padded to a multiple of
    ``EXACT_ALIGN``, so every row is 64-byte aligned), run as one batched call over the
    tokens with the weight shared: a row's bits depend only on the row and the weight,
    whatever ``T`` is and wherever the row sits.
    """
    t, k = x.shape
    n = weight.shape[0]
    kp, np_ = (-k) % EXACT_ALIGN, (-n) % EXACT_ALIGN
    w = weight.t()
    if kp or np_:
        w = F.pad(w, (0, np_, 0, kp))
    xp = (F.pad(x, (0, kp)) if kp else x.contiguous()).view(t, 1, k + kp)
    y = torch.bmm(xp, w.expand(t, *w.shape)).view(t, n + np_)
    if np_:
        y = y[:, :n]
    return y + bias if bias is not None else y


ONEDNN_MIN_ROWS = 1
"""float32 GEMMs with at least this many rows run on oneDNN (``use_onednn_weights``): all
of them. On the 2-core AMD EPYC box (1 thread) oneDNN's prepacked sgemm reaches 190-250
GFLOP/s for M >= 16 on every SmolLM2 layer shape where MKL's ``F.linear`` gets 85-110, and
at M = 1 (batch-1 decode, memory-bound) it streams the weights at 32-37 GB/s where MKL's
GEMV gets 16-24 (30 layers' distinct weights, cache-cold: ``/tmp``-free check in
docs/benchmarks.md, "oneDNN at M = 1")."""


ONEDNN_BUCKET_MIN_ROWS = 64
"""oneDNN GEMMs of more rows than this run on a row count rounded up to a bucket
(``onednn_rows``); up to it, on their own row count (decode batches: few distinct)."""


def onednn_rows(m: int) -> int:
    """The row count a oneDNN GEMM of ``m`` rows runs on: ``m`` up to
    ``ONEDNN_BUCKET_MIN_ROWS``, above it ``m`` rounded up to a multiple of 1/32 of the
    power of two at or above ``m`` (16 buckets an octave, at most 1/16 more rows).

    oneDNN builds, JIT-compiles and caches one primitive per GEMM shape, and a prefill
    step's row count is its prompt's, different nearly every step: each new count cost a
    primitive build (about 1.4 ms per weight shape on the tiny model, page faults
    included) and ~0.46 MiB that oneDNN's 1,024-entry primitive cache kept (the tiny
    model's four shapes at 200 new row counts: +371 MiB), and cycling through more shapes
    than the cache holds rebuilt them again. Buckets bound the shapes to 16 an octave
    (docs/benchmarks.md, "Issue 16, session 23")."""
    if m <= ONEDNN_BUCKET_MIN_ROWS:
        return m
    g = 1 << max(0, (m - 1).bit_length() - 5)
    return -(-m // g) * g


def _row_buckets_enabled() -> bool:
    """Env ``PYMOONCAKE_ONEDNN_ROW_BUCKETS`` not ``0`` (read when a weight is packed)."""
    return os.environ.get("PYMOONCAKE_ONEDNN_ROW_BUCKETS", "1").strip().lower() not in (
        "0", "false", "no", "off")


_PAD = threading.local()


def _padded_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """``x`` ``[m, k]`` copied into the first ``m`` rows of a ``[rows, k]`` tensor whose
    other rows are zero (this thread's staging buffer per ``(k, dtype)``, grown to the
    largest ``rows`` asked and reused; GEMM rows are independent, so the extra rows change
    no real row's result, and zeros keep stale values, denormal or not finite, out of the
    GEMM). Nothing returned from a GEMM aliases it."""
    m, k = x.shape
    key = (k, x.dtype)
    bufs = getattr(_PAD, "bufs", None)
    if bufs is None:
        bufs = _PAD.bufs = {}
    buf = bufs.get(key)
    if buf is None or buf.shape[0] < rows:
        with torch.inference_mode(False):  # a normal tensor: usable in and out of the mode
            buf = bufs[key] = torch.zeros(rows, k, dtype=x.dtype)
    with torch.no_grad():  # never part of an autograd graph
        buf[:m].copy_(x)
        buf[m:rows].zero_()
    return buf[:rows]


ONEDNN_BIAS_ALIGN = 16
"""A Linear with a bias is prepacked only when its output width is a multiple of this: with
torch 2.13's oneDNN, ``mkldnn._linear_pointwise`` with a bias and a width of 4099 or 4100
took 85 s for 257 rows x 576 -> 4099 (``F.linear``: 0.14 s), and 28 s at 1027; 4096, or no
bias, is fast. Such layers stay on ``F.linear``."""


def onednn_enabled() -> bool:
    """Whether ``use_onednn_weights`` prepacks: mkldnn built in and enabled, float32 matmuls
    kept in full precision, and env ``PYMOONCAKE_ONEDNN`` not ``0`` (the off-switch)."""
    if os.environ.get("PYMOONCAKE_ONEDNN", "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    if not (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled):
        return False
    try:
        precision = torch.backends.mkldnn.matmul.fp32_precision
    except AttributeError:  # older torch: no reduced-precision fp32 matmuls
        precision = "ieee"
    return precision in ("none", "ieee") and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters and state-dict names) that switches to
    ``exact_linear`` for float64 inputs, the engine's bit-reproducible mode, and to oneDNN
    for float32 inputs of ``ONEDNN_MIN_ROWS`` rows or more once ``use_onednn_weights`` has
    prepacked the weight (the dense weight stays the parameter; the packed copy is used only
    while the parameter is unchanged: same storage, same version)."""

    _onednn_weight: torch.Tensor | None = None
    _onednn_key: tuple[int, int] | None = None
    _row_buckets: bool = False

    def pack_onednn(self) -> bool:
        """Prepack the float32 weight for oneDNN (``mkldnn._reorder_linear_weight``, the op
        ``torch.compile``'s CPU backend uses); ``False`` (and nothing packed) otherwise."""
        self._onednn_weight = self._onednn_key = None
        w = self.weight.detach()
        if w.dtype != torch.float32 or w.device.type != "cpu" or not onednn_enabled():
            return False
        if self.bias is not None and w.shape[0] % ONEDNN_BIAS_ALIGN:
            return False  # oneDNN's biased kernel is pathological at such widths (see below)
        self._onednn_weight = torch.ops.mkldnn._reorder_linear_weight(w.contiguous())
        self._onednn_key = (w.data_ptr(), self.weight._version)
        self._row_buckets = _row_buckets_enabled()
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float64 and x.dim() == 2:
            return exact_linear(x, self.weight, self.bias)
        packed = self._onednn_weight
        if (packed is not None and x.dtype == torch.float32 and x.dim() >= 2
                and x.numel() >= ONEDNN_MIN_ROWS * x.shape[-1]
                and self._onednn_key == (self.weight.data_ptr(), self.weight._version)):
            return self._onednn(x.contiguous(), packed)
        return F.linear(x, self.weight, self.bias)

    def _onednn(self, x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        """The prepacked oneDNN GEMM of contiguous ``x`` ``[..., in]``; a 2-D ``x`` of more
        than ``ONEDNN_BUCKET_MIN_ROWS`` rows runs padded to ``onednn_rows`` rows and the
        result is the first ``m`` rows (a contiguous view)."""
        m = x.shape[0]
        rows = self.bucket_rows(x)
        if rows == m:
            return torch.ops.mkldnn._linear_pointwise(x, packed, self.bias, "none", [], "")
        return torch.ops.mkldnn._linear_pointwise(
            _padded_rows(x, rows), packed, self.bias, "none", [], "")[:m]

    def bucket_rows(self, x: torch.Tensor) -> int:
        """The row count this layer's oneDNN GEMM runs ``x`` on: ``onednn_rows`` of a 2-D
        ``x``'s rows when row buckets were on at packing, else its own row count."""
        m = x.shape[0]
        return onednn_rows(m) if self._row_buckets and x.dim() == 2 else m

    def packed(self) -> torch.Tensor | None:
        """The oneDNN-packed weight while it matches the parameter, else ``None``."""
        if self._onednn_key == (self.weight.data_ptr(), self.weight._version):
            return self._onednn_weight
        return None

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``linear(x) + residual`` in one oneDNN call (binary post-op; the same float32
        sum as adding afterwards). ``x`` ``[T, in]``, ``residual`` ``[T, out]`` float32.
        A ``T`` that ``onednn_rows`` rounds up runs padded, the add done after the GEMM."""
        packed = self.packed()
        if packed is None:
            return self.forward(x) + residual
        x = x.contiguous()
        if self.bucket_rows(x) != x.shape[0]:
            return self._onednn(x, packed).add_(residual)   # padded rows: add afterwards
        return torch.ops.mkldnn._linear_pointwise.binary(
            x, residual, packed, self.bias, "add")


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with gate and up fused in one matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj.forward(x).split(self.intermediate_size, dim=-1)
        act = exact_pointwise(F.silu, gate) if x.dtype == torch.float64 else F.silu(gate)
        return self.down_proj.forward(act * up)

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``down(silu(gate(x)) * up(x)) + residual`` for float32 ``x`` and ``residual``
        ``[T, hidden]``: the fused gate|up GEMM on oneDNN, the SiLU-multiply by the C
        kernel (``kernels.silu_mul``), the down GEMM with an add post-op. One gate|up GEMM
        and a C pass beat two GEMMs with swish/mul post-ops by 2-9 % at every M measured
        (1-512 rows, 2-core AMD EPYC). Falls back to ``forward`` + add without a packed
        weight or the kernels."""
        from pymooncake.engine import kernels
        packed = self.gate_up_proj.packed()
        if packed is None or not kernels.available():
            return self.forward(x) + residual
        x = x.contiguous()
        m = x.shape[0]
        rows = self.gate_up_proj.bucket_rows(x)
        down = self.down_proj.packed()
        if rows != m and down is not None:
            # padded once: the zero rows stay zero through SiLU-multiply into the down GEMM
            gate_up = torch.ops.mkldnn._linear_pointwise(_padded_rows(x, rows), packed, None,
                                                         "none", [], "")
            return torch.ops.mkldnn._linear_pointwise(
                kernels.silu_mul(gate_up), down, self.down_proj.bias, "none", [], ""
            )[:m].add_(residual)
        gate_up = self.gate_up_proj._onednn(x, packed)
        return self.down_proj.forward_add(kernels.silu_mul(gate_up), residual)


def use_input_major_weights(model: nn.Module) -> None:
    """Store every ``nn.Linear`` weight input-major (``[in, out]`` memory, same values).

    ``F.linear`` computes ``x @ W.T``; with ``W.T`` contiguous, MKL runs the no-transpose
    GEMM, which on this CPU is ~2x faster for decode-sized batches (M = 16) and bit-identical
    in result. Weights shared with an embedding (tied LM head) are left as they are.
    """
    shared = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    for m in model.modules():
        if isinstance(m, nn.Linear) and id(m.weight) not in shared:
            w = m.weight.detach()
            if w.t().is_contiguous():
                continue
            m.weight = nn.Parameter(w.t().contiguous().t(), requires_grad=False)


def use_onednn_weights(model: nn.Module) -> int:
    """Prepack every float32 ``Linear`` weight for oneDNN (see ``Linear``); returns how
    many were packed (0 with ``PYMOONCAKE_ONEDNN=0``, without mkldnn, or for a float64 /
    bfloat16 model, which keep their own paths). Costs a second copy of those weights."""
    return sum(m.pack_onednn() for m in model.modules() if isinstance(m, Linear))
