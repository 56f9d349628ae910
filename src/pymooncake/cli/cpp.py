"""``pymooncake cpp run`` (a CPP prefill group, one prompt through it) and
``pymooncake bench cpp`` (TTFT against one worker, break-even). docs/cpp.md."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from pymooncake.cli.common import add_group, add_json_flag, emit


def _add_common(p: argparse.ArgumentParser) -> None:
    from pymooncake.cli.role_common import add_model_flag
    add_model_flag(p)
    p.add_argument("--stages", type=int, default=2, help="pipeline stages (default 2)")
    p.add_argument("--chunk-tokens", type=int, default=512,
                   help="tokens per pipeline chunk (default 512)")
    p.add_argument("--edge-tokens", type=int, default=128,
                   help="chunk size of the first chunk and of the last --chunk-tokens tokens "
                        "(shorter pipeline fill and drain; default 128; 0: all chunks equal)")
    p.add_argument("--cores", default=None,
                   help="comma-separated core per stage (default: the first allowed cores)")
    add_json_flag(p)


def register(subparsers: argparse._SubParsersAction) -> None:
    cpp = add_group(subparsers, "cpp", "chunked pipeline parallelism for long prefills")
    p = cpp.add_parser(
        "run", help="start a CPP group and prefill one random prompt through it",
        description="Starts --stages stage processes (one core, one torch thread each, a "
                    "contiguous slice of the model's layers each), prefills a random "
                    "--prompt-len token prompt in --chunk-tokens chunks through the "
                    "pipeline and prints the TTFT, the first token (greedy) and per-stage "
                    "compute and hop times.")
    _add_common(p)
    p.add_argument("--prompt-len", type=int, default=4096,
                   help="random prompt tokens (default 4096; ignored with --prompt/--ids)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", default=None,
                     help="prompt text, tokenized with the model's tokenizer")
    src.add_argument("--ids", default=None, help="comma-separated prompt token ids")
    p.add_argument("--seed", type=int, default=0, help="prompt seed (default 0)")
    p.set_defaults(handler=_cmd_run)


def register_bench(bench: argparse._SubParsersAction) -> None:
    p = bench.add_parser(
        "cpp", help="CPP group vs one worker: TTFT per prompt length and the break-even",
        description="One worker (its own core) and a CPP group (one core per stage) stay up "
                    "and take the same fresh random prompts interleaved; reports TTFT "
                    "median [min-max] per length, CPP/single, whether the first tokens "
                    "agree, the hidden-state hop time and the break-even prompt length "
                    "(measured, and from the cost model fitted to the run).")
    _add_common(p)
    p.add_argument("--prompt-len", type=int, default=4096,
                   help="the headline prompt length (default 4096)")
    p.add_argument("--sweep", default="512,768,1024,1536,2048",
                   help="further prompt lengths for the break-even (default %(default)s; "
                        "'' for none)")
    p.add_argument("--repeats", type=int, default=3, help="interleaved repeats (default 3)")
    p.add_argument("--single-cores", default=None,
                   help="comma-separated cores of the single-worker baseline, used in turn "
                        "by repeat (default: the stages' cores)")
    p.set_defaults(handler=_cmd_bench)


def _cores(args: argparse.Namespace) -> list[int] | None:
    from pymooncake.cli.main import UsageError
    for flag, value, low in (("--stages", args.stages, 1),
                             ("--chunk-tokens", args.chunk_tokens, 1),
                             ("--edge-tokens", args.edge_tokens, 0)):
        if value < low:
            raise UsageError(f"{flag} must be >= {low}, got {value}")
    if args.cores is None:
        return None
    cores = _core_list("--cores", args.cores)
    if len(cores) != args.stages:
        raise UsageError(f"--cores names {len(cores)} cores for {args.stages} stages")
    return cores


def _core_list(flag: str, text: str) -> list[int]:
    """Comma-separated core numbers, each one this process may run on (rc 2 otherwise)."""
    import os

    from pymooncake.cli.main import UsageError
    try:
        cores = [int(c) for c in text.split(",") if c.strip()]
    except ValueError:
        raise UsageError(f"{flag} {text!r}: comma-separated core numbers") from None
    allowed = sorted(os.sched_getaffinity(0))
    bad = [c for c in cores if c not in allowed]
    if bad:
        raise UsageError(f"{flag}: core(s) {', '.join(map(str, bad))} not available "
                         f"(allowed: {_ranges(allowed)})")
    return cores


def _ranges(xs: list[int]) -> str:
    out: list[str] = []
    for x in xs:
        if out and out[-1].split("-")[-1] == str(x - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{x}"
        else:
            out.append(str(x))
    return ",".join(out)


class _ModelFacts:
    """What ``cpp`` checks before it starts a stage, read from the model's configuration
    (no weights): layers, vocabulary, context length (max positions) and tokenizer source."""

    TINY_MAX_POSITIONS = 8192
    """The embedded ``tiny`` model has no trained context; the project's default
    ``--max-model-len`` bounds it."""

    def __init__(self, spec: str) -> None:
        import json

        from pymooncake.cli.main import CommandError
        from pymooncake.cli.role_common import resolve_model_arg
        from pymooncake.engine.model.loader import ModelLoadError
        self.source = resolve_model_arg(spec)   # rc 1 naming --model (like every command)
        max_pos: object = None
        try:
            if self.source.kind == "tiny":
                from pymooncake.engine.model.tiny import tiny_config
                mc = tiny_config()
                max_pos = self.TINY_MAX_POSITIONS
            elif self.source.kind == "hf":
                from pymooncake.engine.model.loader import read_model_config
                mc = read_model_config(self.source.path)
                try:
                    cfg = json.loads((self.source.path / "config.json").read_text())
                    max_pos = cfg.get("max_position_embeddings")
                except (OSError, ValueError, AttributeError):
                    max_pos = None
            else:
                from pymooncake.engine.model.gguf import gguf_model_config, read_gguf
                g = read_gguf(self.source.path)
                mc = gguf_model_config(g)
                arch = g.metadata.get("general.architecture")
                max_pos = g.metadata.get(f"{arch}.context_length")
        except (ModelLoadError, ValueError, OSError) as e:
            raise CommandError(f"--model {spec}: {' '.join(str(e).split())}") from None
        self.num_layers, self.vocab_size = mc.num_layers, mc.vocab_size
        self.max_positions: int | None = (
            int(max_pos) if isinstance(max_pos, int) and max_pos > 0 else None)

    def check(self, args: argparse.Namespace, prompt_lens: list[int]) -> None:
        """``--stages`` within the model's layers, prompt lengths within its context."""
        from pymooncake.cli.main import UsageError
        if args.stages > self.num_layers:
            raise UsageError(f"--stages {args.stages}: the model has {self.num_layers} layers "
                             f"(1 to {self.num_layers} stages)")
        over = [n for n in prompt_lens if self.max_positions and n > self.max_positions]
        if over:
            raise UsageError(f"prompt length {max(over)} exceeds the model's context length "
                             f"(max positions) {self.max_positions}")

    def tokenize(self, text: str) -> list[int]:
        from pymooncake.cli.main import CommandError
        from pymooncake.engine.model.tokenizer import load_tokenizer
        try:
            return list(load_tokenizer(self.source).encode(text))
        except Exception as e:  # noqa: BLE001 - tokenizer libraries raise plain Exception
            raise CommandError(f"--prompt: cannot tokenize with the model's tokenizer "
                               f"({' '.join(str(e).split())[:200] or type(e).__name__})"
                               ) from None


