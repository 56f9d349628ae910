"""``pymooncake p2p ...``: the P2P Store from the shell (docs/p2p.md).

``register NAME PATH...`` publishes and then serves until Ctrl-C/SIGTERM (one JSON
``ready`` line on stdout); ``get NAME DIR`` pulls a replica (``--hold``: and keeps serving
it); ``list``; ``unregister NAME``. ``pymooncake bench p2p`` is the namespaced benchmark
(``pymooncake.bench.p2p``). ``serve --p2p-model NAME`` uses :func:`apply_p2p_model`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from typing import Any

from pymooncake.cli.common import add_group, add_json_flag, emit

METADATA_ENV = "PYMOONCAKE_P2P_METADATA"


def _common(p: argparse.ArgumentParser, host: bool = True) -> None:
    p.add_argument("--metadata", default=os.environ.get(METADATA_ENV),
                   help=f"metadata service: etcd://host:port or http://host:port/metadata "
                        f"(default: env {METADATA_ENV})")
    if host:
        p.add_argument("--host", default="127.0.0.1",
                       help="address peers reach this process at (default %(default)s)")
        p.add_argument("--ttl", type=float, default=5.0,
                       help="holder lease (s): a dead peer is forgotten after this long")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``pymooncake p2p``."""
    g = add_group(subparsers, "p2p", "P2P Store: distribute checkpoints peer to peer")
    r = g.add_parser("register", help="publish files/directories under a name and serve them",
                     description="Publish metadata only (shards, sizes, BLAKE3, holder) and "
                                 "serve the bytes until Ctrl-C/SIGTERM.")
    r.add_argument("name")
    r.add_argument("paths", nargs="+", help="files or directories (walked)")
    r.add_argument("--shard-size", type=float, default=4.0, help="shard size in MiB (default 4)")
    _common(r)
    r.set_defaults(handler=_cmd_register)
    p = g.add_parser("get", help="pull a replica from every holder, verify, become a holder",
                     description="Pull NAME into DIR from every current holder in parallel; "
                                 "files appear in DIR only once every shard is verified. "
                                 "Prints the pull's figures (JSON with --json).")
    p.add_argument("name")
    p.add_argument("dir")
    p.add_argument("--parallel", type=int, default=8,
                   help="shards in flight: 1..64, one thread each (default 8)")
    p.add_argument("--stall-timeout", type=float, default=10.0,
                   help="give up after this many seconds with no holder (default 10)")
    p.add_argument("--max-rate", type=float, default=None,
                   help="limit the pull to this many MiB/s")
    p.add_argument("--no-share", action="store_true",
                   help="do not serve what was pulled (a leecher; the bench's baseline)")
    p.add_argument("--hold", action="store_true",
                   help="keep serving the replica after the pull, until Ctrl-C/SIGTERM")
    p.add_argument("--start-at", type=float, default=None, help=argparse.SUPPRESS)
    p.add_argument("--while-pid", type=int, default=None, help=argparse.SUPPRESS)
    _common(p)
    add_json_flag(p)
    p.set_defaults(handler=_cmd_get)
    ls = g.add_parser("list", help="registered payloads and their holders")
    ls.add_argument("--prefix", default="")
    _common(ls, host=False)
    add_json_flag(ls)
    ls.set_defaults(handler=_cmd_list)
    u = g.add_parser("unregister", help="withdraw a payload (its manifest and every holder)")
    u.add_argument("name")
    _common(u, host=False)
    u.set_defaults(handler=_cmd_unregister)


def register_bench(bench: argparse._SubParsersAction) -> None:
    """``pymooncake bench p2p`` (the harness is ``pymooncake.bench.p2p``)."""
    from pymooncake.bench.p2p import add_bench_args
    b = bench.add_parser(
        "p2p", help="P2P Store vs every receiver pulling from the seed, namespaced hosts",
        description="Builds one network namespace per host on a bridge, limits every host's "
                    "link with tc, starts etcd, a seed and N receivers of a generated "
                    "safetensors checkpoint; times the P2P pull against every receiver "
                    "pulling from the seed alone, then a P2P run with a holder killed "
                    "mid-distribution. Needs root, ip, tc, etcd.")
    add_bench_args(b)
    add_json_flag(b)
    b.set_defaults(handler=_cmd_bench)


