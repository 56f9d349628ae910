"""``pymooncake metadata-server``, ``pymooncake transfer ...`` and ``pymooncake bench transfer``."""

from __future__ import annotations

import argparse
from typing import Any

from pymooncake.cli.common import add_group, add_json_flag, emit


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``pymooncake metadata-server`` and ``pymooncake transfer topology``."""
    md = subparsers.add_parser(
        "metadata-server", help="run the Mooncake-style HTTP metadata server",
        description="Serve GET/PUT/DELETE /metadata?key=K (Mooncake's HTTP metadata protocol) "
                    "plus leases and watches, until interrupted. Clients use "
                    "http://HOST:PORT/metadata.")
    md.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    md.add_argument("--port", type=int, default=8080, help="port (default 8080; 0 = any)")
    md.set_defaults(handler=_cmd_metadata_server)

    tr = add_group(subparsers, "transfer", "Transfer Engine: topology and tools")
    topo = tr.add_parser(
        "topology", help="print the NUMA/NIC topology matrix the Transfer Engine uses",
        description="Discover NUMA nodes and network devices from /sys (or read --file, a "
                    "JSON override like {\"cpu:0\": [[\"eth0\"], [\"eth1\"]]}) and print the "
                    "preferred and secondary devices per memory location.")
    topo.add_argument("--file", default=None, metavar="PATH", help="JSON topology override")
    add_json_flag(topo)
    topo.set_defaults(handler=_cmd_topology)
    _add_bench(tr, "bench")  # ``pymooncake transfer bench`` = ``pymooncake bench transfer``


def _cmd_metadata_server(args: argparse.Namespace) -> int:
    import signal

    from pymooncake.cli.main import CommandError, UsageError
    from pymooncake.metadata.http import MetadataHttpServer

    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port must be in 0..65535, got {args.port}")
    try:
        server = MetadataHttpServer(args.host, args.port)
    except OSError as e:
        raise CommandError(f"cannot listen on {args.host}:{args.port}: {e.strerror}") from e
    def on_sigterm(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_sigterm)
    print(f"metadata server listening on {server.url}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return 0


def _cmd_topology(args: argparse.Namespace) -> int:
    from pymooncake.cli.main import CommandError
    from pymooncake.transfer.topology import get_topology

    try:
        topo = get_topology(args.file)
    except ValueError as e:
        raise CommandError(str(e)) from e

    def human(p: dict[str, Any]) -> str:
        lines = [f"topology (source: {p['source']})"]
        for loc, (pref, sec) in p["matrix"].items():
            lines.append(f"  {loc}: preferred={','.join(pref) or '-'} "
                         f"secondary={','.join(sec) or '-'}")
        if p.get("virtual"):
            lines.append(f"  virtual (not used for paths): {','.join(p['virtual'])}")
        return "\n".join(lines)

    emit(topo.to_json(), args.json, human)
    return 0


def register_bench(bench: argparse._SubParsersAction) -> None:
    """Add ``pymooncake bench transfer``."""
    _add_bench(bench, "transfer")


def _add_bench(sub: argparse._SubParsersAction, name: str) -> None:
    p = sub.add_parser(
        name, help="Transfer Engine throughput vs memcpy, plain sockets and Mooncake",
        description="Write a working set of BATCH requests of SIZE bytes into another "
                    "process's registered memory and read it back (verified). Every subject "
                    "(our engine, memcpy, plain sockets with as many connections as --paths, "
                    "Mooncake's engine when its wheel is importable) is set up once and "
                    "every repeat takes single rounds of them in turn; figures are median "
                    "[quartiles] over the repeats, ratios are "
                    "taken per repeat and judged 'met', 'missed' or 'not distinguishable'.")
    p.add_argument("--transport", choices=("local", "shm", "cma", "tcp"), default="tcp",
                   help="local: same engine; shm: target in shared memory of another "
                        "process; cma: target in ordinary memory of another process, one "
                        "kernel copy (process_vm_writev); tcp: sockets to another process "
                        "(default)")
    p.add_argument("--size", type=int, default=1 << 20, metavar="BYTES",
                   help="bytes per request (default 1 MiB)")
    p.add_argument("--batch", type=int, default=16, metavar="N",
                   help="requests per batch (default 16)")
    p.add_argument("--paths", type=int, default=2, metavar="K",
                   help="TCP connections per peer, and of the socket reference (default 2)")
    p.add_argument("--min-time-s", type=float, default=1.0,
                   help="each repeat alternates single rounds of the subjects, as many "
                        "of each, for at least this long times the number of subjects and "
                        "3 rounds each (default 1 s)")
    p.add_argument("--repeat", type=int, default=3,
                   help="interleaved repeats of every subject; medians reported (default 3)")
    p.add_argument("--no-mooncake", action="store_true",
                   help="skip the Mooncake comparison even when the wheel is installed")
    p.add_argument("--mooncake-python", default=None, metavar="PYTHON",
                   help="interpreter whose venv has mooncake-transfer-engine-non-cuda "
                        "(default: $PYMOONCAKE_MOONCAKE_PYTHON, else this one)")
    add_json_flag(p)
    p.set_defaults(handler=_cmd_bench_transfer)


def _cmd_bench_transfer(args: argparse.Namespace) -> int:
    from pymooncake.bench import transfer as bench
    from pymooncake.cli.main import CommandError, UsageError

    for flag, value in (("--size", args.size), ("--batch", args.batch),
                        ("--paths", args.paths), ("--repeat", args.repeat),
                        ("--min-time-s", args.min_time_s)):
        if not value > 0:  # also catches NaN
            raise UsageError(f"{flag} must be positive, got {value}")
    try:
        result = bench.run(args.transport, args.size, args.batch, args.paths,
                           min_time_s=args.min_time_s, compare_mooncake=not args.no_mooncake,
                           repeat=args.repeat, mooncake_python=args.mooncake_python)
    except ValueError as e:
        raise UsageError(str(e)) from e
    except (OSError, RuntimeError) as e:
        raise CommandError(f"benchmark failed: {e}") from e
    emit(bench.to_json(result), args.json, bench.format_human)
    return 0 if result.verified else 1
