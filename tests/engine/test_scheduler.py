"""Continuous batching: batch-size invariance of greedy output, chunked prefill, preemption
by recompute, stop conditions, sampling and roles."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from pymooncake.engine import FinishReason, SamplingParams  # noqa: E402
from pymooncake.engine.model.tokenizer import ByteTokenizer  # noqa: E402

from .conftest import make_engine, random_prompts  # noqa: E402

PARAMS = SamplingParams(max_tokens=12, return_logits=True)


def test_greedy_deterministic_and_identical_between_batch_1_and_8() -> None:
    prompts = random_prompts(8, 20, 90, seed=11)
    singles = []
    for p in prompts:
        (o,) = make_engine(enable_prefix_caching=False).generate([p], PARAMS)
        singles.append(o)
    batched = make_engine(enable_prefix_caching=False).generate(prompts, PARAMS)
    again = make_engine(enable_prefix_caching=False).generate(prompts, PARAMS)
    for s, b, a in zip(singles, batched, again, strict=True):
        assert b.output_token_ids == s.output_token_ids
        assert a.output_token_ids == b.output_token_ids
        assert len(b.output_token_ids) == 12 and b.finish_reason == FinishReason.LENGTH
        diff = (torch.stack(list(s.logits)) - torch.stack(list(b.logits))).abs().max()
        assert float(diff) <= 1e-4


def test_chunked_prefill_equals_one_shot() -> None:
    prompts = random_prompts(3, 100, 150, seed=12)
    one_shot = make_engine(enable_prefix_caching=False).generate(prompts, PARAMS)
    engine = make_engine(enable_prefix_caching=False, prefill_chunk_tokens=16,
                         max_num_batched_tokens=40)
    chunked = engine.generate(prompts, PARAMS)
    for a, b in zip(one_shot, chunked, strict=True):
        assert a.output_token_ids == b.output_token_ids
        diff = (torch.stack(list(a.logits)) - torch.stack(list(b.logits))).abs().max()
        assert float(diff) <= 1e-4


def test_token_budget_is_respected_each_step() -> None:
    engine = make_engine(prefill_chunk_tokens=32, max_num_batched_tokens=48)
    for p in random_prompts(5, 60, 80, seed=13):
        engine.add_request(p, SamplingParams(max_tokens=3))
    while engine.has_unfinished():
        out = engine.scheduler.schedule()
        assert 0 < out.num_batched_tokens <= 48
        assert all(s.num_new_tokens <= 32 for s in out.scheduled)
        logits = engine.runner.execute(out)
        rows = [s for s in out.scheduled if s.samples]
        assert logits.shape[0] == len(rows)
        sampled = {s.request.request_id: (int(logits[i].argmax()), 0.0, None)
                   for i, s in enumerate(rows)}
        engine.scheduler.update_from_output(out, sampled)


def test_decode_step_tokens_caps_only_steps_that_decode() -> None:
    """``decode_step_tokens``: while a request decodes, a step computes at most that many
    tokens (its decode and a short prefill chunk); a step with no decode keeps the full
    ``max_num_batched_tokens``. Output equals the uncapped engine's (same greedy tokens)."""
    prompts = random_prompts(4, 150, 220, seed=21)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    ref = make_engine(enable_prefix_caching=False, prefill_chunk_tokens=128,
                      max_num_batched_tokens=128).generate(prompts, params)
    engine = make_engine(enable_prefix_caching=False, prefill_chunk_tokens=128,
                         max_num_batched_tokens=128, decode_step_tokens=24)
    for p in prompts:
        engine.add_request(p, params)
    capped = full = 0
    while engine.has_unfinished():
        sch = engine.scheduler
        decoding = any(r.num_tokens - r.num_computed_tokens == 1 for r in sch.running)
        out = sch.schedule()
        if decoding:
            assert out.num_batched_tokens <= 24
            capped += 1
        elif out.num_batched_tokens == 128:
            full += 1
        logits = engine.runner.execute(out)
        rows = [s for s in out.scheduled if s.samples]
        sch.update_from_output(out, {s.request.request_id: (int(logits[i].argmax()), 0.0, None)
                                     for i, s in enumerate(rows)})
    assert capped > 0 and full > 0
    again = make_engine(enable_prefix_caching=False, prefill_chunk_tokens=128,
                        max_num_batched_tokens=128, decode_step_tokens=24).generate(prompts,
                                                                                    params)
    assert [o.output_token_ids for o in again] == [o.output_token_ids for o in ref]


