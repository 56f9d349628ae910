"""Predictors the Conductor uses for T_prefill, T_transfer and the decode TBT (Algorithm 1).

They are coefficient sets, fitted from measured profiles (live) or from the simulator's cost
model; the policy evaluates them, never measures. Seconds and tokens throughout.
"""

from __future__ import annotations

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
    """Time of one continuous-batching step: ``overhead + max(compute, memory)``.

    ``compute = per_sequence_s · batch``; ``memory = weight_s + per_context_token_s · context``
    (weights and the batch's KV read from HBM once per step).
    """

    overhead_s: float = 0.01114
    weight_s: float = 0.01507
    per_context_token_s: float = 3.499e-8
    per_sequence_s: float = 1.4e-4

    def step_s(self, batch_size: int, num_context_tokens: int) -> float:
        """Predicted decode step time (s) = the TBT each running request sees."""
        if batch_size <= 0:
            return 0.0
        mem = self.weight_s + self.per_context_token_s * num_context_tokens
        return self.overhead_s + max(self.per_sequence_s * batch_size, mem)


@dataclass(frozen=True, slots=True)
class Estimators:
    """The three predictors the policy needs, bundled."""

    prefill: PrefillEstimator = PrefillEstimator()
    transfer: TransferEstimator = TransferEstimator()
    decode: DecodeEstimator = DecodeEstimator()
