"""``pymooncake prefill | decode``: one engine worker of a serving cluster.

A worker loads the model, registers with the Conductor (``--conductor host:port``), then
prints ``{"event": "ready", ...}`` and serves until SIGTERM/SIGINT. ``decode --colocated``
is the non-disaggregated baseline (prefill and decode in one worker). docs/serving.md.
"""

from __future__ import annotations

import argparse
from typing import Any

from pymooncake.cli.common import port_arg
from pymooncake.cli.cpp_worker import add_cpp_worker_flags, cpp_worker_config
from pymooncake.cli.role_common import (
    add_engine_flags,
    add_otel_flag,
    check_engine_flags,
    print_ready,
    resolve_model_arg,
    run_until_signal,
    start_tracing,
)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``prefill`` and ``decode``."""
    for role in ("prefill", "decode"):
        w = subparsers.add_parser(
            role, help=f"run a {role} worker",
            description=f"An engine worker in the {role} role; registers with the Conductor.")
        w.add_argument("--id", required=True, help="instance id (unique in the cluster)")
        w.add_argument("--conductor", required=True, help="host:port of the Conductor's "
                       "worker endpoint")
        w.add_argument("--metadata", default="http://127.0.0.1:8080/metadata",
                       help="Transfer Engine metadata URL (http://…, etcd://…)")
        w.add_argument("--host", default="127.0.0.1")
        w.add_argument("--port", type=port_arg, default=0, help="RPC port (0 = any free port)")
        w.add_argument("--register-timeout", type=float, default=60.0, metavar="S",
                       help="exit when the Conductor was not reachable for S seconds after "
                            "start (default 60)")
        if role == "prefill":
            w.add_argument("--master", default=None,
                           help="host:port of the Store master (omit: no global Store)")
            w.add_argument("--global-segment-size", type=int, default=None,
                           help="DRAM contributed to the Store (bytes; default: sized from "
                                "the model's KV bytes per token, twice the paged cache)")
            w.add_argument("--prefill-batch", type=int, default=1,
                           help="prompts prefilled together at most (1 = one at a time, "
                                "first come first served: the queue Algorithm 1 predicts)")
            w.add_argument("--no-layerwise-kv", action="store_true",
                           help="ship the prompt KV in one batch after the prefill instead of "
                                "layer by layer during it")
            add_cpp_worker_flags(w)
        else:
            w.add_argument("--colocated", action="store_true",
                           help="prefill and decode here (baseline; no KV is received)")
            w.add_argument("--decode-step-interval-s", type=float, default=0.0, metavar="S",
                           help="while requests decode, start a step at most every S seconds, "
                                "so requests arriving meanwhile share it (fewer weight "
                                "passes; after the first, tokens come about S or more apart); in "
                                "[0, 10]. 0 = off (default)")
            w.add_argument("--recv-buffer-size", type=int, default=None,
                           help="receive arena for P→D KV (bytes; default: sized from the "
                                "model's KV bytes per token)")
        w.add_argument("--no-prefix-cache", action="store_true",
                       help="disable the local prefix cache")
        add_engine_flags(w)
        add_otel_flag(w)
        w.set_defaults(handler=_cmd_worker, role=role)


def _cmd_worker(args: argparse.Namespace) -> int:
    from pymooncake.cli.main import UsageError, require_extras
    check_engine_flags(args, (("--prefill-batch", getattr(args, "prefill_batch", 1)),))
    resolve_model_arg(args.model)
    require_extras("torch")
    cpp = cpp_worker_config(args) if args.role == "prefill" else None
    from pymooncake.engine.worker.base import WorkerConfig
    role = "colocated" if getattr(args, "colocated", False) else args.role
    try:
        cfg = WorkerConfig(
            instance_id=args.id, role=role, conductor=args.conductor,
            metadata_url=args.metadata, master=getattr(args, "master", None), host=args.host,
            port=args.port, model=args.model, num_kv_blocks=args.num_kv_blocks,
            block_size=args.block_size, max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens, num_threads=args.threads,
            decode_step_tokens=args.decode_step_tokens, decode_step_s=args.decode_step_s,
            prefill_hold_s=args.prefill_hold_s,
            decode_step_interval_s=getattr(args, "decode_step_interval_s", 0.0),
            max_model_len=args.max_model_len, enable_prefix_caching=not args.no_prefix_cache,
            global_segment_size_bytes=getattr(args, "global_segment_size", None),
            recv_buffer_bytes=getattr(args, "recv_buffer_size", None),
            layerwise_kv=not getattr(args, "no_layerwise_kv", False),
            prefill_batch=getattr(args, "prefill_batch", 1),
            prefill_order=args.prefill_order, aging_tokens_per_s=args.aging_tokens_per_s,
            startup_profile_tokens=args.startup_profile_tokens,
            register_timeout_s=args.register_timeout)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if cpp is not None:
        from pymooncake.engine.worker.cpp_prefill import CppPrefillWorker
        worker: Any = CppPrefillWorker(cfg, cpp)
    elif role == "prefill":
        from pymooncake.engine.worker.prefill import PrefillWorker
        worker = PrefillWorker(cfg)
    else:
        from pymooncake.engine.worker.decode import DecodeWorker
        worker = DecodeWorker(cfg)
    from pymooncake.cli.main import CommandError
    from pymooncake.engine.cpp.group import CppError
    from pymooncake.engine.model.loader import ModelLoadError
    from pymooncake.engine.worker.base import WorkerFatal
    from pymooncake.metadata import MetadataError
    from pymooncake.obs.tracing import shutdown_tracing
    from pymooncake.store.errors import StoreError
    from pymooncake.transfer.batch import TransferError
    start_tracing(args, role)
    try:
        return run_until_signal(lambda: worker.serve(print_ready))
    except MetadataError as e:   # its Transfer Engine publishes its segment there first
        raise CommandError(f"{role} {args.id}: cannot use the metadata service --metadata "
                           f"{args.metadata}: {e}") from None
    except StoreError as e:      # the Store client (prefill --master) joining the master
        where = f"Store master --master {args.master}: " if getattr(args, "master", None) else ""
        raise CommandError(f"{role} {args.id}: {where}{e}") from None
    except (WorkerFatal, TransferError, OSError, ModelLoadError, CppError) as e:
        # cannot start or cannot join (Store master, metadata service or Conductor refused
        # or unreachable, segment name taken, model file unreadable): one line, not a
        # traceback
        raise CommandError(f"{role} {args.id}: {e}") from None
    finally:
        shutdown_tracing()
