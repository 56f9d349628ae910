"""``pymooncake ep bench``: recovery time and degraded throughput of elastic EP.

Starts ``--ranks`` rank processes (``pymooncake ep rank``) on loopback and the front
(``EPService``) in this process, keeps ``--concurrency`` greedy requests of
``--max-tokens`` tokens in flight, SIGKILLs rank ``--kill-rank`` after ``--before-s``
seconds and runs ``--after-s`` more. Reports (seconds from the kill, tokens/s):

* ``detect_s``: until the front marked the rank dead (a failed ``ep.compute`` or a missed
  heartbeat deadline, whichever came first);
* ``replan_s``: until the re-placement over the survivors finished (every expert has a
  copy again, redundancy restored where slots allow) — the recovery time;
* ``max_gap_s`` around the kill vs ``max_gap_before_s``: the longest time without a
  request finishing;
* throughput (tokens/s of the requests that finished in the window) before the kill and
  after it (one rank fewer: the degraded throughput), and after the re-placement;
* the requests in flight at the kill, how many failed, and whether every one that
  finished has the single-process greedy output (checked on the local engine).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import select
import signal
import subprocess
import sys
import threading
import time
from typing import Any


def add_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--slots-per-rank", type=int, default=4,
                   help="copies per rank and layer (2 with 4 ranks = no redundancy)")
    p.add_argument("--no-replan", action="store_true")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=12)
    p.add_argument("--before-s", type=float, default=6.0)
    p.add_argument("--after-s", type=float, default=8.0)
    p.add_argument("--kill-rank", type=int, default=1)
    p.add_argument("--deadline", type=float, default=1.0, help="heartbeat deadline (s)")


def check_bench_args(args: argparse.Namespace) -> str | None:
    """What is wrong with ``ep bench``'s flags (one line), or ``None``: checked before any
    rank starts."""
    if args.ranks < 1:
        return f"--ranks {args.ranks}: need at least 1 rank"
    if not 0 <= args.kill_rank < args.ranks:
        return f"--kill-rank {args.kill_rank}: must be a rank index in [0, {args.ranks})"
    for flag, v in (("--slots-per-rank", args.slots_per_rank),
                    ("--concurrency", args.concurrency), ("--max-tokens", args.max_tokens),
                    ("--prompt-len", args.prompt_len)):
        if v < 1:
            return f"{flag} {v}: must be >= 1"
    for flag, f in (("--before-s", args.before_s), ("--after-s", args.after_s),
                    ("--deadline", args.deadline)):
        if not f > 0:
            return f"{flag} {f}: must be > 0 seconds"
    return None


def _start_rank() -> tuple[subprocess.Popen, int]:
    p = subprocess.Popen([sys.executable, "-m", "pymooncake", "ep", "rank", "--port", "0"],
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                         env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert p.stdout is not None
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if select.select([p.stdout], [], [], 0.2)[0]:
            line = p.stdout.readline()
            if line.startswith('{"event": "ready"'):
                return p, int(json.loads(line)["port"])
        if p.poll() is not None:
            break
    p.kill()
    raise RuntimeError("an EP rank did not start")


def _rate(done: list[dict[str, Any]], a: float, b: float) -> float:
    toks = sum(len(d["token_ids"]) for d in done if a <= d["end"] < b and d["error"] is None)
    return toks / (b - a) if b > a else 0.0


def _max_gap(ends: list[float], a: float, b: float) -> float:
    pts = [a] + sorted(t for t in ends if a <= t < b) + [b]
    return max(y - x for x, y in zip(pts, pts[1:], strict=False))


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from pymooncake.engine.ep.dispatch import EPOptions
    from pymooncake.engine.ep.models import build_engine
    from pymooncake.engine.ep.service import EPService
    from pymooncake.engine.sampling import SamplingParams
    torch.set_num_threads(1)
    procs = [_start_rank() for _ in range(args.ranks)]
    opts = EPOptions(slots_per_rank=args.slots_per_rank, deadline_s=args.deadline,
                     replan_on_failure=not args.no_replan)
    svc = EPService("tiny-moe", [("127.0.0.1", port) for _, port in procs], options=opts)
    done: list[dict[str, Any]] = []
    stop = threading.Event()
    rng = random.Random(0)
    lock = threading.Lock()

    def client(c: int) -> None:
        while not stop.is_set():
            with lock:
                ids = [256] + [rng.randrange(256) for _ in range(args.prompt_len)]
            ev = threading.Event()
            box: dict[str, Any] = {}
            t0 = time.monotonic()
            svc.submit(ids, args.max_tokens,
                       lambda r, box=box, ev=ev: (box.update(r), ev.set()))
            if not ev.wait(60):
                box = {"error": "client timeout (hang)", "token_ids": []}
            with lock:
                done.append({**box, "ids": ids, "start": t0, "end": time.monotonic()})

    try:
        svc.start()
        threads = [threading.Thread(target=client, args=(c,), daemon=True)
                   for c in range(args.concurrency)]
        for t in threads:
            t.start()
        time.sleep(args.before_s)
        t_kill = time.monotonic()
        os.kill(procs[args.kill_rank][0].pid, signal.SIGKILL)
        time.sleep(args.after_s)
        stop.set()
        for t in threads:
            t.join(70)
        assert svc.backend is not None
        ev = svc.backend.events
        deaths = [t for r, t in ev.deaths if r == args.kill_rank and t >= t_kill]
        replans = [(a, b) for why, a, b in ev.replans if a >= t_kill]
        t_end = t_kill + args.after_s
        t_replan = replans[0][1] if replans else t_end
        in_flight = [d for d in done if d["start"] < t_kill < d["end"]]
        ok_in_flight = [d for d in in_flight if d["error"] is None]
        ref_engine = build_engine("tiny-moe")
        refs = ref_engine.generate([d["ids"] for d in ok_in_flight],
                                   SamplingParams(max_tokens=args.max_tokens))
        same = all(list(r.output_token_ids) == d["token_ids"]
                   for r, d in zip(refs, ok_in_flight, strict=True))
        ends = [d["end"] for d in done]
        errs = [d["end"] for d in done if d["error"] is not None and d["end"] >= t_kill]
        warm = min(1.0, args.before_s / 3)
        return {
            "load_avg_1m": round(os.getloadavg()[0], 2), "ranks": args.ranks,
            "slots_per_rank": args.slots_per_rank,
            "replan_on_failure": not args.no_replan, "concurrency": args.concurrency,
            "max_tokens": args.max_tokens, "heartbeat_deadline_s": args.deadline,
            "detect_s": round(deaths[0] - t_kill, 4) if deaths else None,
            "replan_s": round(t_replan - t_kill, 4) if replans else None,
            "replan_work_s": round(replans[0][1] - replans[0][0], 4) if replans else None,
            "max_gap_before_s": round(_max_gap(ends, t_kill - args.before_s + warm, t_kill), 4),
            "max_gap_s": round(_max_gap(ends, t_kill, t_end), 4),
            "tokens_per_s_before": round(_rate(done, t_kill - args.before_s + warm, t_kill), 1),
            "tokens_per_s_after_kill": round(_rate(done, t_kill, t_end), 1),
            "tokens_per_s_after_replan": round(_rate(done, t_replan, t_end), 1)
            if replans else None,
            "requests": len(done), "errors": sum(d["error"] is not None for d in done),
            "errors_after_kill": sum(d["error"] is not None for d in done if d["end"] >= t_kill),
            "first_error_after_kill_s": round(min(errs) - t_kill, 4) if errs else None,
            "max_error_latency_s": round(max(d["end"] - d["start"] for d in done
                                             if d["error"] is not None), 4) if errs else None,
            "hangs": sum(d["error"] == "client timeout (hang)" for d in done),
            "in_flight_at_kill": len(in_flight), "in_flight_ok": len(ok_in_flight),
            "in_flight_output_unchanged": same,
            "rerouted_rows": ev.rerouted_rows, "missing_after": svc.backend.missing(),
        }
    finally:
        stop.set()
        svc.close()
        for p, _ in procs:
            if p.poll() is None:
                p.kill()
            p.wait(10)


def summary(res: dict[str, Any]) -> str:
    return "\n".join(f"{k}: {v}" for k, v in res.items())
