"""The cost of one whole engine step, fitted from timed steps (a calibration file's ``step``
section; ``sim.calibration`` reads and writes it, ``sim.engine_node`` charges it):
``a + b·tokens + c·pairs + e·sequences + g·decode context + h·chunk prefix`` (docs/sim.md
"The engine-step cost")."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

STEP_TERMS = ("tokens", "pairs", "sequences", "decode_context", "chunk_prefix")
"""The variable terms ``fit_step_cost`` may use, besides the fixed part per step (the order
of ``step_features``)."""
DEFAULT_STEP_TERMS = ("tokens", "pairs", "decode_context", "chunk_prefix")
"""The terms ``calibrate-cpu`` fits: the engine's form (``tokens``, ``pairs``) and the two its
residuals asked for on SmolLM2 (docs/sim.md): a decode's context costs more than a pair
(each decode row reads its whole context's K/V for one query), and a chunk after a prefix
pays per prefix token whatever its size (the prefix's K/V gathered for the chunk)."""


def attention_pairs(num_computed: int, num_new: int) -> float:
    """Causal query-key pairs of ``num_new`` tokens after ``num_computed`` computed ones:
    ``n·(p + (n + 1)/2)`` (a decode, ``n = 1``: ``p + 1``; 0 for ``n = 0``).

    The formula of ``pymooncake.engine.step_time.attention_pairs`` (the engine's online step
    model ``a + b·tokens + c·pairs``), kept here because the simulator never imports the
    engine (DESIGN.md §2); a test checks the two agree."""
    return num_new * (num_computed + (num_new + 1) / 2)


@dataclass(frozen=True, slots=True)
class StepCost:
    """One engine step's seconds::

        overhead_s + per_token_s·tokens + per_pair_s·pairs + per_sequence_s·sequences
                   + per_decode_context_token_s·decode_context
                   + per_prefix_token_s·chunk_prefix

    ``tokens``: computed in the step; ``pairs``: their causal attention pairs
    (``attention_pairs``, decodes included); ``sequences``: requests in the step;
    ``decode_context``: the tokens the decodes attend (each its computed tokens + 1, i.e.
    its pairs again: the extra a decode pays per context token); ``chunk_prefix``: the
    computed tokens before each prefill chunk. Fitted by ``fit_step_cost``; every
    coefficient >= 0, the last three 0 unless fitted."""

    overhead_s: float
    per_token_s: float
    per_pair_s: float
    per_sequence_s: float = 0.0
    per_decode_context_token_s: float = 0.0
    per_prefix_token_s: float = 0.0

    def step_s(self, tokens: float, pairs: float, sequences: float = 0.0,
               decode_context: float = 0.0, chunk_prefix: float = 0.0) -> float:
        """Seconds of a step of these sizes (the class docstring)."""
        return (self.overhead_s + self.per_token_s * tokens + self.per_pair_s * pairs
                + self.per_sequence_s * sequences
                + self.per_decode_context_token_s * decode_context
                + self.per_prefix_token_s * chunk_prefix)

    def composition_s(self, decode_contexts: Sequence[int],
                      chunks: Sequence[tuple[int, int]]) -> float:
        """Seconds of a step of decodes attending ``decode_contexts`` tokens each (computed
        + 1) and prefill chunks ``(computed before, tokens)``; 0 for an empty step."""
        if not decode_contexts and not chunks:
            return 0.0
        ctx = sum(decode_contexts)
        return self.step_s(len(decode_contexts) + sum(k for _, k in chunks),
                           ctx + sum(attention_pairs(p, k) for p, k in chunks),
                           len(decode_contexts) + len(chunks), ctx,
                           sum(p for p, _ in chunks))

    def chunk_s(self, computed: int, k: int) -> float:
        """Seconds a prefill chunk of ``k`` tokens after ``computed`` adds to a step (its
        tokens, pairs, sequence and prefix terms)."""
        return (self.per_token_s * k + self.per_pair_s * attention_pairs(computed, k)
                + self.per_sequence_s + self.per_prefix_token_s * computed)

    def to_json(self) -> dict[str, float]:
        """The file's ``step`` section (seconds, seconds per token / pair / sequence)."""
        return {"overhead_s": self.overhead_s, "per_token_s": self.per_token_s,
                "per_pair_s": self.per_pair_s, "per_sequence_s": self.per_sequence_s,
                "per_decode_context_token_s": self.per_decode_context_token_s,
                "per_prefix_token_s": self.per_prefix_token_s}


def step_features(decodes: float, decode_pairs: float, chunk: float, offset: float
                  ) -> tuple[float, float, float, float, float]:
    """The ``STEP_TERMS`` (``tokens, pairs, sequences, decode_context, chunk_prefix``) of a
    step sample ``[B, D, k, p]``: ``B`` decodes attending ``D`` tokens in all beside one
    prefill chunk of ``k`` tokens after ``p`` (``k = 0``: none)."""
    has = chunk > 0
    return (decodes + chunk, decode_pairs + attention_pairs(int(offset), int(chunk)),
            decodes + (1 if has else 0), decode_pairs, offset if has else 0)


def fit_step_cost(samples: Sequence[Sequence[float]],
                  terms: Sequence[str] = DEFAULT_STEP_TERMS) -> StepCost:
    """Fit ``StepCost`` to step samples ``[B, D, k, p, seconds]`` (``step_features``): the
    fixed part plus the ``terms`` (of ``STEP_TERMS``; the others stay 0), relative least
    squares (each sample weighted by ``1/seconds``), every coefficient >= 0 (the best fit
    over the subsets of columns whose coefficients all come out >= 0). ``tokens`` must be
    among the terms.

    Raises:
        ValueError: an unknown or repeated term, no ``tokens``, a sample that is not 5
            finite numbers with ``seconds > 0`` and sizes >= 0, fewer samples than
            coefficients, or samples that do not determine them (no nonnegative fit with a
            per-token cost > 0)."""
    import numpy as np
    bad = [t for t in terms if t not in STEP_TERMS]
    if bad or len(set(terms)) != len(terms) or "tokens" not in terms:
        raise ValueError(f"step terms must be distinct names of {STEP_TERMS} including "
                         f"'tokens', got {tuple(terms)}")
    rows, ys = [], []
    for s in samples:
        if len(s) != 5 or not all(isinstance(v, int | float) and math.isfinite(v) for v in s) \
                or s[4] <= 0 or min(s[:4]) < 0:
            raise ValueError(f"bad step sample {list(s)!r}: need [B, D, k, p, seconds] "
                             "with seconds > 0")
        f = dict(zip(STEP_TERMS, step_features(*s[:4]), strict=True))
        rows.append([1.0, *(f[t] for t in terms)])
        ys.append(float(s[4]))
    k = 1 + len(terms)
    if len(rows) < k:
        raise ValueError(f"need at least {k} step samples, got {len(rows)}")
    x_all = np.asarray(rows) / np.asarray(ys)[:, None]     # relative: divide by the time
    y_all = np.ones(len(ys))
    scale = np.abs(x_all).max(axis=0)
    scale[scale == 0] = 1.0
    tok = 1 + list(terms).index("tokens")
    best: tuple[np.ndarray, float] | None = None
    for mask in range(1, 1 << k):
        cols = [j for j in range(k) if mask >> j & 1]
        if tok not in cols:
            continue
        a = x_all[:, cols] / scale[cols]
        if np.linalg.matrix_rank(a) < len(cols):
            continue
        coef = np.linalg.lstsq(a, y_all, rcond=None)[0] / scale[cols]
        if (coef < 0).any() or coef[cols.index(tok)] <= 0:
            continue
        sse = float(((x_all[:, cols] @ coef - y_all) ** 2).sum())
        if best is None or sse < best[1]:
            full = np.zeros(k)
            full[cols] = coef
            best = (full, sse)
    if best is None:
        raise ValueError("step samples do not determine the step cost (no nonnegative fit "
                         "with a per-token cost > 0); measure more distinct compositions")
    c = dict(zip(("overhead", *terms), (float(v) for v in best[0]), strict=True))
    return StepCost(c["overhead"], c["tokens"], c.get("pairs", 0.0), c.get("sequences", 0.0),
                    c.get("decode_context", 0.0), c.get("chunk_prefix", 0.0))


def step_rel_errors(cost: StepCost, samples: Sequence[Sequence[float]]) -> list[float]:
    """``predicted / measured − 1`` of every step sample ``[B, D, k, p, seconds]``."""
    return [cost.step_s(*step_features(*s[:4])) / s[4] - 1 for s in samples]