def test_preemption_by_recompute_loses_nothing() -> None:
    prompts = random_prompts(8, 40, 60, seed=14)
    params = SamplingParams(max_tokens=40)
    roomy = make_engine().generate(prompts, params)
    # 8 requests need ~5-7 blocks each; 20 blocks force preemptions
    tight_engine = make_engine(num_kv_blocks=20)
    tight = tight_engine.generate(prompts, params)
    assert tight_engine.scheduler.num_preemptions > 0
    assert sum(o.num_preemptions for o in tight) > 0
    assert [o.output_token_ids for o in tight] == [o.output_token_ids for o in roomy]
    tight_engine.kv_manager.check_integrity()
    assert tight_engine.pool.num_free_blocks == 20


def test_stop_conditions() -> None:
    engine = make_engine()
    (p,) = random_prompts(1, 30, 30, seed=15)
    (free,) = engine.generate([p], SamplingParams(max_tokens=10))
    toks = free.output_token_ids
    (by_id,) = engine.generate([p], SamplingParams(max_tokens=10, stop_token_ids=(toks[3],)))
    assert by_id.output_token_ids == toks[:toks.index(toks[3]) + 1]
    assert by_id.finish_reason == FinishReason.STOP
    text = ByteTokenizer().decode(list(toks))
    stop = text[2:4] if len(text) >= 4 else None
    if stop:
        (by_str,) = engine.generate([p], SamplingParams(max_tokens=10, stop=(stop,)))
        assert by_str.finish_reason == FinishReason.STOP
        assert stop in by_str.text and len(by_str.output_token_ids) < 10
    # EOS: make the model's own greedy token the EOS id of this engine
    engine.scheduler.eos_token_ids = (toks[0],)
    (eos,) = engine.generate([p], SamplingParams(max_tokens=10))
    assert eos.output_token_ids == (toks[0],) and eos.finish_reason == FinishReason.STOP
    (ign,) = engine.generate([p], SamplingParams(max_tokens=10, ignore_eos=True))
    assert ign.output_token_ids == toks


def test_sampling_seed_topk_topp_and_logprobs() -> None:
    engine = make_engine()
    (p,) = random_prompts(1, 20, 20, seed=16)
    sp = SamplingParams(max_tokens=8, temperature=0.8, top_k=20, top_p=0.9, seed=7,
                        logprobs=True, return_logits=True)
    a, b = engine.generate([p, p], [sp, sp])
    assert a.output_token_ids == b.output_token_ids  # same seed, same tokens
    (c,) = engine.generate([p], SamplingParams(max_tokens=8, temperature=0.8, seed=8))
    assert len(c.output_token_ids) == 8
    for tok, lp, logits in zip(a.output_token_ids, a.logprobs, a.logits, strict=True):
        ref = torch.log_softmax(logits.double(), -1)
        assert abs(lp - float(ref[tok])) < 1e-6
        # top-k: the chosen token is among the 20 most likely
        assert tok in torch.topk(logits, 20).indices.tolist()
    (k1,) = engine.generate([p], SamplingParams(max_tokens=5, temperature=1.0, top_k=1, seed=3))
    (g,) = engine.generate([p], SamplingParams(max_tokens=5))
    assert k1.output_token_ids == g.output_token_ids  # top_k=1 is greedy


def test_prefill_role_stops_after_first_token_and_keeps_kv() -> None:
    engine = make_engine(role="prefill")
    (p,) = random_prompts(1, 50, 50, seed=17)
    (o,) = engine.generate([p], SamplingParams(max_tokens=16))
    assert len(o.output_token_ids) == 1
    assert len(engine.export_blocks(p)) == 3


def test_bad_requests_are_rejected_clearly() -> None:
    engine = make_engine(max_model_len=64)
    with pytest.raises(ValueError, match="outside"):
        engine.add_request([1, 2, 999])
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request(list(range(60)), SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="must not be empty"):
        engine.add_request([])
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    (o,) = engine.generate([[256, 1, 2]], SamplingParams(max_tokens=2))
    assert len(o.output_token_ids) == 2


