"""``pymooncake conductor``: the Conductor and the OpenAI front door in one process.

Start-up order, so that ``/health`` tells the truth from the first moment it answers:

1. flags checked, ``--model`` resolved (``engine.model.registry``), ``--profile`` fitted;
2. the HTTP socket and the workers' RPC endpoint listen; the ``{"event": "ready", ...}``
   line (port, worker port, url) goes to stdout — the *process* is up, workers may join;
3. the tokenizer + chat template load in a thread; until they have and until at least one
   prefill and one decode worker (colocated: one worker) registered, ``/health`` is 503
   with ``waiting_for`` and requests are 503 ``not_ready``; then ``/health`` is 200.

docs/serving.md, "Running".
"""

from __future__ import annotations

import argparse
import contextlib
import json
from typing import Any

from pymooncake.cli.common import port_arg
from pymooncake.cli.role_common import (
    POLICY_CHOICES,
    add_model_flag,
    add_otel_flag,
    check_reachable,
    print_ready,
    resolve_model_arg,
    start_tracing,
)

HTTP_KEEP_ALIVE_S = 75
"""How long the OpenAI front door keeps an idle HTTP/1.1 connection open. Longer than the
clients' own idle limit on purpose (httpx: 5 s, aiohttp: 15 s): with uvicorn's default of
5 s the server closed idle connections at the very moment a client reused them, and that
client's next POST got a reset connection (``httpx.ReadError``, no response) — 12 of 200
requests in a loopback test reusing connections idle 4.97-5.03 s, 0 of 154 with 75 s (the
short soak's ``no response: ReadError``: its load client is httpx). A client that closes
first never races the server."""


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``conductor``."""
    c = subparsers.add_parser(
        "conductor", help="run the Conductor and the OpenAI API front door",
        description="The Conductor (placement, early rejection, dispatch) and the OpenAI "
                    "HTTP API in one process; workers register on --worker-port. /health is "
                    "503 (with what it waits for) until the tokenizer is loaded and a prefill "
                    "and a decode worker (--colocated: one worker) have registered.")
    c.add_argument("--host", default="127.0.0.1")
    c.add_argument("--port", type=port_arg, default=8000, help="HTTP port (0 = any free port)")
    c.add_argument("--worker-port", type=port_arg, default=50060,
                   help="RPC port workers register on (0 = any free port)")
    c.add_argument("--policy", default="global-cache", choices=POLICY_CHOICES)
    c.add_argument("--colocated", action="store_true",
                   help="workers prefill and decode together (baseline)")
    c.add_argument("--ttft-slo", type=float, default=10.0, help="TTFT objective (s)")
    c.add_argument("--tbt-slo", type=float, default=1.0, help="TBT objective (s)")
    c.add_argument("--no-early-rejection", action="store_true", help="admit everything")
    c.add_argument("--global-store", action=argparse.BooleanOptionalAction, default=None,
                   help="cross-instance reuse through the Store (default: on for "
                        "global-cache only)")
    c.add_argument("--prefill-concurrency-limit", type=int, default=None,
                   help="requests per prefill instance before sheddable ones are refused")
    c.add_argument("--profile", default=None, help="prefill profile JSON (pymooncake profile)")
    c.add_argument("--store-master", default=None, metavar="URL",
                   help="etcd://host:port[/cluster_id] of the Store's HA masters: the "
                   "store-tier view is rebuilt on each change of their leader")
    add_model_flag(c)
    c.add_argument("--master", default=None, metavar="HOST:PORT",
                   help="the Store master, which copies hot blocks to more prefill "
                        "instances (hot-block replication; none without it)")
    c.add_argument("--hot-replication", action=argparse.BooleanOptionalAction, default=True,
                   help="hot-block replication (on by default; needs --master and the "
                        "global Store)")
    c.add_argument("--hot-replication-budget", type=int, default=256 << 20, metavar="BYTES",
                   help="most bytes the replicas it makes may hold at once")
    c.add_argument("--hot-min-accesses", type=int, default=2, metavar="N",
                   help="reuses within --hot-window that make a block hot")
    c.add_argument("--hot-max-replicas", type=int, default=None, metavar="N",
                   help="most holders per block (default: every prefill instance)")
    c.add_argument("--hot-window", type=float, default=60.0, metavar="S",
                   help="sliding window of the reuse counts (s)")
    c.add_argument("--context-length", type=int, default=8192)
    c.add_argument("--max-concurrency", type=int, default=64)
    c.add_argument("--queue-capacity", type=int, default=256)
    c.add_argument("--queue-timeout", type=float, default=30.0, metavar="S")
    add_otel_flag(c)
    c.set_defaults(handler=_cmd_conductor)


def load_codec(source: Any, model: str) -> Any:
    """The model's tokenizer + chat template for the front door
    (``engine.model.tokenizer.load_tokenizer`` of ``source``, the ``resolve_model_arg`` of
    ``--model`` ``model``; no torch)."""
    from pymooncake.cli.main import CommandError
    from pymooncake.engine.model.tokenizer import load_tokenizer
    try:
        return load_tokenizer(source)
    except (OSError, ValueError) as e:
        raise CommandError(f"--model {model}: cannot load its tokenizer: {e}") from None


def load_profile(path: str) -> Any:
    """A ``PrefillEstimator`` fitted from a ``pymooncake profile`` JSON."""
    from pymooncake.cli.main import CommandError
    from pymooncake.conductor.policy import fit_prefill_estimator
    try:
        with open(path) as f:
            doc = json.load(f)
        samples = [(int(s["num_tokens"]), int(s["num_prefix_tokens"]), float(s["seconds"]))
                   for s in doc["samples"]]
        return fit_prefill_estimator(samples, with_overhead=True)
    except (OSError, KeyError, ValueError, TypeError) as e:
        raise CommandError(f"--profile {path}: {e}") from None


def _cmd_conductor(args: argparse.Namespace) -> int:
    from pymooncake.cli.main import CommandError, UsageError, require_extras
    source = resolve_model_arg(args.model)
    require_extras("fastapi", "uvicorn")
    import asyncio

    from pymooncake.api.admission import AdmissionConfig
    from pymooncake.api.server import ApiConfig, create_app, listen_socket
    from pymooncake.conductor.config import ConductorConfig
    from pymooncake.conductor.service import Conductor
    try:
        cfg = ConductorConfig(policy=args.policy, colocated=args.colocated,
                              ttft_slo_s=args.ttft_slo, tbt_slo_s=args.tbt_slo,
                              early_rejection=not args.no_early_rejection,
                              global_store=args.global_store,
                              context_length=args.context_length,
                              prefill_concurrency_limit=args.prefill_concurrency_limit,
                              store_master=args.store_master, master=args.master,
                              hot_replication=args.hot_replication,
                              hot_replication_budget_bytes=args.hot_replication_budget,
                              hot_min_accesses=args.hot_min_accesses,
                              hot_max_replicas=args.hot_max_replicas,
                              hot_window_s=args.hot_window)
        aliases = (args.model,) if args.model != source.served_name else ()
        api_cfg = ApiConfig(model_name=source.served_name, model_aliases=aliases,
                            context_length=args.context_length,
                            admission=AdmissionConfig(max_concurrency=args.max_concurrency,
                                                      queue_capacity=args.queue_capacity,
                                                      queue_timeout_s=args.queue_timeout))
    except ValueError as e:
        raise UsageError(str(e)) from None
    est = load_profile(args.profile) if args.profile else None
    for flag, value in (("--master", args.master), ("--store-master", args.store_master)):
        if value:
            check_reachable("conductor", flag, value)
    try:
        sock = listen_socket(args.host, args.port)
    except OSError as e:
        raise CommandError(f"--host {args.host} --port {args.port}: cannot listen: "
                           f"{e.strerror or e}") from None

    async def main() -> None:
        import uvicorn
        cond = Conductor(cfg, args.host, args.worker_port, est)
        try:
            await cond.start()
        except OSError as e:
            sock.close()
            raise CommandError(f"--worker-port {args.worker_port}: cannot listen: "
                               f"{e.strerror or e}") from None
        app = create_app(cond, None, api_cfg, health=cond.health, readiness=cond.waiting_for)
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off",
                                               timeout_graceful_shutdown=2,
                                               timeout_keep_alive=HTTP_KEEP_ALIVE_S))
        task = asyncio.ensure_future(server.serve(sockets=[sock]))
        codec = asyncio.ensure_future(asyncio.to_thread(load_codec, source, args.model))
        while not server.started and not task.done():
            await asyncio.sleep(0.02)
        if not task.done():
            print_ready({"port": sock.getsockname()[1], "worker_port": cond.port,
                         "url": f"http://{args.host}:{sock.getsockname()[1]}",
                         "model": source.served_name})
        try:
            await asyncio.wait({codec, task}, return_when=asyncio.FIRST_COMPLETED)
            if codec.done():
                app.state.codec = codec.result()   # /health can turn 200 from now on
            await task
        finally:
            server.should_exit = True
            codec.cancel()
            with contextlib.suppress(BaseException):
                await task
            await cond.stop()
            sock.close()

    from pymooncake.obs.tracing import shutdown_tracing
    start_tracing(args, "conductor")
    try:
        asyncio.run(main())
    finally:
        shutdown_tracing()
    return 0
