"""``bench mixed-step``: a prompt computed beside running decodes, per step policy."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from pymooncake.bench.mixed_step import Policy, parse_policy, run  # noqa: E402


def test_policies_parse_and_bad_ones_name_the_text() -> None:
    assert parse_policy("cap:256") == Policy("cap:256", 256, None)
    assert parse_policy("time:0.6") == Policy("time:0.6", 256, 0.6)
    assert parse_policy("none") == Policy("none", None, None)
    for bad in ("cap:0", "cap:x", "time:0", "time:-1", "time:nan", "none:1", "lifo", ""):
        with pytest.raises(ValueError, match="step policy"):
            parse_policy(bad)


def test_steps_follow_the_policy_on_the_tiny_model() -> None:
    """2 requests decode while a 200-token prompt runs: with no cap it fits one 512-token
    step beside them; with a 16-token cap each step holds the 2 decodes and 14 prompt
    tokens, so ceil(200 / 14) = 15 steps."""
    res = run("tiny", [parse_policy("none"), parse_policy("cap:16"), parse_policy("time:0.05")],
              decoding=2, decode_context=100, prompt_len=200, threads=1, repeats=2)
    p = res["policies"]
    assert p["none"]["steps"] == 1 and p["cap:16"]["steps"] == 15
    for r in p.values():
        assert len(r["repeats"]) == 2 and 0 < r["ttft_s_range"][0] <= r["ttft_s"]
        assert r["max_step_s"] >= r["median_step_s"] > 0
    with pytest.raises(ValueError, match="prompt_len"):
        run("tiny", [parse_policy("none")], prompt_len=0)


def test_cli_refuses_bad_flags_in_one_line(capsys) -> None:  # noqa: ANN001
    from pymooncake.cli.main import main
    for argv, msg in ((["--policies", "cap:0"], "--policies: step policy 'cap:0'"),
                      (["--policies", "none,none"], "lists a policy twice"),
                      (["--decoding", "0"], "--decoding must be >= 1, got 0")):
        try:
            rc = main(["bench", "mixed-step", "--model", "tiny", *argv])
        except SystemExit as e:
            rc = e.code
        assert rc == 2 and msg in capsys.readouterr().err
