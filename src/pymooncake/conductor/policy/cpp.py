"""When a prompt goes to the chunked-pipeline (CPP) prefill group (FAST'25 §5.1, docs/cpp.md).

A CPP group of ``N`` stages holds the model's layers in ``N`` contiguous slices; a prompt's
uncached tokens are cut into chunks of ``chunk_tokens`` that flow through the stages (chunk
``k`` in stage ``i`` while chunk ``k + 1`` is in stage ``i − 1``). Its prefill time is the
pipeline's makespan: with ``c_k`` the single worker's time for chunk ``k`` (the
``PrefillEstimator``'s increment from the chunk's start to its end, so later chunks cost more:
they attend to more context) and a stage doing ``c_k / N`` of it,

    F[i][k] = max(F[i−1][k] + hop_s, F[i][k−1]) + c_k / N,      T_cpp = F[N−1][K−1] + overhead_s

which is ``T_single / N`` plus the fill/drain (the first chunk through stages ``0..N−2``, the
last through the last stage) plus one hop per stage boundary on the critical path. A short
prompt (one chunk) gains nothing and pays the hops: CPP pays from a break-even length on,
measured by ``pymooncake bench cpp`` and kept in ``min_prompt_tokens``. Pure functions, no
clock, no I/O (DESIGN.md §2).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pymooncake.conductor.policy.estimators import PrefillEstimator

CPP_BREAK_EVEN_TOKENS = 560
"""The measured break-even prompt length of a 2-stage CPP group against one worker
(SmolLM2-135M, float32, one core per stage, 512-token chunks with 128-token edges):
``pymooncake bench cpp`` at c584cad measured 557 tokens (wall-clock TTFT ratio crossing 1
between 512 and 640 tokens; the cost model fitted to the same run says 528), rounded up to
a 16-token block. Shorter prompts prefill faster on one worker (docs/benchmarks.md)."""

SMOLLM2_SINGLE_CORE = PrefillEstimator(quadratic_s=2.127e-7, linear_s=9.847e-4)
"""One worker, one core (SmolLM2-135M float32): ``fit_prefill_estimator`` of the worker's
CPU seconds per prefill in that run (512-4,096 tokens: 0.56-7.74 s; the wall-clock times of
the shared machine were 2x that), the default ``CppCostModel.single``."""


@dataclass(frozen=True, slots=True)
class CppCostModel:
    """What the policy knows about one CPP group and the single worker it competes with."""

    num_stages: int = 2
    chunk_tokens: int = 512
    single: PrefillEstimator = field(default=SMOLLM2_SINGLE_CORE)
    """Prefill time of one (single-core) worker; the group's stages are such workers."""
    hop_s: float = 0.003
    """One chunk's hidden states from a stage to the next (s)."""
    overhead_s: float = 0.002
    """Per CPP prefill: dispatch to stage 0 and the first token back from the last (s)."""
    min_prompt_tokens: int = CPP_BREAK_EVEN_TOKENS
    """Measured break-even: never CPP below this many uncached tokens."""
    edge_tokens: int = 128
    """Chunk size at the prompt's two ends (``chunk_sizes``; the group's default); 0: all
    chunks equal."""

    def __post_init__(self) -> None:
        if self.num_stages < 1 or self.chunk_tokens < 1 or self.edge_tokens < 0:
            raise ValueError(f"num_stages and chunk_tokens must be >= 1, got "
                             f"{self.num_stages}, {self.chunk_tokens}")
        if self.hop_s < 0 or self.overhead_s < 0 or self.min_prompt_tokens < 0:
            raise ValueError("hop_s, overhead_s and min_prompt_tokens must be >= 0")


def chunk_sizes(num_tokens: int, chunk_tokens: int, edge_tokens: int = 0) -> list[int]:
    """Chunk lengths of a ``num_tokens`` prefill, as the group cuts it
    (``engine.cpp.runtime.chunk_bounds``): ``chunk_tokens`` each; with ``0 < edge_tokens <
    chunk_tokens`` and more than two chunks' worth, the first chunk and the last
    ``chunk_tokens`` tokens in chunks of ``edge_tokens`` (shorter fill and drain)."""
    if num_tokens <= 0:
        return []
    if not 0 < edge_tokens < chunk_tokens or num_tokens <= 2 * chunk_tokens:
        return [min(chunk_tokens, num_tokens - s) for s in range(0, num_tokens, chunk_tokens)]
    tail = num_tokens - chunk_tokens
    return ([edge_tokens] + [min(chunk_tokens, tail - s)
                             for s in range(edge_tokens, tail, chunk_tokens)]
            + [min(edge_tokens, num_tokens - s) for s in range(tail, num_tokens, edge_tokens)])


def cpp_prefill_s(model: CppCostModel, num_tokens: int, num_prefix_tokens: int = 0) -> float:
    """Predicted CPP prefill time (s) of ``num_tokens`` with ``num_prefix_tokens`` reused
    (the pipeline recurrence in the module docstring; 0 when nothing is left to compute)."""
    p = min(max(num_prefix_tokens, 0), num_tokens)
    if p >= num_tokens:
        return 0.0
    n_st, est = model.num_stages, model.single
    finish = [0.0] * n_st  # F[i] of the previous chunk
    start = p
    for size in chunk_sizes(num_tokens - p, model.chunk_tokens, model.edge_tokens):
        end = start + size
        work = (est.quadratic_s * (end * end - start * start)
                + est.linear_s * (end - start)) / n_st
        ready = 0.0
        for i in range(n_st):
            hop = model.hop_s if i else 0.0
            finish[i] = max(ready + hop, finish[i]) + work
            ready = finish[i]
        start = end
    return finish[-1] + model.overhead_s + est.overhead_s


def single_prefill_s(model: CppCostModel, num_tokens: int, num_prefix_tokens: int = 0) -> float:
    """Predicted prefill time (s) on one worker (``model.single``)."""
    return model.single.prefill_s(num_tokens, num_prefix_tokens)


def break_even_tokens(model: CppCostModel, max_tokens: int = 16384, step: int = 16) -> int | None:
    """Smallest prompt length (a multiple of ``step``) from which the cost model predicts CPP
    faster than one worker at every length up to ``max_tokens``; ``None`` if never."""
    best = None
    for n in range(max_tokens - max_tokens % step, 0, -step):
        if cpp_prefill_s(model, n) < single_prefill_s(model, n):
            best = n
        else:
            break
    return best


def use_cpp(num_tokens: int, num_prefix_tokens: int, model: CppCostModel,
            single_queue_s: float = 0.0, cpp_queue_s: float = 0.0) -> bool:
    """Send the prefill to the CPP group? Only when its uncached part is at least the
    measured break-even (``model.min_prompt_tokens``) and the predicted TTFT through the
    group (its queue + ``cpp_prefill_s``) beats the best single worker's (its queue +
    ``single_prefill_s``)."""
    uncached = num_tokens - min(max(num_prefix_tokens, 0), num_tokens)
    if model.num_stages < 2 or uncached < max(model.min_prompt_tokens, 1):
        return False
    cpp = cpp_queue_s + cpp_prefill_s(model, num_tokens, num_prefix_tokens)
    single = single_queue_s + single_prefill_s(model, num_tokens, num_prefix_tokens)
    return cpp < single
