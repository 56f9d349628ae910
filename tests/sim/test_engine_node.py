"""The colocated node stepped like the engine (``sim.engine_node``, the ``ours-1w`` model):
the decode-step cap, shortest-first admission and prefix reuse, checked against step-by-step
arithmetic done by hand with round costs: prefill 1 ms per token + 10 ms per request; a
decode step of its own 20 ms + 1 ms per sequence + 0.01 ms per context token; decodes riding
in a step with a prefill chunk the decode step's fixed 20 ms + 1 ms each (a prompt token's
cost) + 0.01 ms per context token."""

from __future__ import annotations

import pytest

from pymooncake.conductor.policy import DecodeEstimator, PrefillEstimator, TransferEstimator
from pymooncake.sim.calibration import CalibratedCostModel, CalibratedModel, Calibration
from pymooncake.sim.config import SimConfig
from pymooncake.sim.engine_node import Running, StepPolicy, pick_waiting, step_budget
from pymooncake.sim.runner import simulate

PRE = PrefillEstimator(0.0, 0.001, 0.01)
DEC = DecodeEstimator(overhead_s=0.02, weight_s=0.0, per_context_token_s=0.0,
                      per_sequence_s=0.001, attention_per_context_token_s=1e-5)
CM = CalibratedCostModel(Calibration(CalibratedModel("m", 2, 1000), PRE, DEC,
                                     TransferEstimator(1000, 1e9, 0.0), 100_000),
                         chunk_size_tokens=512)


def _cfg(**kw: object) -> SimConfig:
    base = dict(scenario="colocated", scheduler="local-cache", num_prefill=1, block_size=100,
                chunk_size_tokens=512, max_batch_size=64, step_budget_tokens=512,
                decode_step_tokens=256, waiting_order="shortest", sample_interval_s=0.0)
    return SimConfig(**(base | kw))


def _by_len(res):  # noqa: ANN001, ANN202
    return {r.input_length: r for r in res.requests}


def test_step_budget_is_capped_only_while_a_request_decodes(make_trace) -> None:  # noqa: ANN001
    pol = StepPolicy(512, 256)
    t = make_trace([(0, 300, 4, (1, 2, 3))], block_size=100)
    r = simulate(t, _cfg(), CM).requests[0]     # any SimRequest will do
    prefilling = Running(r, 300, computed=100)
    decoding = Running(r, 301, computed=300, outputs=1)
    assert step_budget(pol, []) == 512
    assert step_budget(pol, [prefilling]) == 512
    assert step_budget(pol, [prefilling, decoding]) == 256
    assert step_budget(StepPolicy(512, None), [decoding]) == 512
    assert step_budget(StepPolicy(128, 256), [decoding]) == 128   # a cap above the budget


def test_shortest_first_with_aging(make_trace) -> None:  # noqa: ANN001
    t = make_trace([(0, 900, 2, ()), (500, 400, 2, ()), (1000, 300, 2, ())])
    reqs = simulate(t, SimConfig(scenario="colocated", num_prefill=1, block_size=512,
                                 sample_interval_s=0.0), CM).requests
    # at 1.0 s: keys 900 - 2000*1.0 = -1100, 400 - 2000*0.5 = -600, 300 - 0 = 300
    assert pick_waiting(StepPolicy(waiting_order="shortest"), reqs, 1.0) == 0
    # without aging the shortest prompt goes first; fcfs takes the first
    assert pick_waiting(StepPolicy(waiting_order="shortest", aging_tokens_per_s=0.0),
                        reqs, 1.0) == 2
    assert pick_waiting(StepPolicy(waiting_order="fcfs"), reqs, 1.0) == 0
    # at 0.6 s, 2000 tokens/s: 900-1200 = -300, 400-200 = 200, 300+800 = 1100
    assert pick_waiting(StepPolicy(waiting_order="shortest"), reqs, 0.6) == 0
    # 100 tokens/s: 900-60=840, 400-10=390, 300+40=340 -> the 300-token prompt
    assert pick_waiting(StepPolicy(waiting_order="shortest", aging_tokens_per_s=100.0),
                        reqs, 0.6) == 2


# A (600 tokens), B (200), C (100) arrive together, 2 output tokens each, nothing shared.
ROWS = [(0, 600, 2, (1, 2, 3, 4, 5, 6)), (0, 200, 2, (7, 8)), (0, 100, 2, (9,))]


