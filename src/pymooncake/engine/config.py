"""``EngineConfig``: one flat frozen config for the engine (STYLE.md §2.4)."""

from __future__ import annotations

from dataclasses import dataclass

ROLES = ("prefill", "decode", "colocated")
DTYPES = ("float32", "bfloat16", "float16", "float64")
KV_LOAD_FAILURE_POLICIES = ("recompute", "fail")
WAITING_ORDERS = ("fcfs", "shortest")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Sizes and policies of one engine instance."""

    block_size: int = 16
    """Tokens per KV block (16 on CPU; the identity namespace includes it)."""
    num_kv_blocks: int = 1024
    """KV blocks in the paged cache (all layers); capacity = num_kv_blocks * block_size."""
    max_num_batched_tokens: int = 2048
    """Token budget of one step (decodes + prefill chunks)."""
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
    sizes are heavy-tailed, like the prompt lengths of the Mooncake traces)."""
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
        if self.num_threads < 0:
            raise ValueError(f"EngineConfig.num_threads must be >= 0, got {self.num_threads}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError("without chunked prefill, max_num_batched_tokens must be >= "
                             "max_model_len; enable chunked prefill or raise the budget")

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_kv_blocks * self.block_size
