"""The calibrated cost of a whole engine step (``sim.step_cost.StepCost``, the file's
optional ``step``; ``calibrate-cpu --mixed-chunks``) and the engine-stepped node that uses it:
the fit recovers coefficients chosen here, a file without ``step`` still loads and gives the
numbers the simulator gave before the step cost existed (computed at commit 7bacfaf), and a
step's time is the formula worked out by hand."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from pymooncake.conductor.policy import DecodeEstimator, PrefillEstimator, TransferEstimator
from pymooncake.sim.cache_model import LruBlockCache
from pymooncake.sim.calibration import (
    DEFAULT_STEP_TERMS,
    CalibratedCostModel,
    CalibratedModel,
    Calibration,
    CalibrationError,
    StepCost,
    attention_pairs,
    fit_step_cost,
    load_calibration,
    parse_calibration,
    step_features,
    step_rel_errors,
)
from pymooncake.sim.cluster import SimRequest
from pymooncake.sim.config import SimConfig
from pymooncake.sim.engine_node import EngineNode, Running, StepPolicy
from pymooncake.sim.runner import simulate

DATA = Path(__file__).parent / "data"
OLD_FILE = DATA / "calibration_2t_before_step.json"
"""docs/sim-calibration-smollm2-2t.json as it was at commit 7bacfaf (AMD machine, 2026-12-04
18:14 UTC): the format before ``step``."""

PRE = PrefillEstimator(0.0, 0.001, 0.01)
DEC = DecodeEstimator(overhead_s=0.02, weight_s=0.0, per_context_token_s=0.0,
                      per_sequence_s=0.001, attention_per_context_token_s=1e-5)


def _grid() -> list[list[float]]:
    """``[B, D, k, p]`` compositions like ``measure_mixed``'s: decode-only, mixed, prefill."""
    out = []
    for b, ctx in ((0, 0), (1, 256), (4, 256), (1, 2048), (12, 2048)):
        d = b * (ctx + 1)
        for p in (0, 1024, 3584):
            if b:
                out.append([b, d, 0, 0])
            out += [[b, d, k, p] for k in (16, 64, 128, 512)]
    return out


def _samples(cost: StepCost, noise: float = 0.0, seed: int = 0) -> list[list[float]]:
    rng = random.Random(seed)
    return [[*s, cost.step_s(*step_features(*s)) * (1 + rng.uniform(-noise, noise))]
            for s in _grid()]


def test_attention_pairs_is_the_engines_formula() -> None:
    from pymooncake.engine.step_time import attention_pairs as engine_pairs
    for p, n in ((0, 1), (1499, 1), (0, 64), (2048, 64), (5120, 512), (7, 0)):
        assert attention_pairs(p, n) == engine_pairs(p, n)
    assert attention_pairs(2048, 64) == 64 * (2048 + 32.5)
    assert step_features(3, 4503, 64, 2400) == (67, 4503 + 64 * 2432.5, 4, 4503, 2400)
    assert step_features(3, 4503, 0, 0) == (3, 4503, 3, 4503, 0)
    assert step_features(0, 0, 512, 1024) == (512, 512 * (1024 + 256.5), 1, 0, 1024)


@pytest.mark.parametrize("true, terms", [
    (StepCost(0.015, 4e-4, 2.5e-7), ("tokens", "pairs")),
    (StepCost(0.012, 3e-4, 1.5e-7, 2e-3), ("tokens", "pairs", "sequences")),
    (StepCost(0.016, 5.5e-4, 1.6e-7, 0.0, 1.2e-6, 5.3e-6), DEFAULT_STEP_TERMS),
])
def test_step_fit_recovers_known_coefficients(true: StepCost, terms: tuple[str, ...]) -> None:
    got = fit_step_cost(_samples(true), terms)
    for name in ("overhead_s", "per_token_s", "per_pair_s", "per_sequence_s"):
        assert getattr(got, name) == pytest.approx(getattr(true, name), rel=1e-6, abs=1e-12)
    noisy = _samples(true, noise=0.03, seed=1)
    got = fit_step_cost(noisy, terms)
    assert got.overhead_s == pytest.approx(true.overhead_s, rel=0.15)
    assert got.per_token_s == pytest.approx(true.per_token_s, rel=0.1)
    assert got.per_pair_s == pytest.approx(true.per_pair_s, rel=0.1)
    assert got.per_decode_context_token_s == pytest.approx(true.per_decode_context_token_s,
                                                           rel=0.25, abs=1e-12)
    assert got.per_prefix_token_s == pytest.approx(true.per_prefix_token_s, rel=0.25,
                                                   abs=1e-12)
    assert max(abs(e) for e in step_rel_errors(got, noisy)) < 0.06


