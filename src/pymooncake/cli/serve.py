"""``pymooncake serve | conductor | prefill | decode | profile``: disaggregated serving.

``serve`` starts a whole cluster on localhost as separate processes — the Store master
(with its HTTP metadata server), the Conductor (with the OpenAI front door), N prefill and M
decode workers — and stops every child on Ctrl-C/SIGTERM. The roles can also be started by
hand (``conductor``, ``prefill``, ``decode``, ``master``) to form one cluster across hosts.
DESIGN.md §1, docs/serving.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from typing import Any

from pymooncake.cli.common import add_json_flag

POLICY_CHOICES = ("global-cache", "local-cache", "load", "round-robin", "random")
OTEL_CHOICES = ("console", "otlp")  # obs.tracing.EXPORTERS (not imported: --help stays fast)


def _ready(info: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps({"event": "ready", **info}) + "\n")
    sys.stdout.flush()


def _add_otel_flag(p: argparse.ArgumentParser) -> None:
    import os
    p.add_argument("--otel", choices=OTEL_CHOICES, default=os.environ.get("PYMOONCAKE_OTEL"),
                   help="export OpenTelemetry spans: console (stderr) or otlp "
                        "(OTEL_EXPORTER_OTLP_ENDPOINT); default: env PYMOONCAKE_OTEL, else off")


def _start_tracing(args: argparse.Namespace, role: str) -> None:
    """``configure_tracing(args.otel, "pymooncake-<role>")``; errors as one-line CLI errors."""
    from pymooncake.cli.main import CommandError, UsageError
    from pymooncake.obs.tracing import configure_tracing
    try:
        configure_tracing(args.otel, f"pymooncake-{role}")
    except ValueError as e:
        raise UsageError(f"--otel / PYMOONCAKE_OTEL: {e}") from None
    except RuntimeError as e:
        raise CommandError(f"--otel {args.otel}: {e}") from None


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny",
                   help="'tiny' (embedded, the default) or a HF model directory")
    p.add_argument("--num-kv-blocks", type=int, default=1024,
                   help="paged KV blocks (default %(default)s)")
    p.add_argument("--block-size", type=int, default=16,
                   help="tokens per KV block (default %(default)s)")
    p.add_argument("--max-num-seqs", type=int, default=64,
                   help="running requests at most (default %(default)s)")
    p.add_argument("--max-model-len", type=int, default=8192,
                   help="prompt + output tokens at most (default %(default)s)")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``serve``, ``conductor``, ``prefill``, ``decode`` and ``profile``."""
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
    s.add_argument("--profile", default=None, help="prefill profile JSON (pymooncake profile)")
    s.add_argument("--max-concurrency", type=int, default=64,
                   help="front-door admission: requests in flight at once (default "
                        "%(default)s)")
    s.add_argument("--metadata", default=None,
                   help="Transfer Engine metadata service for the workers (etcd://host:port, "
                        "http://…/metadata); default: the master's embedded HTTP one")
    s.add_argument("--demo", action="store_true",
                   help="send a few chat requests and a short trace replay, print, stop")
    _add_engine_flags(s)
    _add_otel_flag(s)
    add_json_flag(s)
    s.set_defaults(handler=_cmd_serve)

    c = subparsers.add_parser(
        "conductor", help="run the Conductor and the OpenAI API front door",
        description="The Conductor (placement, early rejection, dispatch) and the OpenAI "
                    "HTTP API in one process; workers register on --worker-port.")
    c.add_argument("--host", default="127.0.0.1")
    c.add_argument("--port", type=int, default=8000, help="HTTP port (0 = any free port)")
    c.add_argument("--worker-port", type=int, default=50060,
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
    c.add_argument("--model", default="tiny", help="model whose tokenizer the API uses")
    c.add_argument("--context-length", type=int, default=8192)
    c.add_argument("--max-concurrency", type=int, default=64)
    c.add_argument("--queue-capacity", type=int, default=256)
    c.add_argument("--queue-timeout", type=float, default=30.0, metavar="S")
    _add_otel_flag(c)
    c.set_defaults(handler=_cmd_conductor)

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
        w.add_argument("--port", type=int, default=0, help="RPC port (0 = any free port)")
        w.add_argument("--register-timeout", type=float, default=60.0, metavar="S",
                       help="exit when the Conductor was not reachable for S seconds after "
                            "start (default 60)")
        if role == "prefill":
            w.add_argument("--master", default=None,
                           help="host:port of the Store master (omit: no global Store)")
            w.add_argument("--global-segment-size", type=int, default=64 << 20,
                           help="DRAM contributed to the Store (bytes)")
            w.add_argument("--prefill-batch", type=int, default=1,
                           help="prompts prefilled together at most (1 = one at a time, "
                                "first come first served: the queue Algorithm 1 predicts)")
            w.add_argument("--prefill-order", choices=("shortest", "fcfs"), default="shortest",
                           help="which queued prompt is prefilled next: fewest tokens first "
                                "(aged, so long prompts are not starved) or arrival order")
            w.add_argument("--no-layerwise-kv", action="store_true",
                           help="ship the prompt KV in one batch after the prefill instead of "
                                "layer by layer during it")
        else:
            w.add_argument("--colocated", action="store_true",
                           help="prefill and decode here (baseline; no KV is received)")
            w.add_argument("--recv-buffer-size", type=int, default=64 << 20,
                           help="receive arena for P→D KV (bytes)")
        w.add_argument("--no-prefix-cache", action="store_true",
                       help="disable the local prefix cache")
        _add_engine_flags(w)
        _add_otel_flag(w)
        w.set_defaults(handler=_cmd_worker, role=role)

    pr = subparsers.add_parser(
        "profile", help="measure prefill time over (input length, prefix length)",
        description="Run the engine's prefill at several prompt and cached-prefix lengths and "
                    "write the (tokens, prefix tokens, seconds) samples and the fitted "
                    "estimator as JSON (the Conductor's --profile).")
    pr.add_argument("--model", default="tiny")
    pr.add_argument("--lengths", default="128,256,512,1024,2048",
                    help="comma-separated prompt lengths (tokens)")
    pr.add_argument("--prefix-fractions", default="0,0.5", help="cached prefix fractions")
    pr.add_argument("--repeats", type=int, default=3, help="runs per point (median)")
    pr.add_argument("--out", default=None, help="write the profile JSON here")
    add_json_flag(pr)
    pr.set_defaults(handler=_cmd_profile)


# -- workers --------------------------------------------------------------------------------
def _run_until_signal(coro_factory: Any) -> int:
    import asyncio
    import signal

    async def main() -> None:
        task = asyncio.ensure_future(coro_factory())
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, task.cancel)
        with contextlib.suppress(asyncio.CancelledError):
            await task

    asyncio.run(main())
    return 0


