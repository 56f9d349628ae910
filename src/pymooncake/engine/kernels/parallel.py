"""Running one prefill chunk's attention on several threads (``prefill_attention``).

The kernel is a ctypes call, which releases the GIL: runs of the chunk's rows computed on
these threads at once use as many cores as the engine's torch threads.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

SPLIT_MIN_WORK = 128 * 1024
"""Query×key pairs of a prefill chunk below which its attention runs on one thread."""

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def attn_pool() -> ThreadPoolExecutor:
    """The threads that compute the other runs of a split prefill attention (created on
    first use, as many as ``torch.get_num_threads() - 1`` at that time, at least one)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max(1, torch.get_num_threads() - 1),
                                       thread_name_prefix="prefill-attn")
        return _pool


def split_rows(n: int, ctx_len: int, parts: int) -> list[int]:
    """Row boundaries ``[0, s1, .., n]`` cutting a chunk of ``n`` causal queries (the last at
    position ``ctx_len - 1``) into ``parts`` runs of about equal work: row ``i`` costs
    ``c + i + 1`` with ``c = ctx_len - n``, so the first ``s`` rows cost
    ``s (2c + s + 1) / 2``, solved for ``s`` at each ``k / parts`` of the total."""
    c = ctx_len - n
    total = n * (2 * c + n + 1) / 2
    cuts = [0]
    for k in range(1, parts):
        t = total * k / parts
        b = 2 * c + 1
        s = int(round((-b + math.sqrt(b * b + 8 * t)) / 2))
        if cuts[-1] < s < n:
            cuts.append(s)
    cuts.append(n)
    return cuts


def run_rows(rows: Callable[[int, int], int], n: int, ctx_len: int) -> int:
    """``rows(a, b)`` (the kernel on queries ``a..b-1``, 0 = success) over all ``n`` rows:
    in one call, or — with ``torch.get_num_threads() > 1`` and at least ``SPLIT_MIN_WORK``
    query×key pairs — in ``split_rows`` runs at once, the first on the calling thread.
    Returns the first nonzero code, else 0."""
    parts = torch.get_num_threads()
    if parts < 2 or n * ctx_len < SPLIT_MIN_WORK:
        return rows(0, n)
    cuts = split_rows(n, ctx_len, parts)
    futures = [attn_pool().submit(rows, a, b) for a, b in zip(cuts[1:-1], cuts[2:],
                                                              strict=True)]
    rc = rows(cuts[0], cuts[1])
    codes = [f.result() for f in futures]
    return rc or next((c for c in codes if c), 0)
