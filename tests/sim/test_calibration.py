"""CPU calibration of the simulator (issue 15): the fits recover known coefficients, a
calibrated run reproduces hand-computed times, bad calibration files fail naming the field."""

from __future__ import annotations

import json
import math

import pytest

from pymooncake.cli.main import main
from pymooncake.conductor.policy import (
    DecodeEstimator,
    PrefillEstimator,
    TransferEstimator,
    fit_decode_estimator,
    fit_prefill_estimator,
)
from pymooncake.sim.calibration import (
    CalibratedModel,
    Calibration,
    CalibrationError,
    load_calibration,
    parse_calibration,
)
from pymooncake.sim.config import SimConfig
from pymooncake.sim.runner import simulate
from pymooncake.sim.sweep import sweep

Q, L, OV = 2.5e-7, 1.1e-3, 0.02
DEC = DecodeEstimator(overhead_s=0.004, weight_s=0.016, per_context_token_s=0.0,
                      per_sequence_s=0.0035, attention_per_context_token_s=2e-7)
KVB = 46080
BW = 5e9
T_OVER = 0.002


def _doc(**over: object) -> dict:
    cal = Calibration(CalibratedModel("smollm2", 30, KVB), PrefillEstimator(Q, L, OV), DEC,
                      TransferEstimator(KVB, BW, T_OVER), 16384, label="test")
    d = cal.to_json()
    d.update(over)
    return d


@pytest.fixture()
def cal_file(tmp_path):  # noqa: ANN001, ANN201
    p = tmp_path / "cal.json"
    p.write_text(json.dumps(_doc()))
    return p


