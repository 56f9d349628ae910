"""``pymooncake sim ...`` on small trace files: JSON keys, and bad input rejected with one line
(exit 1 for bad input files, exit 2 naming the flag for bad argument values) before
anything runs."""

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
    (["--model", "gpt-9"], "--model: unknown model 'gpt-9'"),
    (["--gpu", "V100"], "--gpu: unknown GPU 'V100'"),
    (["--prefill", "0"], "--prefill must be an integer >= 1, got 0"),
    (["--prefill", "-2"], "--prefill must be an integer >= 1, got -2"),
    (["--decode", "0"], "--decode must be an integer >= 1, got 0"),
    (["--cache-capacity-tokens", "-1"], "--cache-capacity-tokens must be an integer >= 0"),
    (["--output-length", "-1"], "--output-length must be an integer >= 1, got -1"),
    (["--output-length", "0"], "--output-length must be an integer >= 1, got 0"),
    (["--time-scale", "0"], "--time-scale must be a finite number > 0, got 0"),
    (["--time-scale", "inf"], "--time-scale must be a finite number > 0, got inf"),
    (["--time-scale", "nan"], "--time-scale must be a finite number > 0, got nan"),
    (["--time-scale", "-1"], "--time-scale must be a finite number > 0, got -1"),
    (["--bandwidth-gbps", "0"], "--bandwidth-gbps must be a finite number > 0, got 0"),
    (["--bandwidth-gbps", "nan"], "--bandwidth-gbps must be a finite number > 0, got nan"),
    (["--ttft-slo-s", "0"], "--ttft-slo-s must be a finite number > 0, got 0"),
    (["--ttft-slo-s", "nan"], "--ttft-slo-s must be a finite number > 0, got nan"),
    (["--tbt-slo-s", "nan"], "--tbt-slo-s must be a finite number > 0, got nan"),
    (["--limit", "-1"], "--limit must be an integer >= 1, got -1"),
    (["--max-batch-size", "0"], "--max-batch-size must be an integer >= 1, got 0"),
    (["--balancing-threshold", "-1"], "--balancing-threshold must be a finite number >= 0"),
    (["--balancing-threshold", "nan"], "--balancing-threshold must be a finite number >= 0"),
    (["--scenario", "pd", "--scheduler", "global-cache"], "--scheduler global-cache needs"),
    (["--scenario", "pd", "--cache-capacity-tokens", "1000"], "--cache-capacity-tokens:"),
    # 8xA800 with LLaMA3-70B: (8·80e9·0.9 − 141,107,363,840 weight bytes) / 327,680 B/token
    # = 1,327,194 KV tokens of HBM; a colocated prefix cache must fit inside it.
    (["--scenario", "colocated", "--cache-capacity-tokens", "3000000"], "1327194 KV tokens"),
    (["--csv", "/nonexistent/dir/x.csv"], "--csv /nonexistent/dir/x.csv: directory"),
])
def test_bad_argument_is_one_line_exit_2(capsys, trace_file, argv, msg) -> None:  # noqa: ANN001
    rc, out, err = _run(capsys, ["sim", "run", str(trace_file), *argv])
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and msg in err


@pytest.mark.parametrize(("argv", "msg"), [
    (["sim", "capacity-curve", "T", "--capacities", "-5"], "--capacities must be an integer"),
    (["sim", "capacity-curve", "T", "--limit", "0"], "--limit must be an integer >= 1"),
    (["sim", "sweep", "T", "--over", "rate", "--values", "0"], "--values (rate factors)"),
    (["sim", "sweep", "T", "--over", "bandwidth", "--values", "nan"], "--values (Gbps)"),
    (["sim", "sweep", "T", "--over", "capacity", "--values", "1.5"], "--values (tokens)"),
    (["sim", "sweep", "T", "--over", "capacity", "--values", "2e6", "--scenario",
      "colocated"], "the node holds 1327194 KV tokens"),
    (["sim", "sweep", "T", "--over", "pd-ratio", "--values", "4", "--prefill", "2",
      "--decode", "2"], "--values (prefill nodes) must be an integer in [1, 3]"),
    (["sim", "reproduce", "--traces-dir", "/nonexistent/traces"], "--traces-dir"),
    (["bench", "sim", "--trace", "T", "--repeat", "0"], "--repeat must be an integer >= 1"),
    (["bench", "sim", "--trace", "T", "--dynamo-python", "/nonexistent/python"],
     "interpreter /nonexistent/python not found"),
    (["sim", "calibrate", "--gpu", "H200"], "measured with LLaMA3-70B on 8xA800"),
    (["sim", "plot", "T", "--out", "/nonexistent/x.png"], "--out /nonexistent/x.png: dir"),
    (["sim", "plot", "T", "--out", "x.txt"], "--out must name a .png file"),
])
def test_bad_argument_of_other_commands_exit_2(capsys, trace_file, argv, msg) -> None:  # noqa: ANN001
    argv = [str(trace_file) if a == "T" else a for a in argv]
    rc, out, err = _run(capsys, argv)
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and msg in err


def test_bad_model_file_stays_exit_1(capsys, trace_file, tmp_path) -> None:  # noqa: ANN001
    rc, _, err = _run(capsys, ["sim", "run", str(trace_file), "--model",
                               str(tmp_path / "missing.json")])
    assert rc == 1 and "no such config.json" in err


def test_capacities_accept_integral_exponent_form(capsys, trace_file) -> None:  # noqa: ANN001
    rc, out, _ = _run(capsys, ["sim", "capacity-curve", str(trace_file), "--json",
                               "--capacities", "1e6", "2_000"])
    assert rc == 0 and json.loads(out)["capacities_tokens"] == [1_000_000, 2000]
    with pytest.raises(SystemExit) as e:   # argparse's own usage error names the flag
        main(["sim", "capacity-curve", str(trace_file), "--capacities", "1.5"])
    assert e.value.code == 2 and "--capacities" in capsys.readouterr().err


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
    assert rc == 2 and "--values (prefill nodes) must be an integer in [1, 3]" in err
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
