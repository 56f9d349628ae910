"""The engine's own step-time model, fitted online, to size a step against a TBT objective.

A colocated engine mixes prefill chunks into its decode steps (chunked prefill, vLLM v1 /
Sarathi-Serve), so every token a decoding request gets waits for the whole step: the step's
time *is* the decodes' time between tokens. A fixed cap on the step's tokens
(``EngineConfig.decode_step_tokens``) is either too small where contexts are short (every
step pays the weights' read and the per-step Python again for few tokens; on SmolLM2 with
2 threads a 256-token step costs ~11 % more per token than a 512-token one) or too large
where they are long (attention grows with the context). ``EngineConfig.decode_step_s``
instead bounds the step's *predicted time*; this module predicts it.

Model (least squares over the last ``window`` steps the engine ran)::

    step_s = a + b * tokens + c * pairs

``tokens``: the tokens the step computes (decodes + prefill chunks); ``pairs``: the
attention's query-key pairs, a chunk of ``n`` tokens after ``p`` computed ones adding
``n * (p + (n + 1) / 2)`` (causal). ``a`` is what every step pays (the weights' read from
memory, the per-step Python), ``b`` the per-token GEMM cost, ``c`` the attention's. No
torch; pure arithmetic.
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np


def attention_pairs(num_computed: int, num_new: int) -> float:
    """Causal query-key pairs of ``num_new`` tokens after ``num_computed``:
    ``n * (p + (n + 1) / 2)`` (a decode, ``n = 1``: ``p + 1``)."""
    return num_new * (num_computed + (num_new + 1) / 2)


class StepTimeModel:
    """``a + b·tokens + c·pairs`` seconds, refitted every ``refit_every`` observations.

    Not ready (``ready`` False, ``max_new_tokens`` None) until the window holds at least
    ``min_samples`` steps of which ``min_samples // 4`` computed at least ``big_tokens``
    tokens and as many fewer: a fit from decode steps alone cannot tell the per-token cost.
    A fit with a negative coefficient is refitted without the attention term, and dropped
    (not ready) if still negative.
    """

    def __init__(self, window: int = 256, min_samples: int = 16, big_tokens: int = 64,
                 refit_every: int = 8) -> None:
        if window < min_samples or min_samples < 4 or big_tokens < 2 or refit_every < 1:
            raise ValueError("StepTimeModel: need window >= min_samples >= 4, big_tokens >= 2, "
                             "refit_every >= 1")
        self.samples: deque[tuple[float, float, float]] = deque(maxlen=window)
        self.min_samples = min_samples
        self.big_tokens = big_tokens
        self.refit_every = refit_every
        self.coef: tuple[float, float, float] | None = None
        """(a s, b s/token, c s/pair) of the last fit; None until ready."""
        self._since_fit = 0

    @property
    def ready(self) -> bool:
        return self.coef is not None

    def observe(self, tokens: int, pairs: float, seconds: float) -> None:
        """Record one step: ``tokens`` computed, ``pairs`` attention pairs, ``seconds`` wall
        time. Non-finite or negative times are ignored."""
        if not (math.isfinite(seconds) and seconds >= 0 and tokens > 0):
            return
        self.samples.append((float(tokens), float(pairs), float(seconds)))
        self._since_fit += 1
        if self._since_fit >= self.refit_every or self.coef is None:
            self._since_fit = 0
            self.coef = self._fit()

    def _fit(self) -> tuple[float, float, float] | None:
        if len(self.samples) < self.min_samples:
            return None
        s = np.asarray(self.samples, dtype=np.float64)
        big = int((s[:, 0] >= self.big_tokens).sum())
        need = self.min_samples // 4
        if big < need or len(s) - big < need:
            return None
        ones = np.ones(len(s))
        for cols in ((ones, s[:, 0], s[:, 1]), (ones, s[:, 0])):
            x = np.stack(cols, axis=1)
            coef, *_ = np.linalg.lstsq(x, s[:, 2], rcond=None)
            if (coef[1:] >= 0).all() and coef[1] > 0:
                c = float(coef[2]) if len(coef) == 3 else 0.0
                return max(0.0, float(coef[0])), float(coef[1]), c
        return None

    def predict_s(self, tokens: float, pairs: float) -> float:
        """Predicted seconds of a step; raises ``RuntimeError`` before the model is ready."""
        if self.coef is None:
            raise RuntimeError("StepTimeModel is not ready")
        a, b, c = self.coef
        return a + b * tokens + c * pairs

    def max_new_tokens(self, limit_s: float, base_tokens: int, base_pairs: float,
                       num_computed: int) -> int | None:
        """The most tokens a prefill chunk after ``num_computed`` tokens can add to a step
        that already holds ``base_tokens`` / ``base_pairs`` (its decodes) while the step's
        predicted time stays within ``limit_s``: the largest ``n`` with
        ``b·n + c·n·(p + (n+1)/2) <= limit - predict(base)``. 0 when the decodes alone fill
        the limit; None before the model is ready."""
        if self.coef is None:
            return None
        _, b, c = self.coef
        room = limit_s - self.predict_s(base_tokens, base_pairs)
        if room <= 0:
            return 0
        lin = b + c * (num_computed + 0.5)      # c/2·n² + lin·n <= room
        if c <= 0:
            return int(room / lin)
        return int((-lin + math.sqrt(lin * lin + 2.0 * c * room)) / c)


MIN_TIMED_CHUNK = 16
"""Under ``decode_step_s``, the first prefill chunk of a step gets at least this many tokens
even when the decodes alone fill the limit, so prompts keep moving (their TBT objective is
then missed by the decode batch itself, not by the prefill). 16, not 64: on ``smollm2``
with 2 threads a 64-token chunk after 4,000 context tokens alone takes ~95 ms with the
decodes, so a floor of 64 held every such step above an 80 ms limit."""


class StepPlan:
    """A step being planned (``engine.scheduler``): tokens left in its ``budget`` and, with
    a fitted ``model`` (``decode_step_s``), the tokens and attention pairs already in it, to
    keep its predicted time within ``limit_s``. ``model`` None: the budget alone."""

    __slots__ = ("budget", "model", "limit_s", "tokens", "pairs", "chunks")

    def __init__(self, budget: int, model: StepTimeModel | None, limit_s: float) -> None:
        self.budget = budget
        self.model = model
        self.limit_s = limit_s
        self.tokens = 0
        self.pairs = 0.0
        self.chunks = 0

    def room(self, left: int, num_computed: int) -> int:
        """Tokens a request with ``left`` to compute after ``num_computed`` may take now."""
        if self.model is None or left <= 1:
            return self.budget
        n = self.model.max_new_tokens(self.limit_s, self.tokens, self.pairs, num_computed) or 0
        if self.chunks == 0:
            n = max(n, MIN_TIMED_CHUNK)
        return min(self.budget, n)

    def add(self, num_computed: int, n: int) -> None:
        self.budget -= n
        self.tokens += n
        self.pairs += attention_pairs(num_computed, n)
        self.chunks += n > 1
