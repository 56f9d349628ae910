"""Prefill profiles for the Conductor's ``PrefillEstimator`` (Mooncake FAST'25 Algorithm 1's
``EstimatePrefillExecutionTime`` from measured profiles, DESIGN.md §7).

``measure_profile`` is ``pymooncake profile`` (a model by name, several prefix fractions,
repeats); ``startup_profile`` is what a prefill or colocated worker measures on its own
engine before it registers, so the Conductor predicts TTFTs for this hardware, thread count
and model from the first request on (its early rejection depends on them) instead of from
the estimator's defaults until enough requests have finished to fit online.
"""

from __future__ import annotations

import dataclasses
import random
import statistics
import time
from typing import Any

STARTUP_PROFILE_LENGTHS = (128, 256, 512, 1024, 2048)
"""Prompt lengths (tokens) a worker times at start, those up to its ``startup_profile_tokens``
and ``max_model_len``: enough points for ``fit_prefill_estimator``'s quadratic + linear +
overhead form (the quadratic term, attention, shows from ~1,000 tokens on a small model)."""


def time_prefills(engine: Any, lengths: list[int], prefix_fractions: list[float],
                  repeats: int, rng: random.Random) -> list[dict[str, Any]]:
    """``{num_tokens, num_prefix_tokens, seconds}`` per (length, fraction): the median wall
    time (s) of ``repeats`` one-token generations of fresh random prompts of ``length``
    tokens, after the first ``fraction`` of each (whole blocks) was put in ``engine``'s
    prefix cache by prefilling it alone. One thread calls it (the engine's)."""
    from pymooncake.engine import SamplingParams
    vocab = engine.model.config.vocab_size
    bs = engine.config.block_size
    params = SamplingParams(max_tokens=1)
    samples = []
    for n in lengths:
        for frac in prefix_fractions:
            p = int(n * frac) // bs * bs
            times = []
            p_real = 0
            for _ in range(repeats):
                ids = [rng.randrange(vocab) for _ in range(n)]
                if p:
                    engine.generate([ids[:p]], params)
                t0 = time.perf_counter()
                out = engine.generate([ids], params)[0]
                times.append(time.perf_counter() - t0)
                p_real = out.num_cached_tokens if p else 0
            samples.append({"num_tokens": n, "num_prefix_tokens": p_real,
                            "seconds": statistics.median(times)})
    return samples


def measure_profile(model: str, lengths: list[int], prefix_fractions: list[float],
                    repeats: int = 3) -> dict[str, Any]:
    """Prefill seconds (median of ``repeats``) per (tokens, prefix tokens) point (the
    Conductor fits ``conductor.policy.fit_prefill_estimator`` to them). Each point uses
    fresh random prompts; the prefix is put in the local prefix cache first by prefilling
    it alone."""
    from pymooncake.engine import Engine, EngineConfig, SamplingParams
    max_len = max(lengths) + 16
    engine = Engine.from_model_name(model, EngineConfig(
        role="prefill", max_model_len=max_len, num_kv_blocks=max(1024, 4 * max_len // 16 + 64),
        max_num_batched_tokens=max(2048, max_len), prefill_chunk_tokens=max(512, max_len)))
    rng = random.Random(0)
    engine.generate([[rng.randrange(engine.model.config.vocab_size) for _ in range(64)]],
                    SamplingParams(max_tokens=1))  # warm up
    samples = time_prefills(engine, lengths, prefix_fractions, repeats, rng)
    return {"model": model, "block_size": engine.config.block_size, "samples": samples}


def startup_profile(engine: Any, max_tokens: int, seed: int = 0
                    ) -> list[tuple[int, int, float]]:
    """``(num_tokens, 0, seconds)`` prefill times of ``engine``'s model and configuration
    (threads, chunk size, dtype) at ``STARTUP_PROFILE_LENGTHS`` up to ``max_tokens`` and the
    engine's ``max_model_len``; empty when fewer than 3 lengths fit (no fit possible).

    Runs on a sibling engine that shares ``engine``'s model weights but has its own small
    paged cache, no hooks, no KV source and no prefix caching, so nothing of the profile
    reaches ``engine``'s cache, its KV events or the Store. Call it on the thread that runs
    ``engine`` (one OpenMP pool per process, ``EngineWorker._engine_thread``)."""
    from pymooncake.engine import Engine, SamplingParams
    cfg = engine.config
    lengths = [n for n in STARTUP_PROFILE_LENGTHS if n <= min(max_tokens, cfg.max_model_len - 1)]
    if len(lengths) < 3:
        return []
    blocks = -(-(max(lengths) + 1) // cfg.block_size) + 1
    sib = Engine(engine.model, dataclasses.replace(
        cfg, num_kv_blocks=blocks, enable_prefix_caching=False, max_num_seqs=1),
        engine.namespace, engine.tokenizer)
    rng = random.Random(seed)
    vocab = engine.model.config.vocab_size
    sib.generate([[rng.randrange(vocab) for _ in range(64)]], SamplingParams(max_tokens=1))
    return [(s["num_tokens"], 0, s["seconds"])
            for s in time_prefills(sib, lengths, [0.0], 1, rng)]