def test_shortest_first_with_the_decode_step_cap(make_trace) -> None:  # noqa: ANN001
    res = simulate(make_trace(ROWS, block_size=100), _cfg(), CM)
    a, b, c = (_by_len(res)[n] for n in (600, 200, 100))
    # step 1 (budget 512, nobody decodes): C 100, B 200, A 212 tokens
    #   = 0.512 + 3 x 0.01 = 0.542 s -> first tokens of C and B
    assert c.first_token_s == pytest.approx(0.542) and b.first_token_s == pytest.approx(0.542)
    # step 2 (C, B decode: budget 256): C 1, B 1, A 254 tokens = 0.254 + 2 decode rows
    #   (0.02 + 0.002 + 1e-5 x (101 + 201) = 0.02502) = 0.27902 s -> C and B finish at
    #   0.82102 s
    assert c.finish_s == pytest.approx(0.82102) and b.finish_s == pytest.approx(0.82102)
    assert c.tbt_s == pytest.approx(0.27902) and b.tbt_s == pytest.approx(0.27902)
    # step 3 (nobody decodes): A's last 134 tokens = 0.134 s -> first token at 0.95502 s
    assert a.first_token_s == pytest.approx(0.95502)
    # step 4: A decodes alone, step(1, 601) = 0.021 + 0.00601 = 0.02701 s
    assert a.finish_s == pytest.approx(0.98203) and a.tbt_s == pytest.approx(0.02701)
    # a request alone costs the calibrated prefill: A's three chunks 212 + 254 + 134
    assert a.prefill_gpu_s == pytest.approx(PRE.prefill_s(600, 0))


def test_without_the_cap_the_decodes_wait_for_a_longer_chunk(make_trace) -> None:  # noqa: ANN001
    res = simulate(make_trace(ROWS, block_size=100), _cfg(decode_step_tokens=None), CM)
    a, c = _by_len(res)[600], _by_len(res)[100]
    # step 2 (budget 512): C 1, B 1, A's last 388 tokens = 0.388 + 0.02502 = 0.41302 s
    assert c.first_token_s == pytest.approx(0.542) and c.tbt_s == pytest.approx(0.41302)
    assert a.first_token_s == pytest.approx(0.95502)
    # step 3: A decodes alone
    assert a.finish_s == pytest.approx(0.98203)


def test_fcfs_lets_the_long_prompt_take_the_first_step(make_trace) -> None:  # noqa: ANN001
    res = simulate(make_trace(ROWS, block_size=100), _cfg(waiting_order="fcfs"), CM)
    a, b, c = (_by_len(res)[n] for n in (600, 200, 100))
    # step 1: A 512 tokens = 0.512 + 0.01 = 0.522 s; step 2: A's last 88, B 200, C 100
    #   (388 <= 512) = 0.388 + 2 x 0.01 (A paid its overhead in step 1) = 0.408 s
    for r in (a, b, c):
        assert r.first_token_s == pytest.approx(0.930)
    # step 3: all three decode, no chunk: step(3, 601 + 201 + 101) = 0.023 + 0.00903 s
    assert a.finish_s == pytest.approx(0.96203)


def test_prefix_blocks_of_a_finished_prefill_are_reused(make_trace) -> None:  # noqa: ANN001
    # the same 300-token prompt twice, 10 s apart: 2 whole blocks reused (the last token is
    # always computed, so the third block is not), 100 tokens computed: 0.1 + 0.01 s
    t = make_trace([(0, 300, 2, (1, 2, 3)), (10_000, 300, 2, (1, 2, 3))], block_size=100)
    first, second = simulate(t, _cfg(), CM).requests
    assert first.hit_tokens == 0 and first.first_token_s == pytest.approx(0.31)
    assert second.hit_tokens == 200
    assert second.first_token_s - second.arrival_s == pytest.approx(0.11)


def test_step_mode_needs_a_colocated_scenario() -> None:
    with pytest.raises(ValueError, match="needs scenario colocated"):
        SimConfig(scenario="pd", step_budget_tokens=512)
    with pytest.raises(ValueError, match="needs step_budget_tokens"):
        SimConfig(scenario="colocated", decode_step_tokens=256)
    with pytest.raises(ValueError, match="waiting_order"):
        SimConfig(scenario="colocated", step_budget_tokens=512, waiting_order="lifo")


