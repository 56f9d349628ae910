"""``pymooncake profile``: measure the engine's prefill time over (prompt length, cached
prefix length) and fit the Conductor's prefill estimator to it (``conductor --profile``).
docs/serving.md, "Running".
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from pymooncake.cli.common import add_json_flag
from pymooncake.cli.role_common import add_model_flag, resolve_model_arg


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``profile``."""
    pr = subparsers.add_parser(
        "profile", help="measure prefill time over (input length, prefix length)",
        description="Run the engine's prefill at several prompt and cached-prefix lengths and "
                    "write the (tokens, prefix tokens, seconds) samples and the fitted "
                    "estimator as JSON (the Conductor's --profile).")
    add_model_flag(pr)
    pr.add_argument("--lengths", default="128,256,512,1024,2048",
                    help="comma-separated prompt lengths (tokens)")
    pr.add_argument("--prefix-fractions", default="0,0.5", help="cached prefix fractions")
    pr.add_argument("--repeats", type=int, default=3, help="runs per point (median)")
    pr.add_argument("--out", default=None, help="write the profile JSON here")
    add_json_flag(pr)
    pr.set_defaults(handler=_cmd_profile)


def _cmd_profile(args: argparse.Namespace) -> int:
    from pymooncake.cli.common import emit
    from pymooncake.cli.main import UsageError, require_extras
    resolve_model_arg(args.model)
    require_extras("torch")
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
