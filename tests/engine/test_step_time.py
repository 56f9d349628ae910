"""``engine.step_time`` (the fitted step-time model), ``EngineConfig.decode_step_s`` (steps
sized to a predicted time while requests decode) and ``waiting_order="srpt"`` (shortest
remaining prompt first among waiting and running prompts)."""

from __future__ import annotations

import math

import pytest

from pymooncake.engine.step_time import StepTimeModel, attention_pairs

A, B, C = 0.05, 0.001, 2e-7     # s, s/token, s/pair: the "true" cost of the tests below


def _fed(n: int = 40) -> StepTimeModel:
    m = StepTimeModel(window=64, min_samples=16, big_tokens=64, refit_every=1)
    for i in range(n):
        tokens = 3 if i % 2 else 64 + 37 * i          # decode steps and prefill chunks
        pairs = attention_pairs(100 * i, tokens)
        m.observe(tokens, pairs, A + B * tokens + C * pairs)
    return m


def test_attention_pairs_counts_causal_query_key_pairs() -> None:
    # by hand: 3 new tokens after 2 computed see 3, 4 and 5 keys
    assert attention_pairs(2, 3) == 3 + 4 + 5
    assert attention_pairs(0, 1) == 1 and attention_pairs(10, 1) == 11
    assert attention_pairs(7, 100) == sum(7 + k for k in range(1, 101))


def test_fit_recovers_the_cost_and_max_new_tokens_solves_the_limit() -> None:
    m = _fed()
    assert m.ready
    a, b, c = m.coef  # type: ignore[misc]
    assert a == pytest.approx(A, rel=1e-6) and b == pytest.approx(B, rel=1e-6)
    assert c == pytest.approx(C, rel=1e-5)
    # room after 2 decodes (contexts 500, 700): 0.4 - (A + 2B + C·1202) s; the largest n with
    # B·n + C·n·(1000 + (n+1)/2) <= room, found here by brute force
    base_t, base_p = 2, attention_pairs(499, 1) + attention_pairs(699, 1)
    n = m.max_new_tokens(0.4, base_t, base_p, 1000)
    room = 0.4 - (A + B * base_t + C * base_p)
    best = max(k for k in range(1, 2000) if B * k + C * attention_pairs(1000, k) <= room)
    assert n in (best, best - 1)          # floating point at the boundary
    assert m.predict_s(base_t + n, base_p + attention_pairs(1000, n)) <= 0.4 + 1e-9
    assert m.max_new_tokens(A / 2, 0, 0.0, 0) == 0          # the limit is already spent


def test_not_ready_without_both_kinds_of_step_and_ignores_bad_samples() -> None:
    m = StepTimeModel(window=64, min_samples=16, big_tokens=64, refit_every=1)
    for _ in range(40):
        m.observe(2, 200.0, 0.04)               # decode steps only: per-token cost unknown
    assert not m.ready and m.max_new_tokens(1.0, 0, 0.0, 0) is None
    with pytest.raises(RuntimeError, match="not ready"):
        m.predict_s(1, 1.0)
    m2 = _fed()
    before = m2.coef
    for bad in (math.nan, math.inf, -1.0):
        m2.observe(100, 100.0, bad)
    assert m2.coef == before and len(m2.samples) == 40
    with pytest.raises(ValueError):
        StepTimeModel(window=8, min_samples=16)


torch = pytest.importorskip("torch")

from pymooncake.engine import SamplingParams  # noqa: E402

from .conftest import make_engine, random_prompts  # noqa: E402


def _run(engine, check) -> None:  # type: ignore[no-untyped-def]
    """Step ``engine`` by hand until done; ``check(schedule_output, decoding)`` each step."""
    sch = engine.scheduler
    while engine.has_unfinished():
        decoding = any(r.num_tokens - r.num_computed_tokens == 1 for r in sch.running)
        out = sch.schedule()
        check(out, decoding)
        logits = engine.runner.execute(out)
        rows = [s for s in out.scheduled if s.samples]
        sch.update_from_output(out, {s.request.request_id: (int(logits[i].argmax()), 0.0, None)
                                     for i, s in enumerate(rows)})


