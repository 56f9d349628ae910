"""``pymooncake sim calibrate-cpu``: time the real engine on pinned cores and write the
simulator's calibration file (``pymooncake.sim.calibration``; docs/sim.md, "CPU calibration").

Measured, in this process, pinned to the given cores with ``threads`` torch threads (one core
and one thread by default; ``node.threads`` / ``node.cores`` of the file record which):
- prefill: ``generate(max_tokens=1)`` of fresh random prompts of ``n`` tokens whose first
  ``p`` tokens were prefilled just before (a local prefix-cache hit), on a ``prefill``-role
  engine with the serving defaults (chunks of ``prefill_chunk_tokens``); median of repeats;
- decode: ``B`` random prompts of ``L`` tokens are prefilled, then each of ``steps``
  ``Engine.step()`` calls of the decoding batch is timed alone; per (B, L) the median step
  time with the mean batch context ``C`` (prompt + output tokens of every sequence);
- transfer: one memory copy of a large float32 tensor (bytes / seconds), unless a bandwidth
  is given; KV bytes per token from the model.
Then ``fit_prefill_estimator`` (with overhead) and ``fit_decode_estimator`` give the costs.
The simulator itself never imports this module (DESIGN.md §2).
"""

from __future__ import annotations

import os
import platform
import random
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pymooncake.bench.runner import copy_bandwidth, cpu_model

Say = Callable[[str], None]
STATISTICS = {"median": statistics.median, "min": min}
"""How the repeats of one point are reduced: the median (a quiet machine) or the minimum
(a loaded one: contention only ever adds time)."""


THREADS = {"n": 1}
"""torch threads of the engines built here (``pin_to_cores`` sets it)."""


def pin_to_cores(cores: Sequence[int], threads: int = 1) -> None:
    """These cores, ``threads`` math threads (set before the engine builds its model; the
    engines then call ``torch.set_num_threads(threads)``, ``EngineConfig.num_threads``)."""
    if threads < 1 or not cores:
        raise ValueError(f"need >= 1 thread and >= 1 core, got {threads} on {list(cores)}")
    os.sched_setaffinity(0, set(cores))
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(threads)
    THREADS["n"] = threads


def pin_to_core(core: int) -> None:
    """One core, one math thread."""
    pin_to_cores([core], 1)


def _engine(model: str, dtype: str, role: str, **kw: object):  # noqa: ANN202
    from pymooncake.engine import Engine, EngineConfig
    return Engine.from_model_name(model, EngineConfig(role=role, dtype=dtype,
                                                      num_threads=THREADS["n"], **kw))


