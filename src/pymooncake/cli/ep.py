"""``pymooncake ep ...``: elastic expert parallelism (docs/ep.md).

``rank`` serves experts (one JSON ``ready`` line with its port, then until SIGTERM);
``serve`` runs the front (engine + dispatcher + RPC API; one ``ready`` line); ``generate``
and ``status`` are its clients; ``bench`` measures recovery time and degraded throughput
(``pymooncake.bench.ep``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from typing import Any

from pymooncake.cli.common import add_group, add_json_flag, emit, port_arg
from pymooncake.cli.role_common import run_until_signal


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``pymooncake ep``."""
    g = add_group(subparsers, "ep", "elastic expert parallelism: EP ranks and their front")
    r = g.add_parser("rank", help="an EP rank: holds and computes routed experts",
                     description="Serve the experts the front assigns (RPC control, token "
                                 "rows over the Transfer Engine) until SIGTERM.")
    r.add_argument("--model", default="tiny-moe", help="tiny-moe or a HF MoE directory")
    r.add_argument("--host", default="127.0.0.1")
    r.add_argument("--port", type=port_arg, default=0, help="RPC port (0: a free one)")
    r.set_defaults(handler=_cmd_rank)
    s = g.add_parser("serve", help="the EP front: attention + router here, experts on ranks",
                     description="Run the MoE model with its routed experts on --ranks "
                                 "(none: in this process) and serve ep.generate / ep.status.")
    s.add_argument("--model", default="tiny-moe", help="tiny-moe or a HF MoE directory")
    s.add_argument("--ranks", default="", help="comma-separated host:port of the EP ranks")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=port_arg, default=0, help="RPC port (0: a free one)")
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
    s.add_argument("--take-over", action="store_true",
                   help="claim ranks that still belong to another live front (that front "
                        "loses them); without it such ranks are refused")
    s.set_defaults(handler=_cmd_serve)
    c = g.add_parser("generate", help="greedy generation through an EP front")
    c.add_argument("--server", required=True, help="host:port of `ep serve`")
    c.add_argument("--prompt", default=None)
    c.add_argument("--ids", default=None, help="comma-separated prompt token ids")
    c.add_argument("--max-tokens", type=int, default=16)
    c.add_argument("--timeout", type=float, default=120.0,
                   help="give up after this many seconds (s; the front itself ends a "
                        "request after 60 s)")
    add_json_flag(c)
    c.set_defaults(handler=_cmd_generate)
    st = g.add_parser("status", help="ranks, placement, missing experts of an EP front")
    st.add_argument("--server", required=True)
    st.add_argument("--timeout", type=float, default=10.0, help="give up after (s)")
    add_json_flag(st)  # accepted like every reporting command's; the status is JSON anyway
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
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(f"bad address {s!r}: use host:port")
    return host, int(port)


def _ranks(spec: str) -> list[tuple[str, int]]:
    """``--ranks``: empty for none; otherwise every comma-separated entry a host:port."""
    from pymooncake.cli.main import UsageError
    if not spec.strip():
        return []
    parts = spec.split(",")
    if any(not p.strip() for p in parts):
        raise UsageError(f"--ranks {spec!r}: an empty entry (use host:port,host:port,...)")
    ranks = [_addr(p) for p in parts]
    dup = {a for a in ranks if ranks.count(a) > 1}
    if dup:
        raise UsageError(f"--ranks: {', '.join(f'{h}:{p}' for h, p in sorted(dup))} "
                         "given more than once")
    return ranks


def _bind_error(what: str, host: str, port: int, e: OSError) -> Any:
    from pymooncake.cli.main import CommandError
    from pymooncake.rpc.local import UnixNameTaken
    if isinstance(e, UnixNameTaken):  # the server's own words name the Unix socket
        why = e.strerror
    else:
        why = os.strerror(e.errno).lower() if e.errno else str(e)
    return CommandError(f"{what}: cannot listen on {host}:{port}: {why}")


def _ready(info: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps({"event": "ready", **info}) + "\n")
    sys.stdout.flush()


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

    async def serve() -> None:
        try:
            await svc.server.start()
        except OSError as e:
            raise _bind_error("ep rank", args.host, args.port, e) from None
        await svc.serve(lambda port: _ready(
            {"port": port, "pid": os.getpid(), "incarnation": svc.incarnation}))
    return run_until_signal(serve)