def test_prefill_fit_recovers_known_coefficients() -> None:
    samples = [(n, p, Q * (n * n - p * p) + L * (n - p) + OV)
               for n in (64, 256, 512, 1024, 2048) for p in (0, n // 2, 3 * n // 4)]
    est = fit_prefill_estimator(samples, with_overhead=True)
    assert est.quadratic_s == pytest.approx(Q, rel=1e-6)
    assert est.linear_s == pytest.approx(L, rel=1e-6)
    assert est.overhead_s == pytest.approx(OV, rel=1e-6)


@pytest.mark.parametrize("true", [
    DEC,                                                      # knee at B* = w/s ≈ 4.57
    DecodeEstimator(0.01, 0.0, 0.0, 0.002, 1e-6),             # purely additive
    DecodeEstimator(0.003, 0.05, 0.0, 0.001, 5e-8),           # memory-bound throughout
])
def test_decode_fit_recovers_known_coefficients(true: DecodeEstimator) -> None:
    samples = [(b, c, true.step_s(b, c)) for b in (1, 2, 4, 8, 16, 32)
               for c in (b * 128, b * 512, b * 1024)]
    est = fit_decode_estimator(samples)
    for b, c, t in samples:
        assert est.step_s(b, c) == pytest.approx(t, rel=1e-4)
    assert est.attention_per_context_token_s == pytest.approx(
        true.attention_per_context_token_s, rel=1e-3)
    if true.weight_s <= true.per_sequence_s * 32:  # the knee is inside the sampled batches
        assert est.overhead_s == pytest.approx(true.overhead_s, rel=1e-3, abs=1e-7)
        assert est.per_sequence_s == pytest.approx(true.per_sequence_s, rel=1e-3)
        assert est.weight_s == pytest.approx(true.weight_s, rel=1e-3, abs=1e-6)
    else:  # never compute-bound: only overhead + weights is determined
        assert est.overhead_s + est.weight_s == pytest.approx(true.overhead_s + true.weight_s)


def test_decode_fit_rejects_undetermined_samples() -> None:
    with pytest.raises(ValueError, match="2 distinct batch sizes"):
        fit_decode_estimator([(4, 100, 0.1), (4, 200, 0.2), (4, 300, 0.3)])
    with pytest.raises(ValueError, match="at least 3"):
        fit_decode_estimator([(1, 100, 0.1)])
    with pytest.raises(ValueError, match="bad decode sample"):
        fit_decode_estimator([(1, 100, 0.1), (2, 100, 0.0), (4, 1, 0.2)])


def test_round_trip(cal_file) -> None:  # noqa: ANN001
    cal = load_calibration(cal_file)
    assert cal.prefill == PrefillEstimator(Q, L, OV) and cal.decode == DEC
    assert parse_calibration(cal.to_json()) == cal


@pytest.mark.parametrize(("mutate", "match"), [
    (lambda d: d.update(format="other"), "format: expected"),
    (lambda d: d.update(version=2), "version: this pymooncake reads version 1"),
    (lambda d: d.pop("prefill"), "prefill: missing or not an object"),
    (lambda d: d["prefill"].pop("linear_s"), r"prefill\.linear_s: missing"),
    (lambda d: d["prefill"].update(linear_s=0), r"prefill\.linear_s: must be > 0"),
    (lambda d: d["decode"].update(overhead_s="fast"), r"decode\.overhead_s: must be a finite"),
    (lambda d: d["decode"].update(weight_s=-1.0), r"decode\.weight_s: must be >= 0"),
    (lambda d: d["transfer"].update(bandwidth_bytes_per_s=math.inf), "must be a finite"),
    (lambda d: d["transfer"].update(kv_bytes_per_token=1), "!= model.kv_bytes_per_token"),
    (lambda d: d["model"].update(num_layers=0), r"model\.num_layers: must be an int >= 1"),
    (lambda d: d["node"].pop("kv_capacity_tokens"), r"node\.kv_capacity_tokens"),
    (lambda d: d.update(samples=[]), "samples: must be an object"),
])
def test_bad_documents_name_the_field(tmp_path, mutate, match: str) -> None:  # noqa: ANN001
    d = _doc()
    mutate(d)
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(d))
    with pytest.raises(CalibrationError, match=match) as e:
        load_calibration(p)
    assert str(e.value).startswith(str(p))


def test_unreadable_files(tmp_path) -> None:  # noqa: ANN001
    with pytest.raises(CalibrationError, match="no such calibration file"):
        load_calibration(tmp_path / "missing.json")
    p = tmp_path / "x.json"
    p.write_text("{not json")
    with pytest.raises(CalibrationError, match="not JSON"):
        load_calibration(p)
    p.write_text("[1, 2]")
    with pytest.raises(CalibrationError, match="not a JSON object"):
        load_calibration(p)


def test_single_request_by_hand(make_trace, cal_file) -> None:  # noqa: ANN001
    n, out = 1000, 5
    cfg = SimConfig(scenario="pd", scheduler="load", num_prefill=1, num_decode=1,
                    calibration=str(cal_file), block_size=128, sample_interval_s=0)
    r = simulate(make_trace([(2000.0, n, out, tuple(range(8)))], 128), cfg).requests[0]
    prefill = Q * n * n + L * n + OV
    assert r.first_token_s - 2.0 == pytest.approx(prefill, rel=1e-12)
    pd = n * KVB / BW + T_OVER                    # KV streamed layer by layer during prefill
    arrive = max(r.first_token_s, 2.0 + pd) + pd / 30
    assert r.kv_arrive_s == pytest.approx(arrive, rel=1e-12)
    steps = [DEC.step_s(1, n + 1 + j) for j in range(out - 1)]
    assert r.finish_s == pytest.approx(arrive + sum(steps), rel=1e-12)
    assert r.tbt_s == pytest.approx(max(steps[0] + arrive - r.first_token_s, *steps))


def test_prefix_hit_by_hand(make_trace, cal_file) -> None:  # noqa: ANN001
    """The second request reuses 6 blocks of 128 tokens prefilled by the first."""
    cfg = SimConfig(scenario="pd-local", num_prefill=1, num_decode=1, block_size=128,
                    cache_capacity_tokens=100_000, calibration=str(cal_file),
                    sample_interval_s=0)
    t = make_trace([(0.0, 800, 1, tuple(range(7))),
                    (60_000.0, 900, 1, tuple(range(6)) + (50, 51))], 128)
    r = simulate(t, cfg).requests[1]
    n, p = 900, 6 * 128
    assert r.hit_tokens == p
    assert r.first_token_s - 60.0 == pytest.approx(Q * (n * n - p * p) + L * (n - p) + OV)


def test_calibrated_rate_sweep_runs(make_trace, cal_file) -> None:  # noqa: ANN001
    t = make_trace([(500.0 * i, 300, 8, (i % 3, 10 + i)) for i in range(20)], 128)
    base = SimConfig(scenario="colocated", scheduler="round-robin", num_prefill=2,
                     calibration=str(cal_file), block_size=128, chunk_size_tokens=128,
                     sample_interval_s=0)
    pts = sweep(t, base, "rate", [0.5, 1.0, 4.0])
    p90 = [p.summary["ttft_p90_s"] for p in pts]
    assert p90[0] <= p90[-1]


def test_cli_run_with_calibration(capsys, tmp_path, cal_file) -> None:  # noqa: ANN001
    tr = tmp_path / "t.jsonl"
    tr.write_text("".join(json.dumps({"timestamp": 300 * i, "input_length": 1500,
                                      "output_length": 4, "hash_ids": [0, 1, 2]}) + "\n"
                          for i in range(10)))
    rc = main(["sim", "run", str(tr), "--calibration", str(cal_file), "--prefill", "1",
               "--decode", "1", "--json"])
    s = json.loads(capsys.readouterr().out)
    assert rc == 0 and s["num_requests"] == 10 and s["calibration"] == str(cal_file)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(_doc(format="nope")))
    rc = main(["sim", "run", str(tr), "--calibration", str(bad)])
    err = capsys.readouterr().err
    assert rc == 1 and "format: expected" in err and str(bad) in err


