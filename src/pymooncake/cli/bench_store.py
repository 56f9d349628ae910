"""``pymooncake bench store``: Store put/get throughput and latency side by side with the
Mooncake wheel, and the master's metadata ops at equal in-flight depth
(``pymooncake.bench.store``, ``pymooncake.bench.store_meta``; figures in
docs/benchmarks.md)."""

from __future__ import annotations

import argparse

from pymooncake.cli.common import add_json_flag, emit
from pymooncake.cli.store import parse_size


def register_bench(bench_subparsers: argparse._SubParsersAction) -> None:
    """Add ``pymooncake bench store``."""
    b = bench_subparsers.add_parser(
        "store", help="store put/get throughput and latency",
        description="Put/get throughput and p50/p99 latency of the store, bytes verified; "
        "with the mooncake-transfer-engine-non-cuda wheel importable, Mooncake's own store "
        "in the same run; the master's metadata ops/s from 4 client processes; and the "
        "metadata ops side by side with Mooncake at equal in-flight depth (one depth or "
        "several).")
    b.add_argument("--size", type=parse_size, action="append", default=None, metavar="BYTES",
                   help="value size (repeatable; default 4K, 64K, 1M, 16M)")
    b.add_argument("--count", type=int, default=64, help="values per size")
    b.add_argument("--mode", choices=("embedded", "remote"), action="append", default=None,
                   help="embedded: reader's own segment; remote: another process's (repeatable)")
    b.add_argument("--metadata-ops", type=int, default=20_000,
                   help="calls of the master benchmark (exist/get_replica_list) and calls per "
                   "op kind of the side-by-side metadata benchmark (0 = skip both)")
    b.add_argument("--metadata-clients", type=int, action="append", default=None, metavar="N",
                   help="client processes (= calls in flight) of the side-by-side metadata "
                   "benchmark: is_exist, batch_is_exist, get_size, remove through the same "
                   f"Python API on both sides; repeatable: one set of rows per depth, in the "
                   f"order given, a repeated depth run once (default 4; 1-{MAX_DEPTH}; a lone "
                   f"0 skips it)")
    b.add_argument("--metadata-only", action="store_true",
                   help="only the side-by-side metadata benchmark (no put/get rows, no "
                   "master rows; --size and --mode are refused with it)")
    b.add_argument("--no-mooncake", action="store_true", help="skip Mooncake's own store")
    b.add_argument("--rpc-poll", type=float, default=None, metavar="S",
                   help="our master's --rpc-poll in every cluster (default: its own)")
    b.add_argument("--repeat", type=int, default=1,
                   help="rounds, each with both stores up and taking turns chunk by chunk "
                        "(the one that starts swapped per round); medians with quartiles")
    b.add_argument("--mooncake-path", default=None, metavar="DIR",
                   help="a site-packages directory holding the Mooncake wheel (appended to "
                   "sys.path; its ../../../bin is searched for mooncake_master)")
    add_json_flag(b)
    b.set_defaults(handler=_run_bench)


MAX_DEPTH = 64
"""Most client processes per side of the side-by-side metadata benchmark (each one a
process, on each side)."""


def metadata_depths(given: list[int] | None) -> list[int]:
    """The in-flight depths of ``--metadata-clients`` (repeatable): in the order given, each
    once; ``[4]`` when none; ``[]`` for a lone 0 (skip). ``UsageError`` naming the value for
    one outside 1..``MAX_DEPTH``, or a 0 among other depths."""
    from pymooncake.cli.main import UsageError

    depths = list(dict.fromkeys(given or [4]))
    if depths == [0]:
        return []
    for n in depths:
        if n == 0:
            raise UsageError("--metadata-clients 0 (skip) cannot be given with other depths")
        if not 1 <= n <= MAX_DEPTH:
            raise UsageError(f"--metadata-clients {n}: must be in 1..{MAX_DEPTH} (0 alone: skip)")
    return depths


def _run_bench(args: argparse.Namespace) -> int:
    from pymooncake.bench import store as bench
    from pymooncake.cli.main import UsageError

    if args.count < 1:
        raise UsageError("--count must be >= 1")
    if args.repeat < 1:
        raise UsageError("--repeat must be >= 1")
    if args.mooncake_path:
        import os
        import sys

        sys.path.append(args.mooncake_path)
        bindir = os.path.normpath(os.path.join(args.mooncake_path, "..", "..", "..", "bin"))
        os.environ["PATH"] = os.environ.get("PATH", "") + os.pathsep + bindir
    sizes = args.size or [4 << 10, 64 << 10, 1 << 20, 16 << 20]
    modes = args.mode or ["embedded", "remote"]
    if args.metadata_ops < 0:
        raise UsageError(f"--metadata-ops {args.metadata_ops}: must be >= 0 (0 = skip)")
    depths = metadata_depths(args.metadata_clients)
    if args.metadata_only:
        if args.size or args.mode:
            raise UsageError("--metadata-only runs no put/get: --size and --mode do not apply")
        if not depths:
            raise UsageError("--metadata-only: --metadata-clients 0 leaves nothing to run")
        if args.metadata_ops == 0:
            raise UsageError("--metadata-only: --metadata-ops 0 leaves nothing to run")
    if args.rpc_poll is not None and not 0 <= args.rpc_poll <= 0.01:
        raise UsageError(f"--rpc-poll {args.rpc_poll}: must be in [0, 0.01] seconds")
    from pymooncake.bench import store_procs as bench_procs

    bench_procs.MASTER_FLAGS[:] = [] if args.rpc_poll is None else ["--rpc-poll",
                                                                     repr(args.rpc_poll)]
    result = [] if args.metadata_only else bench.run(
        sizes, args.count, modes, metadata_ops=args.metadata_ops,
        with_mooncake=not args.no_mooncake, repeat=args.repeat)
    from pymooncake.bench import store_meta

    meta = []
    if args.metadata_ops > 0:
        for n in depths:
            meta += store_meta.run(args.metadata_ops, n, repeat=args.repeat,
                                   with_mooncake=not args.no_mooncake)
    emit(result + meta, args.json,
         lambda rows: "\n".join(x for x in (bench.human(result) if result else "",
                                              store_meta.human(meta)) if x))
    return 0
