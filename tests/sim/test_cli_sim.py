"""``pymooncake sim ...`` on small trace files: JSON keys, and bad input rejected with one line
(exit 1) before anything runs."""

from __future__ import annotations

import json

import pytest

from pymooncake.cli.main import main

REPLAY_KEYS = {"num_requests", "num_rejected", "ttft_mean_s", "ttft_p50_s", "ttft_p99_s",
               "tbt_mean_s", "tbt_p99_s", "slo_attainment", "request_hit_ratio",
               "token_hit_ratio"}


@pytest.fixture()
def trace_file(tmp_path):  # noqa: ANN001, ANN201
    rows = [{"timestamp": 100 * i, "input_length": 1500, "output_length": 4,
             "hash_ids": [0, 1 + i % 3, 10 + i]} for i in range(30)]
    p = tmp_path / "t.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return p


def _run(capsys, argv: list[str]) -> tuple[int, str, str]:  # noqa: ANN001
    rc = main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_run_json_has_replay_keys_and_csv(capsys, trace_file, tmp_path) -> None:  # noqa: ANN001
    csv_path = tmp_path / "r.csv"
    rc, out, _ = _run(capsys, ["sim", "run", str(trace_file), "--prefill", "2", "--decode", "1",
                               "--csv", str(csv_path), "--json"])
    assert rc == 0
    s = json.loads(out)
    assert REPLAY_KEYS | {"prefill_gpu_time_mean_s"} <= set(s)
    assert s["num_requests"] == 30 and s["num_rejected"] == 0
    assert len(csv_path.read_text().splitlines()) == 31


def test_capacity_curve_json(capsys, trace_file) -> None:  # noqa: ANN001
    rc, out, _ = _run(capsys, ["sim", "capacity-curve", str(trace_file), "--json",
                               "--capacities", "0", "1024", "1000000"])
    d = json.loads(out)
    assert rc == 0 and set(d) == {"capacities_tokens", "hit_ratio", "max_hit_ratio"}
    # infinite: block 0 hits from request 1 on (512 of 1500); block 1+i%3 from request 3 on.
    assert d["max_hit_ratio"] == pytest.approx((29 * 512 + 27 * 512) / (30 * 1500))
    assert d["hit_ratio"][0] == 0.0 and d["hit_ratio"][-1] == d["max_hit_ratio"]


@pytest.mark.parametrize(("argv", "msg"), [
    (["--model", "gpt-9"], "unknown model 'gpt-9'"),
    (["--gpu", "V100"], "unknown GPU 'V100'"),
    (["--prefill", "0"], "prefill node"),
    (["--decode", "0"], "decode node"),
    (["--cache-capacity-tokens", "-1"], "capacity must be >= 0"),
])
def test_bad_cluster_is_one_line_exit_1(capsys, trace_file, argv, msg) -> None:  # noqa: ANN001
    rc, out, err = _run(capsys, ["sim", "run", str(trace_file), *argv])
    assert rc == 1 and out == ""
    assert err.count("\n") == 1 and msg in err


def test_malformed_trace_is_one_line_exit_1(capsys, tmp_path) -> None:  # noqa: ANN001
    p = tmp_path / "bad.jsonl"
    p.write_text('{"timestamp": 0, "input_length": 5}\n')
    for cmd in (["sim", "run", str(p)], ["sim", "capacity-curve", str(p)]):
        rc, out, err = _run(capsys, cmd)
        assert rc == 1 and out == "" and "bad.jsonl:1" in err and err.count("\n") == 1
    rc, _, err = _run(capsys, ["sim", "run", str(tmp_path / "missing.jsonl")])
    assert rc == 1 and "no such file" in err


def test_sweep_pd_ratio_and_rate(capsys, trace_file) -> None:  # noqa: ANN001
    rc, out, _ = _run(capsys, ["sim", "sweep", str(trace_file), "--over", "pd-ratio",
                               "--values", "1", "3", "--prefill", "2", "--decode", "2", "--json"])
    d = json.loads(out)
    assert rc == 0 and [(p["num_prefill"], p["num_decode"]) for p in d["points"]] == [(1, 3),
                                                                                      (3, 1)]
    assert d["best_value"] in (1.0, 3.0)
    rc, out, err = _run(capsys, ["sim", "sweep", str(trace_file), "--over", "pd-ratio",
                                 "--values", "4", "--prefill", "2", "--decode", "2"])
    assert rc == 1 and "prefill nodes must be in [1, 3]" in err
    rc, out, _ = _run(capsys, ["sim", "sweep", str(trace_file), "--over", "rate", "--values",
                               "1", "1000", "--prefill", "1", "--decode", "1", "--json",
                               "--ttft-slo-s", "1"])
    d = json.loads(out)
    # at 1000× the 30 requests arrive within 3 ms: the single prefill node queues them past
    # the 1 s TTFT objective, so only the unscaled rate meets 99 %.
    assert [p["slo_attainment"] for p in d["points"]][0] == 1.0
    assert d["points"][1]["slo_attainment"] < 0.99 and d["best_value"] == 1.0


def test_plot_capacity_png(capsys, trace_file, tmp_path) -> None:  # noqa: ANN001
    out_png = tmp_path / "cap.png"
    rc, out, _ = _run(capsys, ["sim", "plot", str(trace_file), "--kind", "capacity", "--out",
                               str(out_png), "--json"])
    assert rc == 0 and json.loads(out)["png"] == str(out_png)
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_sim_without_dynamo(capsys, trace_file) -> None:  # noqa: ANN001
    rc, out, _ = _run(capsys, ["bench", "sim", "--trace", str(trace_file), "--no-dynamo",
                               "--json"])
    d = json.loads(out)
    assert rc == 0 and d["wall_s"] > 0 and d["peak_rss_bytes"] > 10 * 2**20
    assert d["dynamo_wall_s"] is None and d["dynamo_peak_rss_bytes"] is None
    assert "skipped" in d["note"]