def test_fits_keep_coefficients_nonnegative() -> None:
    """Timings whose least-squares fit has a negative term (noise) fit with that term 0."""
    dec = [(1, 128, 0.080), (1, 512, 0.059), (4, 512, 0.084), (4, 2048, 0.135),
           (16, 2048, 0.243), (16, 8192, 0.198)]
    est = fit_decode_estimator(dec)
    assert min(est.overhead_s, est.weight_s, est.per_sequence_s,
               est.attention_per_context_token_s) >= 0
    pre = [(100, 0, 0.2), (200, 0, 0.38), (400, 0, 0.70), (800, 0, 1.2), (800, 400, 0.55)]
    assert fit_prefill_estimator(pre, with_overhead=True).quadratic_s < 0   # unconstrained
    est_p = fit_prefill_estimator(pre, with_overhead=True, nonnegative=True)
    assert min(est_p.quadratic_s, est_p.linear_s, est_p.overhead_s) >= 0


def test_nonnegative_prefill_fit_keeps_a_per_token_cost() -> None:
    """Overhead-bound prompts whose times look convex (the CI failure of
    ``test_calibrate_cpu_threads``: ``prefill.linear_s: must be > 0, got 0.0``): the
    nonnegative fit gives ``linear_s`` = ``LINEAR_FLOOR_S`` and otherwise the best fit
    with every term >= 0 — checked against numpy's ``lstsq`` over each subset of terms
    with the floor's share taken out of the times."""
    np = pytest.importorskip("numpy")
    from pymooncake.conductor.policy.estimators import LINEAR_FLOOR_S
    pts = [(32, 0), (32, 16), (128, 0), (128, 64), (256, 0), (256, 128)]
    # convex beyond n²: an exact fit needs a negative per-token term
    pre = [(n, p, 2e-3 + 6e-9 * (n * n - p * p) - 2e-7 * (n - p)) for n, p in pts]
    assert fit_prefill_estimator(pre, with_overhead=True).linear_s < 0
    est = fit_prefill_estimator(pre, with_overhead=True, nonnegative=True)
    assert est.linear_s == pytest.approx(LINEAR_FLOOR_S, rel=1e-6)
    w = np.array([1 / t for *_, t in pre])
    feats = np.array([[n * n - p * p, n - p, 1.0] for n, p, _ in pre]) * w[:, None]
    y = np.array([t for *_, t in pre]) * w - LINEAR_FLOOR_S * feats[:, 1]
    best = None
    for cols in ([0], [1], [2], [0, 1], [0, 2], [1, 2], [0, 1, 2]):
        x = np.linalg.lstsq(feats[:, cols], y, rcond=None)[0]
        if (x < 0).any():
            continue
        sse = float(((feats[:, cols] @ x - y) ** 2).sum())
        if best is None or sse < best[0]:
            full = np.zeros(3)
            full[cols] = x
            best = (sse, full)
    assert best is not None and best[1][1] == 0      # the floor is all its per-token cost
    assert (est.quadratic_s, est.overhead_s) == pytest.approx((best[1][0], best[1][2]),
                                                              rel=1e-6)
    for n, p, t in pre:
        assert est.prefill_s(n, p) == pytest.approx(t, rel=0.03)


def test_nonnegative_prefill_fit_of_noisy_quadratic_prompts_stays_close() -> None:
    """A per-token cost far below the n² and fixed terms, with 3 % noise (seeded): the
    nonnegative fit still predicts every point within 15 % in each of 100 trials — the
    floor does not force a per-token term in at the cost of the others (a review's case)."""
    import random
    rng = random.Random(7)
    lengths = (16, 64, 256, 1024, 2048, 4096)
    worst = 0.0
    for _ in range(100):
        pre = [(n, 0, (1e-3 + 1e-8 * n + 1e-9 * n * n) * (1 + rng.uniform(-0.03, 0.03)))
               for n in lengths]
        est = fit_prefill_estimator(pre, with_overhead=True, nonnegative=True)
        assert est.linear_s > 0 and est.quadratic_s >= 0 and est.overhead_s >= 0
        worst = max(worst, max(abs(est.prefill_s(n, 0) / t - 1) for n, _, t in pre))
    assert worst < 0.15