def _prompt_ids(args: argparse.Namespace, facts: _ModelFacts) -> list[int] | None:
    """The ``--prompt`` / ``--ids`` token ids (None: a random ``--prompt-len`` prompt)."""
    from pymooncake.cli.main import UsageError
    if args.ids is not None:
        try:
            ids = [int(x) for x in args.ids.split(",") if x.strip()]
        except ValueError:
            raise UsageError(f"--ids {args.ids!r}: comma-separated token ids") from None
        bad = [i for i in ids if not 0 <= i < facts.vocab_size]
        if bad:
            raise UsageError(f"--ids: token id {bad[0]} is outside the model's vocabulary "
                             f"[0, {facts.vocab_size})")
    elif args.prompt is not None:
        ids = facts.tokenize(args.prompt)
    else:
        return None
    if not ids:
        raise UsageError("--prompt/--ids: the prompt has no tokens")
    return ids


def _cmd_run(args: argparse.Namespace) -> int:
    import random

    from pymooncake.cli.main import CommandError, UsageError
    cores = _cores(args)
    if args.prompt_len < 1:
        raise UsageError("--prompt-len must be >= 1")
    facts = _ModelFacts(args.model)
    given = _prompt_ids(args, facts)
    n = len(given) if given is not None else args.prompt_len
    facts.check(args, [n])
    from pymooncake.engine.cpp.group import CppError, CppGroup  # torch: after validation
    try:
        with CppGroup(args.model, args.stages, cores, num_blocks=-(-n // 16) + 16,
                      chunk_tokens=args.chunk_tokens, edge_tokens=args.edge_tokens) as g:
            rng = random.Random(args.seed)
            ids = given if given is not None else [rng.randrange(3, g.vocab_size)
                                                   for _ in range(n)]
            res = g.prefill(ids)
            stats = g.stats(res.request_id)
    except CppError as e:
        raise CommandError(str(e)) from None
    doc: dict[str, Any] = {
        "model": args.model, "stages": [list(r) for r in g.ranges],
        "prompt_tokens": n, "chunk_tokens": args.chunk_tokens,
        "ttft_s": res.ttft_s, "first_token": res.first_token,
        "stage_compute_s": [sum(s.get("compute_s", [])) for s in stats],
        "hop_send_s": [s.get("send_s", []) for s in stats[:-1]],
    }
    emit(doc, args.json, _format_run)
    return 0


def _format_run(doc: dict[str, Any]) -> str:
    hops = [h for s in doc["hop_send_s"] for h in s]
    hop = f", hop median {sorted(hops)[len(hops) // 2] * 1e3:.2f} ms" if hops else ""
    return (f"CPP {len(doc['stages'])} stages (layers {doc['stages']}), "
            f"{doc['prompt_tokens']} tokens in chunks of {doc['chunk_tokens']}: TTFT "
            f"{doc['ttft_s']:.3f} s, first token {doc['first_token']}, stage compute "
            f"{', '.join(f'{s:.3f}' for s in doc['stage_compute_s'])} s{hop}")


def _cmd_bench(args: argparse.Namespace) -> int:
    from pymooncake.cli.main import CommandError, UsageError
    cores = _cores(args)
    single_cores = _core_list("--single-cores", args.single_cores or "")
    try:
        lens = [args.prompt_len] + [int(x) for x in args.sweep.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--sweep {args.sweep!r}: comma-separated prompt lengths") from None
    if min(lens) < 1 or args.repeats < 1:
        raise UsageError("prompt lengths and --repeats must be >= 1")
    _ModelFacts(args.model).check(args, lens)
    from pymooncake.bench.cpp import format_human, run_cpp_bench  # torch: after validation
    from pymooncake.engine.cpp.group import CppError
    try:
        doc = run_cpp_bench(args.model, args.stages, lens, args.repeats, args.chunk_tokens,
                            cores, edge_tokens=args.edge_tokens, single_cores=single_cores,
                            progress=lambda m: print(m, file=sys.stderr, flush=True))
    except (CppError, RuntimeError, ValueError) as e:
        raise CommandError(str(e)) from None
    head = next(r for r in doc["results"] if r["prompt_tokens"] == args.prompt_len)
    doc["headline"] = {"prompt_tokens": args.prompt_len, "ratio": head["ratio"],
                       "target_ratio": 0.65, "met": head["ratio"] <= 0.65
                       and head["first_token_same"]}
    emit(doc, args.json, format_human)
    return 0
