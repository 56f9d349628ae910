"""Decoder building blocks: RMSNorm, rotary position embedding (incl. Llama 3 scaling), SwiGLU.

The maths follows Hugging Face ``transformers``' Llama implementation so that logits agree
within dtype tolerance (RMSNorm in float32, ``rotate_half`` RoPE, inverse frequencies in
float32).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
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
        if x.dtype in (torch.float32, torch.float64):  # one fused op, same maths
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


EXACT_TILE_ROWS = 16
"""Rows per GEMM in the fp64 (batch-invariant) mode: every matmul runs on tiles of exactly
this many rows, so a row's reduction order never depends on how many rows the step has."""


def exact_linear(x: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` for ``x`` ``[T, in]``, batch-invariant (fp64 mode).

    BLAS picks a different kernel (and reduction order) for a GEMM with few rows (GEMV-like
    paths for M = 1, 2) than for many, so one token computed alone differs in the last bits
    from the same token inside a longer prefill. Here the rows are zero-padded to a multiple
    of ``EXACT_TILE_ROWS`` and run as a batch of ``[EXACT_TILE_ROWS, in] @ [in, out]``
    GEMMs of identical shape: each output row is the same bits whatever ``T`` is.
    """
    t, k = x.shape
    pad = (-t) % EXACT_TILE_ROWS
    xp = F.pad(x, (0, 0, 0, pad)) if pad else x
    tiles = (t + pad) // EXACT_TILE_ROWS
    w = weight.t()
    y = torch.bmm(xp.reshape(tiles, EXACT_TILE_ROWS, k), w.expand(tiles, *w.shape))
    y = y.reshape(t + pad, w.shape[1])[:t]
    return y + bias if bias is not None else y


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters and state-dict names) that switches to
    ``exact_linear`` for float64 inputs, the engine's bit-reproducible mode."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float64 and x.dim() == 2:
            return exact_linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with gate and up fused in one matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj.forward(x).split(self.intermediate_size, dim=-1)
        return self.down_proj.forward(F.silu(gate) * up)


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
