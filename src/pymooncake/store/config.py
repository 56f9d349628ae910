"""Store configuration: ``MasterConfig`` (flags of Mooncake's ``mooncake_master``) and the
per-put ``ReplicateConfig``.

Flag names follow Mooncake's master (``--default_kv_lease_ttl`` ms,
``--default_kv_soft_pin_ttl`` ms, ``--eviction_high_watermark_ratio``,
``--eviction_ratio``, ``--client_ttl`` s); the CLI spells them with dashes.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_RPC_POLL_S = 1e-4
"""The master's ``rpc_poll_s`` unless set (see there)."""

ALLOCATION_STRATEGIES: tuple[str, ...] = ("random", "free_ratio_first", "local_first")

MAX_KEY_BYTES = 4096
"""Longest key accepted (UTF-8 bytes); longer keys are ``INVALID_KEY``."""

MAX_SOFT_PIN_TTL_MS = 24 * 3600 * 1000
"""Mooncake's ceiling on a soft pin (24 h)."""


@dataclass(frozen=True, slots=True)
class MasterConfig:
    """Settings of one master (``pymooncake master``).

    Times: leases and pins in milliseconds (Mooncake's units), the rest in seconds.
    Raises ``ValueError`` naming the field to change when a value is out of range.
    """

    host: str = "127.0.0.1"
    port: int = 50051
    default_kv_lease_ttl_ms: float = 10_000.0
    """Read lease granted by ``get_replica_list`` (not ``exist``, BUG-16; default 10 s)."""
    default_kv_soft_pin_ttl_ms: float = 30 * 60 * 1000.0
    """Soft-pin lifetime from when the object becomes readable (default 30 min)."""
    eviction_high_watermark_ratio: float = 0.90
    """Eviction starts when used/capacity of the DRAM pool exceeds this."""
    eviction_ratio: float = 0.05
    """Each watermark pass evicts this share of the objects that have an evictable DRAM
    replica (rounded up; at least enough to get back under the watermark)."""
    client_ttl_s: float = 10.0
    """A client silent for this long is dropped and its segments unmounted."""
    allocation_strategy: str = "random"
    put_start_discard_timeout_s: float = 30.0
    """An unfinished put may be taken over by another ``put_start`` after this."""
    put_start_release_timeout_s: float = 600.0
    """The space of a taken-over put is freed this long after its ``put_start``."""
    max_key_bytes: int = MAX_KEY_BYTES
    metrics_port: int | None = None
    seed: int = 0
    """Seed of the random allocation strategy (placement is reproducible)."""
    rereplicate_budget_bytes: int = 256 << 20
    """Bytes one re-replication pass copies at most (a pass every 0.5 s while objects are
    below the replica count their put got; ``store.master.rereplication``)."""
    rpc_poll_s: float = DEFAULT_RPC_POLL_S
    """While requests come at most this far apart (s), the master's event loop polls this
    long after each for the next one before it sleeps (``RpcServer.poll_s``; 0 = never
    poll). A request after a longer quiet spell starts no poll, so an idle master does not
    spin. 100 µs: on a 2-core VM, 4 clients' ``is_exist`` rose from 43–49k to 59–67k
    calls/s (docs/benchmarks.md, "Issue 16, session 25")."""

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port={self.port}: must be in [0, 65535]")
        if self.default_kv_lease_ttl_ms < 0:
            raise ValueError(f"default_kv_lease_ttl_ms={self.default_kv_lease_ttl_ms}: "
                             "must be >= 0")
        if not 0 <= self.default_kv_soft_pin_ttl_ms <= MAX_SOFT_PIN_TTL_MS:
            raise ValueError(f"default_kv_soft_pin_ttl_ms={self.default_kv_soft_pin_ttl_ms}: "
                             f"must be in [0, {MAX_SOFT_PIN_TTL_MS}] (24 h)")
        if not 0.0 < self.eviction_high_watermark_ratio <= 1.0:
            raise ValueError(f"eviction_high_watermark_ratio={self.eviction_high_watermark_ratio}"
                             ": must be in (0, 1]")
        if not 0.0 <= self.eviction_ratio <= 1.0:
            raise ValueError(f"eviction_ratio={self.eviction_ratio}: must be in [0, 1]")
        if self.client_ttl_s <= 0:
            raise ValueError(f"client_ttl_s={self.client_ttl_s}: must be > 0")
        if self.allocation_strategy not in ALLOCATION_STRATEGIES:
            raise ValueError(f"allocation_strategy={self.allocation_strategy!r}: "
                             f"choose one of {', '.join(ALLOCATION_STRATEGIES)}")
        if self.put_start_discard_timeout_s < 0:
            raise ValueError("put_start_discard_timeout_s must be >= 0")
        if self.put_start_release_timeout_s < self.put_start_discard_timeout_s:
            raise ValueError("put_start_release_timeout_s must be >= put_start_discard_timeout_s")
        if not 0 <= self.rpc_poll_s <= 0.01:
            raise ValueError(f"rpc_poll_s={self.rpc_poll_s}: must be in [0, 0.01] seconds")
        if not 1 <= self.max_key_bytes <= 1 << 20:
            raise ValueError(f"max_key_bytes={self.max_key_bytes}: must be in [1, 1 MiB]")
        if self.rereplicate_budget_bytes <= 0:
            raise ValueError(f"rereplicate_budget_bytes={self.rereplicate_budget_bytes}: "
                             "must be > 0")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port={self.metrics_port}: must be in [0, 65535]")


@dataclass(frozen=True, slots=True)
class ReplicateConfig:
    """How one object is stored (Mooncake's ``ReplicateConfig``).

    ``replica_num`` replicas land on distinct segments (distinct hosts first), best effort:
    fewer segments than ``replica_num`` store fewer replicas. ``soft_pin``: evicted only
    after every unpinned candidate, until ``soft_pin_ttl_ms`` (master default when None)
    after the object becomes readable. ``hard_pin``: never evicted, removed only
    explicitly. ``preferred_segment``: try this segment first (name as mounted).
    Raises ``ValueError`` for a config that cannot be honoured.
    """

    replica_num: int = 1
    soft_pin: bool = False
    hard_pin: bool = False
    preferred_segment: str = ""
    soft_pin_ttl_ms: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.replica_num, bool) or not isinstance(self.replica_num, int):
            raise ValueError(f"replica_num={self.replica_num!r}: must be an int >= 1")
        if not 1 <= self.replica_num <= 64:
            raise ValueError(f"replica_num={self.replica_num}: must be in [1, 64]")
        if self.soft_pin_ttl_ms is not None:
            if not self.soft_pin:
                raise ValueError("soft_pin_ttl_ms given without soft_pin=True")
            if not 0 < self.soft_pin_ttl_ms <= MAX_SOFT_PIN_TTL_MS:
                raise ValueError(f"soft_pin_ttl_ms={self.soft_pin_ttl_ms}: must be in "
                                 f"(0, {MAX_SOFT_PIN_TTL_MS}]")
        if not isinstance(self.preferred_segment, str):
            raise ValueError("preferred_segment must be a str (segment name, '' for none)")
