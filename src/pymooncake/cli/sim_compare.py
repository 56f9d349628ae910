"""``pymooncake sim vs-live`` (the calibrated simulator replaying the live ``bench capacity``
run, plotted against it) and ``pymooncake sim scale-out`` (the same kind of sweep at 8P+8D
against 16 vLLM-like colocated instances, SIMULATED). docs/sim.md, "CPU calibration"."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from pymooncake.cli.common import add_json_flag, emit


def _fail(e: BaseException) -> None:
    from pymooncake.cli.main import CommandError
    raise CommandError(str(e)) from None


def _out_ok(flag: str, path: str | None, suffix: str) -> None:
    from pymooncake.cli.main import UsageError
    if path is None:
        return
    p = Path(path)
    if p.suffix.lower() != suffix:
        raise UsageError(f"{flag} must name a {suffix} file, got {path!r}")
    if not (p.parent if str(p.parent) else Path(".")).is_dir():
        raise UsageError(f"{flag} {path}: directory {p.parent} does not exist")


def _trace_paths(items: list[str] | None) -> dict[str, str]:
    from pymooncake.cli.main import UsageError
    out = {}
    for it in items or ():
        label, sep, path = it.partition("=")
        if not sep or not label or not path:
            raise UsageError(f"--trace: LABEL=PATH, got {it!r}")
        out[label] = path
    return out


def _say(args: argparse.Namespace):  # noqa: ANN202
    return None if args.json else (lambda s: print(s, file=sys.stderr, flush=True))


def _read_live(path: str) -> dict:
    """The live ``bench capacity`` document at ``path``; ``ValueError`` naming the file and
    what is wrong (unreadable, not JSON, not an object, no points)."""
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise ValueError(f"--live {path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"--live {path}: not JSON ({e.msg}, line {e.lineno})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("config"), dict):
        raise ValueError(f"--live {path}: not a `bench capacity` document (a JSON object "
                         f"with a config object)")
    if not isinstance(doc.get("points"), list) or not doc["points"]:
        raise ValueError(f"--live {path}: no swept points to compare")
    return doc


def _cmd_vs_live(args: argparse.Namespace) -> int:
    _out_ok("--out", args.out, ".png")
    _out_ok("--sim-out", args.sim_out, ".json")
    paths = _trace_paths(args.trace)
    try:
        from pymooncake.bench.sim_vs_live import compare, simulate_like_live
        from pymooncake.bench.sim_vs_live_plot import plot_vs_live
        from pymooncake.sim.calibration import load_calibration
        cals = [(load_calibration(f), f) for f in args.calibration]
        live = _read_live(args.live)
        sim = simulate_like_live(live, *cals[0], trace_paths=paths, say=_say(args),
                                 more=cals[1:], conductor_prefill=args.conductor_prefill)
        rows = compare(live, sim, args.tolerance)
        if args.sim_out:
            Path(args.sim_out).write_text(json.dumps(sim, indent=1))
        png = str(plot_vs_live(live, sim, args.out)) if args.out else None
    except (OSError, ValueError, KeyError) as e:
        _fail(e if not isinstance(e, KeyError) else ValueError(
            f"{args.live}: the live document lacks {e.args[0]!r}"))
    below = [r for r in rows if r["below_saturation"]]
    out = {"rows": rows, "png": png, "tolerance": args.tolerance,
           "not_simulated": sim["config"]["not_simulated"],
           "below_saturation_points": len(below),
           "below_saturation_within_tolerance": sum(r["within_tolerance"] for r in below)}

    def human(d: dict[str, Any]) -> str:
        lines = [f"{'trace':<13}{'system':<16}{'rate':>6}{'live p90':>10}{'sim p90':>10}"
                 f"{'error':>8}  below sat."]
        for r in d["rows"]:
            lv, sv, e = r["live_ttft_p90_s"], r["sim_ttft_p90_s"], r["rel_error"]
            lines.append(f"{r['trace']:<13}{r['system']:<16}{r['rate']:>6g}"
                         f"{'-' if lv is None else f'{lv:.3f}':>10}"
                         f"{'-' if sv is None else f'{sv:.3f}':>10}"
                         f"{'-' if e is None else f'{e:+.0%}':>8}  {r['below_saturation']}")
        lines += [f"not simulated: {s} ({why})" for s, why in d["not_simulated"].items()]
        lines.append(f"below saturation: {d['below_saturation_within_tolerance']}/"
                     f"{d['below_saturation_points']} within ±{d['tolerance']:.0%}")
        if d["png"]:
            lines.append(f"wrote {d['png']}")
        return "\n".join(lines)
    emit(out, args.json, human)
    return 0


def _cmd_scale_out(args: argparse.Namespace) -> int:
    from pymooncake.cli.main import UsageError
    _out_ok("--out", args.out, ".png")
    _out_ok("--sim-out", args.sim_out, ".json")
    paths = _trace_paths(args.trace) or {
        t: str(Path(args.traces_dir) / f"{t}_trace.jsonl") for t in ("conversation", "synthetic")}
    if min(args.prefill, args.decode, args.colocated, args.requests) < 1:
        raise UsageError("--prefill, --decode, --colocated and --requests must be >= 1")
    if not args.rates or min(args.rates) <= 0 or not args.kv_gib > 0:
        raise UsageError("--rates (req/s) and --kv-gib must be > 0")
    try:
        from pymooncake.bench import capacity as cap
        from pymooncake.bench.sim_vs_live import scale_out
        from pymooncake.bench.sim_vs_live_plot import plot_scale_out
        from pymooncake.sim.calibration import load_calibration
        cal = load_calibration(args.calibration)
        doc = scale_out(cal, args.calibration, paths, rates=sorted(args.rates),
                        requests=args.requests, length_scale=args.length_scale,
                        prefill=args.prefill, decode=args.decode, colocated=args.colocated,
                        multiples=args.multiples, seed=args.seed, kv_gib=args.kv_gib,
                        say=_say(args))
        an = cap.analyze(doc)
        if args.sim_out:
            Path(args.sim_out).write_text(json.dumps(doc | {"analysis": an}, indent=1))
        png = str(plot_scale_out(doc, args.out)) if args.out else None
    except (OSError, ValueError) as e:
        _fail(e)
    pd_name, co_name = doc["config"]["systems"]

    def ratio(p: dict[str, Any]) -> float | None:
        a, b = p["capacity"][pd_name]["median"], p["capacity"][co_name]["median"]
        return a / b if b > 0 else None
    out = {"simulated": True, "png": png, "base": {t: a["base"] for t, a in an.items()},
           "capacity": {t: [{k: p[k] for k in ("ttft_multiple", "tbt_multiple", "capacity")}
                            | {"ratio": ratio(p)} for p in a["pairs"]]
                        for t, a in an.items()}}

    def human(d: dict[str, Any]) -> str:
        lines = ["SIMULATED (CPU-calibrated costs), effective capacity in req/s:"]
        for t, pairs in d["capacity"].items():
            for p in pairs:
                caps = ", ".join(f"{s} {v['median']:g}" for s, v in p["capacity"].items())
                r = "" if p["ratio"] is None else f"  (ratio {p['ratio']:.2f}x)"
                lines.append(f"{t} TTFT {p['ttft_multiple']:g}x TBT {p['tbt_multiple']:g}x: "
                             f"{caps}{r}")
        if d["png"]:
            lines.append(f"wrote {d['png']}")
        return "\n".join(lines)
    emit(out, args.json, human)
    return 0


def register(sim: argparse._SubParsersAction) -> None:
    """Add ``sim vs-live`` and ``sim scale-out``."""
    p = sim.add_parser(
        "vs-live", help="calibrated simulator against a live `bench capacity` run",
        description="Replay the live capacity run's sample, rates and admission objectives in "
                    "the simulator with CPU-calibrated costs; print simulated against live "
                    "p90 TTFT per (trace, system, rate) and plot them.")
    p.add_argument("--calibration", required=True, metavar="FILE", action="append",
                   help="calibration JSON (sim calibrate-cpu); give one per thread count "
                        "the systems need: 1 thread (ours-pd, ours-colocated, vllm-2x1), "
                        "one per core (ours-1w, calibrate-cpu --threads 2 --cores 0,1)")
    p.add_argument("--live", required=True, metavar="FILE",
                   help="the document `pymooncake bench capacity` wrote")
    p.add_argument("--trace", action="append", metavar="LABEL=PATH",
                   help="trace file of a label when the live document's path is not here")
    p.add_argument("--tolerance", type=float, default=0.20,
                   help="relative p90 TTFT error counted as a match (default %(default)s)")
    p.add_argument("--conductor-prefill", choices=("calibrated", "defaults"),
                   default="calibrated",
                   help="what ours-1w's Conductor predicts a prefill with: the calibrated "
                        "cost (live runs since 4760ab6 fit a start-up profile) or the "
                        "Conductor's built-in defaults (live runs before it)")
    p.add_argument("--out", default=None, metavar="PNG", help="plot here")
    p.add_argument("--sim-out", default=None, metavar="JSON",
                   help="write the simulated capacity document here")
    add_json_flag(p)
    p.set_defaults(handler=_cmd_vs_live)

    p = sim.add_parser(
        "scale-out", help="SIMULATED: 8P+8D Mooncake vs 16 vLLM-like colocated instances",
        description="The capacity sweep at a scale this machine cannot host, with "
                    "CPU-calibrated costs (one node = one core): Mooncake P/D (global cache, "
                    "Algorithm 1, early rejection) against vLLM-like colocated instances "
                    "(chunked prefill mixed with decode, local prefix cache, round-robin).")
    p.add_argument("--calibration", required=True, metavar="FILE")
    p.add_argument("--traces-dir", default="/work/shared/traces")
    p.add_argument("--trace", action="append", metavar="LABEL=PATH",
                   help="traces to use (default: conversation and synthetic in --traces-dir)")
    p.add_argument("--prefill", type=int, default=8)
    p.add_argument("--decode", type=int, default=8)
    p.add_argument("--colocated", type=int, default=16)
    p.add_argument("--rates", type=float, nargs="+",
                   default=[0.2, 0.4, 0.6, 0.8, 1.0, 1.2, 1.4, 1.6, 2.0, 2.4, 2.8, 3.2, 3.6,
                            4.0, 4.8, 5.6, 6.4, 7.2, 8.0, 9.6],
                   help="arrival rates, req/s (default: 0.2 to 9.6)")
    p.add_argument("--requests", type=int, default=320,
                   help="requests per point (whole prefix families; default %(default)s)")
    p.add_argument("--length-scale", type=int, default=4)
    p.add_argument("--multiples", type=float, nargs="+", default=[2.0, 5.0, 10.0],
                   help="threshold multiples of the simulated single-request base")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-gib", type=float, default=2.0,
                   help="paged KV per node, GiB (the live --kv-gib; default %(default)s)")
    p.add_argument("--out", default=None, metavar="PNG")
    p.add_argument("--sim-out", default=None, metavar="JSON")
    add_json_flag(p)
    p.set_defaults(handler=_cmd_scale_out)
