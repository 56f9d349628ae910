"""``pymooncake bench store-load``: the share of a Store prefix load hidden by compute
(harness: ``pymooncake.bench.store_load``; figures in docs/benchmarks.md)."""

from __future__ import annotations

import argparse

from pymooncake.cli.common import add_json_flag, emit


def register_bench(bench_subparsers: argparse._SubParsersAction) -> None:
    """Add ``pymooncake bench store-load``."""
    b = bench_subparsers.add_parser(
        "store-load", help="Store prefix load: TTFT and the load share hidden by compute",
        description="A prompt whose prefix another worker (a store-server process) holds in "
                    "the Mooncake Store is served by a prefill engine in each load mode "
                    "(sync: the step thread waits for the whole load; async: the request "
                    "waits off the step thread; layerwise: it computes while later layer "
                    "groups arrive), interleaved repeats; prints medians of TTFT, the Store "
                    "read time, compute time, the engine's waits for layers and the hidden "
                    "fraction of the read time, and checks the first token against a full "
                    "prefill of the prompt.")
    b.add_argument("--model", default="smollm2", help="model spec (default smollm2)")
    b.add_argument("--prefix-tokens", type=int, default=2048,
                   help="prompt tokens held in the Store (a multiple of the block size)")
    b.add_argument("--suffix-tokens", type=int, default=512,
                   help="new prompt tokens computed after the prefix")
    b.add_argument("--repeats", type=int, default=3, help="interleaved repeats per mode")
    b.add_argument("--modes", default="sync,async,layerwise", help="comma-separated modes")
    b.add_argument("--transports", default="shm,tcp",
                   help="Transfer Engine transports of every party (default shm,tcp)")
    b.add_argument("--threads", type=int, default=1, help="torch threads of the engines")
    add_json_flag(b)
    b.set_defaults(handler=_cmd)


def _cmd(args: argparse.Namespace) -> int:
    import sys

    from pymooncake.bench.store_load import format_report, run
    try:
        res = run(args.model, args.prefix_tokens, args.suffix_tokens, args.repeats,
                  tuple(m for m in args.modes.split(",") if m), args.transports,
                  threads=args.threads)
    except ValueError as e:
        print(f"pymooncake bench store-load: {e}", file=sys.stderr)
        return 2
    emit(res, args.json, format_report)
    return 0
