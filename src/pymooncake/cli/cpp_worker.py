"""``pymooncake prefill --cpp-stages N``: the flags of a CPP prefill instance (a
chunked-pipeline group serving as one prefill instance of the cluster; docs/cpp.md) and
their checks, made before any process starts."""

from __future__ import annotations

import argparse
from typing import Any

DEFAULT_CHUNK_TOKENS = 512
DEFAULT_EDGE_TOKENS = 128
_GROUP_FLAGS = ("--cpp-min-tokens", "--cpp-chunk-tokens", "--cpp-edge-tokens", "--cpp-cores")


def add_cpp_worker_flags(p: argparse.ArgumentParser) -> None:
    """``--cpp-stages`` and the group's knobs (``prefill`` and ``serve``)."""
    from pymooncake.conductor.policy.cpp import CPP_BREAK_EVEN_TOKENS
    p.add_argument("--cpp-stages", type=int, default=None, metavar="N",
                   help="a CPP prefill group of N stage processes (N >= 2, at most the "
                        "model's layers), each holding a contiguous slice of the layers; "
                        "the Conductor sends it the long prompts (docs/cpp.md)")
    p.add_argument("--cpp-min-tokens", type=int, default=None, metavar="T",
                   help="uncached prompt tokens below which the CPP group is never used "
                        f"(default {CPP_BREAK_EVEN_TOKENS}: the measured break-even, SmolLM2 "
                        "on one core per stage; pymooncake bench cpp). One of two "
                        "conditions: a longer prompt goes to the group only when the "
                        "Conductor's cost model also predicts a smaller TTFT there "
                        "(docs/cpp.md); needs --cpp-stages")
    p.add_argument("--cpp-chunk-tokens", type=int, default=None,
                   help=f"tokens per pipeline chunk (default {DEFAULT_CHUNK_TOKENS}; needs "
                        "--cpp-stages)")
    p.add_argument("--cpp-edge-tokens", type=int, default=None,
                   help=f"chunk size at the prompt's two ends (default {DEFAULT_EDGE_TOKENS}; "
                        "0: all chunks equal; needs --cpp-stages)")
    p.add_argument("--cpp-cores", default=None,
                   help="comma-separated core per stage (default: not pinned; needs "
                        "--cpp-stages)")


def cpp_worker_config(args: argparse.Namespace) -> Any:
    """``engine.worker.cpp_prefill.CppWorkerConfig`` from the flags, or None without
    ``--cpp-stages``. Raises ``UsageError`` (exit 2) naming the flag: fewer than 2 stages,
    more stages than the model has layers, a bad chunk size or core list, a
    ``--cpp-min-tokens`` above ``--max-model-len`` or the model's context (the group could
    never be used), a group flag without ``--cpp-stages``."""
    from pymooncake.cli.main import UsageError
    n = getattr(args, "cpp_stages", None)
    if n is None:
        for flag in _GROUP_FLAGS:
            if getattr(args, flag[2:].replace("-", "_"), None) is not None:
                raise UsageError(f"{flag} sets up a CPP prefill group: add --cpp-stages N "
                                 "(N >= 2), or drop it")
        return None
    if n < 2:
        raise UsageError(f"--cpp-stages must be >= 2 (a pipeline of stages), got {n}")
    from pymooncake.conductor.policy.cpp import CPP_BREAK_EVEN_TOKENS
    for name, default in (("cpp_min_tokens", CPP_BREAK_EVEN_TOKENS),
                          ("cpp_chunk_tokens", DEFAULT_CHUNK_TOKENS),
                          ("cpp_edge_tokens", DEFAULT_EDGE_TOKENS)):
        if getattr(args, name) is None:
            setattr(args, name, default)
    from pymooncake.cli.cpp import _core_list, _ModelFacts
    facts = _ModelFacts(args.model)
    layers = facts.num_layers
    if n > layers:
        raise UsageError(f"--cpp-stages {n}: the model has {layers} layers (2 to {layers} "
                         "stages)")
    cores = None if args.cpp_cores is None else tuple(_core_list("--cpp-cores",
                                                                 args.cpp_cores))
    limits = [(v, what) for v, what in (
        (getattr(args, "max_model_len", None), "--max-model-len"),
        (facts.max_positions, "the model's context length")) if v]
    for limit, what in limits:
        if args.cpp_min_tokens > limit:
            raise UsageError(f"--cpp-min-tokens {args.cpp_min_tokens} is above {what} "
                             f"({limit} tokens): no prompt could reach the CPP group")
    from pymooncake.engine.worker.cpp_prefill import CppWorkerConfig
    try:
        return CppWorkerConfig(num_stages=n, min_prompt_tokens=args.cpp_min_tokens,
                               chunk_tokens=args.cpp_chunk_tokens,
                               edge_tokens=args.cpp_edge_tokens, cores=cores)
    except ValueError as e:
        raise UsageError(str(e)) from None


def cpp_worker_argv(args: argparse.Namespace) -> list[str]:
    """The ``--cpp-*`` flags to hand on to a ``prefill`` child (``serve``)."""
    out = ["--cpp-stages", str(args.cpp_stages), "--cpp-min-tokens", str(args.cpp_min_tokens),
           "--cpp-chunk-tokens", str(args.cpp_chunk_tokens),
           "--cpp-edge-tokens", str(args.cpp_edge_tokens)]
    if args.cpp_cores is not None:
        out += ["--cpp-cores", args.cpp_cores]
    return out