def _cmd_worker(args: argparse.Namespace) -> int:
    from pymooncake.cli.main import UsageError
    from pymooncake.engine.worker.base import WorkerConfig
    role = "colocated" if getattr(args, "colocated", False) else args.role
    try:
        cfg = WorkerConfig(
            instance_id=args.id, role=role, conductor=args.conductor,
            metadata_url=args.metadata, master=getattr(args, "master", None), host=args.host,
            port=args.port, model=args.model, num_kv_blocks=args.num_kv_blocks,
            block_size=args.block_size, max_num_seqs=args.max_num_seqs,
            max_model_len=args.max_model_len, enable_prefix_caching=not args.no_prefix_cache,
            global_segment_size_bytes=getattr(args, "global_segment_size", 64 << 20),
            recv_buffer_bytes=getattr(args, "recv_buffer_size", 64 << 20),
            layerwise_kv=not getattr(args, "no_layerwise_kv", False),
            prefill_batch=getattr(args, "prefill_batch", 1),
            prefill_order=getattr(args, "prefill_order", "shortest"),
            register_timeout_s=args.register_timeout)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if role == "prefill":
        from pymooncake.engine.worker.prefill import PrefillWorker
        worker: Any = PrefillWorker(cfg)
    else:
        from pymooncake.engine.worker.decode import DecodeWorker
        worker = DecodeWorker(cfg)
    from pymooncake.cli.main import CommandError
    from pymooncake.engine.worker.base import WorkerFatal
    from pymooncake.obs.tracing import shutdown_tracing
    from pymooncake.store.errors import StoreError
    from pymooncake.transfer.batch import TransferError
    _start_tracing(args, role)
    try:
        return _run_until_signal(lambda: worker.serve(_ready))
    except (WorkerFatal, StoreError, TransferError, OSError) as e:
        # cannot start or cannot join (Store master, metadata service or Conductor refused
        # or unreachable, segment name taken): one line, not a traceback
        raise CommandError(f"{role} {args.id}: {e}") from None
    finally:
        shutdown_tracing()


