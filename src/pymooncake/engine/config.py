"""``EngineConfig``: one flat frozen config for the engine (STYLE.md §2.4)."""

from __future__ import annotations

from dataclasses import dataclass

ROLES = ("prefill", "decode", "colocated")
DTYPES = ("float32", "bfloat16", "float16", "float64")
KV_LOAD_FAILURE_POLICIES = ("recompute", "fail")
WAITING_ORDERS = ("fcfs", "shortest", "srpt")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Sizes and policies of one engine instance."""

    block_size: int = 16
    """Tokens per KV block (16 on CPU; the identity namespace includes it)."""
    num_kv_blocks: int = 1024
    """KV blocks in the paged cache (all layers); capacity = num_kv_blocks * block_size."""
    max_num_batched_tokens: int = 2048
    """Token budget of one step (decodes + prefill chunks)."""
    decode_step_tokens: int | None = None
    """While a running request decodes, the step's budget is at most this (None: no cap):
    prefill chunks stay short enough that the decodes' TBT stays low, and a step with no
    decode still takes ``max_num_batched_tokens`` (Sarathi-Serve's stall-free batching)."""
    decode_step_s: float | None = None
    """While a running request decodes, a step's *predicted time* is at most this many
    seconds (None: off): prefill chunks are sized from the engine's own fitted step-time
    model (``engine.step_time``: ``a + b·tokens + c·attention pairs``), so they are long
    where contexts are short and short where attention is dear. Until the model has seen
    enough steps, ``decode_step_tokens`` applies. Set it a little under the TBT objective:
    every decode in the step waits the step's whole time for its next token."""
    prefill_hold_s: float | None = None
    """While a running request decodes, prompts (waiting, or mid-prefill) get no tokens in
    the step — it carries the decodes alone, so their TBT is a decode step's — until one of
    them has waited this many seconds since it arrived; then every cap above applies as
    usual (None: off). For TBT objectives that no step carrying a prefill chunk meets
    (about 2x the single-request TBT) and a TTFT objective with room for the wait: a
    time-shared form of prefill/decode disaggregation on one engine (Mooncake FAST'25
    §1, DistServe §2: a prefill chunk beside the decodes is what raises their TBT)."""
    max_num_seqs: int = 64
    """Running requests at most."""
    enable_chunked_prefill: bool = True
    prefill_chunk_tokens: int = 512
    """Largest prefill chunk of one request in one step."""
    enable_prefix_caching: bool = True
    max_model_len: int = 8192
    """Prompt + output tokens at most per request."""
    role: str = "colocated"
    """``prefill`` (stops after the first token), ``decode`` or ``colocated``."""
    dtype: str = "float32"
    """Weights, activations and KV dtype. ``float64`` is the bit-reproducible mode."""
    num_threads: int = 1
    """torch intra-op threads (0 leaves torch's default). 1 by default: on the project's
    2 shared cores, a second OpenMP thread that is descheduled makes every op wait for it
    (measured ~7x slower decode steps under load from other processes)."""
    waiting_order: str = "fcfs"
    """Which waiting request is admitted next: ``fcfs`` (arrival order) or ``shortest``
    (fewest tokens left to compute first, aged by ``aging_tokens_per_s`` so a long prompt
    is not starved: shortest-job-first lowers the mean waiting time of a queue whose job
    sizes are heavy-tailed, like the prompt lengths of the Mooncake traces). ``srpt``
    extends ``shortest`` to prompts already running: after the decodes, every prompt with
    tokens left — running ones' next chunks and waiting ones, net of their cached prefix —
    goes fewest-left first (shortest remaining processing time, preemptive at chunk
    granularity: a paused prompt keeps its blocks)."""
    aging_tokens_per_s: float = 2000.0
    """``shortest``: a waiting request counts as this many tokens shorter per second waited."""
    kv_load_failure: str = "recompute"
    """A failed external/layer-wise KV load: ``recompute`` the request, or ``fail`` it."""

    def __post_init__(self) -> None:
        for name in ("block_size", "num_kv_blocks", "max_num_batched_tokens", "max_num_seqs",
                     "prefill_chunk_tokens", "max_model_len"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"EngineConfig.{name} must be a positive int, got {v!r}")
        if self.role not in ROLES:
            raise ValueError(f"EngineConfig.role must be one of {ROLES}, got {self.role!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"EngineConfig.dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.kv_load_failure not in KV_LOAD_FAILURE_POLICIES:
            raise ValueError(f"EngineConfig.kv_load_failure must be one of "
                             f"{KV_LOAD_FAILURE_POLICIES}, got {self.kv_load_failure!r}")
        if self.waiting_order not in WAITING_ORDERS:
            raise ValueError(f"EngineConfig.waiting_order must be one of {WAITING_ORDERS}, "
                             f"got {self.waiting_order!r}")
        if not self.aging_tokens_per_s >= 0:
            raise ValueError(f"EngineConfig.aging_tokens_per_s must be >= 0, got "
                             f"{self.aging_tokens_per_s!r}")
        if self.decode_step_tokens is not None and (
                not isinstance(self.decode_step_tokens, int) or self.decode_step_tokens < 1):
            raise ValueError(f"EngineConfig.decode_step_tokens must be a positive int or None, "
                             f"got {self.decode_step_tokens!r}")
        if self.decode_step_s is not None and not (
                isinstance(self.decode_step_s, (int, float)) and 0 < self.decode_step_s < 3600):
            raise ValueError(f"EngineConfig.decode_step_s must be a number of seconds in "
                             f"(0, 3600) or None, got {self.decode_step_s!r}")
        if self.prefill_hold_s is not None and not (
                isinstance(self.prefill_hold_s, (int, float)) and 0 < self.prefill_hold_s < 3600):
            raise ValueError(f"EngineConfig.prefill_hold_s must be a number of seconds in "
                             f"(0, 3600) or None, got {self.prefill_hold_s!r}")
        if self.num_threads < 0:
            raise ValueError(f"EngineConfig.num_threads must be >= 0, got {self.num_threads}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError("without chunked prefill, max_num_batched_tokens must be >= "
                             "max_model_len; enable chunked prefill or raise the budget")

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_kv_blocks * self.block_size


DEFAULT_KV_CAPACITY_TOKENS = 16384
"""Paged KV cache capacity when neither ``num_kv_blocks`` nor a memory budget is given
(1,024 blocks of 16: the tiny model's 32 MiB, SmolLM2-135M's 720 MiB in float32)."""
STORE_SEGMENT_CACHES = 2
"""A prefill worker's Store segment holds this many of its local caches' worth of KV."""


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int,
                       elem_bytes: int) -> int:
    """K and V of one token over all layers: ``layers x 2 x kv_heads x head_dim x bytes``."""
    return num_layers * 2 * num_kv_heads * head_dim * elem_bytes


@dataclass(frozen=True, slots=True)
class KVSizing:
    """Every KV buffer of one worker, sized from the model's KV bytes per token (issue 14:
    fixed byte counts tuned for the tiny model refused a real model's requests)."""

    kv_bytes_per_token: int
    block_size: int
    num_kv_blocks: int
    recv_buffer_bytes: int
    """Decode role: the P→D receive arena. It holds prompts in transit (a buffer is freed
    once its KV is in the paged cache), so it never needs more than the cache: by default
    the larger of one ``max_model_len`` prompt and half the cache, at most the cache."""
    global_segment_size_bytes: int
    """Prefill role: DRAM given to the Store, ``STORE_SEGMENT_CACHES`` caches by default."""

    @property
    def block_nbytes(self) -> int:
        return self.kv_bytes_per_token * self.block_size

    @property
    def kv_cache_bytes(self) -> int:
        return self.num_kv_blocks * self.block_nbytes

    def describe(self, role: str) -> str:
        """One log line: what was sized, in tokens and MiB."""
        mib = 1 << 20
        parts = [f"KV {self.kv_bytes_per_token} B/token",
                 f"paged cache {self.num_kv_blocks} blocks x {self.block_size} = "
                 f"{self.num_kv_blocks * self.block_size} tokens, "
                 f"{self.kv_cache_bytes / mib:.0f} MiB"]
        if role == "decode":
            parts.append(f"receive arena {self.recv_buffer_bytes / mib:.0f} MiB "
                         f"({self.recv_buffer_bytes // self.kv_bytes_per_token} tokens)")
        if role == "prefill":
            parts.append(f"Store segment {self.global_segment_size_bytes / mib:.0f} MiB "
                         f"({self.global_segment_size_bytes // self.kv_bytes_per_token} "
                         f"tokens)")
        return "; ".join(parts)


def size_kv(kv_bytes: int, block_size: int, max_model_len: int, *,
            num_kv_blocks: int | None = None, kv_memory_bytes: int | None = None,
            recv_buffer_bytes: int | None = None,
            global_segment_size_bytes: int | None = None) -> KVSizing:
    """Size a worker's KV buffers. Explicit values win; ``None`` derives them:

    * paged cache: ``kv_memory_bytes // block bytes`` blocks when a budget is given, else
      ``max(DEFAULT_KV_CAPACITY_TOKENS, max_model_len)`` tokens;
    * receive arena: ``min(cache, max(max_model_len, cache / 2))`` tokens (whole blocks);
    * Store segment: ``STORE_SEGMENT_CACHES x`` the cache's bytes.

    Raises ``ValueError`` naming the field when a size is not positive or a budget holds
    less than one block."""
    if kv_bytes <= 0 or block_size <= 0 or max_model_len <= 0:
        raise ValueError(f"kv_bytes_per_token, block_size and max_model_len must be > 0, got "
                         f"{kv_bytes}, {block_size}, {max_model_len}")
    block = kv_bytes * block_size
    for name, v in (("num_kv_blocks", num_kv_blocks), ("kv_memory_bytes", kv_memory_bytes),
                    ("recv_buffer_bytes", recv_buffer_bytes),
                    ("global_segment_size_bytes", global_segment_size_bytes)):
        if v is not None and v <= 0:
            raise ValueError(f"{name} must be > 0 (or None to size it from the model), "
                             f"got {v}")
    if num_kv_blocks is None:
        if kv_memory_bytes is not None:
            num_kv_blocks = kv_memory_bytes // block
            if num_kv_blocks < 1:
                raise ValueError(f"kv_memory_bytes {kv_memory_bytes} holds no KV block "
                                 f"({block} bytes: {block_size} tokens x {kv_bytes} B)")
        else:
            num_kv_blocks = -(-max(DEFAULT_KV_CAPACITY_TOKENS, max_model_len) // block_size)
    if recv_buffer_bytes is None:
        prompt_blocks = -(-max_model_len // block_size)
        recv_buffer_bytes = min(num_kv_blocks, max(prompt_blocks, num_kv_blocks // 2)) * block
    if global_segment_size_bytes is None:
        global_segment_size_bytes = STORE_SEGMENT_CACHES * num_kv_blocks * block
    return KVSizing(kv_bytes, block_size, num_kv_blocks, recv_buffer_bytes,
                    global_segment_size_bytes)
