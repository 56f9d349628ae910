"""Predictors the Conductor uses for T_prefill, T_transfer and the decode TBT (Algorithm 1).

They are coefficient sets, fitted from measured profiles (live) or from the simulator's cost
model; the policy evaluates them, never measures. Seconds and tokens throughout.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PrefillEstimator:
    """``t(n, p) = quadratic_s·(n² − p²) + linear_s·(n − p) + overhead_s`` for ``n`` prompt
    tokens of which ``p`` are reused (FAST'25 §2.2: FLOPs = l·(a·n²·d + b·n·d²)).

    Defaults: the fit of the paper's Figure 14a (8×A800, LLaMA3-70B), PAPER.md §6.
    """

    quadratic_s: float = 7.146e-10
    linear_s: float = 1.1622e-4
    overhead_s: float = 0.0

    def prefill_s(self, num_tokens: int, num_prefix_tokens: int = 0) -> float:
        """Predicted prefill time (s) of ``num_tokens`` with ``num_prefix_tokens`` reused."""
        p = min(max(num_prefix_tokens, 0), num_tokens)
        if p >= num_tokens:
            return 0.0
        return (self.quadratic_s * (num_tokens * num_tokens - p * p)
                + self.linear_s * (num_tokens - p) + self.overhead_s)


@dataclass(frozen=True, slots=True)
class TransferEstimator:
    """``t = num_tokens · kv_bytes_per_token / bandwidth + overhead`` (one batch transfer)."""

    kv_bytes_per_token: int = 327_680
    """LLaMA3-70B in bf16: 2·80·8·128·2 B (PAPER.md §6)."""
    bandwidth_bytes_per_s: float = 87e9
    """Transfer Engine on 4×200 Gbps (paper Figure 12)."""
    overhead_s: float = 0.001

    def transfer_s(self, num_tokens: int) -> float:
        """Predicted time (s) to move the KV of ``num_tokens`` tokens (0 for none)."""
        if num_tokens <= 0:
            return 0.0
        return num_tokens * self.kv_bytes_per_token / self.bandwidth_bytes_per_s + self.overhead_s


@dataclass(frozen=True, slots=True)
class DecodeEstimator:
    """Time of one continuous-batching step:
    ``overhead + max(compute, memory) + attention_per_context_token_s · context``.

    ``compute = per_sequence_s · batch``; ``memory = weight_s + per_context_token_s · context``
    (weights and the batch's KV read from HBM once per step). The last term (0 on a GPU
    roofline) is attention work that does not overlap the GEMMs, as on a CPU core
    (``fit_decode_estimator``).
    """

    overhead_s: float = 0.01114
    weight_s: float = 0.01507
    per_context_token_s: float = 3.499e-8
    per_sequence_s: float = 1.4e-4
    attention_per_context_token_s: float = 0.0

    def step_s(self, batch_size: int, num_context_tokens: int) -> float:
        """Predicted decode step time (s) = the TBT each running request sees."""
        if batch_size <= 0:
            return 0.0
        mem = self.weight_s + self.per_context_token_s * num_context_tokens
        return (self.overhead_s + max(self.per_sequence_s * batch_size, mem)
                + self.attention_per_context_token_s * num_context_tokens)


@dataclass(frozen=True, slots=True)
class Estimators:
    """The three predictors the policy needs, bundled."""

    prefill: PrefillEstimator = PrefillEstimator()
    transfer: TransferEstimator = TransferEstimator()
    decode: DecodeEstimator = DecodeEstimator()


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting (tiny dense systems)."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for c in range(n):
        piv = max(range(c, n), key=lambda r: abs(m[r][c]))
        if m[piv][c] == 0.0:
            raise ValueError("profile samples do not determine the estimator (singular fit); "
                             "measure more distinct prompt lengths")
        m[c], m[piv] = m[piv], m[c]
        for r in range(c + 1, n):
            f = m[r][c] / m[c][c]
            for k in range(c, n + 1):
                m[r][k] -= f * m[c][k]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][k] * x[k] for k in range(r + 1, n))) / m[r][r]
    return x


LINEAR_FLOOR_S = 1e-12
"""The least per-token prefill cost (seconds a token) a nonnegative fit gives: a
picosecond, far below any real token's GEMMs (~1e-6 s and up on a CPU), so a fit that
found none predicts the same times but is never a free token (CI, session 24:
``sim calibrate-cpu`` on the tiny model fitted ``linear_s`` 0.0 on a loaded runner)."""


def fit_prefill_estimator(samples: Sequence[tuple[int, int, float]], *,
                          with_overhead: bool = False, relative: bool = True,
                          nonnegative: bool = False) -> PrefillEstimator:
    """Least-squares fit of ``PrefillEstimator`` to measured ``(num_tokens, num_prefix_tokens,
    seconds)`` profiles (e.g. ``pymooncake profile`` output).

    Features are ``n² − p²``, ``n − p`` and (``with_overhead``) 1. ``relative`` minimises the
    relative residuals (each sample weighted by ``1/seconds``, so short prompts count as much
    as long ones); otherwise absolute seconds. ``nonnegative`` keeps every coefficient
    >= 0 (noisy timings can otherwise give a negative term) and ``linear_s`` at least
    ``LINEAR_FLOOR_S``: on overhead-bound prompts noise can make ``quadratic + overhead``
    the closest curve, and a per-token cost of exactly 0 is refused by a calibration file
    (``sim.calibration``); the floor keeps that fit's predictions. Raises ``ValueError`` with
    fewer samples than parameters, a bad sample (``seconds <= 0`` when relative) or a
    singular system.
    """
    k = 3 if with_overhead else 2
    if len(samples) < k:
        raise ValueError(f"need at least {k} profile samples, got {len(samples)}")
    rows = []
    for n, p, t in samples:
        if n < 1 or not 0 <= p <= n or t < 0 or (relative and t <= 0):
            raise ValueError(f"bad profile sample (tokens={n}, prefix={p}, seconds={t})")
        w = 1.0 / t if relative else 1.0
        f = [float(n * n - p * p) * w, float(n - p) * w] + ([w] if with_overhead else [])
        rows.append((f, float(t) * w))
    if nonnegative:   # linear_s = LINEAR_FLOOR_S + x1, x1 >= 0: fit what the floor leaves
        x = _nnls([(f, t - LINEAR_FLOOR_S * f[1]) for f, t in rows])[0]
        x[1] += LINEAR_FLOOR_S
    else:
        x = _lstsq(rows)[0]
    return PrefillEstimator(x[0], x[1], x[2] if with_overhead else 0.0)


def _lstsq(rows: Sequence[tuple[list[float], float]]) -> tuple[list[float], float]:
    """Least squares on column-scaled normal equations; returns (x, sum of squared residuals)."""
    k = len(rows[0][0])
    scale = [max(abs(f[j]) for f, _ in rows) or 1.0 for j in range(k)]
    ata = [[sum(f[i] / scale[i] * f[j] / scale[j] for f, _ in rows) for j in range(k)]
           for i in range(k)]
    atb = [sum(f[i] / scale[i] * t for f, t in rows) for i in range(k)]
    x = [v / s for v, s in zip(_solve(ata, atb), scale, strict=True)]
    sse = sum((sum(a * b for a, b in zip(f, x, strict=True)) - t) ** 2 for f, t in rows)
    return x, sse


def _nnls(rows: Sequence[tuple[list[float], float]]) -> tuple[list[float], float]:
    """Least squares with every coefficient >= 0: the best of the unconstrained fits over
    the subsets of columns whose coefficients all come out >= 0 (exact for a few columns)."""
    k = len(rows[0][0])
    best: tuple[list[float], float] | None = None
    for mask in range(1, 1 << k):
        cols = [j for j in range(k) if mask >> j & 1]
        try:
            xs, sse = _lstsq([([f[j] for j in cols], t) for f, t in rows])
        except ValueError:
            continue
        if min(xs) < 0 or (best is not None and sse >= best[1]):
            continue
        x = [0.0] * k
        for j, v in zip(cols, xs, strict=True):
            x[j] = v
        best = (x, sse)
    if best is None:
        raise ValueError("profile samples do not determine the estimator (singular fit); "
                         "measure more distinct points")
    return best


def fit_decode_estimator(samples: Sequence[tuple[int, int, float]], *,
                         relative: bool = True, grid: int = 200) -> DecodeEstimator:
    """Least-squares fit of a ``DecodeEstimator`` to measured ``(batch, context tokens,
    seconds)`` decode steps, in the form ``o + max(s·B, w) + a·C`` (a CPU core: the weights
    are read once per step whatever the batch, the batch's GEMM work grows with ``B`` and
    attention adds ``a`` per context token; ``per_context_token_s`` is 0).

    With ``w = s·B*`` the model is ``o + s·max(B, B*) + a·C``, linear for a fixed knee ``B*``:
    the knee is searched on a grid over ``[0, max B]`` and refined by golden section; the
    knee with the least residual wins (``B* = 0``: purely additive). Every coefficient is
    kept >= 0 (noisy timings). ``relative`` weights each sample by ``1/seconds``. Raises
    ``ValueError`` for fewer than 3 samples, a bad sample or a singular system (e.g. one
    batch size only).
    """
    if len(samples) < 3:
        raise ValueError(f"need at least 3 decode samples, got {len(samples)}")
    for b, c, t in samples:
        if b < 1 or c < 0 or not t > 0:
            raise ValueError(f"bad decode sample (batch={b}, context={c}, seconds={t})")
    if len({b for b, _, _ in samples}) < 2:
        raise ValueError("decode samples need at least 2 distinct batch sizes")

    def fit(knee: float) -> tuple[list[float], float]:
        rows = []
        for b, c, t in samples:
            w = 1.0 / t if relative else 1.0
            rows.append(([w, max(float(b), knee) * w, float(c) * w], t * w))
        try:
            return _nnls(rows)
        except ValueError:
            return [0.0, 0.0, 0.0], math.inf

    # The knee stays below the largest batch (else s multiplies a constant).
    b_max = float(max(b for b, _, _ in samples))
    knees = [b_max * i / grid for i in range(grid)]
    errs = [fit(k)[1] for k in knees]
    i = min(range(len(knees)), key=errs.__getitem__)
    if math.isinf(errs[i]):
        raise ValueError("decode samples do not determine the estimator (singular fit); "
                         "measure more batch sizes and contexts")
    lo, hi = knees[max(0, i - 1)], knees[min(grid - 1, i + 1)]
    g = (5 ** 0.5 - 1) / 2
    for _ in range(60):
        m1, m2 = hi - g * (hi - lo), lo + g * (hi - lo)
        if fit(m1)[1] <= fit(m2)[1]:
            hi = m2
        else:
            lo = m1
    knee = min((knees[i], (lo + hi) / 2), key=lambda k: fit(k)[1])
    (o, s, a), _ = fit(knee)
    return DecodeEstimator(overhead_s=o, weight_s=s * knee, per_context_token_s=0.0,
                           per_sequence_s=s, attention_per_context_token_s=a)
