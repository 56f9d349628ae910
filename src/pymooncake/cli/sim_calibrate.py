"""``pymooncake sim calibrate-cpu`` (measure the engine on one core, write the calibration
file) and ``pymooncake sim cpu-capacity`` (the calibrated rate sweep: beside the live capacity
results, or at a scale this machine cannot host). docs/sim.md, "CPU calibration".
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from typing import Any

from pymooncake.cli.common import add_json_flag, emit


def _csv(kind: type, text: str, flag: str) -> list:
    from pymooncake.cli.main import UsageError
    try:
        out = [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"{flag}: comma-separated numbers, got {text!r}") from None
    if not out:
        raise UsageError(f"{flag}: give at least one value")
    return out


def _pair(text: str) -> tuple[int, int]:
    try:
        n, k = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"N:K (prompt:output tokens), got {text!r}") from None
    if n < 1 or k < 2:
        raise argparse.ArgumentTypeError(f"N >= 1 and K >= 2, got {text!r}")
    return n, k


def _cmd_calibrate_cpu(args: argparse.Namespace) -> int:
    from pymooncake.cli.main import CommandError, UsageError, require_extras
    lengths = _csv(int, args.lengths, "--lengths")
    fracs = _csv(float, args.prefix_fractions, "--prefix-fractions")
    batches = _csv(int, args.batches, "--batches")
    contexts = _csv(int, args.contexts, "--contexts")
    if min(lengths) < 2 or not all(0 <= f < 1 for f in fracs) or len(set(lengths)) < 2:
        raise UsageError("--lengths: >= 2 distinct lengths >= 2; --prefix-fractions in [0, 1)")
    if min(batches) < 1 or len(set(batches)) < 2 or min(contexts) < 1:
        raise UsageError("--batches: >= 2 distinct batch sizes >= 1; --contexts >= 1")
    if args.repeats < 1 or args.decode_steps < 1:
        raise UsageError("--repeats and --decode-steps must be >= 1")
    cores = _csv(int, args.cores, "--cores") if args.cores else [args.core]
    flag = "--cores" if args.cores else "--core"
    if args.threads < 1:
        raise UsageError("--threads must be >= 1")
    allowed = sorted(os.sched_getaffinity(0))
    if len(set(cores)) != len(cores) or not set(cores) <= set(allowed):
        raise UsageError(f"{flag}: distinct CPUs among this process's {allowed}, got "
                         f"{args.cores or args.core}")
    out_dir = os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(out_dir) or not os.access(out_dir, os.W_OK):
        raise UsageError(f"--out {args.out}: directory {out_dir} does not exist or is not "
                         f"writable")
    bw = None
    if args.transfer_bandwidth_gbps is not None:
        if not args.transfer_bandwidth_gbps > 0:
            raise UsageError("--transfer-bandwidth-gbps must be > 0")
        bw = args.transfer_bandwidth_gbps * 1e9 / 8
    from pymooncake.sim.step_cost import STEP_TERMS
    terms = _csv(str, args.step_terms, "--step-terms")   # checked even without mixed chunks
    if not set(terms) <= set(STEP_TERMS) or "tokens" not in terms:
        raise UsageError(f"--step-terms: names of {', '.join(STEP_TERMS)} including "
                         f"'tokens', got {args.step_terms!r}")
    mixed = {}
    if args.mixed_chunks:
        mixed = dict(mixed_chunks=_csv(int, args.mixed_chunks, "--mixed-chunks"),
                     mixed_decodes=_csv(int, args.mixed_decodes, "--mixed-decodes"),
                     mixed_contexts=_csv(int, args.mixed_contexts, "--mixed-contexts"),
                     mixed_offsets=_csv(int, args.mixed_offsets, "--mixed-offsets"),
                     mixed_repeats=args.mixed_repeats, mixed_block_size=args.mixed_block_size,
                     step_terms=terms)
        if min(mixed["mixed_chunks"]) < 1 or min(mixed["mixed_decodes"]) < 0 or \
                min(mixed["mixed_contexts"]) < 1 or min(mixed["mixed_offsets"]) < 0:
            raise UsageError("--mixed-chunks, --mixed-contexts >= 1; --mixed-decodes, "
                             "--mixed-offsets >= 0")
        if args.mixed_repeats < 1 or args.mixed_block_size < 1:
            raise UsageError("--mixed-repeats and --mixed-block-size must be >= 1")
    require_extras("torch")
    from pymooncake.bench.calibrate import calibrate
    say = None if args.json else (lambda s: print(s, file=sys.stderr, flush=True))
    try:
        doc = calibrate(args.model, dtype=args.dtype, core=cores[0], cores=cores,
                        threads=args.threads, lengths=lengths,
                        prefix_fractions=fracs, repeats=args.repeats, batches=batches,
                        contexts=contexts, decode_steps=args.decode_steps,
                        transfer_bandwidth_bytes_per_s=bw,
                        transfer_overhead_s=args.transfer_overhead_ms / 1000,
                        kv_capacity_tokens=args.kv_capacity_tokens, label=args.label,
                        statistic=args.statistic, holdout=args.holdout, **mixed,
                        command=shlex.join(["pymooncake", *sys.argv[1:]]), say=say)
    except (OSError, ValueError) as e:
        doc = getattr(e, "document", None)
        if doc is not None:     # measured, but the fit is unusable: keep the samples
            aside = f"{args.out}.rejected.json"
            with open(aside, "w") as f:
                json.dump(doc, f, indent=1)
            raise CommandError(f"{e} (the measured samples are in {aside})") from None
        raise CommandError(str(e)) from None
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")

    def human(d: dict[str, Any]) -> str:
        p, dc, t = d["prefill"], d["decode"], d["transfer"]
        return "\n".join([
            f"wrote {args.out} ({d['label'] or 'no label'})",
            f"prefill t = {p['quadratic_s']:.3e}·(n²−p²) + {p['linear_s']:.3e}·(n−p) + "
            f"{p['overhead_s']:.3e} s   (rel. RMS {d['fit']['prefill_rel_rms']:.1%})",
            f"decode step = {dc['overhead_s']:.3e} + max({dc['per_sequence_s']:.3e}·B, "
            f"{dc['weight_s']:.3e}) + {dc['attention_per_context_token_s']:.3e}·C s   "
            f"(rel. RMS {d['fit']['decode_rel_rms']:.1%})",
            *([] if "step" not in d else [
                f"engine step = {d['step']['overhead_s']:.3e} + {d['step']['per_token_s']:.3e}"
                f"·tokens + {d['step']['per_pair_s']:.3e}·pairs + "
                f"{d['step']['per_sequence_s']:.3e}·sequences + "
                f"{d['step']['per_decode_context_token_s']:.3e}·decode context + "
                f"{d['step']['per_prefix_token_s']:.3e}·chunk prefix s   (rel. RMS "
                f"{d['fit']['step_rel_rms']:.1%}, {len(d['samples']['step'])} steps; the "
                f"engine's form a + b·tokens + c·pairs: "
                f"{d['fit']['step_engine_form']['rel_rms']:.1%})"]),
            f"transfer {t['kv_bytes_per_token']} B/token at {t['bandwidth_bytes_per_s'] / 1e9:.2f}"
            f" GB/s ({t['bandwidth_source']}) + {t['overhead_s'] * 1000:.1f} ms", *[
                f"held out: {h['prompt_tokens']} tokens + {h['output_tokens']} out: first "
                f"token {h['first_token_s']:.3f} s measured, {h['sim_first_token_s']:.3f} s "
                f"simulated ({h['first_token_error']:+.0%}); total {h['total_s']:.3f} s vs "
                f"{h['sim_total_s']:.3f} s ({h['total_error']:+.0%})"
                for h in d["fit"].get("holdout", [])]])
    emit(doc, args.json, human)
    return 0


def register(sim: argparse._SubParsersAction) -> None:
    """Add ``sim calibrate-cpu`` and ``sim cpu-capacity`` to the ``sim`` group."""
    p = sim.add_parser(
        "calibrate-cpu", help="measure the engine on pinned cores; write a sim calibration",
        description="Pin to one core (1 thread; or --cores with --threads), time the "
                    "engine's prefill over prompt and cached-prefix lengths and its decode step "
                    "over batch size and context, fit the simulator's cost model and write "
                    "the calibration JSON (sim run/sweep --calibration FILE). docs/sim.md, "
                    "'CPU calibration'.")
    p.add_argument("--model", default="smollm2", help="engine --model spec (default %(default)s)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--core", type=int, default=0, help="CPU core to pin to (default 0)")
    p.add_argument("--cores", default=None, metavar="LIST",
                   help="pin to these cores instead, e.g. 0,1 (a node of several cores)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads of the timed engine (EngineConfig.num_threads; the "
                        "live --threads, e.g. 2 for ours-1w on --cores 0,1; default 1)")
    p.add_argument("--lengths", default="64,128,256,512,1024,2048",
                   help="prefill prompt lengths, tokens (default %(default)s)")
    p.add_argument("--prefix-fractions", default="0,0.5,0.75",
                   help="cached prefix share of each prompt (default %(default)s)")
    p.add_argument("--repeats", type=int, default=3, help="prefill runs per point, median")
    p.add_argument("--batches", default="1,2,4,8,16,32",
                   help="decode batch sizes (default %(default)s)")
    p.add_argument("--contexts", default="128,512,1024",
                   help="decode prompt length per sequence, tokens (default %(default)s)")
    p.add_argument("--decode-steps", type=int, default=16,
                   help="timed decode steps per (batch, context), median (default 16)")
    p.add_argument("--transfer-bandwidth-gbps", type=float, default=None,
                   help="P→D KV bandwidth in Gbps (default: one measured memory copy)")
    p.add_argument("--transfer-overhead-ms", type=float, default=2.0,
                   help="fixed cost per KV transfer, ms (default %(default)s)")
    p.add_argument("--kv-capacity-tokens", type=int, default=None,
                   help="KV tokens of one node's paged cache (default: the engine's 16384)")
    p.add_argument("--statistic", choices=("median", "min"), default="median",
                   help="reduce the repeats of a point by their median (quiet machine) or "
                        "minimum (loaded machine) (default %(default)s)")
    p.add_argument("--holdout", type=_pair, nargs="*", default=[(768, 32), (1536, 32)],
                   metavar="N:K", help="whole requests (N prompt, K output tokens) timed "
                   "for the simulated-vs-measured check, not fitted (default 768:32 1536:32)")
    p.add_argument("--mixed-chunks", default="", metavar="LIST",
                   help="also time whole engine steps of decodes plus one prefill chunk of "
                        "these sizes, tokens (e.g. 16,32,64,128,256,512), and fit the file's "
                        "'step' cost (the simulator's ours-1w node then uses it); default: "
                        "not measured, no 'step' in the file")
    p.add_argument("--mixed-decodes", default="0,1,4,12",
                   help="running decodes beside the chunk (0: prefill alone; default "
                        "%(default)s)")
    p.add_argument("--mixed-contexts", default="256,2048",
                   help="prompt tokens of each decoding request (default %(default)s)")
    p.add_argument("--mixed-offsets", default="0,1024,2048,3584,5120",
                   help="cached tokens before the chunk (rounded down to whole blocks; "
                        "default %(default)s)")
    p.add_argument("--mixed-repeats", type=int, default=2,
                   help="rounds over offsets and chunks per decode set (default %(default)s)")
    p.add_argument("--mixed-block-size", type=int, default=128,
                   help="KV block size of the engine timed for mixed steps (default "
                        "%(default)s: the live runs')")
    p.add_argument("--step-terms", default="tokens,pairs,decode_context,chunk_prefix",
                   help="variable terms of the step fit besides its fixed part, of "
                        "tokens,pairs,sequences,decode_context,chunk_prefix ('tokens' "
                        "required; default %(default)s)")
    p.add_argument("--label", default="", help="free text stored in the file (e.g. 'quiet')")
    p.add_argument("--out", default="calibration.json", help="file to write")
    add_json_flag(p)
    p.set_defaults(handler=_cmd_calibrate_cpu)
    from pymooncake.cli.sim_compare import register as register_compare
    register_compare(sim)
