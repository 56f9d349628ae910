"""``engine.worker.config.engine_config``: each role's step budget and prefill chunk.

A prefill worker computes one prompt at a time with nothing decoding beside it, so its
chunk of a prompt is its whole step budget: a prompt up to the budget is one step (a
512-token chunk cap there only added steps, each with the fixed cost of a step: the
per-layer hooks and, for a tail, a new oneDNN shape; issue 16). A colocated worker keeps
one 512-token chunk a step, which bounds the TBT of the decodes running beside it.
"""

from __future__ import annotations

from pymooncake.engine import Engine
from pymooncake.engine.config import EngineConfig
from pymooncake.engine.sampling import SamplingParams
from pymooncake.engine.worker.config import WorkerConfig, engine_config


def _cfg(role: str, **kw: object) -> EngineConfig:
    return engine_config(WorkerConfig(role, role, "127.0.0.1:1", **kw), role)


def test_each_roles_budget_and_chunk() -> None:
    default_budget = EngineConfig().max_num_batched_tokens      # 2048
    p = _cfg("prefill")
    assert (p.max_num_batched_tokens, p.prefill_chunk_tokens) == (default_budget, 2048)
    assert p.max_num_seqs == 1                                   # prefill_batch 1
    p1k = _cfg("prefill", max_num_batched_tokens=1024)
    assert (p1k.max_num_batched_tokens, p1k.prefill_chunk_tokens) == (1024, 1024)
    c = _cfg("colocated")
    assert (c.max_num_batched_tokens, c.prefill_chunk_tokens) == (512, 512)
    d = _cfg("decode")
    assert d.max_num_batched_tokens == default_budget


def _steps_to_prefill(cfg: EngineConfig, n: int) -> int:
    eng = Engine.from_model_name("tiny", EngineConfig(
        num_kv_blocks=256, max_model_len=2048, enable_prefix_caching=False,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        prefill_chunk_tokens=cfg.prefill_chunk_tokens, max_num_seqs=cfg.max_num_seqs))
    eng.add_request([3 + i % 200 for i in range(n)], SamplingParams(max_tokens=1,
                                                                    temperature=0.0))
    steps = 0
    while eng.has_unfinished():
        eng.step()
        steps += 1
    return steps


def test_a_prefill_worker_computes_a_prompt_up_to_its_budget_in_one_step() -> None:
    # 1,300 tokens: ceil(1300 / 512) = 3 chunks on a colocated worker, 1 on a prefill one
    assert _steps_to_prefill(_cfg("colocated"), 1300) == 3
    assert _steps_to_prefill(_cfg("prefill"), 1300) == 1
    # a prompt past the budget is still chunked, at the budget: ceil(2047 / 1024) = 2
    assert _steps_to_prefill(_cfg("prefill"), 2047) == 1
    assert _steps_to_prefill(_cfg("prefill", max_num_batched_tokens=1024), 2047) == 2


def test_a_requests_own_chunk_cap_holds_until_it_is_cleared() -> None:
    """``Request.max_chunk_tokens`` (a prefill worker sets it while a prompt's KV target is
    on its way): 1,300 tokens at a 2,048 chunk: capped at 512, two steps compute 512 each;
    the cap cleared, the next step computes the other 276 and finishes the prefill."""
    eng = Engine.from_model_name("tiny", EngineConfig(
        num_kv_blocks=256, max_model_len=2048, enable_prefix_caching=False,
        prefill_chunk_tokens=2048, max_num_seqs=1))
    rid = eng.add_request([3 + i % 200 for i in range(1300)],
                          SamplingParams(max_tokens=1, temperature=0.0))
    req = eng.requests[rid]
    req.max_chunk_tokens = 512
    eng.step()
    assert req.num_computed_tokens == 512
    eng.step()
    assert req.num_computed_tokens == 1024          # still capped
    req.max_chunk_tokens = None
    assert eng.step() and not eng.has_unfinished()  # the other 276 tokens, finished
