"""``pymooncake trace ...`` (Mooncake JSONL traces) and ``pymooncake bench identity``."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from pymooncake.cli.common import add_group, add_json_flag, emit


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``pymooncake trace {stats,head,scale}``."""
    trace = add_group(subparsers, "trace", "Mooncake JSONL request traces: statistics, transforms")

    stats = trace.add_parser(
        "stats", help="request count, lengths, duration and prefix-cache ratio of a trace",
        description="Statistics of a Mooncake JSONL trace (.jsonl or .jsonl.gz). The cache "
                    "ratio is the token-weighted hit ratio of an infinite prefix cache "
                    "replayed in arrival order (docs/workload.md).")
    stats.add_argument("file", nargs="?", default=None, metavar="FILE",
                       help="trace file (default: the bundled conversation trace)")
    _add_load_flags(stats)
    add_json_flag(stats)
    stats.set_defaults(handler=_cmd_stats)

    head = trace.add_parser(
        "head", help="write the first N requests (or a time window) of a trace as JSONL",
        description="Write a part of a trace as Mooncake JSONL to stdout or --output.")
    head.add_argument("file", nargs="?", default=None, metavar="FILE",
                      help="trace file (default: the bundled conversation trace)")
    head.add_argument("-n", "--num-requests", type=int, default=None, metavar="N",
                      help="keep the first N requests in arrival order")
    head.add_argument("--start-s", type=float, default=None,
                      help="keep arrivals at or after this time (s); rebased to 0")
    head.add_argument("--end-s", type=float, default=None,
                      help="keep arrivals before this time (s)")
    _add_load_flags(head)
    _add_output_flag(head)
    head.set_defaults(handler=_cmd_head)

    scale = trace.add_parser(
        "scale", help="speed a trace up or down (divide its inter-arrival times)",
        description="Write the trace with timestamps divided by FACTOR (FACTOR > 1 = faster).")
    scale.add_argument("factor", type=float, metavar="FACTOR", help="speed-up factor (> 0)")
    scale.add_argument("file", nargs="?", default=None, metavar="FILE",
                       help="trace file (default: the bundled conversation trace)")
    _add_load_flags(scale)
    _add_output_flag(scale)
    scale.set_defaults(handler=_cmd_scale)


def _add_load_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--skip-invalid", action="store_true",
                   help="skip malformed lines and report how many instead of failing")
    p.add_argument("--block-size", type=int, default=512, metavar="N",
                   help="tokens per hash id (default: 512, the Mooncake traces')")


def _add_output_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("-o", "--output", default=None, metavar="PATH",
                   help="write here (.jsonl, or .jsonl.gz for gzip) instead of stdout")


def _load(args: argparse.Namespace):  # noqa: ANN202
    from pymooncake.cli.main import CommandError, UsageError
    from pymooncake.workload import TraceError, bundled_trace_path, load_trace

    if args.block_size < 1:
        raise UsageError(f"--block-size must be >= 1, got {args.block_size}")
    path = args.file if args.file is not None else bundled_trace_path("conversation")
    try:
        return load_trace(path, skip_invalid=args.skip_invalid, block_size=args.block_size)
    except TraceError as e:
        raise CommandError(str(e)) from None


def _human_stats(d: dict[str, Any]) -> str:
    lines = [
        f"trace            {d['path']}",
        f"requests         {d['num_requests']:,}"
        + (f"  ({d['num_skipped']:,} invalid lines skipped)" if d["num_skipped"] else ""),
        f"duration         {d['duration_s']:,.1f} s  ({d['request_rate_per_s']:.2f} req/s)",
        f"input length     mean {d['mean_input_length']:,.0f}  p50 {d['p50_input_length']:,.0f}"
        f"  p99 {d['p99_input_length']:,.0f} tokens",
        f"output length    mean {d['mean_output_length']:,.0f}  p50 {d['p50_output_length']:,.0f}"
        f"  p99 {d['p99_output_length']:,.0f} tokens",
        f"total tokens     {d['total_input_tokens']:,} in, {d['total_output_tokens']:,} out",
        f"blocks           {d['num_blocks']:,} hash ids, {d['num_unique_blocks']:,} unique"
        f" ({d['block_size']} tokens each)",
        f"cache ratio      {d['cache_ratio']:.1%} token-weighted"
        f"  ({d['request_cache_ratio']:.1%} request-weighted;"
        " infinite prefix cache, arrival order)",
    ]
    return "\n".join(lines)


def _cmd_stats(args: argparse.Namespace) -> int:
    from pymooncake.cli.main import CommandError
    from pymooncake.workload import trace_stats

    trace = _load(args)
    if not trace.requests:
        skipped = f" ({trace.num_skipped} invalid lines skipped)" if trace.num_skipped else ""
        raise CommandError(f"{trace.path}: no valid requests{skipped}")
    payload = {"path": trace.path, **trace_stats(trace).to_dict()}
    emit(payload, args.json, _human_stats)
    return 0


def _write(trace, output: str | None) -> None:  # noqa: ANN001
    import gzip
    import sys

    from pymooncake.cli.main import CommandError

    def lines():  # noqa: ANN202
        for r in trace.requests:
            ts = r.timestamp_ms
            yield json.dumps({"timestamp": int(ts) if ts == int(ts) else ts,
                              "input_length": r.input_length,
                              "output_length": r.output_length,
                              "hash_ids": list(r.hash_ids)}) + "\n"

    if output is None:
        sys.stdout.writelines(lines())
        return
    try:
        opener = gzip.open if output.endswith(".gz") else open
        with opener(output, "wt", encoding="utf-8") as f:
            f.writelines(lines())
    except OSError as e:
        raise CommandError(f"{output}: cannot write ({e.strerror or e})") from None


