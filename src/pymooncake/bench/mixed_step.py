"""``pymooncake bench mixed-step``: one prompt's TTFT while other requests decode, per step
policy (issue 15: the step sizes of a colocated engine).

A colocated engine computes a prompt in chunks that share steps with the running decodes
(chunked prefill): every decode waits the whole step for its next token, and every step
pays a fixed cost (all the weights read from memory, the step's Python). The step policy
trades the prompt's TTFT against the decodes' TBT; this measures both on the real engine.

Per policy (``cap:N`` = ``EngineConfig.decode_step_tokens`` N; ``time:S`` = ``decode_step_s``
S with a 256-token cap until the step-time model is fitted; ``none`` = neither), one engine
with ``--threads`` threads: ``decoding`` requests of ``decode_context`` random prompt tokens
are prefilled and left decoding; a ``prompt_len``-token prompt is added, and the steps run
until its first token. Reported: its TTFT (s), the steps it took and the longest and median
step (s, the decodes' token intervals meanwhile). Policies are interleaved over
``repeats``; each engine first warms up (and fits its model) on one such round.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass
from typing import Any

from pymooncake.engine import Engine, EngineConfig, SamplingParams

WARMUP_DECODE_TOKENS = 8


@dataclass(frozen=True, slots=True)
class Policy:
    name: str
    decode_step_tokens: int | None
    decode_step_s: float | None


def parse_policy(text: str) -> Policy:
    """``cap:N`` (N >= 1 tokens), ``time:S`` (0 < S < 3600 seconds) or ``none``; raises
    ``ValueError`` naming the text otherwise."""
    kind, _, val = text.partition(":")
    try:
        if kind == "none" and not val:
            return Policy(text, None, None)
        if kind == "cap" and int(val) >= 1:
            return Policy(text, int(val), None)
        if kind == "time" and 0 < float(val) < 3600:
            return Policy(text, 256, float(val))
    except ValueError:
        pass
    raise ValueError(f"step policy {text!r}: use cap:N, time:S or none")


def _round(eng: Engine, rng: random.Random, decoding: int, context: int, prompt_len: int
           ) -> dict[str, Any]:
    vocab = eng.model.config.vocab_size

    def toks(n: int) -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(n)]

    # enough tokens to decode through the whole prompt (at least one prompt token a step)
    budget = prompt_len + WARMUP_DECODE_TOKENS + 16
    ids = [eng.add_request(toks(context), SamplingParams(max_tokens=budget, ignore_eos=True))
           for _ in range(decoding)]
    while any(not eng.requests[i].output_token_ids for i in ids):
        eng.step()
    for _ in range(WARMUP_DECODE_TOKENS):
        eng.step()
    t0 = time.perf_counter()
    rid = eng.add_request(toks(prompt_len), SamplingParams(max_tokens=1, ignore_eos=True))
    steps: list[float] = []
    ttft = None
    while ttft is None:
        s = time.perf_counter()
        outs = eng.step()
        steps.append(time.perf_counter() - s)
        if any(o.request_id == rid for o in outs):
            ttft = time.perf_counter() - t0
    for i in ids:
        eng.abort(i)
    return {"ttft_s": ttft, "steps": len(steps), "max_step_s": max(steps),
            "median_step_s": statistics.median(steps)}


def run(model: str, policies: list[Policy], *, decoding: int = 3, decode_context: int = 1500,
        prompt_len: int = 2400, threads: int = 2, repeats: int = 3, block_size: int = 128,
        seed: int = 0) -> dict[str, Any]:
    """The measurement (module docstring); raises ``ValueError`` for sizes below 1."""
    for name, v in (("decoding", decoding), ("decode_context", decode_context),
                    ("prompt_len", prompt_len), ("threads", threads), ("repeats", repeats)):
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    per_decoder = decode_context + prompt_len + WARMUP_DECODE_TOKENS + 16
    need = decoding * per_decoder + prompt_len
    engines = {}
    for p in policies:
        cfg = EngineConfig(max_num_batched_tokens=512, prefill_chunk_tokens=512,
                           decode_step_tokens=p.decode_step_tokens, decode_step_s=p.decode_step_s,
                           max_num_seqs=decoding + 2, max_model_len=max(per_decoder,
                                                                        prompt_len + 8),
                           num_kv_blocks=need // block_size + 16, block_size=block_size,
                           enable_prefix_caching=False, num_threads=threads)
        engines[p.name] = Engine.from_model_name(model, cfg)
        _round(engines[p.name], random.Random(seed), decoding, decode_context, prompt_len)
    rows: dict[str, list[dict[str, Any]]] = {p.name: [] for p in policies}
    for r in range(repeats):
        for p in policies:
            rows[p.name].append(_round(engines[p.name], random.Random(seed + 1 + r), decoding,
                                       decode_context, prompt_len))
    out = {}
    for name, rs in rows.items():
        out[name] = {k: statistics.median(x[k] for x in rs) for k in rs[0]} | {
            "ttft_s_range": [min(x["ttft_s"] for x in rs), max(x["ttft_s"] for x in rs)],
            "repeats": rs}
    return {"model": model, "threads": threads, "decoding": decoding,
            "decode_context": decode_context, "prompt_len": prompt_len, "policies": out}