def _attention_path(engine, path: str):
    """Force one decode/prefill attention path on ``engine``'s runner: ``kernel`` (the C
    kernels read the paged cache in place), ``workspace`` (SDPA over the DecodeWorkspace)
    or ``gather`` (SDPA over a per-step gather of the paged blocks)."""
    from pymooncake.engine.runner import DecodeWorkspace
    runner = engine.runner
    runner.use_kernels = path == "kernel"
    runner.workspace = DecodeWorkspace(runner.kv) if path == "workspace" else None
    return engine


def test_decode_attention_paths_agree() -> None:
    """The C kernel (in place), the workspace and the per-step gather give the same tokens
    and logits up to float32 rounding, while requests join and leave (refills, appends)."""
    from pymooncake.engine import kernels
    prompts = random_prompts(6, 20, 70, seed=18)
    params = SamplingParams(max_tokens=20, return_logits=True)
    paths = ["workspace", "gather"] + (["kernel"] if kernels.available() else [])
    runs = {p: _attention_path(make_engine(max_num_batched_tokens=64, prefill_chunk_tokens=32),
                               p).generate(prompts, params) for p in paths}
    for path in paths[1:]:
        for x, y in zip(runs[path], runs["workspace"], strict=True):
            assert x.output_token_ids == y.output_token_ids, path
            lx, ly = torch.stack(list(x.logits)), torch.stack(list(y.logits))
            # the paths sum in different orders: fp32 rounding only, i.e. a few ulps of the
            # largest logit (2e-6 relative = 16 ulps; measured 7.6e-6 absolute on logits of
            # ~15 with MKL GEMMs, 1.2e-5 with oneDNN's), never a real difference
            assert float((lx - ly).abs().max()) <= 2e-6 * float(ly.abs().max()), path


def test_shortest_waiting_order_runs_short_prompts_first_and_ages_long_ones() -> None:
    """``waiting_order="shortest"`` (prefill role, one prompt at a time): the queued prompts
    run fewest-tokens-first; a long prompt that has waited ``len/aging`` seconds goes
    ahead of shorter newcomers (no starvation). Clock injected, so no timing."""
    now = [0.0]
    eng = make_engine(role="prefill", max_num_seqs=1, waiting_order="shortest",
                      aging_tokens_per_s=100.0)
    eng.scheduler.clock = lambda: now[0]
    order: list[str] = []
    p = random_prompts(4, 10, 10, seed=3)[0]
    eng.add_request(p * 3, SamplingParams(max_tokens=1), "first")      # 30 tokens
    eng.add_request(p * 20, SamplingParams(max_tokens=1), "long")      # 200
    eng.add_request(p * 5, SamplingParams(max_tokens=1), "mid")        # 50
    eng.add_request(p * 2, SamplingParams(max_tokens=1), "short")      # 20
    while eng.has_unfinished():
        order += [o.request_id for o in eng.step()]
    assert order == ["short", "first", "mid", "long"]
    # aging: "long" (200) queued at t=0; at t=2 s it counts as 200 - 2*100 = 0 tokens, so it
    # goes before a 20-token prompt that arrived at t=2
    order = []
    eng.add_request(p * 3, SamplingParams(max_tokens=1), "head")
    eng.add_request(p * 20, SamplingParams(max_tokens=1), "old-long")
    now[0] = 2.0
    eng.add_request(p * 2, SamplingParams(max_tokens=1), "new-short")
    while eng.has_unfinished():
        order += [o.request_id for o in eng.step()]
    assert order == ["head", "old-long", "new-short"]
    with pytest.raises(ValueError, match="waiting_order"):
        make_engine(waiting_order="random")


