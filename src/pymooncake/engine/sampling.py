"""Per-request sampling: greedy, temperature, top-k, top-p, seed; logprobs of chosen tokens."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where sampling happens, not by the pure cores
    import torch


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request samples and when it stops."""

    max_tokens: int = 16
    """Generated tokens at most (stop reason ``length``)."""
    temperature: float = 0.0
    """0 = greedy (argmax); > 0 divides the logits before softmax."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 = all."""
    top_p: float = 1.0
    """Keep the smallest set of tokens whose probability reaches top_p."""
    seed: int | None = None
    """Per-request generator seed: the same seed gives the same tokens."""
    stop_token_ids: tuple[int, ...] = ()
    """Stop after emitting any of these (the token is kept in the output)."""
    stop: tuple[str, ...] = ()
    """Stop when the decoded output contains any of these strings."""
    ignore_eos: bool = False
    """Do not stop at the model's EOS token ids."""
    logprobs: bool = False
    """Return the log-probability of each chosen token."""
    return_logits: bool = False
    """Keep the float32 logits row of every sampling step (tests, cold/warm comparisons)."""

    def __post_init__(self) -> None:
        """Raises ``ValueError`` naming the field: a non-int count, a NaN or infinite
        temperature/top_p, an out-of-range value, or an empty stop string."""
        for name in ("max_tokens", "top_k"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise ValueError(f"{name} must be an int, got {value!r}")
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise ValueError(f"{name} must be a number, got {value!r}")
            if not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and (isinstance(self.seed, bool)
                                      or not isinstance(self.seed, numbers.Integral)):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        for s in stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty str, got {s!r} "
                                 "(an empty string would stop after the first token)")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "stop", stop)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def sample_row(logits: torch.Tensor, params: SamplingParams,
               generator: torch.Generator | None) -> tuple[int, float]:
    """Sample one token from a ``[vocab]`` logits row; returns (token id, logprob).

    The logprob is of the chosen token under the model's distribution (raw logits, before
    temperature/top-k/top-p).
    """
    import torch

    logprobs = torch.log_softmax(logits.double(), dim=-1)
    if params.greedy:
        token = int(torch.argmax(logits))
        return token, float(logprobs[token])
    x = logits.double() / params.temperature
    if params.top_k and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, idx = torch.sort(x, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        cum = torch.cumsum(probs, dim=-1)
        remove = cum - probs >= params.top_p  # keep the token that crosses top_p
        sorted_x = sorted_x.masked_fill(remove, float("-inf"))
        x = torch.full_like(x, float("-inf")).scatter(0, idx, sorted_x)
    probs = torch.softmax(x, dim=-1)
    token = int(torch.multinomial(probs, 1, generator=generator))
    return token, float(logprobs[token])


def greedy_batch(logits: torch.Tensor) -> list[int]:
    """Argmax of each row of ``[N, vocab]`` logits."""
    import torch
    return torch.argmax(logits, dim=-1).tolist()