def measure_prefill(model: str, dtype: str, lengths: Sequence[int],
                    prefix_fractions: Sequence[float], repeats: int,
                    say: Say | None = None, statistic: str = "median"
                    ) -> tuple[list[list[float]], dict[str, int]]:
    """``[[n, p, seconds], ...]`` and the engine's sizes (serving defaults: chunked)."""
    from pymooncake.engine import SamplingParams
    max_len = max(*lengths, 64) + 16
    blocks = max(1024, 3 * max_len // 16 + 64)
    eng = _engine(model, dtype, "prefill", max_model_len=max_len, num_kv_blocks=blocks)
    cfg = eng.config
    vocab = eng.model.config.vocab_size
    rng = random.Random(0)
    one = SamplingParams(max_tokens=1)
    eng.generate([[rng.randrange(vocab) for _ in range(64)]], one)  # warm-up
    out = []
    for n in lengths:
        for frac in prefix_fractions:
            p = int(n * frac) // cfg.block_size * cfg.block_size
            times, cached = [], 0
            for _ in range(repeats):
                ids = [rng.randrange(vocab) for _ in range(n)]
                if p:
                    eng.generate([ids[:p]], one)
                t0 = time.perf_counter()
                res = eng.generate([ids], one)[0]
                times.append(time.perf_counter() - t0)
                cached = res.num_cached_tokens
            t = STATISTICS[statistic](times)
            out.append([n, cached if p else 0, t])
            if say:
                say(f"prefill n={n} p={cached if p else 0}: {t * 1000:.1f} ms")
    sizes = {"engine_block_size": cfg.block_size, "prefill_chunk_tokens":
             cfg.prefill_chunk_tokens, "max_num_batched_tokens": cfg.max_num_batched_tokens}
    return out, sizes


def measure_decode(model: str, dtype: str, batches: Sequence[int], contexts: Sequence[int],
                   steps: int, say: Say | None = None, statistic: str = "median"
                   ) -> list[list[float]]:
    """``[[B, C, seconds], ...]``: the median decode step of ``B`` sequences of ``L`` prompt
    tokens (``C`` = mean total context of the timed steps)."""
    from pymooncake.engine import SamplingParams
    max_len = max(contexts) + steps + 32
    b_max = max(batches)
    blocks = b_max * (-(-max_len // 16) + 2) + 64
    eng = _engine(model, dtype, "colocated", max_model_len=max_len, num_kv_blocks=blocks,
                  max_num_seqs=max(64, b_max), max_num_batched_tokens=max(2048, max_len),
                  enable_prefix_caching=False)
    vocab = eng.model.config.vocab_size
    rng = random.Random(1)
    eng.generate([[rng.randrange(vocab) for _ in range(32)]], SamplingParams(max_tokens=4))
    out = []
    for b in batches:
        for L in contexts:
            params = SamplingParams(max_tokens=steps + 3, ignore_eos=True)
            rids = [eng.add_request([rng.randrange(vocab) for _ in range(L)], params)
                    for _ in range(b)]
            reqs = [eng.requests[r] for r in rids]
            while any(not r.output_token_ids for r in reqs):
                eng.step()
            eng.step()  # the first all-decode step (allocations)
            times, ctxs = [], []
            for _ in range(steps):
                ctxs.append(sum(r.num_tokens for r in reqs))
                t0 = time.perf_counter()
                eng.step()
                times.append(time.perf_counter() - t0)
            while eng.has_unfinished():
                eng.step()
            t = STATISTICS[statistic](times)
            out.append([b, round(statistics.fmean(ctxs)), t])
            if say:
                say(f"decode B={b} L={L}: {t * 1000:.2f} ms/step")
    return out


def measure_holdout(model: str, dtype: str, cases: Sequence[tuple[int, int]],
                    say: Say | None = None, statistic: str = "median", repeats: int = 2
                    ) -> list[dict[str, Any]]:
    """Whole single requests not used by the fits: ``(prompt tokens, output tokens)`` ->
    measured first-token and total seconds (the simulator's prediction is added later)."""
    from pymooncake.engine import SamplingParams
    max_len = max(n + k for n, k in cases) + 32
    eng = _engine(model, dtype, "colocated", max_model_len=max_len,
                  num_kv_blocks=max(256, max_len // 8 + 64), enable_prefix_caching=False)
    vocab = eng.model.config.vocab_size
    rng = random.Random(2)
    eng.generate([[rng.randrange(vocab) for _ in range(32)]], SamplingParams(max_tokens=2))
    out = []
    for n, k in cases:
        firsts, totals = [], []
        for _ in range(repeats):
            ids = [rng.randrange(vocab) for _ in range(n)]
            t0 = time.perf_counter()
            eng.generate([ids], SamplingParams(max_tokens=1))
            firsts.append(time.perf_counter() - t0)
            ids = [rng.randrange(vocab) for _ in range(n)]
            t0 = time.perf_counter()
            eng.generate([ids], SamplingParams(max_tokens=k, ignore_eos=True))
            totals.append(time.perf_counter() - t0)
        first, total = STATISTICS[statistic](firsts), STATISTICS[statistic](totals)
        out.append({"prompt_tokens": n, "output_tokens": k, "first_token_s": first,
                    "total_s": total})
        if say:
            say(f"holdout n={n} out={k}: first token {first:.3f} s, total {total:.3f} s")
    return out


def _git(*args: str) -> str | None:
    try:
        r = subprocess.run(["git", *args], capture_output=True, text=True, timeout=10,
                           cwd=Path(__file__).resolve().parent)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def provenance(core: int, model: str, dtype: str, cores: Sequence[int] = ()
               ) -> dict[str, Any]:
    """Where and with what the calibration was measured."""
    import importlib.metadata as md

    import torch

    from pymooncake.engine import kernels
    from pymooncake.engine.model.layers import onednn_enabled

    def ver(d: str) -> str | None:
        try:
            return md.version(d)
        except md.PackageNotFoundError:
            return None
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {
        "machine": platform.node(), "cpu": cpu_model(), "os_cpus": os.cpu_count(),
        "core": core, "cores": list(cores or [core]), "torch_threads": torch.get_num_threads(),
        "model": model, "dtype": dtype,
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "pymooncake": ver("pymooncake")},
        "commit": _git("rev-parse", "HEAD"), "worktree_dirty": bool(status),
        "engine_paths": {"onednn": onednn_enabled(), "c_kernels": kernels.available(),
                         "c_kernels_unavailable_because": kernels.why_unavailable()},
        "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def _rel_rms(pred: Callable[..., float], samples: Sequence[Sequence[float]]) -> float:
    errs = [(pred(int(a), int(b)) - t) / t for a, b, t in samples]
    return (sum(e * e for e in errs) / len(errs)) ** 0.5


def calibrate(model: str = "smollm2", *, dtype: str = "float32", core: int = 0,
              lengths: Sequence[int] = (64, 128, 256, 512, 1024, 2048),
              prefix_fractions: Sequence[float] = (0.0, 0.5, 0.75), repeats: int = 3,
              batches: Sequence[int] = (1, 2, 4, 8, 16, 32),
              contexts: Sequence[int] = (128, 512, 1024), decode_steps: int = 16,
              transfer_bandwidth_bytes_per_s: float | None = None,
              transfer_overhead_s: float = 0.002, kv_capacity_tokens: int | None = None,
              holdout: Sequence[tuple[int, int]] = ((768, 32), (1536, 32)),
              statistic: str = "median", threads: int = 1,
              cores: Sequence[int] | None = None,
              mixed_chunks: Sequence[int] = (), mixed_decodes: Sequence[int] = (0, 1, 4, 12),
              mixed_contexts: Sequence[int] = (256, 2048),
              mixed_offsets: Sequence[int] = (0, 1024, 2048, 3584, 5120),
              mixed_repeats: int = 2, mixed_block_size: int = 128,
              step_terms: Sequence[str] | None = None,
              label: str = "", command: str = "", say: Say | None = None) -> dict[str, Any]:
    """Measure, fit and return the calibration document (``Calibration.to_json``): pinned to
    ``cores`` (default ``[core]``) with ``threads`` torch threads per engine. With
    ``mixed_chunks`` (prefill chunk sizes, tokens), also whole engine steps of decodes plus
    one chunk (``measure_mixed`` with the ``mixed_*`` sizes) and the file's ``step`` cost
    fitted to them (``sim.step_cost.fit_step_cost`` with ``step_terms``, default
    ``DEFAULT_STEP_TERMS``); without, the file has no ``step`` (as before)."""
    cores = list(cores) if cores else [core]
    pin_to_cores(cores, threads)
    from pymooncake.conductor.policy import (
        TransferEstimator,
        fit_decode_estimator,
        fit_prefill_estimator,
    )
    from pymooncake.engine.config import DEFAULT_KV_CAPACITY_TOKENS
    from pymooncake.sim.calibration import (
        DEFAULT_STEP_TERMS,
        CalibratedModel,
        Calibration,
        fit_step_cost,
        parse_calibration,
        step_rel_errors,
    )
    load0 = os.getloadavg()
    t_start = time.time()
    pre, sizes = measure_prefill(model, dtype, lengths, prefix_fractions, repeats, say,
                                 statistic)
    dec = measure_decode(model, dtype, batches, contexts, decode_steps, say, statistic)
    hold = measure_holdout(model, dtype, holdout, say, statistic) if holdout else []
    from pymooncake.bench.calibrate_mixed import measure_mixed
    mixed = (measure_mixed(model, dtype, mixed_decodes, mixed_contexts, mixed_chunks,
                           mixed_offsets, mixed_repeats, mixed_block_size, say)
             if mixed_chunks else [])
    eng = _engine(model, dtype, "decode", num_kv_blocks=16)
    mc = eng.model.config
    from pymooncake.engine.config import kv_bytes_per_token
    kvb = kv_bytes_per_token(mc.num_layers, mc.num_kv_heads, mc.head_dim,
                             4 if dtype == "float32" else 2 if dtype != "float64" else 8)
    fused = bool(eng.model.use_fused_path)
    del eng
    if transfer_bandwidth_bytes_per_s is None:
        cb = copy_bandwidth(1 << 27, 5)
        bw, src = cb["bytes_per_s"] / 2, "measured copy"  # one copy: nbytes / seconds
    else:
        bw, src = transfer_bandwidth_bytes_per_s, "flag"
    pest = fit_prefill_estimator([(int(n), int(p), t) for n, p, t in pre], with_overhead=True,
                                 nonnegative=True)
    dest = fit_decode_estimator([(int(b), int(c), t) for b, c, t in dec])
    for h in hold:  # the simulator's single-request arithmetic, with the fitted costs
        n, k = h["prompt_tokens"], h["output_tokens"]
        h["sim_first_token_s"] = pest.prefill_s(n, 0)
        h["sim_total_s"] = h["sim_first_token_s"] + sum(dest.step_s(1, n + 1 + j)
                                                        for j in range(k - 1))
        h["first_token_error"] = h["sim_first_token_s"] / h["first_token_s"] - 1
        h["total_error"] = h["sim_total_s"] / h["total_s"] - 1
    step, step_fit = None, {}
    if mixed:
        terms = tuple(step_terms or DEFAULT_STEP_TERMS)
        step = fit_step_cost(mixed, terms)
        engine_form = fit_step_cost(mixed, ("tokens", "pairs"))

        def rms(cost: Any) -> float:
            errs = step_rel_errors(cost, mixed)
            return (sum(e * e for e in errs) / len(errs)) ** 0.5
        step_fit = {"step_rel_rms": rms(step), "step_terms": list(terms),
                    "step_block_size": mixed_block_size,
                    "step_engine_form": {**engine_form.to_json(),
                                         "rel_rms": rms(engine_form)}}
    prov = provenance(cores[0], model, dtype, cores)
    prov["engine_paths"]["fused_step"] = fused
    prov["load_average"] = {"start": list(load0), "end": list(os.getloadavg())}
    prov["measure_seconds"] = round(time.time() - t_start, 1)
    prov["command"] = command
    prov["statistic"] = statistic
    node = {**sizes, "cores": len(cores), "threads": threads}
    cal = Calibration(
        CalibratedModel(model, mc.num_layers, kvb, dtype), pest, dest,
        TransferEstimator(kvb, bw, transfer_overhead_s),
        kv_capacity_tokens or DEFAULT_KV_CAPACITY_TOKENS, label=label, node=node,
        samples={"prefill": pre, "decode": dec, **({"step": mixed} if mixed else {})},
        fit={"prefill_rel_rms": _rel_rms(pest.prefill_s, pre),
             "decode_rel_rms": _rel_rms(dest.step_s, dec), "holdout": hold, **step_fit},
        provenance=prov, transfer_source=src, step=step)
    doc = cal.to_json()
    try:
        parse_calibration(doc, "generated calibration")  # what we write, we can read
    except ValueError as e:     # keep what was measured: the caller writes it aside
        e.document = doc        # type: ignore[attr-defined]
        raise
    return doc
