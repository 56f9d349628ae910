"""``SimConfig``: one flat frozen configuration of a simulated cluster and run.

Defaults reproduce the paper's setting (FAST'25 §5.1): LLaMA3-70B on 8×A800 nodes, 512-token
blocks, about 3M tokens of DRAM cache per node, TTFT SLO 30 s, TBT SLO 100 ms.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pymooncake.conductor.policy import PREFILL_POLICIES
from pymooncake.conductor.policy.cpp import CPP_BREAK_EVEN_TOKENS

SCENARIOS = ("colocated", "pd", "pd-local", "pd-global")
"""colocated: vLLM-like nodes doing prefill and decode (optional local prefix cache and
chunked prefill); pd: P/D without cross-request cache; pd-local: P/D + a local cache per
prefill node; pd-global: P/D + the global pool (any node's blocks reusable over the network)."""

SCHEDULERS = tuple(PREFILL_POLICIES)

DEFAULT_PD_CACHE_TOKENS = 3_000_000
"""Default DRAM cache per prefill node of the P/D scenarios (~1 TB at 320 KB/token, §5.3.1)."""

COLOCATED_CACHE_SHARE = 0.5
"""Default colocated prefix cache: this share of the HBM KV space left after the weights
(the rest holds the running requests' KV)."""


def _finite(name: str, v: float, lo: float, *, strict: bool) -> None:
    ok = isinstance(v, (int, float)) and math.isfinite(v) and (v > lo if strict else v >= lo)
    if not ok:
        raise ValueError(f"{name} must be a finite number {'>' if strict else '>='} {lo:g}, "
                         f"got {v!r}")


@dataclass(frozen=True, slots=True)
class SimConfig:
    """A simulated cluster and how to drive it."""

    scenario: str = "pd-global"
    """One of ``SCENARIOS``."""
    scheduler: str = "global-cache"
    """Prefill policy: one of ``conductor.policy.PREFILL_POLICIES``."""
    num_prefill: int = 8
    """Prefill nodes (for ``colocated``: the nodes, each prefilling and decoding)."""
    num_decode: int = 8
    """Decode nodes (ignored for ``colocated``)."""
    model: str = "llama3-70b"
    """Model preset name or a path to a Hugging Face config.json."""
    gpu: str = "A800"
    """GPU preset: A800, H800, H100, H200 (a node = 8 GPUs)."""
    calibration: str | None = None
    """Path of a CPU calibration file (``sim.calibration``): its measured costs replace the
    ``model``/``gpu`` roofline and its transfer bandwidth replaces ``network_bandwidth_gbps``;
    a node is then one core running one engine."""
    cache_capacity_tokens: int | None = None
    """KV cache per node, in tokens. ``None``: ``DEFAULT_PD_CACHE_TOKENS`` of DRAM per prefill
    node for ``pd-local``/``pd-global``; for ``colocated`` an HBM prefix cache of
    ``COLOCATED_CACHE_SHARE`` of the KV space left after the weights (``resolve_cache_tokens``).
    A colocated cache is HBM: it is deducted from the node's decode KV capacity. Ignored
    (must be ``None`` or 0) for ``pd``."""
    block_size: int = 512
    """Tokens per trace hash id / cache block."""
    output_length: int | None = None
    """Override every request's output length (tokens); ``None`` keeps the trace's."""
    ttft_slo_s: float = 30.0
    tbt_slo_s: float = 0.1
    early_rejection: bool = False
    """Reject requests whose predicted TTFT/TBT misses the SLO (off in the §5.2 runs)."""
    network_bandwidth_gbps: float = 696.0
    """Inter-node KV bandwidth (87 GB/s: the Transfer Engine on 4×200 Gbps, Figure 12)."""
    chunked_prefill: bool = True
    """Colocated nodes: interleave prefill chunks with decode steps (else prefill stalls decode)."""
    chunk_size_tokens: int = 4096
    step_budget_tokens: int | None = None
    """Colocated only: when set, each node is stepped like the engine's scheduler
    (``sim.engine_node``: prefill chunks and decodes merged in steps of at most this many
    tokens, ``max_num_batched_tokens``; its prefix cache is its whole KV space, as the
    engine's free blocks keep their hashes); None: the analytic colocated node."""
    decode_step_tokens: int | None = None
    """With ``step_budget_tokens``: a step's budget while any request decodes
    (``EngineConfig.decode_step_tokens``; None: no cap)."""
    waiting_order: str = "fcfs"
    """With ``step_budget_tokens``: ``fcfs``, ``shortest`` (fewest prompt tokens first,
    aged by ``aging_tokens_per_s``) or ``srpt`` (running and waiting prompts together,
    fewest tokens left first), the engine's ``waiting_order``."""
    decode_step_s: float | None = None
    """With ``step_budget_tokens``: while any request decodes, each step's prefill chunks
    keep its time within this (``EngineConfig.decode_step_s``; None: off)."""
    prefill_hold_s: float | None = None
    """With ``step_budget_tokens``: while any request decodes, steps carry the decodes alone
    until a prompt has waited this long since it arrived (``EngineConfig.prefill_hold_s``;
    None: off)."""
    aging_tokens_per_s: float = 2000.0
    policy_prefill: tuple[float, float, float] | None = None
    """The Conductor's prefill predictor ``(quadratic_s, linear_s, overhead_s)`` when it is
    not the cost model's truth (a live Conductor started without ``--profile`` predicts with
    ``ConductorConfig``'s defaults, and a colocated one never refits them); None: the truth."""
    max_batch_size: int = 256
    """Largest continuous batch of a decode node."""
    kvcache_balancing_threshold: float = 1.0
    hot_block_min_accesses: int = 1
    """A fetched block is kept as a replica once accessed this many times."""
    sample_interval_s: float = 300.0
    """How often the replica counts of the hottest keys are sampled (0 = never)."""
    seed: int = 0
    cpp_groups: int = 0
    """Chunked-pipeline (CPP) prefill groups added to the prefill pool (FAST'25 §5.1,
    docs/cpp.md), each of ``cpp_stages`` nodes; the placement is then
    ``policy.with_cpp(scheduler)``: long prompts to a group where ``use_cpp`` says it pays.
    A group computes the whole prompt (no prefix reuse), in ``cpp_prefill_s`` seconds."""
    cpp_stages: int = 2
    cpp_chunk_tokens: int = 4096
    cpp_min_tokens: int = CPP_BREAK_EVEN_TOKENS
    """Uncached tokens from which a prompt may go to a group (the measured break-even)."""
    cpp_hop_s: float = 0.003
    """One chunk's hidden states to the next stage (s)."""

    def __post_init__(self) -> None:
        if self.scenario not in SCENARIOS:
            raise ValueError(f"unknown scenario {self.scenario!r}; use one of {SCENARIOS}")
        if self.scheduler not in PREFILL_POLICIES:
            raise ValueError(f"unknown scheduler {self.scheduler!r}; use one of {SCHEDULERS}")
        if self.num_prefill < 1:
            raise ValueError(f"the cluster needs >= 1 prefill node, got {self.num_prefill}")
        if self.scenario != "colocated" and self.num_decode < 1:
            raise ValueError(f"scenario {self.scenario} needs >= 1 decode node, "
                             f"got {self.num_decode}")
        if self.cache_capacity_tokens is not None and self.cache_capacity_tokens < 0:
            raise ValueError("cache capacity must be >= 0 tokens per node, "
                             f"got {self.cache_capacity_tokens}")
        if self.scenario == "pd" and self.cache_capacity_tokens:
            raise ValueError("scenario pd has no cross-request cache; leave "
                             "cache_capacity_tokens unset (or use pd-local / pd-global)")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1 token, got {self.block_size}")
        if self.output_length is not None and self.output_length < 1:
            raise ValueError(f"output_length must be >= 1 token, got {self.output_length}")
        _finite("ttft_slo_s", self.ttft_slo_s, 0, strict=True)
        _finite("tbt_slo_s", self.tbt_slo_s, 0, strict=True)
        _finite("network_bandwidth_gbps", self.network_bandwidth_gbps, 0, strict=True)
        _finite("kvcache_balancing_threshold", self.kvcache_balancing_threshold, 0,
                strict=False)
        if self.chunk_size_tokens < 1 or self.max_batch_size < 1:
            raise ValueError("chunk_size_tokens and max_batch_size must be >= 1")
        if self.hot_block_min_accesses < 1:
            raise ValueError("hot_block_min_accesses must be >= 1")
        _finite("sample_interval_s", self.sample_interval_s, 0, strict=False)
        if self.step_budget_tokens is not None and (
                self.scenario != "colocated" or self.step_budget_tokens < 1):
            raise ValueError(f"step_budget_tokens must be >= 1 and needs scenario colocated, "
                             f"got {self.step_budget_tokens} with {self.scenario}")
        if self.decode_step_tokens is not None and (
                self.step_budget_tokens is None or self.decode_step_tokens < 1):
            raise ValueError("decode_step_tokens must be >= 1 and needs step_budget_tokens")
        if self.waiting_order not in ("fcfs", "shortest", "srpt"):
            raise ValueError(f"waiting_order must be fcfs, shortest or srpt, got "
                             f"{self.waiting_order!r}")
        if self.decode_step_s is not None and (self.step_budget_tokens is None
                                               or not self.decode_step_s > 0):
            raise ValueError("decode_step_s must be > 0 and needs step_budget_tokens")
        if self.prefill_hold_s is not None and (self.step_budget_tokens is None
                                                or not self.prefill_hold_s > 0):
            raise ValueError("prefill_hold_s must be > 0 and needs step_budget_tokens")
        _finite("aging_tokens_per_s", self.aging_tokens_per_s, 0, strict=False)
        if self.policy_prefill is not None and (len(self.policy_prefill) != 3 or any(
                not (math.isfinite(v) and v >= 0) for v in self.policy_prefill)):
            raise ValueError(f"policy_prefill must be 3 finite numbers >= 0, got "
                             f"{self.policy_prefill!r}")
        if self.cpp_groups < 0 or (self.cpp_groups and self.scenario == "colocated"):
            raise ValueError(f"cpp_groups must be >= 0 and needs a P/D scenario, got "
                             f"{self.cpp_groups} with {self.scenario}")
        if self.cpp_groups and (self.cpp_stages < 2 or self.cpp_chunk_tokens < 1
                                or self.cpp_min_tokens < 0):
            raise ValueError("cpp_stages must be >= 2, cpp_chunk_tokens >= 1 and "
                             "cpp_min_tokens >= 0")
        _finite("cpp_hop_s", self.cpp_hop_s, 0, strict=False)

    @property
    def network_bandwidth_bytes_per_s(self) -> float:
        return self.network_bandwidth_gbps * 1e9 / 8

    @property
    def remote_reuse(self) -> bool:
        """Whether a node may reuse blocks held by another node (the global pool)."""
        return self.scenario == "pd-global"

    @property
    def node_cache_tokens(self) -> int:
        """Cache per node in effect for the P/D scenarios (0 for ``pd``: no cross-request
        cache). For ``colocated`` use ``resolve_cache_tokens`` (it needs the HBM size)."""
        if self.scenario == "pd":
            return 0
        if self.cache_capacity_tokens is None:
            return DEFAULT_PD_CACHE_TOKENS
        return self.cache_capacity_tokens

    def resolve_cache_tokens(self, kv_capacity_tokens: int) -> int:
        """Cache tokens per node given the node's HBM KV space (tokens beside the weights).

        Raises ``ValueError`` when a colocated cache leaves no HBM for the running requests.
        """
        if self.scenario != "colocated":
            return self.node_cache_tokens
        if self.step_budget_tokens is not None:   # the engine's free blocks keep their hashes
            return min(self.cache_capacity_tokens or kv_capacity_tokens, kv_capacity_tokens)
        if self.cache_capacity_tokens is None:
            return int(kv_capacity_tokens * COLOCATED_CACHE_SHARE)
        if self.cache_capacity_tokens >= kv_capacity_tokens:
            raise ValueError(
                f"a colocated prefix cache lives in HBM: {self.cache_capacity_tokens} tokens do "
                f"not fit beside the weights and the running requests' KV (the node holds "
                f"{kv_capacity_tokens} KV tokens); use a cache capacity below "
                f"{kv_capacity_tokens}")
        return self.cache_capacity_tokens
