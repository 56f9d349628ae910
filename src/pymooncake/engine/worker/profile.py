"""``pymooncake profile``: measure the engine's prefill time over (prompt length, cached
prefix length) for the Conductor's ``PrefillEstimator`` (Mooncake FAST'25 Algorithm 1's
``EstimatePrefillExecutionTime`` from measured profiles, DESIGN.md §7)."""

from __future__ import annotations

import statistics
import time
from typing import Any


def measure_profile(model: str, lengths: list[int], prefix_fractions: list[float],
                    repeats: int = 3) -> dict[str, Any]:
    """Prefill seconds (median of ``repeats``) per (tokens, prefix tokens) point (the
    Conductor fits ``conductor.policy.fit_prefill_estimator`` to them). Each point uses
    fresh random prompts; the prefix is put in the local
    prefix cache first by prefilling it alone."""
    import random

    from pymooncake.engine import Engine, EngineConfig, SamplingParams
    max_len = max(lengths) + 16
    engine = Engine.from_model_name(model, EngineConfig(
        role="prefill", max_model_len=max_len, num_kv_blocks=max(1024, 4 * max_len // 16 + 64),
        max_num_batched_tokens=max(2048, max_len), prefill_chunk_tokens=max(512, max_len)))
    vocab = engine.model.config.vocab_size
    bs = engine.config.block_size
    rng = random.Random(0)
    params = SamplingParams(max_tokens=1)
    samples = []
    engine.generate([[rng.randrange(vocab) for _ in range(64)]], params)  # warm up
    for n in lengths:
        for frac in prefix_fractions:
            p = int(n * frac) // bs * bs
            times = []
            for _ in range(repeats):
                ids = [rng.randrange(vocab) for _ in range(n)]
                if p:
                    engine.generate([ids[:p]], params)
                t0 = time.perf_counter()
                out = engine.generate([ids], params)[0]
                times.append(time.perf_counter() - t0)
                p_real = out.num_cached_tokens
            samples.append({"num_tokens": n, "num_prefix_tokens": p_real if p else 0,
                            "seconds": statistics.median(times)})
    return {"model": model, "block_size": bs, "samples": samples}