def test_decode_step_s_sizes_chunks_from_the_model_and_keeps_output() -> None:
    """With a fitted model, a step that decodes holds the chunk the model allows within
    ``decode_step_s`` (not the token cap); greedy output equals the plain engine's."""
    prompts = random_prompts(4, 150, 220, seed=21)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    kw = dict(enable_prefix_caching=False, prefill_chunk_tokens=128, max_num_batched_tokens=128)
    ref = make_engine(**kw).generate(prompts, params)
    engine = make_engine(**kw, decode_step_tokens=24, decode_step_s=0.3)
    m = engine.scheduler.step_time
    assert m is not None and not m.ready
    for i in range(16):   # a known model: 0.01 s + 0.004 s/token, no attention term
        t = 2 if i % 2 else 100
        m.observe(t, attention_pairs(0, t), 0.01 + 0.004 * t)
    assert m.ready and m.coef == pytest.approx((0.01, 0.004, 0.0), abs=1e-9)
    m.observe = lambda *a: None   # keep it fixed: real step times would move it

    sizes: list[tuple[int, int]] = []

    def check(out, decoding) -> None:  # type: ignore[no-untyped-def]
        if not decoding:
            return
        dec = sum(1 for s in out.scheduled if s.num_new_tokens == 1)
        chunk = out.num_batched_tokens - dec
        sizes.append((dec, chunk))
        # room for the chunk: (0.3 - 0.01 - 0.004·dec) / 0.004 tokens, at most 128 - dec
        if chunk:
            assert chunk <= min(128 - dec, int((0.3 - 0.01 - 0.004 * dec) / 0.004))

    for p in prompts:
        engine.add_request(p, params)
    _run(engine, check)
    assert any(chunk > 24 for _, chunk in sizes)     # beyond the token cap
    assert max(chunk for _, chunk in sizes) <= 72    # 0.29 s / 0.004 = 72 with no decode
    again = make_engine(**kw, decode_step_tokens=24, decode_step_s=0.3).generate(prompts, params)
    assert [o.output_token_ids for o in again] == [o.output_token_ids for o in ref]
    with pytest.raises(ValueError, match="decode_step_s"):
        make_engine(decode_step_s=0.0)


def test_srpt_pauses_a_running_prompt_for_a_shorter_one() -> None:
    """``srpt``: a 20-token prompt that arrives while a 200-token prompt is half computed
    runs first (its first token comes before the long one's); with ``shortest`` the
    running long prompt keeps the budget. Same tokens either way."""
    p = random_prompts(1, 10, 10, seed=5)[0]
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    results = {}
    for order in ("shortest", "srpt"):
        eng = make_engine(enable_prefix_caching=False, waiting_order=order,
                          prefill_chunk_tokens=32, max_num_batched_tokens=32,
                          aging_tokens_per_s=0.0)
        eng.add_request(p * 20, params, "long")
        for _ in range(3):
            eng.step()                                   # 96 of 200 tokens computed
        eng.add_request(p * 2, params, "short")
        first: list[str] = []
        done = {}
        while eng.has_unfinished():
            outs = eng.step()
            for r in eng.scheduler.running:
                if r.output_token_ids and r.request_id not in first:
                    first.append(r.request_id)
            done.update({o.request_id: o.output_token_ids for o in outs})
        results[order] = (first, done)
    assert results["srpt"][0][0] == "short"
    assert results["shortest"][0][0] == "long"
    assert results["srpt"][1] == results["shortest"][1]


def test_srpt_under_block_pressure_preempts_only_unscheduled_requests_and_loses_nothing() -> None:
    """``srpt`` with prompts of mixed lengths, chunked, and 20 blocks: preemptions happen,
    a victim is never a request already in the step (its blocks would be freed under it),
    and every output equals the roomy FCFS engine's."""
    prompts = random_prompts(8, 20, 120, seed=14)
    params = SamplingParams(max_tokens=30)
    roomy = make_engine().generate(prompts, params)
    eng = make_engine(num_kv_blocks=20, waiting_order="srpt", prefill_chunk_tokens=32,
                      max_num_batched_tokens=48)
    ids = [eng.add_request(p, params) for p in prompts]
    done = {}

    def check(out, decoding) -> None:  # type: ignore[no-untyped-def]
        victims = {id(r) for r in out.preempted}
        assert not victims & {id(s.request) for s in out.scheduled}

    sch = eng.scheduler
    while eng.has_unfinished():
        out = sch.schedule()
        check(out, False)
        logits = eng.runner.execute(out)
        rows = [s for s in out.scheduled if s.samples]
        for r in sch.update_from_output(out, {s.request.request_id: (int(logits[i].argmax()),
                                                                     0.0, None)
                                              for i, s in enumerate(rows)}):
            done[r.request_id] = tuple(r.output_token_ids)
    assert sch.num_preemptions > 0
    assert [done[i] for i in ids] == [o.output_token_ids for o in roomy]
    eng.kv_manager.check_integrity()