def _open(args: argparse.Namespace, host: bool = True) -> Any:
    from pymooncake.cli.main import CommandError, UsageError
    from pymooncake.metadata import MetadataError
    from pymooncake.p2p import P2PStore
    if not args.metadata:
        raise UsageError(f"--metadata is required (or set {METADATA_ENV}): etcd://host:port "
                         "or http://host:port/metadata")
    if host and not args.ttl > 0:
        raise UsageError(f"--ttl must be > 0 seconds, got {args.ttl}")
    try:
        if host:
            return P2PStore(args.metadata, host=args.host, holder_ttl_s=args.ttl)
        return P2PStore(args.metadata)
    except ValueError as e:
        raise UsageError(f"--metadata: {e}") from None
    except (MetadataError, OSError, TimeoutError) as e:
        raise CommandError(f"cannot start the P2P peer ({args.metadata}): "
                           f"{e or type(e).__name__}") from None


def _errors() -> tuple[type[BaseException], ...]:
    from pymooncake.metadata import MetadataError
    from pymooncake.p2p import P2PError
    return (P2PError, MetadataError, OSError, ValueError)   # OSError: TimeoutError too


def _line(e: BaseException, doing: str = "") -> str:
    """One line for an expected failure: an ``OSError`` from a path (a directory that is a
    file, no permission, disk full) as ``DOING: REASON: 'PATH'``, anything else as is."""
    if isinstance(e, OSError) and e.strerror and not isinstance(e, TimeoutError):
        where = f": {str(e.filename)!r}" if e.filename is not None else ""
        return f"{doing + ': ' if doing else ''}{e.strerror[:1].lower()}{e.strerror[1:]}{where}"
    return str(e) or type(e).__name__