def _cmd_serve(args: argparse.Namespace) -> int:
    from pymooncake.cli.main import CommandError, UsageError
    # flags first: a usage error must not wait for torch's import
    ranks = _ranks(args.ranks)
    if args.slots_per_rank < 1:
        raise UsageError(f"--slots-per-rank must be >= 1, got {args.slots_per_rank}")
    for flag, v in (("--heartbeat", args.heartbeat), ("--deadline", args.deadline)):
        if not v > 0:
            raise UsageError(f"{flag} must be > 0 seconds, got {v:g}")
    import torch

    from pymooncake.engine.ep.dispatch import EPOptions
    from pymooncake.engine.ep.service import EPService
    from pymooncake.engine.model.loader import ModelLoadError
    from pymooncake.metadata import MetadataError
    torch.set_num_threads(1)
    opts = EPOptions(slots_per_rank=args.slots_per_rank, heartbeat_s=args.heartbeat,
                     deadline_s=args.deadline, replan_on_failure=not args.no_replan,
                     take_over=args.take_over)
    svc = EPService(args.model, ranks, options=opts, degraded_topk=args.degraded_topk,
                    metadata=args.metadata)

    async def serve() -> None:
        # bind our own port first: a taken port must fail before any rank is touched
        try:
            server = await svc.listen(args.host, args.port)
        except OSError as e:
            raise _bind_error("ep serve", args.host, args.port, e) from None
        try:
            try:
                await asyncio.get_running_loop().run_in_executor(None, svc.start)
            except MetadataError as e:   # the Transfer Engine publishes its segment there
                raise CommandError(f"ep serve: cannot use the metadata service --metadata "
                                   f"{args.metadata}: {e}") from None
            except (ModelLoadError, RuntimeError) as e:
                raise CommandError(str(e)) from None
        except BaseException:
            await server.stop()
            raise
        await svc.serve(ready=lambda port: _ready(
            {"port": port, "pid": os.getpid(), "ranks": len(ranks)}), server=server)
    try:
        return run_until_signal(serve)
    finally:
        svc.close()


def _timeout(args: argparse.Namespace) -> float:
    from pymooncake.cli.main import UsageError
    if not args.timeout > 0:
        raise UsageError(f"--timeout must be positive, got {args.timeout}")
    return float(args.timeout)


def _call(server: str, method: str, params: Any, timeout_s: float) -> Any:
    """One RPC to an EP front with an overall deadline (a server that accepts the connection
    but never answers, or trickles bytes, cannot hang the client). Its ``ep.status`` is
    asked first, with a short deadline, so a port that is not an EP front fails fast."""
    import threading

    from pymooncake.cli.main import CommandError
    from pymooncake.rpc import RpcError, SyncRpcClient
    host, port = _addr(server)
    client = SyncRpcClient(host, port, timeout_s=timeout_s)

    def bounded(m: str, p: Any, t: float) -> Any:
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["out"] = client.call(m, p, t)
            except BaseException as e:  # noqa: BLE001 (re-raised in the caller's thread)
                box["err"] = e
        th = threading.Thread(target=run, daemon=True)
        th.start()
        th.join(t + 0.5)
        if th.is_alive():
            raise CommandError(f"{server}: no answer to {m} in {t:.3g} s (is it an "
                               "`ep serve` front?)")
        if "err" in box:
            e = box["err"]
            if isinstance(e, RpcError):
                msg = e.message
                if m == "ep.status" and ("no response" in msg or "frame" in msg
                                         or "closed" in msg):
                    msg += " (is it an `ep serve` front?)"
                raise CommandError(msg if server in msg else f"{server}: {msg}")
            raise e
        return box["out"]
    try:
        probe_s = min(timeout_s, 10.0)
        st = bounded("ep.status", None, probe_s)
        if not isinstance(st, dict) or "counters" not in st:
            raise CommandError(f"{server}: not an `ep serve` front (ep.status answered "
                               f"{type(st).__name__})")
        return st if method == "ep.status" else bounded(method, params, timeout_s)
    finally:
        client.close()


def _text(o: dict[str, Any]) -> str:
    text = o["text"] if o["text"] is not None else " ".join(map(str, o["token_ids"]))
    if o.get("degraded"):
        missing = ", ".join(f"layer {a} expert {b}" for a, b in o.get("missing_experts") or [])
        text += ("\n[degraded: some tokens ran without experts that had no live copy"
                 f"{': ' + missing if missing else ''}; output may differ]")
    return text


def _cmd_generate(args: argparse.Namespace) -> int:
    from pymooncake.cli.main import CommandError, UsageError
    params: dict[str, Any] = {"max_tokens": args.max_tokens}
    if args.ids is not None and args.prompt is not None:
        raise UsageError("--prompt and --ids conflict: give one")
    if args.ids is not None:
        try:
            ids = [int(t) for t in args.ids.split(",")]
        except ValueError:
            raise UsageError(f"--ids {args.ids!r}: comma-separated integers") from None
        if any(t < 0 for t in ids):
            raise UsageError("--ids: token ids are >= 0")
        params["prompt_token_ids"] = ids
    elif args.prompt is not None:
        if not args.prompt:
            raise UsageError("--prompt is empty")
        params["prompt"] = args.prompt
    else:
        raise UsageError("give --prompt or --ids")
    if args.max_tokens < 1:
        raise UsageError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    out = _call(args.server, "ep.generate", params, _timeout(args))
    if args.json:
        emit(out, True)
        return 0 if out["error"] is None else 1
    if out["error"] is not None:
        raise CommandError(f"{args.server}: {out['error']}")
    emit(out, False, _text)
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    emit(_call(args.server, "ep.status", None, _timeout(args)), True)
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from pymooncake.bench.ep import check_bench_args, run_bench, summary
    from pymooncake.cli.main import UsageError
    bad = check_bench_args(args)
    if bad is not None:
        raise UsageError(bad)
    res = run_bench(args)
    emit(res, args.json, summary)
    return 0