# -- conductor ------------------------------------------------------------------------------
def load_codec(model: str) -> Any:
    """The model's tokenizer + chat template for the front door."""
    from pymooncake.engine.model.tokenizer import ByteTokenizer, HFTokenizer
    if model == "tiny":
        return ByteTokenizer()
    return HFTokenizer(model)


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
    import asyncio

    from pymooncake.api.admission import AdmissionConfig
    from pymooncake.api.server import ApiConfig, create_app, listen_socket
    from pymooncake.cli.main import UsageError
    from pymooncake.conductor.config import ConductorConfig
    from pymooncake.conductor.service import Conductor
    try:
        cfg = ConductorConfig(policy=args.policy, colocated=args.colocated,
                              ttft_slo_s=args.ttft_slo, tbt_slo_s=args.tbt_slo,
                              early_rejection=not args.no_early_rejection,
                              global_store=args.global_store,
                              context_length=args.context_length,
                              prefill_concurrency_limit=args.prefill_concurrency_limit)
        api_cfg = ApiConfig(model_name=args.model if args.model == "tiny" else args.model,
                            context_length=args.context_length,
                            admission=AdmissionConfig(max_concurrency=args.max_concurrency,
                                                      queue_capacity=args.queue_capacity,
                                                      queue_timeout_s=args.queue_timeout))
    except ValueError as e:
        raise UsageError(str(e)) from None
    est = load_profile(args.profile) if args.profile else None
    codec = load_codec(args.model)

    from pymooncake.cli.main import CommandError
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
        app = create_app(cond, codec, api_cfg, health=cond.health)
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off",
                                               timeout_graceful_shutdown=2))
        task = asyncio.ensure_future(server.serve(sockets=[sock]))
        while not server.started and not task.done():
            await asyncio.sleep(0.02)
        if not task.done():
            _ready({"port": sock.getsockname()[1], "worker_port": cond.port,
                    "url": f"http://{args.host}:{sock.getsockname()[1]}"})
        try:
            await task
        finally:
            await cond.stop()
            sock.close()

    from pymooncake.obs.tracing import shutdown_tracing
    _start_tracing(args, "conductor")
    try:
        asyncio.run(main())
    finally:
        shutdown_tracing()
    return 0


# -- serve (all in one) ---------------------------------------------------------------------
def _check_serve_flags(args: argparse.Namespace) -> None:
    """Refuse bad ``serve`` flags before any child starts (exit 2, one line naming the flag)
    rather than letting a child fail with a traceback."""
    import os

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
    if args.model != "tiny" and not os.path.isdir(args.model):
        raise UsageError(f"--model must be 'tiny' or a model directory; {args.model!r} is not "
                         "a directory")
    for flag, v in (("--num-kv-blocks", args.num_kv_blocks), ("--block-size", args.block_size),
                    ("--max-num-seqs", args.max_num_seqs),
                    ("--max-model-len", args.max_model_len),
                    ("--max-concurrency", args.max_concurrency)):
        if v < 1:
            raise UsageError(f"{flag} must be >= 1, got {v}")
    for flag, f in (("--ttft-slo", args.ttft_slo), ("--tbt-slo", args.tbt_slo)):
        if not f > 0:
            raise UsageError(f"{flag} must be > 0 seconds, got {f}")


def _cmd_serve(args: argparse.Namespace) -> int:
    from pymooncake.cli.main import CommandError
    _check_serve_flags(args)
    spec = ClusterSpec(num_prefill=args.prefill, num_decode=0 if args.colocated else args.decode,
                       colocated=args.colocated, prefix_cache=not args.no_prefix_cache,
                       policy=args.policy, model=args.model, port=args.port,
                       num_kv_blocks=args.num_kv_blocks, block_size=args.block_size,
                       max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                       ttft_slo_s=args.ttft_slo, tbt_slo_s=args.tbt_slo, profile=args.profile,
                       max_concurrency=args.max_concurrency, quiet=args.demo,
                       global_store=args.global_store, otel=args.otel, metadata=args.metadata)
    import signal

    from pymooncake.obs.tracing import shutdown_tracing
    _start_tracing(args, "serve")
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
            return run_demo(cluster.url, args.json)
        _ready({"url": cluster.url, "pids": cluster.pids()})
        sys.stderr.write(f"pymooncake: serving the OpenAI API on {cluster.url} "
                         "(Ctrl-C stops the cluster)\n")
        cluster.wait()          # returns only when the cluster cannot serve any more
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        cluster.stop()
        shutdown_tracing()