def _serve_forever(store: Any, while_pid: int | None = None) -> int:
    """Serve until SIGINT/SIGTERM (or until process ``while_pid`` is gone)."""
    def _stop(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    try:
        while True:
            time.sleep(1.0 if while_pid else 3600)
            if while_pid:
                try:
                    os.kill(while_pid, 0)
                except ProcessLookupError:
                    return 0
    except KeyboardInterrupt:
        return 0


def _ready(info: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps({"event": "ready", **info}) + "\n")
    sys.stdout.flush()


def _cmd_register(args: argparse.Namespace) -> int:
    from pymooncake.cli.main import CommandError, UsageError
    if not args.shard_size > 0:
        raise UsageError(f"--shard-size must be > 0 MiB, got {args.shard_size}")
    store = _open(args)
    try:
        try:
            m = store.register(args.name, args.paths,
                               shard_bytes=max(1, int(args.shard_size * (1 << 20))))
        except _errors() as e:
            raise CommandError(_line(e, f"cannot register {args.name!r}")) from None
        _ready({"name": m.name, "segment": store.segment, "manifest_id": m.manifest_id,
                "total_bytes": m.total_bytes, "num_shards": len(m.shards), "pid": os.getpid()})
        return _serve_forever(store)
    finally:
        store.close()


def _cmd_get(args: argparse.Namespace) -> int:
    from pymooncake.cli.main import CommandError, UsageError
    from pymooncake.p2p import PullOptions
    from pymooncake.p2p.puller import MAX_PARALLEL
    if not 1 <= args.parallel <= MAX_PARALLEL:
        raise UsageError(f"--parallel must be in 1..{MAX_PARALLEL} (shards in flight, one "
                         f"thread each), got {args.parallel}")
    if args.max_rate is not None and not args.max_rate > 0:
        raise UsageError(f"--max-rate must be > 0 MiB/s, got {args.max_rate}")
    if not args.stall_timeout > 0:
        raise UsageError(f"--stall-timeout must be > 0 s, got {args.stall_timeout}")
    opts = PullOptions(parallel=args.parallel, stall_timeout_s=args.stall_timeout,
                       max_rate=args.max_rate * (1 << 20) if args.max_rate else None,
                       share=not args.no_share)
    store = _open(args)
    try:
        if args.start_at is not None:
            time.sleep(max(0.0, args.start_at - time.time()))
        try:
            rep = store.get_replica(args.name, args.dir, opts)
        except _errors() as e:
            raise CommandError(_line(e, f"cannot pull {args.name!r} into {args.dir}")) from None
        s = rep.stats
        doc = {"name": args.name, "dir": str(rep.path), "segment": store.segment,
               "bytes": s.bytes, "shards": s.shards, "seconds": round(s.seconds, 4),
               "started_at": s.started_at, "finished_at": s.finished_at,
               "bytes_from": s.bytes_from, "checksum_failures": s.checksum_failures,
               "transfer_failures": s.transfer_failures,
               "cpu_s": round(sum(os.times()[:2]), 3)}
        if args.hold:
            _ready(doc)
            return _serve_forever(store, args.while_pid)
        emit(doc, args.json, lambda d: (
            f"pulled {d['name']} into {d['dir']}: {d['bytes'] / (1 << 20):.1f} MiB in "
            f"{d['shards']} shards, {d['seconds']:.2f} s, from {len(d['bytes_from'])} "
            f"holders ({d['checksum_failures']} checksum and {d['transfer_failures']} "
            "transfer failures re-pulled)"))
        return 0
    finally:
        store.close()


def _cmd_list(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from pymooncake.cli.main import CommandError
    store = _open(args, host=False)
    try:
        try:
            infos = [asdict(i) for i in store.list(args.prefix)]
        except _errors() as e:
            raise CommandError(_line(e)) from None
    finally:
        store.close()
    emit(infos, args.json, lambda xs: "\n".join(
        f"{i['name']}\t{i['total_bytes'] / (1 << 20):.1f} MiB\t{i['num_shards']} shards\t"
        f"{i['complete_holders']}/{i['holders']} holders complete" for i in xs)
        or "(no payloads)")
    return 0


def _cmd_unregister(args: argparse.Namespace) -> int:
    from pymooncake.cli.main import CommandError
    store = _open(args, host=False)
    try:
        try:
            existed = store.unregister(args.name)
        except _errors() as e:
            raise CommandError(_line(e)) from None
    finally:
        store.close()
    if not existed:
        raise CommandError(f"no payload named {args.name!r} is registered")
    return 0


def add_p2p_model_flags(p: argparse.ArgumentParser) -> None:
    """``--p2p-model NAME`` / ``--p2p-metadata`` / ``--p2p-dir`` / ``--p2p-host`` (serve)."""
    p.add_argument("--p2p-model", default=None, metavar="NAME",
                   help="start from a P2P-distributed checkpoint: pull the model directory "
                        "registered as NAME (pymooncake p2p register) into --p2p-dir, load "
                        "it as --model, and serve it to other hosts while running")
    p.add_argument("--p2p-metadata", default=None,
                   help=f"P2P metadata service (default: --metadata, else env {METADATA_ENV})")
    p.add_argument("--p2p-dir", default=None,
                   help="where the pulled model goes (default ~/.cache/pymooncake/p2p/NAME)")
    p.add_argument("--p2p-host", default="127.0.0.1",
                   help="address other hosts pull from this one at (default %(default)s)")


def missing_model_files(d: Any) -> list[str]:
    """What a HF model directory ``d`` lacks for ``serve --model DIR`` (empty: it has all):
    ``config.json`` and ``*.safetensors`` weights (``engine.model.loader``) and one of the
    tokenizer files (``identity.fingerprint.TOKENIZER_FILES``, the front door's tokenizer).
    Names only, nothing is parsed."""
    from pathlib import Path

    from pymooncake.identity.fingerprint import TOKENIZER_FILES
    d = Path(d)
    missing = [] if (d / "config.json").is_file() else ["config.json"]
    if not any((d / n).is_file() for n in TOKENIZER_FILES):
        missing.append("tokenizer file (tokenizer.json, tokenizer_config.json, ...)")
    if not any(d.glob("*.safetensors")):
        missing.append("*.safetensors weights")
    return missing


def apply_p2p_model(args: argparse.Namespace) -> Any:
    """With ``--p2p-model``: pull it, point ``args.model`` at the directory and return the
    holder process (``pymooncake p2p get --hold``: it keeps serving the replica to other
    hosts and is stopped at exit). ``None`` without the flag. Bad flags → ``UsageError``;
    a failed pull → ``CommandError`` (the child's one line), before anything else starts.

    The pull runs in a child so that the caller, which forks the cluster's processes next,
    holds no metadata-client (gRPC) threads of its own."""
    if not getattr(args, "p2p_model", None):
        return None
    if getattr(args, "model_given", False):
        from pymooncake.cli.main import UsageError
        raise UsageError(f"--p2p-model {args.p2p_model} and --model {args.model} conflict: "
                         "the pulled directory is the model; give one of them")
    import atexit
    import subprocess
    from pathlib import Path
    from urllib.parse import quote

    from pymooncake.cli.main import CommandError, UsageError
    name = args.p2p_model
    md = args.p2p_metadata or getattr(args, "metadata", None) or os.environ.get(METADATA_ENV)
    if not md:
        raise UsageError(f"--p2p-model needs --p2p-metadata (or --metadata, or {METADATA_ENV})")
    into = Path(args.p2p_dir or Path.home() / ".cache" / "pymooncake" / "p2p" /
                quote(name, safe=""))
    import tempfile
    errf = tempfile.TemporaryFile("w+")   # noqa: SIM115 - the child writes it while we live
    child = subprocess.Popen(
        [sys.executable, "-m", "pymooncake", "p2p", "get", name, str(into), "--hold",
         "--metadata", md, "--host", args.p2p_host, "--while-pid", str(os.getpid())],
        stdout=subprocess.PIPE, stderr=errf, text=True)
    assert child.stdout is not None
    line = child.stdout.readline()        # the ready line, or EOF when the pull failed
    if not line.startswith('{"event": "ready"'):
        child.wait()
        errf.seek(0)
        err = errf.read()
        why = next((ln.removeprefix("pymooncake: error: ") for ln in err.splitlines()
                    if ln.startswith("pymooncake: error: ")), f"exit status {child.returncode}")
        raise (UsageError if child.returncode == 2 else CommandError)(
            f"--p2p-model {name}: {why}")

    def _stop() -> None:
        if child.poll() is None:
            child.terminate()
            try:
                child.wait(timeout=10)
            except subprocess.TimeoutExpired:
                child.kill()

    atexit.register(_stop)
    missing = missing_model_files(into)
    if missing:           # checked before any process of the cluster starts
        _stop()
        raise CommandError(f"--p2p-model {name}: the payload pulled into {into} is not a "
                           f"model directory: no {', no '.join(missing)} (register a HF "
                           "model directory under that name)")
    sys.stderr.write(f"pymooncake: pulled {name} into {into} (P2P Store); pid {child.pid} "
                     "serves it to other hosts while this runs\n")
    args.model = str(into)
    return child


def _cmd_bench(args: argparse.Namespace) -> int:
    from pymooncake.bench.p2p import BenchError, format_human, run_bench
    from pymooncake.cli.main import CommandError
    try:
        doc = run_bench(args, progress=lambda m: print(m, file=sys.stderr, flush=True))
    except BenchError as e:
        raise CommandError(str(e)) from None
    emit(doc, args.json, format_human)
    return 0
