"""Hot-block replication on a live replay, with and without (issue 17 item 4).

``python -m pymooncake.cli.bench_hot [--limit 300] [--repeats 1] [--json]`` starts the
``bench serving`` global-cache cluster (master, Conductor, 2 prefill + 1 decode workers,
tiny model unless ``--model``) once with hot-block replication (the default) and once with
``--no-hot-replication``, replays the first ``--limit`` conversation-trace requests
(``pymooncake replay``), and reports per configuration the replay's hit ratios and TTFT
percentiles plus, like FAST'25 Figure 11, the replica counts of the hottest Store keys
over the replay: every ``--sample-s`` seconds the master is asked how many segments hold
each key (``replica_segments``); keys are ranked by their count summed over the samples,
and the count of the keys at ranks 1, 10, 100 and 1000 is reported per sample.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import threading
import time
from typing import Any

from pymooncake.cli.cluster import ClusterSpec, LocalCluster

CONFIGS: dict[str, list[str]] = {"hot-replication": [],
                                 "hot-min-accesses-1": ["--hot-min-accesses", "1"],
                                 "no-replication": ["--no-hot-replication"]}
"""The default (a block is hot after 2 reuses in 60 s), every reused block replicated (the
paper's proactive migration), and replication off."""
RANKS = (1, 10, 100, 1000)


class ReplicaSampler(threading.Thread):
    """Samples every Store key's replica count from the master every ``every_s``."""

    def __init__(self, master_addr: str, every_s: float) -> None:
        super().__init__(daemon=True, name="replica-sampler")
        self.master_addr, self.every_s = master_addr, every_s
        self.samples: list[tuple[float, dict[str, int]]] = []
        self._halt = threading.Event()

    def sample(self) -> dict[str, int]:
        from pymooncake.rpc.client import SyncRpcClient
        host, port = self.master_addr.rsplit(":", 1)
        c = SyncRpcClient(host, int(port), timeout_s=10.0)
        try:
            keys = [k for k in c.call("list_keys", {}) if k.startswith("kv/")]
            segs = c.call("replica_segments", {"keys": keys}) if keys else []
        finally:
            c.close()
        return {k: len(s) for k, s in zip(keys, segs, strict=True) if s}

    def run(self) -> None:
        t0 = time.monotonic()
        while not self._halt.wait(self.every_s):
            try:
                self.samples.append((time.monotonic() - t0, self.sample()))
            except Exception as e:  # noqa: BLE001 - a missed sample, not a failed run
                print(f"sample failed: {e}", file=sys.stderr)

    def stop(self) -> None:
        self._halt.set()
        self.join(30)


def rank_series(samples: list[tuple[float, dict[str, int]]],
                ranks: tuple[int, ...] = RANKS) -> dict[str, Any]:
    """Figure 11: keys ranked by their replica count summed over ``samples`` (ties: by
    key); for each rank that exists, that key's count in every sample."""
    total: dict[str, int] = {}
    for _, counts in samples:
        for k, n in counts.items():
            total[k] = total.get(k, 0) + n
    order = sorted(total, key=lambda k: (-total[k], k))
    out: dict[str, Any] = {"t_s": [round(t, 1) for t, _ in samples],
                           "num_keys": len(order)}
    for r in ranks:
        if r <= len(order):
            k = order[r - 1]
            out[f"rank_{r}"] = [c.get(k, 0) for _, c in samples]
    hist: dict[int, int] = {}
    for n in (samples[-1][1].values() if samples else ()):
        hist[n] = hist.get(n, 0) + 1
    out["last_sample_keys_by_replicas"] = dict(sorted(hist.items()))
    return out


def run_one(name: str, args: argparse.Namespace) -> dict[str, Any]:
    spec = ClusterSpec(port=0, quiet=True, max_model_len=8192, num_kv_blocks=args.kv_blocks,
                       global_segment_size=args.global_segment_size, num_prefill=args.prefill,
                       num_decode=args.decode, ttft_slo_s=args.ttft_slo * 10,
                       tbt_slo_s=args.tbt_slo * 10, model=args.model, policy="global-cache",
                       extra_conductor_flags=CONFIGS[name])
    cluster = LocalCluster(spec)
    try:
        cluster.start()
        sampler = ReplicaSampler(cluster.master_addr, args.sample_s)
        sampler.start()
        argv = [sys.executable, "-m", "pymooncake", "replay", "--url", cluster.url,
                "--limit", str(args.limit), "--time-scale", str(args.time_scale),
                "--length-scale", str(args.length_scale), "--ttft-slo", str(args.ttft_slo),
                "--tbt-slo", str(args.tbt_slo), "--json"]
        r = subprocess.run(argv, capture_output=True, text=True, timeout=1800)
        sampler.stop()
        if r.returncode != 0:
            raise RuntimeError(f"replay against {name} failed: {r.stderr[-2000:]}")
        rep = json.loads(r.stdout)
        import httpx
        health = httpx.get(cluster.url + "/health", timeout=10).json()
        keep = ("num_requests", "num_served", "num_rejected", "num_failed", "ttft_mean_s",
                "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "tbt_p99_s", "request_hit_ratio",
                "token_hit_ratio", "prompt_tokens", "cached_tokens", "wall_s")
        out = {k: rep.get(k) for k in keep}
        out["stage_means_s"] = rep.get("stage_means_s")
        out["hot_replication"] = health.get("hot_replication")
        out["figure11"] = rank_series(sampler.samples)
        return out
    finally:
        cluster.stop()


def _mean(vals: list[Any]) -> Any:
    nums = [v for v in vals if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return sum(nums) / len(nums) if nums and len(nums) == len(vals) else vals[-1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pymooncake.cli.bench_hot",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--limit", type=int, default=300)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--time-scale", type=float, default=1.0)
    p.add_argument("--length-scale", type=int, default=32)
    p.add_argument("--prefill", type=int, default=2)
    p.add_argument("--decode", type=int, default=1)
    p.add_argument("--kv-blocks", type=int, default=2048,
                   help="paged KV blocks per worker (bench serving's 2048)")
    p.add_argument("--global-segment-size", type=int, default=512 << 20)
    p.add_argument("--ttft-slo", type=float, default=5.0)
    p.add_argument("--tbt-slo", type=float, default=0.5)
    p.add_argument("--sample-s", type=float, default=5.0)
    p.add_argument("--model", default="tiny")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    names = [c for c in args.configs.split(",") if c]
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for rep in range(args.repeats):
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            runs[name].append(run_one(name, args))
            print(f"{name} repeat {rep}: done", file=sys.stderr)
    summary = {}
    for n, rs in runs.items():
        keys = ("ttft_mean_s", "ttft_p50_s", "ttft_p99_s", "request_hit_ratio",
                "token_hit_ratio")
        summary[n] = {k: _mean([r[k] for r in rs]) for k in keys}
        summary[n]["per_repeat"] = {k: [r[k] for r in rs] for k in keys}
    doc = {"machine": f"{platform.machine()}, {os.cpu_count()} cores",
           "model": args.model, "limit": args.limit, "prefill": args.prefill,
           "decode": args.decode, "repeats": args.repeats, "summary": summary, "runs": runs}
    if args.json:
        print(json.dumps(doc, indent=1))
    else:
        for n, s in summary.items():
            print(f"{n:<16} " + " ".join(f"{k}={s[k]:.4f}" for k in s if k != "per_repeat"))
        for n, rs in runs.items():
            f11 = rs[-1]["figure11"]
            print(f"{n}: Figure 11 (replicas per sample, t = {f11['t_s']})")
            for r in RANKS:
                if f"rank_{r}" in f11:
                    print(f"  rank {r:>5}: {f11[f'rank_{r}']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