# -- profile --------------------------------------------------------------------------------
def _cmd_profile(args: argparse.Namespace) -> int:
    from pymooncake.cli.common import emit
    from pymooncake.cli.main import UsageError
    from pymooncake.engine.worker.profile import measure_profile
    try:
        lengths = [int(x) for x in args.lengths.split(",") if x]
        fracs = [float(x) for x in args.prefix_fractions.split(",") if x]
    except ValueError:
        raise UsageError("--lengths and --prefix-fractions are comma-separated numbers") from None
    if not lengths or min(lengths) < 2 or not all(0 <= f < 1 for f in fracs):
        raise UsageError("--lengths must be >= 2 tokens and --prefix-fractions in [0, 1)")
    from pymooncake.conductor.policy import fit_prefill_estimator
    doc = measure_profile(args.model, lengths, fracs, max(1, args.repeats))
    est = fit_prefill_estimator([(s["num_tokens"], s["num_prefix_tokens"], s["seconds"])
                                 for s in doc["samples"]], with_overhead=True)
    doc["estimator"] = {"quadratic_s": est.quadratic_s, "linear_s": est.linear_s,
                        "overhead_s": est.overhead_s}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=2)

    def human(d: dict[str, Any]) -> str:
        lines = [f"{'tokens':>7} {'prefix':>7} {'seconds':>9}"]
        lines += [f"{s['num_tokens']:>7} {s['num_prefix_tokens']:>7} {s['seconds']:>9.4f}"
                  for s in d["samples"]]
        e = d["estimator"]
        lines.append(f"fit: t = {e['quadratic_s']:.3e}·(n²−p²) + {e['linear_s']:.3e}·(n−p) "
                     f"+ {e['overhead_s']:.3e} s")
        return "\n".join(lines)

    emit(doc, args.json, human)
    return 0


class ClusterSpec:
    """What ``serve`` starts (flags of ``pymooncake serve``)."""

    def __init__(self, **kw: Any) -> None:
        self.num_prefill: int = kw.pop("num_prefill", 1)
        self.num_decode: int = kw.pop("num_decode", 1)
        self.colocated: bool = kw.pop("colocated", False)
        self.prefix_cache: bool = kw.pop("prefix_cache", True)
        self.policy: str = kw.pop("policy", "global-cache")
        self.model: str = kw.pop("model", "tiny")
        self.port: int = kw.pop("port", 0)
        self.num_kv_blocks: int = kw.pop("num_kv_blocks", 1024)
        self.block_size: int = kw.pop("block_size", 16)
        self.max_num_seqs: int = kw.pop("max_num_seqs", 64)
        self.max_model_len: int = kw.pop("max_model_len", 8192)
        self.ttft_slo_s: float = kw.pop("ttft_slo_s", 10.0)
        self.tbt_slo_s: float = kw.pop("tbt_slo_s", 1.0)
        self.profile: str | None = kw.pop("profile", None)
        self.max_concurrency: int = kw.pop("max_concurrency", 64)
        self.queue_capacity: int = kw.pop("queue_capacity", 256)
        self.prefill_concurrency_limit: int | None = kw.pop("prefill_concurrency_limit", None)
        self.quiet: bool = kw.pop("quiet", False)
        self.global_store: bool | None = kw.pop("global_store", None)
        self.global_segment_size: int = kw.pop("global_segment_size", 64 << 20)
        self.extra_conductor_flags: list[str] = kw.pop("extra_conductor_flags", [])
        self.metadata: str | None = kw.pop("metadata", None)
        """Transfer Engine metadata URL for the workers (``etcd://…``, ``http://…``);
        None = the master's embedded HTTP metadata server."""
        self.otel: str | None = kw.pop("otel", None)
        if kw:
            raise TypeError(f"unknown ClusterSpec fields {sorted(kw)}")


