"""Plain values the Conductor's policy reads and returns (DESIGN.md §7, Mooncake FAST'25 §4).

Every type is a frozen dataclass so the live Conductor (``conductor/cluster_view.py``) and the
simulator (``sim/runner.py``) build the same snapshot and call the same functions. Times are
seconds on the caller's clock (virtual time in the simulator, ``time.monotonic`` live); the
policy never reads a clock itself.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import dataclass
from typing import NewType

from pymooncake.conductor.policy.cpp import CppCostModel

InstanceId = NewType("InstanceId", str)
"""Name of a prefill or decode instance (one node / one engine process)."""

BlockKeyLike = Hashable
"""A block key: ``identity.BlockKey`` live, a trace ``hash_id`` (int) in the simulator."""


@dataclass(frozen=True, slots=True)
class RequestInfo:
    """What the policy knows about one request."""

    request_id: str
    num_prompt_tokens: int
    """Prompt length in tokens (>= 1)."""
    block_keys: tuple[BlockKeyLike, ...]
    """Chained prefix-block keys of the prompt, in order (DESIGN.md §3)."""
    max_output_tokens: int
    """Tokens the request will generate at most (>= 0)."""
    arrival_s: float
    """Arrival time on the caller's clock."""
    sequence_number: int = 0
    """Arrival order (>= 0); the round-robin and random policies derive their choice from it."""
    sheddable: bool = False
    """Low priority: may be rejected when the prefill pool is saturated (BUG-51 step 2)."""

    def __post_init__(self) -> None:
        if self.num_prompt_tokens < 1:
            raise ValueError(f"num_prompt_tokens must be >= 1, got {self.num_prompt_tokens}")
        if self.max_output_tokens < 0:
            raise ValueError(f"max_output_tokens must be >= 0, got {self.max_output_tokens}")
        if self.sequence_number < 0:
            raise ValueError(f"sequence_number must be >= 0, got {self.sequence_number}")


@dataclass(frozen=True, slots=True)
class PrefillInstanceState:
    """One prefill instance as seen at decision time."""

    instance_id: InstanceId
    busy_until_s: float
    """Predicted end of the prefill now running (<= now when idle)."""
    queued_prefill_s: float = 0.0
    """Sum of the predicted prefill times of the requests waiting in its queue (seconds)."""
    num_in_flight: int = 0
    """Requests running or queued on it (the saturation signal's numerator)."""
    concurrency_limit: int | None = None
    """Requests it may hold at once; ``None`` = unlimited (never saturated)."""
    queued_prefills_s: tuple[float, ...] = ()
    """With ``shortest_first``: the predicted prefill time of each queued request."""
    shortest_first: bool = False
    """The instance runs its queue shortest job first (``EngineConfig.waiting_order``): a
    new request waits only for the running prefill and the queued ones no longer than
    itself, not for the whole queue."""
    cpp: CppCostModel | None = None
    """Set when the instance is a chunked-pipeline (CPP) prefill group (FAST'25 §5.1):
    its cost model. ``cpp_placement.with_cpp`` sends it only the prompts ``use_cpp`` says
    pay; the plain policies see only the instances where this is ``None``."""

    def __post_init__(self) -> None:
        if self.concurrency_limit is not None and self.concurrency_limit < 1:
            raise ValueError("concurrency_limit must be >= 1 request (None = unlimited), "
                             f"got {self.concurrency_limit}")


@dataclass(frozen=True, slots=True)
class DecodeInstanceState:
    """One decode instance as seen at decision time.

    ``finish_s`` lets admission predict the decode load *at the moment the prefill will
    finish* (DESIGN.md §7): the running requests predicted to finish before then have left.
    """

    instance_id: InstanceId
    num_running: int
    """Requests in its continuous batch now."""
    num_context_tokens: int
    """Sum of the KV lengths (tokens) of the running requests."""
    kv_capacity_tokens: int
    """KV tokens its HBM can hold for requests."""
    max_batch_size: int
    """Largest continuous batch it runs."""
    finish_s: tuple[float, ...] = ()
    """Predicted finish time of each running request, sorted ascending."""
    num_incoming: int = 0
    """Requests already placed on it whose KV has not arrived yet (they join before us)."""
    incoming_context_tokens: int = 0
    """Their prompt tokens."""


@dataclass(frozen=True, slots=True)
class ClusterView:
    """Snapshot of the cluster handed to the policy; built fresh for every decision."""

    now_s: float
    prefill: tuple[PrefillInstanceState, ...]
    decode: tuple[DecodeInstanceState, ...]


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """Prefix match of one request against the cache holders (from ``PrefixIndex.match``).

    ``local_blocks[i]`` is the number of leading block keys held by ``view.prefill[i]``;
    ``best_blocks``/``best_holder`` are the longest match over every holder the request may
    reuse from (prefill instances and the global store); ``best_holder`` is ``None`` when
    cross-instance reuse is off or nothing matches.
    """

    local_blocks: tuple[int, ...]
    best_blocks: int = 0
    best_holder: InstanceId | None = None


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a request runs and what the policy predicted for it."""

    prefill_instance: InstanceId
    decode_instance: InstanceId | None
    """``None`` for a colocated placement (the prefill instance decodes too)."""
    prefix_blocks: int
    """Leading blocks reused (local + transferred)."""
    transfer_blocks: int
    """Of those, blocks fetched from ``transfer_source`` (0 = none)."""
    transfer_source: InstanceId | None
    predicted_queue_s: float
    predicted_transfer_s: float
    predicted_prefill_s: float
    predicted_tbt_s: float = 0.0

    @property
    def predicted_ttft_s(self) -> float:
        """Queue + transfer + prefill: the quantity Algorithm 1 minimises."""
        return self.predicted_queue_s + self.predicted_transfer_s + self.predicted_prefill_s


@dataclass(frozen=True, slots=True)
class Rejection:
    """The request is refused before any prefill runs (HTTP 429 with ``Retry-After``)."""

    reason: str
    """``"ttft_slo"``, ``"tbt_slo"``, ``"decode_full"`` (no decode batch slot or KV
    capacity), ``"saturated"`` or ``"no_instance"``."""
    retry_after_s: float
    predicted_ttft_s: float = 0.0
    predicted_tbt_s: float = 0.0


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    """Knobs of the scheduling policy (defaults: the paper's end-to-end setting, §5.1)."""

    ttft_slo_s: float = 30.0
    """TTFT objective (seconds)."""
    tbt_slo_s: float = 0.1
    """TBT objective (seconds; the paper's threshold I)."""
    kvcache_balancing_threshold: float = 1.0
    """Algorithm 1: fetch the best holder's blocks when ``best / local`` exceeds this."""
    early_rejection: bool = True
    """Reject when a predicted SLO cannot be met (Mooncake §6); off = admit everything."""
    block_size_tokens: int = 512
    """Tokens per block key."""
    seed: int = 0
    """Seed of the random policy (combined with the request's sequence number)."""

    def __post_init__(self) -> None:
        for name in ("ttft_slo_s", "tbt_slo_s"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be a finite number > 0 seconds, got {v!r}")
        v = self.kvcache_balancing_threshold
        if not (math.isfinite(v) and v >= 0):
            raise ValueError(f"kvcache_balancing_threshold must be a finite number >= 0, "
                             f"got {v!r}")
        if self.block_size_tokens < 1:
            raise ValueError(f"block_size_tokens must be >= 1, got {self.block_size_tokens}")
