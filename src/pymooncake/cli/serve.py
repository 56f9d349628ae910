"""``pymooncake serve``: a whole P/D serving cluster on localhost, as separate processes.

Starts the Store master (with its HTTP metadata server), the Conductor with the OpenAI front
door, N prefill and M decode workers (``cli.cluster.LocalCluster``), prints one JSON
``ready`` line with the URL once ``/health`` is 200 (every worker registered, tokenizer
loaded), and stops every child on Ctrl-C/SIGTERM. ``--demo`` runs ``cli.demo`` against it
and stops. The roles it starts are ``cli.conductor`` and ``cli.worker``; they can be
started by hand to form one cluster across hosts. DESIGN.md §1, docs/serving.md.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from pymooncake.cli.cluster import ClusterSpec, LocalCluster
from pymooncake.cli.common import add_json_flag
from pymooncake.cli.cpp_worker import add_cpp_worker_flags, cpp_worker_argv, cpp_worker_config
from pymooncake.cli.p2p import add_p2p_model_flags, apply_p2p_model
from pymooncake.cli.role_common import (
    POLICY_CHOICES,
    add_engine_flags,
    add_otel_flag,
    check_engine_flags,
    print_ready,
    resolve_model_arg,
    start_tracing,
)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``serve``."""
    s = subparsers.add_parser(
        "serve", help="start a whole P/D cluster on localhost (the main job)",
        description="Start the Store master (+ HTTP metadata), the Conductor with the OpenAI "
                    "API, N prefill and M decode workers as separate processes on 127.0.0.1; "
                    "Ctrl-C stops them all. --demo sends a few requests and a short trace "
                    "replay, prints the results and exits.")
    s.add_argument("--port", type=int, default=8000,
                   help="HTTP port of the OpenAI API (default %(default)s; 0 = any free port)")
    s.add_argument("--prefill", type=int, default=1, help="prefill workers (N; default 1)")
    s.add_argument("--decode", type=int, default=None, help="decode workers (M; default 1)")
    s.add_argument("--colocated", action="store_true",
                   help="baseline: --prefill N workers that prefill and decode together")
    s.add_argument("--no-prefix-cache", action="store_true",
                   help="colocated baseline without the local prefix cache")
    s.add_argument("--policy", default="global-cache", choices=POLICY_CHOICES,
                   help="prefill placement (default: global-cache = Algorithm 1)")
    s.add_argument("--global-store", action=argparse.BooleanOptionalAction, default=None,
                   help="cross-instance reuse through the Store (default: on for "
                        "global-cache only)")
    s.add_argument("--ttft-slo", type=float, default=10.0,
                   help="TTFT objective (s; default %(default)s)")
    s.add_argument("--tbt-slo", type=float, default=1.0,
                   help="TBT objective (s; default %(default)s)")
    s.add_argument("--decode-step-interval-s", type=float, default=0.0, metavar="S",
                   help="decode workers: while requests decode, start a step at most every S "
                        "seconds, so requests arriving meanwhile share it (fewer weight "
                        "passes; after the first, tokens come about S or more apart); in "
                        "[0, 10] and below --tbt-slo. 0 = off (default)")
    s.add_argument("--profile", default=None, help="prefill profile JSON (pymooncake profile)")
    s.add_argument("--max-concurrency", type=int, default=64,
                   help="front-door admission: requests in flight at once (default "
                        "%(default)s)")
    s.add_argument("--metadata", default=None,
                   help="Transfer Engine metadata service for the workers (etcd://host:port, "
                        "http://…/metadata); default: the master's embedded HTTP one")
    s.add_argument("--demo", action="store_true",
                   help="send a few chat requests and a short trace replay, print, stop")
    add_engine_flags(s)
    add_cpp_worker_flags(s)
    add_p2p_model_flags(s)
    add_otel_flag(s)
    add_json_flag(s)
    s.set_defaults(handler=_cmd_serve)


