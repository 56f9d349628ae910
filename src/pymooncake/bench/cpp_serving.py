"""Live TTFT with and without a CPP prefill group (issue 19, docs/cpp.md "In the live cluster").

``python -m pymooncake.bench.cpp_serving --model smollm2 --prompt-len 4096 --repeats 3``
starts a cluster (``LocalCluster``: Store master, Conductor, one single prefill worker, one
decode worker) with a ``--cpp-stages`` group (``prefill-cpp``), sends ``--repeats`` fresh
random prompts one after another and records the client-side TTFT (first streamed token);
then the same cluster without the group, the same prompts. The placement must send each
prompt to the group in the first cluster (checked from the Conductor's
``pymooncake_conductor_placements_total``); the first tokens of both clusters must agree.
One JSON line per prompt and a summary line (medians, ratio) on stdout.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from typing import Any


def _ttft(url: str, model: str, ids: list[int]) -> tuple[float, list[int]]:
    import httpx
    body = {"model": model, "prompt": ids, "max_tokens": 2, "temperature": 0, "stream": True,
            "return_token_ids": True, "ignore_eos": True}
    t0 = time.perf_counter()
    first: float | None = None
    toks: list[int] = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=1200) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:]).get("choices", []):
                    if c.get("token_ids"):
                        first = first or time.perf_counter() - t0
                        toks += c["token_ids"]
    if first is None:
        raise RuntimeError("no token came back")
    return first, toks


def _placed_on(url: str, instance: str) -> float:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for s in fam.samples:
            if (s.name == "pymooncake_conductor_placements_total"
                    and s.labels.get("prefill_instance") == instance):
                return s.value
    return 0.0


def run(args: argparse.Namespace) -> dict[str, Any]:
    from pymooncake.cli.cluster import ClusterSpec, LocalCluster
    prompts = []
    for i in range(args.repeats):
        rng = random.Random(args.seed + i)
        prompts.append([rng.randrange(1000, 40000) for _ in range(args.prompt_len)])
    cpp = ["--cpp-stages", str(args.stages), "--cpp-min-tokens", str(args.min_tokens)]
    out: dict[str, Any] = {}
    for mode, argv in (("cpp", cpp), ("single", [])):
        c = LocalCluster(ClusterSpec(model=args.model, num_prefill=1, num_decode=1, port=0,
                                     quiet=True, max_model_len=args.prompt_len + 64,
                                     global_store=False, policy="local-cache", cpp_argv=argv))
        try:
            c.start()
            rows = []
            for i, ids in enumerate(prompts):
                before = _placed_on(c.url, "prefill-cpp")
                t, toks = _ttft(c.url, args.model, ids)
                grouped = _placed_on(c.url, "prefill-cpp") > before
                rows.append({"mode": mode, "prompt": i, "ttft_s": round(t, 3),
                             "tokens": toks, "on_group": grouped})
                print(json.dumps(rows[-1]), flush=True)
            out[mode] = rows
        finally:
            c.stop()
    med = {m: statistics.median(r["ttft_s"] for r in out[m]) for m in out}
    summary = {"prompt_len": args.prompt_len, "stages": args.stages,
               "cpp_median_s": med["cpp"], "single_median_s": med["single"],
               "ratio": round(med["cpp"] / med["single"], 3),
               "all_on_group": all(r["on_group"] for r in out["cpp"]),
               "same_tokens": all(a["tokens"] == b["tokens"]
                                  for a, b in zip(out["cpp"], out["single"], strict=True))}
    print(json.dumps(summary), flush=True)
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--prompt-len", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--min-tokens", type=int, default=560)
    p.add_argument("--seed", type=int, default=11)
    args = p.parse_args(argv)
    if args.prompt_len < 1 or args.repeats < 1 or args.stages < 2:
        p.error("--prompt-len and --repeats must be >= 1, --stages >= 2")
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