def _set_pdeathsig() -> None:  # runs in the child before exec (Linux): die with the parent
    import ctypes
    import signal
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _proc_cpu_s(pid: int) -> float | None:
    """utime + stime of ``pid`` in seconds from ``/proc/<pid>/stat``; None if unreadable."""
    import os
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(b")") + 2:].split()   # after "pid (comm) "; state is fields[0]
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class LocalCluster:
    """Master, Conductor and workers as child processes on 127.0.0.1.

    ``start()`` returns when every worker has registered with the Conductor; ``stop()``
    sends SIGTERM to every child (workers first), waits, and kills what is left — always
    call it (``finally``). Raises ``RuntimeError``/``TimeoutError`` from ``start()`` when a
    process exits or is not ready in time (what was started is stopped).
    """

    def __init__(self, spec: ClusterSpec) -> None:
        self.spec = spec
        self.procs: dict[str, Any] = {}
        self.url = ""
        self.master_addr = ""
        self.metadata_url = ""
        self.worker_addr = ""

    def _spawn(self, name: str, argv: list[str], timeout_s: float = 60.0) -> dict[str, Any]:
        import os
        import selectors
        import subprocess
        import threading
        import time
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        src = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
        stderr = subprocess.DEVNULL if self.spec.quiet else None
        p = subprocess.Popen([sys.executable, "-m", "pymooncake", *argv],
                             stdout=subprocess.PIPE, stderr=stderr, env=env,
                             preexec_fn=_set_pdeathsig)
        self.procs[name] = p
        sel = selectors.DefaultSelector()
        sel.register(p.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                if sel.select(0.1):
                    line = p.stdout.readline()
                    if not line and p.poll() is not None:
                        break
                    if line.startswith(b"{"):
                        info = json.loads(line)
                        if info.get("event") == "ready":
                            threading.Thread(target=_drain, args=(p.stdout,),
                                             daemon=True).start()
                            return info
                elif p.poll() is not None:
                    break
        finally:
            sel.close()
        if p.poll() is not None:
            raise RuntimeError(f"{name} exited with status {p.returncode}")
        raise TimeoutError(f"{name} not ready in {timeout_s:.0f} s")

    def start(self) -> None:
        import time

        import httpx
        s = self.spec
        try:
            if s.metadata:
                m = self._spawn("master", ["master", "--port", "0"])
                self.metadata_url = s.metadata
            else:
                m = self._spawn("master", ["master", "--port", "0",
                                           "--enable-http-metadata-server",
                                           "--http-metadata-server-port", "0"])
                self.metadata_url = m["metadata_url"]
            self.master_addr = f"127.0.0.1:{m['port']}"
            cflags = ["conductor", "--port", str(s.port), "--worker-port", "0", "--policy",
                      s.policy, "--model", s.model, "--context-length", str(s.max_model_len),
                      "--ttft-slo", str(s.ttft_slo_s), "--tbt-slo", str(s.tbt_slo_s),
                      "--max-concurrency", str(s.max_concurrency),
                      "--queue-capacity", str(s.queue_capacity), *s.extra_conductor_flags]
            if s.colocated:
                cflags.append("--colocated")
            if s.profile:
                cflags += ["--profile", s.profile]
            if s.global_store is not None:
                cflags.append("--global-store" if s.global_store else "--no-global-store")
            if s.prefill_concurrency_limit:
                cflags += ["--prefill-concurrency-limit", str(s.prefill_concurrency_limit)]
            if s.otel:
                cflags += ["--otel", s.otel]
            c = self._spawn("conductor", cflags)
            self.url = c["url"]
            self.worker_addr = f"127.0.0.1:{c['worker_port']}"
            common = ["--conductor", self.worker_addr, "--metadata", self.metadata_url,
                      "--model", s.model, "--num-kv-blocks", str(s.num_kv_blocks),
                      "--block-size", str(s.block_size), "--max-num-seqs", str(s.max_num_seqs),
                      "--max-model-len", str(s.max_model_len)]
            if not s.prefix_cache:
                common.append("--no-prefix-cache")
            if s.otel:
                common += ["--otel", s.otel]
            names = []
            for i in range(s.num_prefill):
                name = f"colocated-{i}" if s.colocated else f"prefill-{i}"
                if s.colocated:
                    argv = ["decode", "--colocated", "--id", name, *common]
                else:
                    argv = ["prefill", "--id", name, "--master", self.master_addr,
                            "--global-segment-size", str(s.global_segment_size), *common]
                self._spawn(name, argv)
                names.append(name)
            for i in range(s.num_decode):
                self._spawn(f"decode-{i}", ["decode", "--id", f"decode-{i}", *common])
                names.append(f"decode-{i}")
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                h = httpx.get(self.url + "/health", timeout=5).json()
                if {w["instance_id"] for w in h.get("workers", [])} >= set(names):
                    return
                time.sleep(0.1)
            raise TimeoutError("workers did not register with the Conductor in 30 s")
        except BaseException:
            self.stop()
            raise

    def pids(self) -> dict[str, int]:
        return {n: p.pid for n, p in self.procs.items()}

    def cpu_seconds(self) -> dict[str, float]:
        """User + system CPU seconds each live child has used so far (Linux ``/proc``;
        children whose ``stat`` cannot be read are left out)."""
        return {n: t for n, p in self.procs.items() if (t := _proc_cpu_s(p.pid)) is not None}

    def wait(self) -> None:
        """Block while the cluster can serve. A worker that exits is reported on stderr and
        the others of its role serve on (the Conductor drops it after its load reports
        stop); return when the Store master or the Conductor exits, or when every worker
        of a role (prefill, decode or colocated) has."""
        import time
        reported: set[str] = set()
        pools: dict[str, set[str]] = {}
        for n in self.procs:
            if n not in ("master", "conductor"):
                pools.setdefault(n.rsplit("-", 1)[0], set()).add(n)
        while True:
            dead = {n for n, p in self.procs.items() if p.poll() is not None}
            for n in sorted(dead - reported):
                sys.stderr.write(f"pymooncake: {n} exited with status "
                                 f"{self.procs[n].returncode}\n")
            reported |= dead
            gone = [role for role, names in pools.items() if names <= dead]
            if dead & {"master", "conductor"} or gone:
                why = f"no {gone[0]} worker is left" if gone else \
                    f"{', '.join(sorted(dead & {'master', 'conductor'}))} exited"
                sys.stderr.write(f"pymooncake: {why}; stopping the cluster\n")
                return
            time.sleep(0.5)

    def stop(self) -> None:
        """SIGTERM every child (workers, then conductor, then master), then kill leftovers."""
        import signal
        import subprocess
        import time
        order = list(reversed(list(self.procs.items())))
        for _, p in order:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.send_signal(signal.SIGTERM)
        # One deadline for all children (not 8 s each in turn): the whole stop is bounded
        # by ~8 s + the kills, however many children there are.
        deadline = time.monotonic() + 8.0
        for _, p in order:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
        for _, p in order:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(5)


def _drain(stream: Any) -> None:
    try:
        while stream.read(65536):
            pass
    except (OSError, ValueError):
        pass


# -- demo -----------------------------------------------------------------------------------
DEMO_PROMPTS = (
    "What is Mooncake?",
    "Explain prefill and decode disaggregation in one sentence.",
    "What is Mooncake?",
)


def run_demo(url: str, as_json: bool) -> int:
    """Chat requests (the third repeats the first: a prefix hit), then a short replay of the
    bundled conversation trace through the HTTP API; prints answers, TTFT/TBT, hits."""
    import time

    import httpx

    from pymooncake.cli.common import emit
    chats = []
    with httpx.Client(base_url=url, timeout=120) as client:
        for prompt in DEMO_PROMPTS:
            t0 = time.monotonic()
            ttft = None
            tokens = 0
            text = []
            usage: dict[str, Any] = {}
            with client.stream("POST", "/v1/chat/completions", json={
                    "model": "tiny", "messages": [{"role": "user", "content": prompt}],
                    "max_tokens": 24, "temperature": 0, "stream": True,
                    "stream_options": {"include_usage": True}}) as r:
                r.raise_for_status()
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):
                        usage = chunk["usage"]
                    for ch in chunk.get("choices", []):
                        piece = ch.get("delta", {}).get("content")
                        if piece:
                            if ttft is None:
                                ttft = time.monotonic() - t0
                            text.append(piece)
                            tokens += 1
            total = time.monotonic() - t0
            chats.append({"prompt": prompt, "answer": "".join(text),
                          "ttft_s": round(ttft or total, 4),
                          "tbt_mean_s": round((total - (ttft or total)) / max(tokens - 1, 1), 4),
                          "prompt_tokens": usage.get("prompt_tokens"),
                          "cached_tokens": (usage.get("prompt_tokens_details") or {})
                          .get("cached_tokens")})
        health = client.get("/health").json()
    replay = _demo_replay(url)
    doc = {"url": url, "chats": chats, "replay": replay,
           "workers": [{k: w[k] for k in ("instance_id", "role", "pid")}
                       for w in health.get("workers", [])]}

    def human(d: dict[str, Any]) -> str:
        out = [f"cluster at {d['url']}: " + ", ".join(f"{w['instance_id']} (pid {w['pid']})"
                                                       for w in d["workers"])]
        for c in d["chats"]:
            out.append(f"> {c['prompt']}\n  {c['answer']!r}\n  TTFT {c['ttft_s'] * 1e3:.0f} ms, "
                       f"TBT {c['tbt_mean_s'] * 1e3:.1f} ms, prompt {c['prompt_tokens']} "
                       f"tokens, cached {c['cached_tokens']}")
        r = d["replay"]
        if "error" in r:
            out.append(f"replay: {r['error']}")
        else:
            out.append(f"replay of {r['num_requests']} trace requests: TTFT mean "
                       f"{r['ttft_mean_s'] * 1e3:.0f} ms (P99 {r['ttft_p99_s'] * 1e3:.0f} ms), "
                       f"TBT mean {r['tbt_mean_s'] * 1e3:.1f} ms, token hit ratio "
                       f"{r['token_hit_ratio']:.2f}, rejected {r['num_rejected']}")
        return "\n".join(out)

    emit(doc, as_json, human)
    return 0