def test_early_rejection_uses_the_conductors_predictor_and_view(make_trace) -> None:  # noqa: ANN001
    # A (600 tokens) at 0 s, B (200 tokens) at 0.1 s; the truth predicts A 0.61 s, B 0.21 s.
    t = make_trace([(0, 600, 2, (1, 2, 3, 4, 5, 6)), (100, 200, 2, (7, 8))], block_size=100)
    # The live Conductor's view: A placed at 0 s runs until 0.61 s; B waits for it:
    # predicted TTFT of B = (0.61 - 0.1) + 0.21 = 0.72 s
    a, b = simulate(t, _cfg(early_rejection=True, ttft_slo_s=0.71), CM).requests
    assert not a.rejected and b.rejected == "ttft_slo"
    a, b = simulate(t, _cfg(early_rejection=True, ttft_slo_s=0.73), CM).requests
    assert not a.rejected and not b.rejected
    # A alone is predicted 0.61 s > 0.5 s by the truth; the live Conductor's default
    # predictor (5e-8, 1e-4, 3e-3) says 0.018 + 0.06 + 0.003 = 0.081 s and admits it
    one = make_trace([(0, 600, 2, (1, 2, 3, 4, 5, 6))], block_size=100)
    assert simulate(one, _cfg(early_rejection=True, ttft_slo_s=0.5), CM
                    ).requests[0].rejected == "ttft_slo"
    r = simulate(one, _cfg(early_rejection=True, ttft_slo_s=0.5,
                           policy_prefill=(5e-8, 1e-4, 3e-3)), CM).requests[0]
    assert not r.rejected and r.predicted_prefill_s == pytest.approx(0.081)
    assert r.first_token_s == pytest.approx(0.61)     # the cost is still the truth


def test_decode_step_s_sizes_the_chunk_to_the_time_limit(make_trace) -> None:  # noqa: ANN001
    """``decode_step_s``: while B and C decode, A's chunk is the longest that keeps the step
    within the limit (not the 256-token cap); with no room, ``MIN_TIMED_CHUNK`` tokens."""
    res = simulate(make_trace(ROWS, block_size=100), _cfg(decode_step_s=0.15), CM)
    a, b, c = (_by_len(res)[n] for n in (600, 200, 100))
    # step 1 as with the cap: 0.542 s. Step 2: decode rows 0.02502 s, A's chunk k with
    #   0.001 k + 0.02502 <= 0.15 -> k = 124: 0.14902 s -> C and B finish at 0.69102 s
    assert c.first_token_s == pytest.approx(0.542)
    assert c.tbt_s == pytest.approx(0.14902) and b.finish_s == pytest.approx(0.69102)
    # step 3: A's last 600 - 212 - 124 = 264 tokens -> the same first token as with the cap
    assert a.first_token_s == pytest.approx(0.95502)
    # a limit below the decode rows alone: A still gets 16 tokens (0.016 + 0.02502 s)
    c2 = _by_len(simulate(make_trace(ROWS, block_size=100), _cfg(decode_step_s=0.004), CM))[100]
    assert c2.tbt_s == pytest.approx(0.04102)
    with pytest.raises(ValueError, match="decode_step_s"):
        SimConfig(scenario="colocated", decode_step_s=0.1)


def test_srpt_runs_a_short_newcomer_before_a_running_prompt(make_trace) -> None:  # noqa: ANN001
    """``srpt``: C (100 tokens) arrives at 50 ms while A (600) is in its first 128-token
    chunk; the next step computes C whole before A continues (C left 100 < A's 472)."""
    rows = [(0, 600, 2, (1, 2, 3, 4, 5, 6)), (50, 100, 2, (9,))]
    kw = dict(step_budget_tokens=128, chunk_size_tokens=128, decode_step_tokens=None,
              aging_tokens_per_s=0.0)
    res = simulate(make_trace(rows, block_size=100), _cfg(waiting_order="srpt", **kw), CM)
    a, c = _by_len(res)[600], _by_len(res)[100]
    # step 1: A 128 = 0.138 s; step 2: C 100 (+ overhead) and A 28 = 0.138 s -> C at 0.276 s
    assert c.first_token_s == pytest.approx(0.276)
    # step 3: C decodes (0.02 + 0.001 + 1e-5 x 101) with A's next 127 tokens -> C ends at
    #   0.42501 s
    assert c.finish_s == pytest.approx(0.42501)
    # A: 600 tokens at 1 ms + its overhead + C's whole cost before it + C's decode row
    assert a.first_token_s == pytest.approx(0.61 + 0.11 + 0.02201)
    # shortest (admission only): the running A keeps the budget; C starts after A's prefill
    res = simulate(make_trace(rows, block_size=100), _cfg(waiting_order="shortest", **kw), CM)
    assert _by_len(res)[100].first_token_s > _by_len(res)[600].first_token_s