def test_step_fit_keeps_coefficients_nonnegative_and_refuses_bad_input() -> None:
    # no attention cost at all, and times that fall slightly with the context: an
    # unconstrained fit gives a negative per-pair cost; this one gives 0
    samples = [[*s, 0.01 + 5e-4 * step_features(*s)[0] - 1e-12 * step_features(*s)[1]]
               for s in _grid()]
    got = fit_step_cost(samples, ("tokens", "pairs"))
    assert got.per_pair_s == 0.0 and got.per_token_s > 0 and got.overhead_s > 0
    assert got.per_token_s == pytest.approx(5e-4, rel=0.05)
    with pytest.raises(ValueError, match="step terms"):
        fit_step_cost(samples, ("tokens", "flops"))
    with pytest.raises(ValueError, match="including 'tokens'"):
        fit_step_cost(samples, ("pairs",))
    with pytest.raises(ValueError, match="bad step sample"):
        fit_step_cost([*samples, [1, 2, 3, 4, 0.0]])
    with pytest.raises(ValueError, match="bad step sample"):
        fit_step_cost([*samples, [1, 2, 3, 0.5]])
    with pytest.raises(ValueError, match="at least 3"):
        fit_step_cost(samples[:2], ("tokens", "pairs"))


def test_an_old_file_without_step_loads_and_gives_the_numbers_of_before() -> None:
    """The first-token and finish times below are what the simulator gave at 7bacfaf (before
    the step cost) for this trace and this file, with the engine-stepped node."""
    cal = load_calibration(OLD_FILE)
    assert cal.step is None and "step" not in cal.to_json()
    assert parse_calibration(cal.to_json()).step is None
    from pymooncake.workload.trace import Trace, TraceRequest
    rows = [(0, 700, 6, (1, 2, 3, 4, 5, 6)), (100, 300, 8, (1, 2, 7)),
            (150, 1500, 4, tuple(range(10, 22))), (400, 200, 10, (30, 31)),
            (900, 2600, 3, tuple(range(40, 61))), (1000, 128, 12, (70,))]
    trace = Trace(tuple(TraceRequest(t, n, o, h, i) for i, (t, n, o, h) in enumerate(rows)),
                  block_size=128)
    before = {
        (64, None): [(0.539766181, 0.770236122), (0.539766181, 0.866162093),
                     (1.489269171, 1.633849926), (1.489269171, 1.898002091),
                     (3.420541838, 3.453068473), (1.590998738, 2.086907096)],
        (256, 0.15): [(0.539766181, 1.288142084), (0.539766181, 1.587890158),
                      (1.438047968, 1.887074716), (1.587890158, 2.934174433),
                      (3.394039824, 3.42656646), (1.587890158, 3.233080766)]}
    cm = CalibratedCostModel(cal, chunk_size_tokens=512)
    for (cap, limit), want in before.items():
        cfg = SimConfig(scenario="colocated", scheduler="local-cache", num_prefill=1,
                        block_size=128, chunk_size_tokens=512, max_batch_size=64,
                        step_budget_tokens=512, decode_step_tokens=cap, decode_step_s=limit,
                        waiting_order="shortest", sample_interval_s=0.0)
        got = [(r.first_token_s, r.finish_s) for r in simulate(trace, cfg, cm).requests]
        assert got == [pytest.approx(w, abs=1e-8) for w in want]


def test_step_section_round_trips_and_is_checked() -> None:
    doc = json.loads(OLD_FILE.read_text())
    doc["step"] = {"overhead_s": 0.015, "per_token_s": 4e-4, "per_pair_s": 2.5e-7}
    cal = parse_calibration(doc)
    assert cal.step == StepCost(0.015, 4e-4, 2.5e-7, 0.0, 0.0, 0.0)
    doc["step"] |= {"per_decode_context_token_s": 1e-6, "per_prefix_token_s": 5e-6}
    cal = parse_calibration(doc)
    assert cal.step == StepCost(0.015, 4e-4, 2.5e-7, 0.0, 1e-6, 5e-6)
    assert parse_calibration(cal.to_json()) == cal
    doc["step"]["per_token_s"] = 0
    with pytest.raises(CalibrationError, match=r"step\.per_token_s: must be > 0"):
        parse_calibration(doc, "f.json")
    doc["step"] = {"overhead_s": 0.01, "per_token_s": 1e-4, "per_pair_s": -1}
    with pytest.raises(CalibrationError, match=r"step\.per_pair_s: must be >= 0"):
        parse_calibration(doc, "f.json")
    doc["step"] = [1, 2]
    with pytest.raises(CalibrationError, match="step: missing or not an object"):
        parse_calibration(doc, "f.json")


