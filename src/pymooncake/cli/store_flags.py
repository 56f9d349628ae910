"""``pymooncake master``'s config errors in the words of its flags (``MasterConfig`` and
``HaConfig`` name their fields; the user typed flags)."""

from __future__ import annotations

import re

MASTER_FLAGS = {
    "port": "--port", "default_kv_lease_ttl_ms": "--default-kv-lease-ttl",
    "default_kv_soft_pin_ttl_ms": "--default-kv-soft-pin-ttl",
    "eviction_high_watermark_ratio": "--eviction-high-watermark-ratio",
    "eviction_ratio": "--eviction-ratio", "client_ttl_s": "--client-ttl",
    "allocation_strategy": "--allocation-strategy",
    "put_start_discard_timeout_s": "--put-start-discard-timeout",
    "put_start_release_timeout_s": "--put-start-release-timeout",
    "metrics_port": "--metrics-port", "rereplicate_budget_bytes": "--rereplicate-budget",
    "rpc_poll_s": "--rpc-poll",
    "cluster_id": "--cluster-id", "lease_ttl_s": "--ha-lease-ttl",
    "snapshot_every": "--ha-snapshot-every"}
"""``MasterConfig``/``HaConfig`` field → the ``master`` flag that sets it."""


def flag_message(message: str, flags: dict[str, str] = MASTER_FLAGS) -> str:
    """A config error in the flags' words: ``client_ttl_s=-1.0: must be > 0`` →
    ``--client-ttl -1.0: must be > 0``; a snake_case field name it mentions elsewhere is
    swapped for its flag too (``put_start_release_timeout_s must be >= …``), a plain word
    (``port``) only where it is written ``port=``."""
    def swap(m: re.Match[str]) -> str:
        name, eq = m.group(1), m.group(2)
        if not eq and "_" not in name:
            return m.group(0)
        return f"{flags[name]} " if eq else flags[name]

    names = "|".join(sorted(map(re.escape, flags), key=len, reverse=True))
    return re.sub(r"\b(" + names + r")\b(=?)", swap, message)
