"""Workload layer: Mooncake traces, statistics, token materialisation, arrival scaling.

DESIGN.md §2/§8. Pure: imports only ``pymooncake.identity``, the standard library and numpy.
"""

from pymooncake.workload.arrival import scale_arrivals, take_first, take_window
from pymooncake.workload.materialize import (
    MaterializedRequest,
    materialize_tokens,
    materialize_trace,
    scaled_length,
)
from pymooncake.workload.stats import (
    TraceStats,
    prefix_blocks_hit,
    prefix_hit_tokens,
    trace_stats,
)
from pymooncake.workload.trace import (
    DEFAULT_BLOCK_SIZE,
    Trace,
    TraceError,
    TraceRequest,
    bundled_trace_path,
    load_trace,
    max_hash_ids,
)

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "MaterializedRequest",
    "Trace",
    "TraceError",
    "TraceRequest",
    "TraceStats",
    "bundled_trace_path",
    "load_trace",
    "materialize_tokens",
    "materialize_trace",
    "max_hash_ids",
    "prefix_blocks_hit",
    "prefix_hit_tokens",
    "scale_arrivals",
    "scaled_length",
    "take_first",
    "take_window",
    "trace_stats",
]