@pytest.mark.parametrize("order", ["fcfs", "shortest", "srpt"])
def test_a_prompt_waits_for_its_prefix_still_being_computed(order: str) -> None:
    """B shares A's first 6 blocks (16 tokens each) and arrives after A's first chunk (one
    16-token block a step, a 40-token budget). Admitting B at once would recompute blocks
    1-5 beside A; B instead waits until A has computed them (``prefix_in_progress``) and
    starts with 6 x 16 = 96 tokens cached. Greedy output equals an engine without cache."""
    a, tail = random_prompts(2, 117, 117, seed=31)          # A: 7 blocks + 5 tokens
    b = a[:96] + tail[1:21]                                  # B: A's 6 blocks + 20 tokens
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    eng = make_engine(prefill_chunk_tokens=16, max_num_batched_tokens=40, waiting_order=order)
    assert eng.config.block_size == 16
    eng.add_request(a, params, "A")
    assert eng.step() == []                                   # A: tokens 0-15
    eng.add_request(b, params, "B")
    waited = 0
    outs = {}
    while eng.has_unfinished():
        waiting = [r.request_id for r in eng.scheduler.waiting]
        if "B" in waiting:
            b_req = eng.scheduler.waiting[waiting.index("B")]
            waited += eng.scheduler.prefix_in_progress(b_req)
        outs |= {o.request_id: o for o in eng.step()}
    assert waited == 5                                        # while A computed blocks 1-5
    assert outs["B"].num_cached_tokens == 96 and outs["A"].num_cached_tokens == 0
    ref = make_engine(enable_prefix_caching=False).generate([a, b], params)
    assert [outs["A"].output_token_ids, outs["B"].output_token_ids] == [
        o.output_token_ids for o in ref]


@pytest.mark.parametrize("order", ["fcfs", "shortest", "srpt"])
def test_prefill_hold_keeps_prompts_out_of_decode_steps_until_they_have_waited(
        order: str) -> None:
    """``prefill_hold_s=5``: A (40 tokens) decodes; B (60) arrives at t=0 and C (70) at
    t=3. Until t=5 every step carries A's decode alone (1 token) — B is neither admitted nor
    given a chunk; at t=5 B has waited 5 s and the steps mix again: B's first chunk (32, the
    chunk size) rides with A's decode, then B's and C's chunks go on. Once A has finished
    (no decode), nothing is held. Greedy output equals the engine without the hold's.
    Clock injected; hand-counted tokens."""
    now = [0.0]
    prompts = random_prompts(3, 40, 40, seed=31)
    a, b, c = prompts[0], (prompts[1] * 2)[:60], (prompts[2] * 2)[:70]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    kw = dict(enable_prefix_caching=False, prefill_chunk_tokens=32, max_num_batched_tokens=64,
              waiting_order=order)
    ref = make_engine(**kw).generate([a, b, c], params)
    eng = make_engine(prefill_hold_s=5.0, **kw)
    eng.scheduler.clock = lambda: now[0]
    eng.add_request(a, params, "A")
    steps: list[dict[str, int]] = []
    outs: dict[str, list[int]] = {}

    def step() -> None:
        out = eng.scheduler.schedule()
        steps.append({s.request.request_id: s.num_new_tokens for s in out.scheduled})
        logits = eng.runner.execute(out)
        rows = [s for s in out.scheduled if s.samples]
        eng.scheduler.update_from_output(out, {
            s.request.request_id: (int(logits[i].argmax()), 0.0, None)
            for i, s in enumerate(rows)})
        for r in list(eng.scheduler.running) + [s.request for s in rows]:
            outs[r.request_id] = list(r.output_token_ids)

    step()                                  # A's prompt (32 + 8: two chunks)
    step()
    assert steps == [{"A": 32}, {"A": 8}]   # A's first token: A decodes from here on
    eng.add_request(b, params, "B")
    step()
    now[0] = 3.0
    eng.add_request(c, params, "C")
    step()
    now[0] = 4.99
    step()
    assert steps[2:] == [{"A": 1}] * 3      # held: B and C wait while A decodes
    now[0] = 5.0                            # B has waited 5 s: mixed steps again
    while eng.has_unfinished():
        step()
    # B's chunk 32, C's the 31 left of the budget; B's last 28, C's next 32 (B samples);
    # then C (queued at t=3, 2 s ago) is mid-prefill and held while A and B decode: A's
    # last token at step 12, B's (12 tokens from step 6) at step 17, C's last 7 at step 18
    assert steps[5:8] == [{"A": 1, "B": 32, "C": 31}, {"A": 1, "B": 28, "C": 32},
                          {"A": 1, "B": 1}]
    assert [s for s in steps[8:19] if "C" in s] == [{"C": 7}] and steps[18] == {"C": 7}
    got = {r: outs[r] for r in ("A", "B", "C")}
    assert got == {"A": list(ref[0].output_token_ids), "B": list(ref[1].output_token_ids),
                   "C": list(ref[2].output_token_ids)}
    with pytest.raises(ValueError, match="prefill_hold_s"):
        make_engine(prefill_hold_s=0.0)
