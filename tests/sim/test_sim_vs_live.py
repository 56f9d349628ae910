"""The calibrated simulator beside the live capacity experiment: the same sample and rates,
the comparison rows and the plots, on a recorded small sample of the live document's format
(tests/sim/data, numbers invented), and the SIMULATED scale-out sweep."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pymooncake.bench import capacity as cap
from pymooncake.bench.sim_vs_live import (
    compare,
    scale_lengths,
    simulate_like_live,
    system_config,
)
from pymooncake.cli.main import main
from pymooncake.conductor.policy import DecodeEstimator, PrefillEstimator, TransferEstimator
from pymooncake.sim.calibration import CalibratedModel, Calibration, load_calibration
from pymooncake.workload import load_trace

DATA = Path(__file__).with_name("data")
LIVE = DATA / "capacity_live_sample.json"
TRACE = DATA / "capacity_live_trace.jsonl"


@pytest.fixture()
def cal_file(tmp_path):  # noqa: ANN001, ANN201
    cal = Calibration(CalibratedModel("smollm2", 30, 46080),
                      PrefillEstimator(2.5e-7, 1.1e-3, 0.02),
                      DecodeEstimator(0.004, 0.016, 0.0, 0.0035, 2e-7),
                      TransferEstimator(46080, 5e9, 0.002), 16384, label="test")
    p = tmp_path / "cal.json"
    p.write_text(json.dumps(cal.to_json()))
    return p


def test_scale_lengths_keeps_blocks_aligned() -> None:
    t = scale_lengths(load_trace(TRACE), 4)
    assert t.block_size == 128
    for r, o in zip(t.requests, load_trace(TRACE).requests, strict=True):
        assert r.input_length == -(-o.input_length // 4) and r.hash_ids == o.hash_ids
        assert len(r.hash_ids) <= -(-r.input_length // 128)
    with pytest.raises(ValueError, match="must divide"):
        scale_lengths(load_trace(TRACE), 3)


def test_simulate_like_live_has_the_live_shape(cal_file) -> None:  # noqa: ANN001
    live = json.loads(LIVE.read_text())
    sim = simulate_like_live(live, load_calibration(cal_file), str(cal_file),
                             trace_paths={"tiny": str(TRACE)})
    assert sim["simulated"] and sim["config"]["traces"] == ["tiny"]
    assert {(p["system"], p["rate"]) for p in sim["points"]} == {
        (s, r) for s in live["config"]["systems"] for r in live["config"]["rates"]}
    assert all(p["summary"]["num_requests"] == 12 for p in sim["points"])
    an = cap.analyze(sim)               # the live capacity arithmetic works on it unchanged
    assert an["tiny"]["pairs"]
    rows = compare(live, sim)
    assert len(rows) == 9
    assert all(r["rel_error"] is not None for r in rows)
    at1 = [r for r in rows if r["rate"] == 1.0]
    assert not any(r["below_saturation"] for r in at1)   # 3 of 12 rejected in the sample


def test_cli_vs_live_and_scale_out(capsys, tmp_path, cal_file) -> None:  # noqa: ANN001
    png = tmp_path / "vs.png"
    rc = main(["sim", "vs-live", "--calibration", str(cal_file), "--live", str(LIVE),
               "--trace", f"tiny={TRACE}", "--out", str(png), "--sim-out",
               str(tmp_path / "sim.json"), "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and png.stat().st_size > 1000 and len(out["rows"]) == 9
    png2 = tmp_path / "so.png"
    rc = main(["sim", "scale-out", "--calibration", str(cal_file), "--trace", f"tiny={TRACE}",
               "--prefill", "2", "--decode", "2", "--colocated", "4", "--requests", "16",
               "--rates", "0.5", "2", "--out", str(png2), "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["simulated"] and png2.stat().st_size > 1000
    assert set(out["capacity"]["tiny"][0]["capacity"]) == {"mooncake-2P2D", "vllm-like-4x1"}


def test_cli_vs_live_prints_a_rate_the_live_run_skipped(capsys, tmp_path, cal_file
                                                        ) -> None:  # noqa: ANN001
    """A rate `bench capacity` skipped after two saturated ones has no live p90: the table
    prints '-' for it (the printer raised TypeError on None, 2026-12-04) and the point is
    not counted below saturation."""
    live = json.loads(LIVE.read_text())
    system, top = live["config"]["systems"][0], max(live["config"]["rates"])
    for p in live["points"]:
        if p["system"] == system and p["rate"] == top:
            p["records"] = []
            p["summary"] = cap.summarize_point([]) | {
                "num_requests": 12, "bad_fraction": 1.0, "skipped": "saturated at lower rates"}
    f = tmp_path / "live.json"
    f.write_text(json.dumps(live))
    rc = main(["sim", "vs-live", "--calibration", str(cal_file), "--live", str(f),
               "--trace", f"tiny={TRACE}"])
    out = capsys.readouterr().out
    row = next(ln for ln in out.splitlines()
               if ln.startswith("tiny") and ln.split()[1] == system
               and float(ln.split()[2]) == top)
    assert rc == 0 and row.split()[3:6] == ["-", row.split()[4], "-"]
    assert row.split()[-1] == "False"


def test_cli_vs_live_bad_input(capsys, tmp_path, cal_file) -> None:  # noqa: ANN001
    bad = tmp_path / "live.json"
    bad.write_text(json.dumps({"kind": "other"}))
    rc = main(["sim", "vs-live", "--calibration", str(cal_file), "--live", str(bad)])
    assert rc == 1 and "not a `bench capacity` document" in capsys.readouterr().err
    rc = main(["sim", "vs-live", "--calibration", str(cal_file), "--live", str(LIVE),
               "--out", str(tmp_path / "x.txt")])
    assert rc == 2 and "--out must name a .png" in capsys.readouterr().err


def test_vs_live_on_the_recorded_real_run(cal_file) -> None:  # noqa: ANN001
    """`bench capacity`'s sample recorded from a real tiny run (tests/bench/data, written by
    the capacity harness): the simulator replays the same 6 requests at the same rates."""
    live_path = Path(__file__).parents[1] / "bench" / "data" / "capacity_tiny.json"
    if not live_path.exists():
        pytest.skip("no recorded live capacity sample")
    live = json.loads(live_path.read_text())
    from pymooncake.workload.trace import bundled_trace_path
    trace = Path(live["traces"]["conversation"]["path"])
    if not trace.exists():
        trace = bundled_trace_path("conversation")
    sim = simulate_like_live(live, load_calibration(cal_file), str(cal_file),
                             trace_paths={"conversation": str(trace)})
    assert sim["config"]["systems"] == ["ours-pd"]            # vllm (2 threads) not modelled
    assert [p["rate"] for p in sim["points"]] == live["config"]["rates"]
    assert all(p["summary"]["num_requests"] == 6 for p in sim["points"])
    rows = compare(live, sim)
    assert [r["system"] for r in rows] == ["ours-pd", "ours-pd"]
    assert all(r["live_ttft_p90_s"] > 0 and r["sim_ttft_p90_s"] > 0 for r in rows)
    live["traces"]["conversation"]["mean_input_tokens"] += 1.0
    with pytest.raises(ValueError, match="sample cannot be rebuilt"):
        simulate_like_live(live, load_calibration(cal_file), str(cal_file),
                           trace_paths={"conversation": str(trace)})


def test_ours_1w_takes_the_calibration_of_its_threads(cal_file, tmp_path) -> None:  # noqa: ANN001
    """ours-1w (one engine on both cores) is simulated only with a 2-thread calibration, as
    one node stepped like the engine with every engine's KV (sample numbers invented)."""
    live = json.loads(LIVE.read_text().replace("ours-colocated", "ours-1w"))
    one = load_calibration(cal_file)
    sim = simulate_like_live(live, one, str(cal_file), trace_paths={"tiny": str(TRACE)})
    assert sim["config"]["systems"] == ["vllm-2x1", "ours-pd"]
    assert sim["config"]["not_simulated"] == {"ours-1w": "no 2-thread calibration given"}
    doc = one.to_json()
    doc["node"] |= {"threads": 2, "cores": 2}
    two_path = tmp_path / "cal2.json"
    two_path.write_text(json.dumps(doc))
    sim = simulate_like_live(live, one, str(cal_file), trace_paths={"tiny": str(TRACE)},
                             more=[(load_calibration(two_path), str(two_path))])
    assert sim["config"]["systems"] == ["vllm-2x1", "ours-1w", "ours-pd"]
    assert sim["calibration_of_system"] == {"vllm-2x1": str(cal_file), "ours-1w": str(two_path),
                                            "ours-pd": str(cal_file)}
    pts = [p for p in sim["points"] if p["system"] == "ours-1w"]
    assert [p["rate"] for p in pts] == [0.25, 0.5, 1.0]
    assert all(p["summary"]["num_requests"] == 12 for p in pts)
    cfg = system_config("ours-1w", cores=2, block_size=128, chunk_tokens=512,
                        kv_tokens=364 * 128 * 2, admission=(2.5, 0.15))
    assert (cfg.num_prefill, cfg.step_budget_tokens, cfg.decode_step_tokens,
            cfg.waiting_order, cfg.early_rejection, cfg.ttft_slo_s) == (
                1, 512, 256, "shortest", True, 2.5)
    assert cfg.resolve_cache_tokens(364 * 128 * 2) == 93_184   # the whole paged KV
    assert cfg.policy_prefill is None   # the calibrated cost (the live start-up profile)
    assert system_config("ours-1w", cores=2, block_size=128, chunk_tokens=512,
                         kv_tokens=364 * 128 * 2, admission=(2.5, 0.15),
                         conductor_prefill="defaults").policy_prefill == (5e-8, 1e-4, 3e-3)
    with pytest.raises(ValueError, match="conductor_prefill must be one of"):
        system_config("ours-1w", cores=2, block_size=128, chunk_tokens=512,
                      kv_tokens=364 * 128 * 2, admission=None, conductor_prefill="truth")
    assert cfg.decode_step_s is None
    cfg = system_config("ours-1w-c384-t650-srpt", cores=2, block_size=128, chunk_tokens=512,
                        kv_tokens=364 * 128 * 2, admission=(2.5, 0.15))
    assert (cfg.decode_step_tokens, cfg.decode_step_s, cfg.waiting_order) == (384, 0.65, "srpt")