def _demo_replay(url: str) -> dict[str, Any]:
    import subprocess
    argv = [sys.executable, "-m", "pymooncake", "replay", "--url", url, "--limit", "12",
            "--time-scale", "4", "--length-scale", "32", "--json"]
    try:
        r = subprocess.run(argv, capture_output=True, timeout=90, text=True)
    except subprocess.TimeoutExpired:
        return {"error": "replay did not finish in 90 s"}
    if r.returncode != 0:
        return {"error": (r.stderr.strip().splitlines() or ["replay failed"])[-1]}
    doc = json.loads(r.stdout)
    return {k: doc.get(k) for k in ("num_requests", "num_rejected", "ttft_mean_s", "ttft_p99_s",
                                    "tbt_mean_s", "tbt_p99_s", "token_hit_ratio",
                                    "request_hit_ratio")}


# -- bench serving --------------------------------------------------------------------------
BENCH_CONFIGS: dict[str, dict[str, Any]] = {
    "global-cache": {"policy": "global-cache"},
    "random": {"policy": "random"},
    "colocated-no-cache": {"colocated": True, "prefix_cache": False},
}
"""The issue's comparison: P/D + global Store + cache-aware placement (Algorithm 1), P/D with
random placement (local caches only, the paper's Figure 5 baseline), and colocated workers
without a prefix cache. Every configuration runs the same number of engine processes."""


