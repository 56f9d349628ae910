"""``ConductorConfig``: the live Conductor's settings (STYLE.md §2.4)."""

from __future__ import annotations

from dataclasses import dataclass

POLICIES = ("global-cache", "local-cache", "load", "round-robin", "random")


@dataclass(frozen=True, slots=True)
class ConductorConfig:
    """How the Conductor places, admits and dispatches requests (DESIGN.md §7)."""

    policy: str = "global-cache"
    """Prefill placement: ``global-cache`` (Algorithm 1 with the global Store),
    ``local-cache`` (no cross-instance reuse), ``load``, ``round-robin``, ``random``."""
    colocated: bool = False
    """Workers prefill and decode together (the non-disaggregated baseline)."""
    ttft_slo_s: float = 10.0
    """TTFT objective (s) for early rejection."""
    tbt_slo_s: float = 1.0
    """TBT objective (s) for early rejection."""
    context_length: int = 0
    """Tokens per request (prompt + output) the front door admits; a worker registering
    with a smaller ``max_model_len`` is refused (``CONTEXT_TOO_SMALL``). 0 = unchecked."""
    early_rejection: bool = True
    prefill_concurrency_limit: int | None = None
    """Requests one prefill instance holds at once before sheddable ones are refused."""
    worker_timeout_s: float = 3.0
    """A worker silent this long (no load report) leaves the cluster view."""
    rpc_timeout_s: float = 60.0
    """Longest prefill or prepare call (s)."""
    kvcache_balancing_threshold: float = 1.0
    kv_bytes_per_token: int = 2048
    """Transfer estimate: KV bytes of one token (tiny model fp32: 2·4·2·32·4)."""
    transfer_bandwidth_bytes_per_s: float = 1e9
    """Transfer estimate: Store → prefill bandwidth on this host (bytes/s)."""
    prefill_quadratic_s: float = 5.0e-8
    """Prefill estimate ``a·(n²−p²) + b·(n−p) + c`` (s); replaced by ``--profile``. The
    defaults are ``pymooncake profile`` of the tiny model on the project's 2-core machine
    (3.3e-8, 6.6e-5, 1.8e-3) times 1.5 for cores shared with the other processes."""
    prefill_linear_s: float = 1.0e-4
    prefill_overhead_s: float = 3.0e-3
    overlap_admission_min_queue_s: float = 0.0
    """Decode admission overlaps the prefill (its queue and compute) when the predicted
    queue time is at least this (s); below it admission goes first and the prefill waits
    for it. 0 = always overlap: a prefill that ends before its ``KVTarget`` arrives waits
    for it and ships its full blocks from the prefix cache in one batch (the decode worker
    then computes the prompt's partial last block)."""
    online_profile: bool = True
    """Refit the prefill estimate from the compute windows prefill workers report (their
    ``prefill`` stage with its prompt and reused lengths), every ``online_profile_every``
    results over the last ``online_profile_window``: the predictor tracks the hardware it
    runs on and the load it shares it with (FAST'25 Algorithm 1's T_prefill)."""
    online_profile_every: int = 16
    online_profile_window: int = 256
    decode_step_s: float = 0.02
    """Decode estimate: one continuous-batching step at small batch (s)."""
    seed: int = 0
    global_store: bool | None = None
    """Cross-instance reuse through the global Store (prefill workers load missing prefix
    blocks from it and put new ones). ``None`` = on for ``global-cache`` only, as in the
    paper's Figure 5 (the other policies run with each instance's local cache)."""
    store_master: str | None = None
    """``etcd://host:port[/cluster_id]`` of the Store's HA masters: on each change of
    leader the store-tier view is dropped and rebuilt from the KV events that follow
    (BUG-58). ``None`` = a single master (nothing to follow)."""
    master: str | None = None
    """``host:port`` of the Store master, which copies hot blocks to more holders
    (``hot_replication``); ``None`` = no replication."""
    hot_replication: bool = True
    """Hot-block replication (FAST'25 §4.2, Figure 11; ``conductor.replication``): blocks
    reused at least ``hot_min_accesses`` times in the last ``hot_window_s`` seconds are
    copied to the Store segment of one more prefill instance per placement, which then
    counts them as its own hits. Needs ``master`` and the global Store."""
    hot_replication_budget_bytes: int = 256 << 20
    """Most bytes the replicas made by hot-block replication may hold at once."""
    hot_min_accesses: int = 2
    hot_max_replicas: int | None = None
    """Most holders (prefill instances, plus the Store itself) per block; None = any."""
    hot_window_s: float = 60.0

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.ttft_slo_s <= 0 or self.tbt_slo_s <= 0:
            raise ValueError("ttft_slo_s and tbt_slo_s must be > 0 seconds")
        if self.prefill_concurrency_limit is not None and self.prefill_concurrency_limit < 1:
            raise ValueError("prefill_concurrency_limit must be >= 1 or None")
        if self.context_length < 0:
            raise ValueError(f"context_length must be >= 0 tokens, got {self.context_length}")
        if self.online_profile_every < 1 or self.online_profile_window < 3:
            raise ValueError("online_profile_every must be >= 1 and online_profile_window >= 3")
        if self.worker_timeout_s <= 0 or self.rpc_timeout_s <= 0:
            raise ValueError("timeouts must be > 0 seconds")
        if self.hot_replication_budget_bytes < 0 or self.hot_window_s <= 0:
            raise ValueError("hot_replication_budget_bytes must be >= 0, hot_window_s > 0")
        if self.hot_min_accesses < 1 or (self.hot_max_replicas is not None
                                         and self.hot_max_replicas < 1):
            raise ValueError("hot_min_accesses and hot_max_replicas must be >= 1")
        if self.store_master is not None:
            from pymooncake.conductor.store_leader import parse_store_master

            parse_store_master(self.store_master)

    @property
    def use_store(self) -> bool:
        """Cross-instance reuse through the global Store (see ``global_store``)."""
        if self.global_store is not None:
            return self.global_store
        return self.policy == "global-cache" and not self.colocated
