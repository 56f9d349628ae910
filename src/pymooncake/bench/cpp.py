"""``pymooncake bench cpp``: TTFT of a CPP group against one worker, and the break-even.

One worker (``Engine``, role prefill, chunked prefill at ``chunk_tokens``) runs in a child
pinned to one core with one torch thread; there is one such child per core, used in turn
by repeat (the stages take every core, so the baseline must not always get the less loaded
one of a shared machine). The CPP group's stages are pinned one per core
(``engine.cpp.group.CppGroup``). All stay up and are driven interleaved: for every repeat
and prompt length, the same fresh random prompt (no prefix reuse) goes to the worker, then
to the group. Reported: median [min-max] TTFT per length, the ratio CPP/single, whether the
first (greedy) tokens agree, the per-hop send time of the hidden states, the measured
break-even length, and the cost model's (``conductor.policy.cpp``) fitted to these figures.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

READY = "CPP_BENCH_SINGLE_READY"


def _single_main(argv: Sequence[str]) -> int:
    """The single-worker child: ``single MODEL CORE NUM_BLOCKS CHUNK``; then one JSON prompt
    per stdin line, one JSON answer (ttft_s, token) per stdout line."""
    model, core, num_blocks, chunk = argv[0], int(argv[1]), int(argv[2]), int(argv[3])
    if core >= 0:
        os.sched_setaffinity(0, {core})
    import torch

    from pymooncake.engine import Engine, EngineConfig
    from pymooncake.engine.sampling import SamplingParams
    torch.set_num_threads(1)
    eng = Engine.from_model_name(model, EngineConfig(
        role="prefill", num_kv_blocks=num_blocks, prefill_chunk_tokens=chunk,
        max_model_len=num_blocks * 16, num_threads=1))
    print(READY, eng.model.config.vocab_size, flush=True)
    for line in sys.stdin:
        ids = json.loads(line)["ids"]
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            out = eng.generate([ids], SamplingParams(max_tokens=1))[0]
        except Exception as e:  # noqa: BLE001 - relayed to the parent as one line
            print(json.dumps({"error": " ".join(f"{type(e).__name__}: {e}".split())}),
                  flush=True)
            continue
        print(json.dumps({"ttft_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0,
                          "token": out.output_token_ids[0]}), flush=True)
    return 0


class _Single:
    def __init__(self, model: str, core: int, num_blocks: int, chunk: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pymooncake.bench.cpp", "single", model, str(core),
             str(num_blocks), str(chunk)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True, env=dict(os.environ, OMP_NUM_THREADS="1"),
            start_new_session=True)  # its own autogroup, as each CPP stage has
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith(READY):
            self.close()
            raise RuntimeError("the single-worker child did not start; see its stderr")
        self.vocab_size = int(line.split()[1])

    def prefill(self, ids: list[int]) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"ids": ids}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the single-worker child exited; see its stderr")
        doc = json.loads(line)
        if "error" in doc:
            raise RuntimeError(f"single worker: {doc['error']}")
        return doc

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _summary(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def critical_path_s(stats: Sequence[dict[str, list[float]]], key: str = "compute_s") -> float:
    """The pipeline's makespan from the stages' measured per-chunk compute (``key``:
    ``compute_s`` wall, ``compute_cpu_s`` the compute thread's CPU time) and send times
    (``CppGroup.stats``). With CPU times: the TTFT had no stage waited for its core."""
    finish = [0.0] * len(stats)
    for k in range(len(stats[0].get("compute_s", []))):
        ready = 0.0
        for i, st in enumerate(stats):
            hop = stats[i - 1]["send_s"][k] if i and k < len(stats[i - 1]["send_s"]) else 0.0
            finish[i] = max(ready + hop, finish[i]) + st[key][k]
            ready = finish[i]
    return finish[-1]


def measured_break_even(points: Sequence[tuple[int, float]]) -> float | None:
    """From ``(prompt length, TTFT ratio CPP/single)``: the length from which CPP wins at
    every longer measured length, interpolated linearly where the ratio crosses 1 (the
    shortest length if CPP wins everywhere; ``None`` if it loses at the longest)."""
    pts = sorted(points)
    if not pts or pts[-1][1] >= 1.0:
        return None
    i = len(pts) - 1
    while i > 0 and pts[i - 1][1] < 1.0:
        i -= 1
    if i == 0:
        return float(pts[0][0])
    (n0, r0), (n1, r1) = pts[i - 1], pts[i]
    return n0 + (n1 - n0) * (r0 - 1.0) / (r0 - r1)


def run_cpp_bench(model: str, num_stages: int, prompt_lens: Sequence[int], repeats: int,
                  chunk_tokens: int, cores: Sequence[int] | None = None, seed: int = 0,
                  edge_tokens: int = 0, single_cores: Sequence[int] | None = None,
                  progress: Callable[[str], None] = lambda m: None) -> dict[str, Any]:
    """Run the benchmark (module docstring); returns the JSON document."""
    from pymooncake.conductor.policy.cpp import CppCostModel, break_even_tokens, cpp_prefill_s
    from pymooncake.conductor.policy.estimators import fit_prefill_estimator
    from pymooncake.engine.cpp.group import CppGroup
    allowed = sorted(os.sched_getaffinity(0))
    cores = list(cores) if cores is not None else allowed[:num_stages]
    if len(cores) < num_stages:
        raise ValueError(f"{num_stages} stages need {num_stages} cores, {len(cores)} given")
    lens = sorted(set(prompt_lens))
    warm_len = min(lens[0], chunk_tokens) + chunk_tokens  # the warm-up prompt (below)
    # every prompt sent, the warm-up included, must fit the single worker's max_model_len
    # (num_blocks * 16) with its one output token
    num_blocks = -(-(max(max(lens), warm_len) + 1) // 16) + 16
    s_cores = list(single_cores) if single_cores else cores[:num_stages]
    progress(f"starting one worker on each of cores {s_cores} and {num_stages} stages on "
             f"{cores[:num_stages]}")
    singles = [_Single(model, c, num_blocks, chunk_tokens) for c in s_cores]
    group = CppGroup(model, num_stages, cores, num_blocks=num_blocks, chunk_tokens=chunk_tokens,
                     edge_tokens=edge_tokens)
    hidden = 0
    rows: dict[int, dict[str, list]] = {n: {"single": [], "cpp": [], "same": [], "hop": [],
                                            "busy": [], "path": [],
                                            "path_cpu": [], "single_cpu": [],
                                            "core": []}
                                        for n in lens}
    try:
        group.start()
        rng = random.Random(seed)
        vocab = min(singles[0].vocab_size, group.vocab_size)
        hidden = group.hidden_size

        def prompt(n: int) -> list[int]:
            return [rng.randrange(3, vocab) for _ in range(n)]
        warm = prompt(warm_len)
        for single in singles:
            single.prefill(warm)
        group.release(group.prefill(warm).request_id)
        for r in range(repeats):
            for n in lens:
                ids = prompt(n)
                s = singles[r % len(singles)].prefill(ids)
                c = group.prefill(ids)
                stats = group.stats(c.request_id)
                hops = [x for st in stats for x in st.get("send_s", [])]
                group.release(c.request_id)
                row = rows[n]
                row["single"].append(s["ttft_s"])
                row["cpp"].append(c.ttft_s)
                row["same"].append(s["token"] == c.first_token)
                row["hop"].extend(hops)
                row["busy"].append([sum(st.get("compute_s", [])) for st in stats])
                row["path"].append(critical_path_s(stats))
                row["path_cpu"].append(critical_path_s(stats, "compute_cpu_s"))
                row["single_cpu"].append(s["cpu_s"])
                row["core"].append(s_cores[r % len(singles)])
                progress(f"repeat {r + 1}/{repeats} {n:>6} tokens: single (core "
                         f"{s_cores[r % len(singles)]}) {s['ttft_s']:.3f} s, "
                         f"cpp {c.ttft_s:.3f} s ({c.ttft_s / s['ttft_s']:.3f}x), first token "
                         f"{'same' if s['token'] == c.first_token else 'DIFFERENT'}")
    finally:
        group.close()
        for single in singles:
            single.close()
    results = []
    for n in lens:
        row = rows[n]
        sm, cm = statistics.median(row["single"]), statistics.median(row["cpp"])
        results.append({"prompt_tokens": n, "single_ttft_s": _summary(row["single"]),
                        "cpp_ttft_s": _summary(row["cpp"]), "ratio": cm / sm,
                        "first_token_same": all(row["same"]),
                        "stage_busy_s_median": [statistics.median(b) for b in zip(*row["busy"],
                                                                                   strict=True)],
                        "critical_path_s": _summary(row["path"]),
                        "single_cpu_s": _summary(row["single_cpu"]),
                        "single_ttft_s_by_core": {
                            str(c): statistics.median(t for t, k in zip(row["single"], row["core"],
                                                                        strict=True) if k == c)
                            for c in sorted(set(row["core"]))},
                        "critical_path_cpu_s": _summary(row["path_cpu"]),
                        "ratio_cpu": statistics.median(row["path_cpu"])
                        / statistics.median(row["single_cpu"]),
                        "hop_send_s_median": statistics.median(row["hop"]) if row["hop"] else None})
    hops = [h for n in lens for h in rows[n]["hop"]]
    doc: dict[str, Any] = {
        "model": model, "stages": num_stages, "cores": cores[:num_stages],
        "single_cores": s_cores,
        "chunk_tokens": chunk_tokens, "edge_tokens": edge_tokens, "repeats": repeats,
        "results": results,
        "break_even_tokens_measured": measured_break_even(
            [(r["prompt_tokens"], r["ratio"]) for r in results]),
        "break_even_tokens_measured_cpu": measured_break_even(
            [(r["prompt_tokens"], r["ratio_cpu"]) for r in results]),
        "hop_bytes": chunk_tokens * 4 * hidden,
        "hop_send_s_median": statistics.median(hops) if hops else None,
    }
    if len(lens) >= 2:
        est = fit_prefill_estimator([(n, 0, statistics.median(rows[n]["single"])) for n in lens])
        cm = CppCostModel(num_stages, chunk_tokens, est, doc["hop_send_s_median"] or 0.0, 0.0,
                          0, edge_tokens)
        doc["cost_model"] = {
            "single_quadratic_s": est.quadratic_s, "single_linear_s": est.linear_s,
            "hop_s": cm.hop_s, "break_even_tokens": break_even_tokens(cm),
            "predicted_cpp_ttft_s": {str(n): cpp_prefill_s(cm, n) for n in lens}}
    return doc


def format_human(doc: dict[str, Any]) -> str:
    lines = [f"CPP {doc['stages']} stages on cores {doc['cores']} vs one worker "
             f"({doc['model']}, chunks of {doc['chunk_tokens']}, edges "
             f"{doc['edge_tokens']}, {doc['repeats']} repeats; "
             "TTFT median [min-max])"]
    for r in doc["results"]:
        s, c = r["single_ttft_s"], r["cpp_ttft_s"]
        lines.append(f"  {r['prompt_tokens']:>6} tokens: single {s['median']:.3f} "
                     f"[{s['min']:.3f}-{s['max']:.3f}] s, cpp {c['median']:.3f} "
                     f"[{c['min']:.3f}-{c['max']:.3f}] s, ratio {r['ratio']:.3f}, first token "
                     f"{'same' if r['first_token_same'] else 'DIFFERENT'}; stage busy "
                     f"{', '.join(f'{b:.3f}' for b in r['stage_busy_s_median'])} s, critical "
                     f"path {r['critical_path_s']['median']:.3f} s; CPU time: single "
                     f"{r['single_cpu_s']['median']:.3f} s, critical path "
                     f"{r['critical_path_cpu_s']['median']:.3f} s, ratio {r['ratio_cpu']:.3f}")
    hop = doc.get("hop_send_s_median")
    if hop is not None:
        lines.append(f"  hidden-state hop (one chunk, RPC): median {hop * 1e3:.2f} ms")
    lines.append(f"  break-even (measured): wall {doc['break_even_tokens_measured']}, CPU time "
                 f"{doc['break_even_tokens_measured_cpu']}")
    if "cost_model" in doc:
        lines.append(f"  break-even (cost model fitted here): "
                     f"{doc['cost_model']['break_even_tokens']}")
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "single":
        sys.exit(_single_main(sys.argv[2:]))
    sys.exit(2)