def register_bench(bench_subparsers: argparse._SubParsersAction) -> None:
    """Add ``pymooncake bench serving``."""
    b = bench_subparsers.add_parser(
        "serving", help="live trace replay against P/D and colocated clusters",
        description="Start each configuration as a real local cluster, replay the first "
                    "--limit requests of the bundled conversation trace through the OpenAI "
                    "API (pymooncake replay), and compare TTFT/TBT, hits and rejections.")
    b.add_argument("--configs", default=",".join(BENCH_CONFIGS),
                   help=f"comma-separated subset of {', '.join(BENCH_CONFIGS)}")
    b.add_argument("--limit", type=int, default=300, help="trace requests replayed")
    b.add_argument("--repeats", type=int, default=1,
                   help="replay each configuration this many times, interleaved; numbers "
                        "are means over the repeats, with per-repeat values listed")
    b.add_argument("--time-scale", type=float, default=1.0, help="arrival speed-up")
    b.add_argument("--length-scale", type=int, default=32, help="divide lengths by this")
    b.add_argument("--prefill", type=int, default=2, help="prefill workers (P/D configs)")
    b.add_argument("--decode", type=int, default=1, help="decode workers (P/D configs)")
    b.add_argument("--ttft-slo", type=float, default=5.0, help="TTFT objective (s)")
    b.add_argument("--tbt-slo", type=float, default=0.5, help="TBT objective (s)")
    b.add_argument("--global-segment-size", type=int, default=512 << 20,
                   help="DRAM each prefill worker gives the Store (bytes)")
    add_json_flag(b)
    b.set_defaults(handler=_cmd_bench_serving)


def _cmd_bench_serving(args: argparse.Namespace) -> int:
    import os
    import platform

    from pymooncake.cli.common import emit
    from pymooncake.cli.main import UsageError
    if args.repeats < 1:
        raise UsageError(f"--repeats must be >= 1, got {args.repeats}")
    if args.limit < 1:
        raise UsageError(f"--limit must be >= 1, got {args.limit}")
    names = [c for c in args.configs.split(",") if c]
    bad = [c for c in names if c not in BENCH_CONFIGS]
    if bad or not names:
        raise UsageError(f"--configs: unknown {bad}; choose from {', '.join(BENCH_CONFIGS)}")
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for rep in range(args.repeats):
        # interleaved, each repeat starting one configuration later: a slow minute on the
        # shared machine does not always land on the same configuration
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            runs[name].append(_bench_one(name, args))
    results = {n: _aggregate(rs) for n, rs in runs.items()}
    doc = {"machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}",
           "limit": args.limit, "time_scale": args.time_scale,
           "length_scale": args.length_scale, "prefill": args.prefill, "decode": args.decode,
           "repeats": args.repeats, "results": results}

    def human(d: dict[str, Any]) -> str:
        keys = ("num_requests", "num_rejected", "ttft_mean_s", "ttft_p50_s", "ttft_p99_s",
                "tbt_mean_s", "tbt_p99_s", "slo_attainment", "request_hit_ratio",
                "token_hit_ratio")
        lines = [f"{'config':<20}" + "".join(f"{k:>18}" for k in keys)]
        for n, res in d["results"].items():
            cells = []
            for k in keys:
                v = res.get(k)
                cells.append(f"{v:>18.4f}" if isinstance(v, float) else f"{v!s:>18}")
            lines.append(f"{n:<20}" + "".join(cells))
        if d["repeats"] > 1:
            lines.append("mean TTFT (s) of each repeat, in run order:")
            for n, res in d["results"].items():
                lines.append(f"  {n:<20}" + " ".join(
                    f"{v:.4f}" for v in res["per_repeat"]["ttft_mean_s"]))
        return "\n".join(lines)

    emit(doc, args.json, human)
    return 0