def _check_serve_flags(args: argparse.Namespace) -> None:
    """Refuse bad ``serve`` flags before any child starts (exit 2, one line naming the flag)
    rather than letting a child fail with a traceback."""
    from pymooncake.cli.main import UsageError
    if args.colocated and args.decode is not None:
        raise UsageError("--decode does not apply with --colocated (--prefill N colocated "
                         "workers prefill and decode)")
    if args.no_prefix_cache and not args.colocated:
        raise UsageError("--no-prefix-cache is for the --colocated baseline; P/D prefill "
                         "workers always keep their local prefix cache")
    if args.json and not args.demo:
        raise UsageError("--json only applies to --demo (serve prints one JSON 'ready' line "
                         "on stdout anyway)")
    if args.decode is None:
        args.decode = 1
    if args.prefill < 1 or (not args.colocated and args.decode < 1):
        raise UsageError("need --prefill >= 1 and --decode >= 1 (or --colocated)")
    if args.metadata and not args.metadata.startswith(("etcd://", "http://", "https://")):
        raise UsageError(f"--metadata must be etcd://host:port or http(s)://…, got "
                         f"{args.metadata!r}")
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port must be in 0..65535, got {args.port}")
    resolve_model_arg(args.model)     # exit 1 naming --model (missing file or package)
    check_engine_flags(args, (("--max-concurrency", args.max_concurrency),))
    for flag, f in (("--ttft-slo", args.ttft_slo), ("--tbt-slo", args.tbt_slo)):
        if not f > 0:
            raise UsageError(f"{flag} must be > 0 seconds, got {f}")
    from pymooncake.engine.worker.config import MAX_DECODE_STEP_INTERVAL_S
    if not 0 <= args.decode_step_interval_s <= MAX_DECODE_STEP_INTERVAL_S:
        raise UsageError(f"--decode-step-interval-s must be in [0, {MAX_DECODE_STEP_INTERVAL_S:g}] "
                         f"seconds, got {args.decode_step_interval_s}")
    if args.decode_step_interval_s >= args.tbt_slo:
        raise UsageError(f"--decode-step-interval-s ({args.decode_step_interval_s} s) must be "
                         f"below --tbt-slo ({args.tbt_slo} s): every request would miss it")
    if args.decode_step_interval_s and args.colocated:
        raise UsageError("--decode-step-interval-s paces decode workers; it does not apply with "
                         "--colocated")
    if args.cpp_stages is not None and args.colocated:
        raise UsageError("--cpp-stages adds a CPP prefill group to a P/D cluster; it "
                         "does not apply with --colocated")
    cpp_worker_config(args)     # exit 2 naming the --cpp-* flag (one without --cpp-stages)


def _cmd_serve(args: argparse.Namespace) -> int:
    from pymooncake.cli.main import CommandError, require_extras
    apply_p2p_model(args)       # --p2p-model: pull the checkpoint, args.model = its dir
    _check_serve_flags(args)
    require_extras("torch", "fastapi", "uvicorn")   # the children's, named here in one line
    spec = ClusterSpec(num_prefill=args.prefill, num_decode=0 if args.colocated else args.decode,
                       colocated=args.colocated, prefix_cache=not args.no_prefix_cache,
                       policy=args.policy, model=args.model, port=args.port,
                       num_kv_blocks=args.num_kv_blocks, block_size=args.block_size,
                       max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                       max_num_batched_tokens=args.max_num_batched_tokens,
                       num_threads=args.threads, decode_step_tokens=args.decode_step_tokens,
                       decode_step_s=args.decode_step_s, prefill_hold_s=args.prefill_hold_s,
                       decode_step_interval_s=args.decode_step_interval_s,
                       prefill_order=args.prefill_order,
                       aging_tokens_per_s=args.aging_tokens_per_s,
                       startup_profile_tokens=args.startup_profile_tokens,
                       ttft_slo_s=args.ttft_slo,
                       tbt_slo_s=args.tbt_slo, profile=args.profile,
                       max_concurrency=args.max_concurrency, quiet=args.demo,
                       global_store=args.global_store, otel=args.otel, metadata=args.metadata,
                       cpp_argv=cpp_worker_argv(args) if args.cpp_stages is not None else [])
    import signal

    from pymooncake.obs.tracing import shutdown_tracing
    start_tracing(args, "serve")
    cluster = LocalCluster(spec)

    def _stop(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)   # also when started with SIGINT ignored (nohup, &)
    try:
        try:
            cluster.start()
        except (RuntimeError, TimeoutError) as e:
            raise CommandError(f"cluster did not start: {e}") from None
        if args.demo:
            from pymooncake.cli.demo import run_demo
            return run_demo(cluster.url, args.json)
        print_ready({"url": cluster.url, "model": cluster.model_name, "pids": cluster.pids()})
        sys.stderr.write(f"pymooncake: serving {cluster.model_name} with the OpenAI API on "
                         f"{cluster.url} (Ctrl-C stops the cluster)\n")
        cluster.wait()          # returns only when the cluster cannot serve any more
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        cluster.stop()
        shutdown_tracing()