def _cmd_head(args: argparse.Namespace) -> int:
    from pymooncake.cli.main import UsageError
    from pymooncake.workload import take_first, take_window

    trace = _load(args)
    try:
        if args.start_s is not None or args.end_s is not None:
            trace = take_window(trace, args.start_s or 0.0,
                                args.end_s if args.end_s is not None else float("inf"))
        if args.num_requests is not None:
            trace = take_first(trace, args.num_requests)
    except ValueError as e:
        raise UsageError(str(e)) from None
    _write(trace, args.output)
    return 0


def _cmd_scale(args: argparse.Namespace) -> int:
    from pymooncake.cli.main import UsageError
    from pymooncake.workload import scale_arrivals

    trace = _load(args)
    try:
        trace = scale_arrivals(trace, args.factor)
    except ValueError as e:
        raise UsageError(str(e)) from None
    _write(trace, args.output)
    return 0


# ---------------------------------------------------------------------------- bench


def register_bench(bench: argparse._SubParsersAction) -> None:
    """Add ``pymooncake bench identity`` and ``pymooncake bench trace``."""
    t = bench.add_parser(
        "trace", help="trace load, statistics and token materialisation times",
        description="Time load_trace, trace_stats and materialize_trace on a trace "
                    "(median of repeats).")
    t.add_argument("file", nargs="?", default=None, metavar="FILE",
                   help="trace file (default: the bundled conversation trace)")
    t.add_argument("--repeat", type=int, default=5, help="runs; the median is reported")
    t.add_argument("--materialize-requests", type=int, default=1000, metavar="N",
                   help="materialise the first N requests (vocab 32000, scale 1)")
    _add_load_flags(t)
    add_json_flag(t)
    t.set_defaults(handler=_cmd_bench_trace)

    p = bench.add_parser(
        "identity", help="block-key throughput: chained BLAKE3 keys for N tokens",
        description="Time identity.block_keys over N random token ids (median of repeats).")
    p.add_argument("--tokens", type=int, default=1_000_000, metavar="N",
                   help="token ids per run (default: 1,000,000)")
    p.add_argument("--block-size", type=int, default=16, metavar="B",
                   help="tokens per block (default: 16)")
    p.add_argument("--repeat", type=int, default=5, help="runs; the median is reported")
    add_json_flag(p)
    p.set_defaults(handler=_cmd_bench_identity)


def _cmd_bench_trace(args: argparse.Namespace) -> int:
    from pymooncake.cli.main import UsageError
    from pymooncake.workload import materialize_trace, take_first, trace_stats

    if args.repeat < 1 or args.materialize_requests < 0:
        raise UsageError("--repeat must be >= 1 and --materialize-requests >= 0")
    load_s, stats_s, mat_s = [], [], []
    trace = None
    num_tokens = 0
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        trace = _load(args)
        t1 = time.perf_counter()
        trace_stats(trace)
        t2 = time.perf_counter()
        mat = materialize_trace(take_first(trace, args.materialize_requests), vocab_size=32_000)
        t3 = time.perf_counter()
        num_tokens = sum(len(m.token_ids) for m in mat)
        load_s.append(t1 - t0)
        stats_s.append(t2 - t1)
        mat_s.append(t3 - t2)
    assert trace is not None
    payload = {"path": trace.path, "num_requests": len(trace), "repeat": args.repeat,
               "load_median_s": statistics.median(load_s),
               "stats_median_s": statistics.median(stats_s),
               "materialize_requests": min(args.materialize_requests, len(trace)),
               "materialize_tokens": num_tokens,
               "materialize_median_s": statistics.median(mat_s)}
    emit(payload, args.json, lambda d: (
        f"{d['path']}: {d['num_requests']:,} requests; load {d['load_median_s'] * 1e3:.0f} ms, "
        f"stats {d['stats_median_s'] * 1e3:.0f} ms, materialise {d['materialize_requests']:,} "
        f"requests ({d['materialize_tokens']:,} tokens) {d['materialize_median_s'] * 1e3:.0f} ms"
        f" (medians of {d['repeat']})"))
    return 0


def _cmd_bench_identity(args: argparse.Namespace) -> int:
    import numpy as np

    from pymooncake.cli.main import UsageError
    from pymooncake.identity import CacheNamespace, block_keys, kv_layout_descriptor

    if args.tokens < 1 or args.block_size < 1 or args.repeat < 1:
        raise UsageError("--tokens, --block-size and --repeat must be >= 1")
    ns = CacheNamespace(model_id="bench", weight_revision="r0", tokenizer_fingerprint="t0",
                        kv_dtype="float16",
                        kv_layout=kv_layout_descriptor(32, 8, 128, "float16"),
                        block_size=args.block_size)
    tokens = np.random.default_rng(0).integers(0, 128_000, size=args.tokens, dtype=np.int64)
    times = []
    num_keys = 0
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        num_keys = len(block_keys(tokens, ns))
        times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    payload = {"num_tokens": args.tokens, "block_size": args.block_size, "num_keys": num_keys,
               "repeat": args.repeat, "median_s": med, "min_s": min(times),
               "keys_per_s": num_keys / med, "tokens_per_s": args.tokens / med}
    emit(payload, args.json, lambda d: (
        f"block_keys: {d['num_tokens']:,} tokens, block {d['block_size']} -> "
        f"{d['num_keys']:,} keys in {d['median_s'] * 1e3:.1f} ms (median of {d['repeat']}); "
        f"{d['keys_per_s']:,.0f} keys/s, {d['tokens_per_s'] / 1e6:.1f} M tokens/s"))
    return 0