def _bench_one(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """One configuration: a fresh local cluster, one replay, the replay's JSON report plus
    the CPU seconds each cluster process and the replay client used during it."""
    import resource
    import subprocess

    from pymooncake.cli.main import CommandError
    extra = BENCH_CONFIGS[name]
    n_engines = args.prefill + args.decode
    spec = ClusterSpec(port=0, quiet=True, max_model_len=8192, num_kv_blocks=2048,
                       global_segment_size=args.global_segment_size,
                       num_prefill=n_engines if extra.get("colocated") else args.prefill,
                       num_decode=0 if extra.get("colocated") else args.decode,
                       ttft_slo_s=args.ttft_slo * 10, tbt_slo_s=args.tbt_slo * 10, **extra)
    cluster = LocalCluster(spec)
    try:
        cluster.start()
        argv = [sys.executable, "-m", "pymooncake", "replay", "--url", cluster.url,
                "--limit", str(args.limit), "--time-scale", str(args.time_scale),
                "--length-scale", str(args.length_scale), "--ttft-slo", str(args.ttft_slo),
                "--tbt-slo", str(args.tbt_slo), "--json"]
        cpu0, ru0 = cluster.cpu_seconds(), resource.getrusage(resource.RUSAGE_CHILDREN)
        r = subprocess.run(argv, capture_output=True, text=True, timeout=1800)
        cpu1, ru1 = cluster.cpu_seconds(), resource.getrusage(resource.RUSAGE_CHILDREN)
        if r.returncode != 0:
            raise CommandError(f"replay against {name} failed: "
                               f"{(r.stderr.strip().splitlines() or ['?'])[-1]}")
        res: dict[str, Any] = json.loads(r.stdout)   # with replay's per-stage means
        cpu = {n: round(cpu1[n] - cpu0[n], 2) for n in cpu1 if n in cpu0}
        res["cluster_cpu_s"] = {"total": round(sum(cpu.values()), 2), **cpu}
        res["replay_client_cpu_s"] = round(
            ru1.ru_utime + ru1.ru_stime - ru0.ru_utime - ru0.ru_stime, 2)
        return res
    except (RuntimeError, TimeoutError) as e:
        raise CommandError(f"{name}: cluster did not start: {e}") from None
    finally:
        cluster.stop()


REPEAT_KEYS = ("ttft_mean_s", "ttft_p50_s", "ttft_p99_s", "tbt_mean_s", "tbt_p99_s",
               "slo_attainment", "token_hit_ratio")
"""Per-repeat values kept in ``bench serving``'s ``per_repeat`` lists."""


def _aggregate(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One configuration's repeats → one report. A single run is returned as it is. With
    several, every number (also nested ones: stage means, CPU seconds) is the mean over the
    repeats — for ``ttft_mean_s`` that is the mean over all requests of all repeats when
    every repeat served the same number (each replays the same requests); percentiles are
    the mean of the per-repeat
    percentiles — and ``per_repeat`` lists ``REPEAT_KEYS`` of each repeat in run order."""
    if len(runs) == 1:
        return runs[0]

    def mean(vals: list[Any]) -> Any:
        if all(isinstance(v, dict) for v in vals):
            keys = [k for k in vals[0] if all(k in v for v in vals)]
            return {k: mean([v[k] for v in vals]) for k in keys}
        if all(v == vals[0] for v in vals):
            return vals[0]               # counts such as num_requests stay ints
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals):
            return sum(vals) / len(vals)
        return vals[-1]

    out: dict[str, Any] = mean(runs)
    out["repeats"] = len(runs)
    out["per_repeat"] = {k: [r.get(k) for r in runs] for k in REPEAT_KEYS}
    return out
