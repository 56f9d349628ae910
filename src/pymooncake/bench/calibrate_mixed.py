"""``calibrate-cpu --mixed-chunks``: whole engine steps of known composition, timed on the
real engine, for the calibration's ``step`` cost (``sim.step_cost``; docs/sim.md "The
engine-step cost"). Split from ``bench.calibrate``, which calls it."""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Sequence
from typing import Any

from pymooncake.bench.calibrate import Say, _engine

WARM_DECODE_STEPS = 4
"""Untimed all-decode steps after a decode set's prefill (its allocations)."""


def _timed_step(eng: Any, dec: Sequence[Any], k: int) -> list[float]:
    """``[B, D, k, 0, seconds]`` of one ``eng.step()`` with decodes ``dec`` (the chunk's
    offset is filled in by the caller once the engine has said what it had cached)."""
    pairs = sum(r.num_computed_tokens + 1 for r in dec)
    t0 = time.perf_counter()
    eng.step()
    return [len(dec), pairs, k, 0, time.perf_counter() - t0]


def measure_mixed(model: str, dtype: str, decodes: Sequence[int], contexts: Sequence[int],
                  chunks: Sequence[int], offsets: Sequence[int], repeats: int,
                  block_size: int = 128, say: Say | None = None) -> list[list[float]]:
    """Whole engine steps of known composition, one row ``[B, D, k, p, seconds]`` per timed
    ``Engine.step()``: ``B`` running decodes whose attention pairs sum to ``D`` (each decode
    ``num_computed + 1``) beside one prefill chunk of ``k`` tokens after ``p`` cached ones
    (``k = 0``, ``p = 0``: a decode-only step; ``B = 0``: a prefill step alone).

    One ``colocated`` engine with ``block_size``-token blocks (the live runs' 128) and prefix
    caching; per ``B`` in ``decodes`` (0 once, else per context ``L`` in ``contexts``): ``B``
    random prompts of ``L`` tokens are prefilled in one step and left decoding; then, per
    repeat and offset ``p`` (a whole number of blocks, rounded down), a decode-only step and,
    per ``k`` in ``chunks``, a prompt of ``p`` tokens cached just before plus ``k`` fresh ones
    is added and the step that computes those ``k`` tokens (its only chunk) is timed. Each
    step is timed alone, not reduced: the fit sees every sample. Untimed first: every
    (offset, chunk) once alone (the first step at a long context costs up to seconds more),
    and ``WARM_DECODE_STEPS`` decode steps per decode set.

    Raises:
        ValueError: an empty list, a size below its minimum (``B``, ``p`` >= 0; ``L``, ``k``,
            ``repeats``, ``block_size`` >= 1).
        RuntimeError: a chunk that the engine did not compute in one step (it would not be
            the composition recorded)."""
    from pymooncake.engine import SamplingParams
    if not (decodes and contexts and chunks and offsets) or min(decodes) < 0 or \
            min(contexts) < 1 or min(chunks) < 1 or min(offsets) < 0 or repeats < 1 or \
            block_size < 1:
        raise ValueError("mixed steps: need decodes >= 0, contexts >= 1, chunks >= 1, "
                         "offsets >= 0, repeats >= 1, block size >= 1, none empty")
    offsets = sorted({p // block_size * block_size for p in offsets})
    steps = repeats * len(offsets) * (len(chunks) + 1) + WARM_DECODE_STEPS + 8
    b_max, ctx_max = max(decodes), max(contexts) if max(decodes) else 0
    prompt_max = max(offsets) + max(chunks)
    max_len = max(ctx_max + steps, prompt_max) + block_size
    per_seq = -(-max_len // block_size) + 1
    blocks = (b_max + 2) * per_seq + sum(-(-p // block_size) for p in offsets) + 64
    batched = max(2048, b_max * ctx_max + b_max, prompt_max + b_max)
    eng = _engine(model, dtype, "colocated", block_size=block_size, max_model_len=max_len,
                  num_kv_blocks=blocks, max_num_seqs=b_max + 4, max_num_batched_tokens=batched,
                  prefill_chunk_tokens=batched, enable_prefix_caching=True)
    vocab = eng.model.config.vocab_size
    rng = random.Random(3)

    def toks(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    one = SamplingParams(max_tokens=1)
    eng.generate([toks(64)], one)   # warm-up
    prefixes = {p: toks(p) for p in offsets}
    eng.generate([prefixes[p] for p in offsets if p], one)
    for p in offsets:      # untimed: every shape once (first long contexts cost seconds)
        for k in chunks:
            eng.generate([prefixes[p] + toks(k)], one)
    out: list[list[float]] = []
    sets = [(0, 0)] + [(b, L) for b in sorted(set(decodes)) if b for L in contexts]
    for b, L in sets:
        first = len(out)
        eng.generate([prefixes[p] for p in offsets if p], one)   # cached, untimed
        params = SamplingParams(max_tokens=steps + 4, ignore_eos=True)
        dec = [eng.requests[eng.add_request(toks(L), params)] for _ in range(b)]
        while any(not r.output_token_ids for r in dec):
            eng.step()
        for _ in range(WARM_DECODE_STEPS if dec else 0):
            eng.step()      # the first all-decode steps (allocations)

        for _ in range(repeats):
            for p in offsets:
                if dec:
                    out.append(_timed_step(eng, dec, 0))
                for k in chunks:
                    req = eng.requests[eng.add_request(prefixes[p] + toks(k), one)]
                    out.append(_timed_step(eng, dec, k))
                    if not req.is_finished or req.num_cached_tokens < 0:
                        raise RuntimeError(f"mixed step: a {k}-token chunk after {p} did not "
                                           "finish in one step")
                    out[-1][3] = req.num_cached_tokens
        for r in dec:
            eng.abort(r.request_id)
        if say:
            med = statistics.median(x[4] for x in out[first:])
            say(f"mixed B={b} L={L}: {len(out) - first} steps, median {med * 1000:.1f} ms")
    return out
