"""Messages that cross two top-level packages (api ↔ conductor ↔ engine workers).

They are plain frozen dataclasses: in-process they are passed as they are, over the wire
they travel through ``rpc.codec.to_wire`` / ``from_wire``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SamplingOptions:
    """How one request samples and when it stops (OpenAI request fields, validated)."""

    max_tokens: int
    """Generated tokens at most (≥ 1); finish reason ``length`` when reached."""
    temperature: float = 1.0
    """0 = greedy; OpenAI's default is 1."""
    top_p: float = 1.0
    top_k: int = 0
    """0 = off (an extension, as in vLLM)."""
    seed: int | None = None
    stop: tuple[str, ...] = ()
    """Stop strings; the matched string is not part of the output (OpenAI semantics)."""
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    """One request as the front door hands it to the Conductor: token ids, not text."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingOptions
    priority: int = 0
    """Lower is more important (vLLM's convention); > 0 is sheddable under overload."""
    arrival_time_s: float = 0.0
    """Monotonic arrival time at the front door (s), for TTFT and queue timeouts."""


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """New tokens of one request, streamed back to the front door.

    ``cached_tokens`` is the number of prompt tokens whose KV the *prefill* side reused
    from a cache (CASES BUG-56: KV moved from a prefill to a decode instance is not a
    hit); it is set on the first event and on the last.
    """

    request_id: str
    token_ids: tuple[int, ...]
    finish_reason: str | None = None
    """``None`` while running; then ``"stop"``, ``"length"`` or ``"abort"``."""
    cached_tokens: int | None = None
    logprobs: tuple[float, ...] | None = None


@dataclass(frozen=True, slots=True)
class Rejection:
    """Why a request was refused, and when to retry (HTTP 429 or 503 + Retry-After)."""

    status: int
    """429 = too many requests now (queue full, SLO unreachable); 503 = queue timeout or
    no instance able to serve."""
    code: str
    """``queue_full``, ``queue_timeout``, ``slo_ttft``, ``slo_tbt``, ``no_instance``…"""
    message: str
    retry_after_s: float = 1.0

    def __post_init__(self) -> None:
        if self.status not in (429, 503):
            raise ValueError(f"a rejection is HTTP 429 or 503, got {self.status}")


class RequestRejected(Exception):
    """Raised by a backend's ``generate`` when the request is refused (early rejection)."""

    def __init__(self, rejection: Rejection) -> None:
        super().__init__(f"{rejection.code}: {rejection.message}")
        self.rejection = rejection
