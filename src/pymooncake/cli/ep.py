"""``pymooncake ep ...``: elastic expert parallelism (docs/ep.md).

``rank`` serves experts (one JSON ``ready`` line with its port, then until SIGTERM);
``serve`` runs the front (engine + dispatcher + RPC API; one ``ready`` line); ``generate``
and ``status`` are its clients; ``bench`` measures recovery time and degraded throughput
(``pymooncake.bench.ep``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
from typing import Any

from pymooncake.cli.common import add_group, add_json_flag, emit


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``pymooncake ep``."""
    g = add_group(subparsers, "ep", "elastic expert parallelism: EP ranks and their front")
    r = g.add_parser("rank", help="an EP rank: holds and computes routed experts",
                     description="Serve the experts the front assigns (RPC control, token "
                                 "rows over the Transfer Engine) until SIGTERM.")
    r.add_argument("--model", default="tiny-moe", help="tiny-moe or a HF MoE directory")
    r.add_argument("--host", default="127.0.0.1")
    r.add_argument("--port", type=int, default=0, help="RPC port (0: a free one)")
    r.set_defaults(handler=_cmd_rank)
    s = g.add_parser("serve", help="the EP front: attention + router here, experts on ranks",
                     description="Run the MoE model with its routed experts on --ranks "
                                 "(none: in this process) and serve ep.generate / ep.status.")
    s.add_argument("--model", default="tiny-moe", help="tiny-moe or a HF MoE directory")
    s.add_argument("--ranks", default="", help="comma-separated host:port of the EP ranks")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=0)
    s.add_argument("--slots-per-rank", type=int, default=4,
                   help="expert copies per rank and layer (extra ones replicate hot experts)")
    s.add_argument("--heartbeat", type=float, default=0.2, help="heartbeat period (s)")
    s.add_argument("--deadline", type=float, default=1.0,
                   help="a rank silent this long (s) is dead")
    s.add_argument("--no-replan", action="store_true",
                   help="do not re-place a dead rank's experts on the survivors")
    s.add_argument("--degraded-topk", action="store_true",
                   help="tokens whose expert has no live copy use the other top-k experts "
                        "(said in the response) instead of failing")
    s.add_argument("--metadata", default=None,
                   help="metadata service for the Transfer Engine (default: one in-process)")
    s.set_defaults(handler=_cmd_serve)
    c = g.add_parser("generate", help="greedy generation through an EP front")
    c.add_argument("--server", required=True, help="host:port of `ep serve`")
    c.add_argument("--prompt", default=None)
    c.add_argument("--ids", default=None, help="comma-separated prompt token ids")
    c.add_argument("--max-tokens", type=int, default=16)
    add_json_flag(c)
    c.set_defaults(handler=_cmd_generate)
    st = g.add_parser("status", help="ranks, placement, missing experts of an EP front")
    st.add_argument("--server", required=True)
    st.set_defaults(handler=_cmd_status)
    b = g.add_parser("bench", help="recovery time and degraded throughput with a rank killed",
                     description="Starts N ranks and a front on loopback, measures "
                                 "throughput, kills one rank mid-run, measures detection, "
                                 "recovery and the throughput before and after re-placement.")
    from pymooncake.bench.ep import add_bench_args
    add_bench_args(b)
    add_json_flag(b)
    b.set_defaults(handler=_cmd_bench)


def _addr(s: str) -> tuple[str, int]:
    from pymooncake.cli.main import UsageError
    host, _, port = s.strip().rpartition(":")
    if not host or not port.isdigit():
        raise UsageError(f"bad address {s!r}: use host:port")
    return host, int(port)


def _ready(info: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps({"event": "ready", **info}) + "\n")
    sys.stdout.flush()


def _run_until_signal(coro_fn: Any) -> int:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, task.cancel)
        await coro_fn()
    with contextlib.suppress(asyncio.CancelledError, KeyboardInterrupt):
        asyncio.run(main())
    return 0


def _cmd_rank(args: argparse.Namespace) -> int:
    import torch

    from pymooncake.cli.main import CommandError
    from pymooncake.engine.ep.rank import RankService
    from pymooncake.engine.model.loader import ModelLoadError
    torch.set_num_threads(1)
    try:
        svc = RankService(args.model, args.host, args.port)
    except ModelLoadError as e:
        raise CommandError(str(e)) from None
    return _run_until_signal(lambda: svc.serve(
        lambda port: _ready({"port": port, "pid": os.getpid(), "incarnation": svc.incarnation})))


def _cmd_serve(args: argparse.Namespace) -> int:
    import torch

    from pymooncake.cli.main import CommandError, UsageError
    from pymooncake.engine.ep.dispatch import EPOptions
    from pymooncake.engine.ep.service import EPService
    from pymooncake.engine.model.loader import ModelLoadError
    torch.set_num_threads(1)
    ranks = [_addr(a) for a in args.ranks.split(",") if a.strip()]
    if args.slots_per_rank < 1 or not args.heartbeat > 0 or not args.deadline > 0:
        raise UsageError("--slots-per-rank, --heartbeat and --deadline must be positive")
    opts = EPOptions(slots_per_rank=args.slots_per_rank, heartbeat_s=args.heartbeat,
                     deadline_s=args.deadline, replan_on_failure=not args.no_replan)
    svc = EPService(args.model, ranks, options=opts, degraded_topk=args.degraded_topk,
                    metadata=args.metadata)
    try:
        svc.start()
    except (ModelLoadError, RuntimeError) as e:
        raise CommandError(str(e)) from None
    try:
        return _run_until_signal(lambda: svc.serve(args.host, args.port, lambda port: _ready(
            {"port": port, "pid": os.getpid(), "ranks": len(ranks)})))
    finally:
        svc.close()


def _client(server: str) -> Any:
    from pymooncake.rpc import SyncRpcClient
    host, port = _addr(server)
    return SyncRpcClient(host, port, timeout_s=120.0)


def _cmd_generate(args: argparse.Namespace) -> int:
    from pymooncake.cli.main import CommandError, UsageError
    from pymooncake.rpc import RpcError
    params: dict[str, Any] = {"max_tokens": args.max_tokens}
    if args.ids:
        try:
            params["prompt_token_ids"] = [int(t) for t in args.ids.split(",")]
        except ValueError:
            raise UsageError("--ids: comma-separated integers") from None
    elif args.prompt is not None:
        params["prompt"] = args.prompt
    else:
        raise UsageError("give --prompt or --ids")
    try:
        out = _client(args.server).call("ep.generate", params)
    except RpcError as e:
        raise CommandError(f"{args.server}: {e.message}") from None
    emit(out, args.json, lambda o: o["text"] if o["error"] is None else f"error: {o['error']}")
    return 0 if out["error"] is None else 1


def _cmd_status(args: argparse.Namespace) -> int:
    from pymooncake.cli.main import CommandError
    from pymooncake.rpc import RpcError
    try:
        emit(_client(args.server).call("ep.status"), True)
    except RpcError as e:
        raise CommandError(f"{args.server}: {e.message}") from None
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from pymooncake.bench.ep import run_bench, summary
    res = run_bench(args)
    emit(res, args.json, summary)
    return 0
