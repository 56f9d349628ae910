"""Trace statistics, including the theoretical prefix-cache ratio (Mooncake FAST'25 Table 2).

The cache ratio is the **token-weighted hit ratio of an infinite prefix cache replayed in
arrival order**. Per request, ``prefix_hit_tokens`` gives the tokens an infinite cache
would serve: the longest prefix of its ``hash_ids`` whose ids were all seen by *earlier*
requests, in tokens, ``min(prefix_blocks * block_size, input_length)``: a hit on a
partial last block counts only the prompt tokens it covers. Then::

    cache_ratio = sum(hit_tokens_r) / sum(input_length_r)          (token-weighted)
    request_cache_ratio = mean(hit_tokens_r / input_length_r)      (request-weighted)

The simulator's capacity curve uses the same ``prefix_hit_tokens``, so its infinite-capacity
end equals ``cache_ratio`` exactly. docs/workload.md compares the figures with the paper.
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from dataclasses import asdict, dataclass

import numpy as np

from pymooncake.workload.trace import Trace


def prefix_blocks_hit(hash_ids: Sequence[int], seen: Container[int]) -> int:
    """Number of leading ``hash_ids`` that are all in ``seen`` (stops at the first miss).

    A Mooncake hash id names a block together with its whole prefix, so id membership of
    each leading block is the prefix match; a hit after a miss does not count.
    """
    n = 0
    for h in hash_ids:
        if h not in seen:
            break
        n += 1
    return n


def prefix_hit_tokens(hash_ids: Sequence[int], input_length: int, seen: Container[int],
                      block_size: int) -> int:
    """Prompt tokens a cache holding the blocks ``seen`` serves for one request.

    ``min(prefix_blocks_hit(hash_ids, seen) * block_size, input_length)``: the rule shared
    by ``trace_stats`` (``seen`` = every id of the earlier requests, an infinite cache) and
    the simulator (``seen`` = what its finite cache holds). ``seen`` is not modified.

    Args:
        hash_ids: the request's prefix-block hash ids.
        input_length: the request's prompt length in tokens.
        seen: any container of hash ids (a set, a dict, a cache's key view).
        block_size: tokens per hash id (512 in the Mooncake traces).

    Returns:
        hit tokens in ``[0, input_length]``.
    """
    return min(prefix_blocks_hit(hash_ids, seen) * block_size, input_length)


@dataclass(frozen=True, slots=True)
class TraceStats:
    """Summary of a trace (lengths in tokens, times in seconds)."""

    num_requests: int
    num_skipped: int
    block_size: int
    mean_input_length: float
    mean_output_length: float
    p50_input_length: float
    p99_input_length: float
    p50_output_length: float
    p99_output_length: float
    total_input_tokens: int
    total_output_tokens: int
    duration_s: float
    """Last arrival minus first arrival."""
    request_rate_per_s: float
    """``num_requests / duration_s`` (0 when the duration is 0)."""
    num_unique_blocks: int
    """Distinct hash ids in the trace."""
    num_blocks: int
    """Hash ids over all requests (with repetitions)."""
    cache_hit_tokens: int
    """Sum of ``prefix_hit_tokens`` over the requests (infinite cache, arrival order)."""
    cache_ratio: float
    """Token-weighted prefix-cache hit ratio: ``cache_hit_tokens / total_input_tokens``."""
    request_cache_ratio: float
    """Request-weighted: mean over requests of ``hit_tokens / input_length``."""
    block_cache_ratio: float
    """Block-weighted: prefix blocks hit / all hash ids (partial blocks count as one)."""

    def to_dict(self) -> dict[str, float | int]:
        """Plain dict (JSON-ready), in field order."""
        return asdict(self)


def trace_stats(trace: Trace) -> TraceStats:
    """Statistics of ``trace`` (requests taken in arrival order, as ``Trace`` holds them).

    An empty trace gives zeros everywhere.
    """
    reqs = trace.requests
    bs = trace.block_size
    n = len(reqs)
    if n == 0:
        return TraceStats(0, trace.num_skipped, bs, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0, 0, 0.0,
                          0.0, 0, 0, 0, 0.0, 0.0, 0.0)
    inp = np.fromiter((r.input_length for r in reqs), dtype=np.int64, count=n)
    out = np.fromiter((r.output_length for r in reqs), dtype=np.int64, count=n)
    seen: set[int] = set()
    hit_tokens = np.empty(n, dtype=np.int64)
    blocks_hit = 0
    num_blocks = 0
    for i, r in enumerate(reqs):
        hit_tokens[i] = prefix_hit_tokens(r.hash_ids, r.input_length, seen, bs)
        blocks_hit += prefix_blocks_hit(r.hash_ids, seen)
        num_blocks += len(r.hash_ids)
        seen.update(r.hash_ids)
    duration_s = (reqs[-1].timestamp_ms - reqs[0].timestamp_ms) / 1000.0
    total_in = int(inp.sum())
    return TraceStats(
        num_requests=n,
        num_skipped=trace.num_skipped,
        block_size=bs,
        mean_input_length=float(inp.mean()),
        mean_output_length=float(out.mean()),
        p50_input_length=float(np.percentile(inp, 50)),
        p99_input_length=float(np.percentile(inp, 99)),
        p50_output_length=float(np.percentile(out, 50)),
        p99_output_length=float(np.percentile(out, 99)),
        total_input_tokens=total_in,
        total_output_tokens=int(out.sum()),
        duration_s=duration_s,
        request_rate_per_s=n / duration_s if duration_s > 0 else 0.0,
        num_unique_blocks=len(seen),
        num_blocks=num_blocks,
        cache_hit_tokens=int(hit_tokens.sum()),
        cache_ratio=float(hit_tokens.sum() / total_in),
        request_cache_ratio=float((hit_tokens / inp).mean()),
        block_cache_ratio=blocks_hit / num_blocks if num_blocks else 0.0,
    )