def test_ours_1w_on_the_recorded_real_pilot(cal_file, tmp_path, capsys) -> None:  # noqa: ANN001
    """A real recorded `bench capacity` pilot of ours-1w (tests/sim/data, trimmed; made
    before 4760ab6, when the live Conductor predicted with its built-in defaults): the
    simulator rebuilds the live run's 16 requests and, predicting as that Conductor did
    (``--conductor-prefill defaults``), rejects none of them at the live objectives, as
    live; predicting with the calibrated cost (what a Conductor with a start-up profile
    does) it rejects some at the tight 5x objective."""
    live = json.loads((DATA / "capacity_pilot_1w_conversation.json").read_text())
    from pymooncake.workload.trace import bundled_trace_path
    trace = Path(live["traces"]["conversation"]["path"])
    if not trace.exists():
        trace = bundled_trace_path("conversation")
    doc = load_calibration(cal_file).to_json()
    doc["node"] |= {"threads": 2, "cores": 2}
    two = tmp_path / "cal2.json"
    two.write_text(json.dumps(doc))
    sim = simulate_like_live(live, load_calibration(two), str(two),
                             trace_paths={"conversation": str(trace)},
                             conductor_prefill="defaults")
    calibrated = simulate_like_live(live, load_calibration(two), str(two),
                                    trace_paths={"conversation": str(trace)})
    assert sum(p["summary"]["num_rejected"] for p in calibrated["points"]) > 0
    assert calibrated["config"]["conductor_prefill"] == "calibrated"
    assert sim["config"]["systems"] == ["ours-1w"]
    assert sim["config"]["admission_slo_s"]["conversation"] == pytest.approx([6.37565, 0.214961],
                                                                             rel=1e-4)
    assert [p["rate"] for p in sim["points"]] == [0.1, 0.2, 0.3, 0.45, 0.6]
    assert all(p["summary"]["num_requests"] == 16 and p["summary"]["num_rejected"] == 0
               for p in sim["points"])
    rows = compare(live, sim)
    assert len(rows) == 5 and all(r["below_saturation"] for r in rows)
    assert rows[0]["live_ttft_p90_s"] == pytest.approx(3.690059)
    rc = main(["sim", "vs-live", "--calibration", str(cal_file), "--calibration", str(two),
               "--live", str(DATA / "capacity_pilot_1w_conversation.json"),
               "--trace", f"conversation={trace}", "--conductor-prefill", "defaults",
               "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["not_simulated"] == {} and len(out["rows"]) == 5
    assert [r["sim_ttft_p90_s"] for r in out["rows"]] == [r["sim_ttft_p90_s"] for r in rows]


@pytest.mark.parametrize(("content", "message"), [
    (b"[]", "not a `bench capacity` document"),
    (b"null", "not a `bench capacity` document"),
    (b'{"config": {}, "points": []}', "no swept points"),
    (b"garbage", "not JSON"),
    (b"\xff\xfe", "not UTF-8"),
])
def test_vs_live_refuses_a_bad_live_file_naming_it(cal_file, tmp_path, capsys, content,
                                                   message) -> None:  # noqa: ANN001
    bad = tmp_path / "live.json"
    bad.write_bytes(content)
    assert main(["sim", "vs-live", "--calibration", str(cal_file), "--live", str(bad)]) == 1
    err = capsys.readouterr().err.strip()
    assert f"--live {bad}: {message}" in err and len(err.splitlines()) == 1