@pytest.mark.parametrize("order", ["fcfs", "shortest", "srpt"])
def test_a_prompt_waits_for_its_prefix_still_being_computed(make_trace, order) -> None:  # noqa: ANN001
    # A (750 tokens, blocks 1-8) computes 100 tokens a step (chunk 100, budget 250); B (650
    # tokens, A's blocks 1-6 then its own) arrives during A's first step. As the engine's
    # Scheduler.prefix_in_progress, B waits while A computes blocks 2-6: A's steps 0.11 s
    # (with the 10 ms overhead), then 0.1 s each, so A has 600 tokens at 0.61 s. Then B
    # starts with 600 tokens hit: a step of A's 100 and B's 50 + 10 ms = 0.16 s, B's first
    # token at 0.77 s (admitted at once, it would have hit 100 tokens, not 600).
    t = make_trace([(0, 750, 2, tuple(range(1, 9))), (50, 650, 2, (1, 2, 3, 4, 5, 6, 99))],
                   block_size=100)
    res = simulate(t, _cfg(step_budget_tokens=250, chunk_size_tokens=100,
                           waiting_order=order), CM)
    a, b = res.requests
    assert (a.hit_tokens, b.hit_tokens) == (0, 600)
    assert b.prefill_start_s == pytest.approx(0.61)
    assert b.first_token_s == pytest.approx(0.77)


def test_prefill_hold_runs_the_decodes_alone_until_a_prompt_has_waited(make_trace) -> None:  # noqa: ANN001
    # A (100 tokens, 10 out) at 0, B (300 tokens) at 0.05 s. Step 1: A's prompt, 0.1 + 0.01
    # = 0.11 s. Without a hold, step 2 mixes A's decode and B's 300 tokens: 0.31 + (0.02 +
    # 0.001 + 1e-5 x 101) = 0.33201 s, B's first token at 0.44201 s.
    t = make_trace([(0, 100, 10, (1,)), (50, 300, 2, (7, 8, 9))], block_size=100)
    a, b = simulate(t, _cfg(decode_step_tokens=None), CM).requests
    assert b.prefill_start_s == pytest.approx(0.11) and b.first_token_s == pytest.approx(0.44201)
    # prefill_hold_s 0.15: A decodes alone (0.021 + 1e-5 x context 101, 102, ...) while B
    # has waited less: steps end at 0.13201, 0.15403, 0.17606, 0.19810, 0.22015; at 0.22015
    # B has waited 0.17015 >= 0.15, so step 7 mixes again: 0.31 + 0.02206 = 0.33206 s
    a, b = simulate(t, _cfg(decode_step_tokens=None, prefill_hold_s=0.15), CM).requests
    assert b.prefill_start_s == pytest.approx(0.22015)
    assert b.first_token_s == pytest.approx(0.55221)
    # a hold past A's whole decode: A's 9 decode steps (0.189 + 1e-5 x 945 = 0.19845 s; the
    # longest, its TBT, 0.021 + 1e-5 x 109) end at 0.30845; with nobody decoding nothing is
    # held: B alone, first token at 0.61845
    a, b = simulate(t, _cfg(decode_step_tokens=None, prefill_hold_s=1.0), CM).requests
    assert a.finish_s == pytest.approx(0.30845) and a.tbt_s == pytest.approx(0.02209)
    assert b.prefill_start_s == pytest.approx(0.30845)
    assert b.first_token_s == pytest.approx(0.61845)
    with pytest.raises(ValueError, match="prefill_hold_s"):
        _cfg(prefill_hold_s=0.0)