STEP = StepCost(0.01, 2e-4, 3e-7, 1e-3, 2e-6, 4e-6)


def _node(policy: StepPolicy, step: StepCost | None = STEP) -> EngineNode:
    return EngineNode("n", LruBlockCache("n", 100_000, 128), policy, PRE, DEC, 100_000, 128,
                      step)


def _req(i: int, n: int, out: int = 4) -> SimRequest:
    return SimRequest(index=i, arrival_s=0.0, input_length=n, output_length=out,
                      hash_ids=tuple(range(100 * i, 100 * i + n // 128)))


def test_engine_node_step_time_is_the_formula_by_hand() -> None:
    # two decodes (contexts 1000 and 1500: 999 and 1499 computed) and a prompt 2048 tokens
    # into 2400; budget 64 while requests decode: the decodes take 2, the chunk 62
    node = _node(StepPolicy(512, 64, waiting_order="fcfs"))
    a, b, c = _req(0, 999), _req(1, 1499), _req(2, 2400)
    node.running = [Running(a, 1000, computed=999, outputs=1),
                    Running(b, 1500, computed=1499, outputs=1),
                    Running(c, 2400, computed=2048)]
    t = node.plan(0.0)
    assert [k for _, k in node.planned] == [1, 1, 62]
    # tokens 64, pairs 1000 + 1500 + 62 x (2048 + 31.5) = 131,429, 3 sequences, decode
    # context 2,500, chunk prefix 2,048
    pairs = 1000 + 1500 + 62 * (2048 + 63 / 2)
    assert t == pytest.approx(0.01 + 2e-4 * 64 + 3e-7 * pairs + 1e-3 * 3 + 2e-6 * 2500
                              + 4e-6 * 2048, rel=1e-12)
    assert t == pytest.approx(0.01 + 0.0128 + 0.0394287 + 0.003 + 0.005 + 0.008192,
                              rel=1e-12)
    assert c.prefill_gpu_s == pytest.approx(2e-4 * 62 + 3e-7 * 62 * 2079.5 + 1e-3
                                            + 4e-6 * 2048)
    # the decodes alone (contexts 1001, 1501)
    node.finish(t)
    node.running = node.running[:2]
    assert node.plan(t) == pytest.approx(0.01 + 4e-4 + 3e-7 * 2502 + 2e-3 + 2e-6 * 2502)
    # the same composition without a step cost: the rule of before (chunk + mixed decodes)
    old = _node(StepPolicy(512, 64, waiting_order="fcfs"), step=None)
    old.running = [Running(_req(0, 999), 1000, computed=999, outputs=1),
                   Running(_req(1, 1499), 1500, computed=1499, outputs=1),
                   Running(_req(2, 2400), 2400, computed=2048)]
    assert old.plan(0.0) == pytest.approx(0.001 * 62 + 0.02 + 0.001 * 2 + 1e-5 * 2500)


def test_decode_step_s_sizes_the_chunk_with_the_step_cost() -> None:
    # no attention cost: one decode + k tokens cost 0.01 + 0.001 (1 + k) + 0.002 (2 seqs);
    # within 0.1005 s: k <= 87.5
    node = _node(StepPolicy(512, 256, decode_step_s=0.1005, waiting_order="fcfs"),
                 StepCost(0.01, 1e-3, 0.0, 1e-3))
    node.running = [Running(_req(0, 99), 100, computed=99, outputs=1)]
    node.add(_req(1, 1000))
    t = node.plan(0.0)
    assert [k for _, k in node.planned] == [1, 87]
    assert t == pytest.approx(0.01 + 0.088 + 0.002)


def test_a_request_alone_costs_its_steps(make_trace) -> None:  # noqa: ANN001
    """Through the runner: a 300-token prompt in one step, then a step per decode."""
    cal = Calibration(CalibratedModel("m", 2, 1000), PRE, DEC,
                      TransferEstimator(1000, 1e9, 0.0), 100_000, step=STEP)
    cfg = SimConfig(scenario="colocated", scheduler="local-cache", num_prefill=1,
                    block_size=128, chunk_size_tokens=512, max_batch_size=64,
                    step_budget_tokens=512, decode_step_tokens=64, sample_interval_s=0.0)
    r = simulate(make_trace([(0, 300, 3, (1, 2))], block_size=128), cfg,
                 CalibratedCostModel(cal, chunk_size_tokens=512)).requests[0]
    first = 0.01 + 2e-4 * 300 + 3e-7 * 300 * 301 / 2 + 1e-3
    assert r.first_token_s == pytest.approx(first)
    steps = [0.01 + 2e-4 + (3e-7 + 2e-6) * (300 + j + 1) + 1e-3 for j in range(2)]
    assert r.finish_s == pytest.approx(first + sum(steps))
