"""Elastic EP with real rank processes on loopback (``pymooncake ep rank``): 4 ranks give
the single-process greedy output; a rank killed mid-generation is survived (replicas) or
ends the requests cleanly (no replica); a replacement rank rejoins and is used again."""

from __future__ import annotations

import time

import pytest

from pymooncake.engine.ep.dispatch import EPOptions
from tests.ep.conftest import PROMPTS, generate_all, reference

pytestmark = pytest.mark.integration


def _join(threads: list, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), "a request hung"


def test_four_ranks_match_single_process(cluster, front) -> None:
    f = front(cluster.ranks)
    threads, results = generate_all(f, 32)
    _join(threads)
    assert [results[i]["token_ids"] for i in range(len(PROMPTS))] == reference(32)
    assert all(results[i]["error"] is None for i in results)
    st = f.client().call("ep.status")
    assert [r["alive"] for r in st["ranks"]] == [True] * 4
    for layer in st["placement"]:  # 4 slots x 4 ranks: every expert has 2 copies
        assert sorted(len(rs) for rs in layer.values()) == [2] * 8


def test_kill_rank_mid_generation_then_rejoin(cluster, front) -> None:
    cluster.restore()
    ranks = cluster.ranks
    f = front(ranks, options=EPOptions(slots_per_rank=4))
    threads, results = generate_all(f, 400)
    time.sleep(0.3)
    assert len(results) < len(PROMPTS), "generation finished before the kill"
    ranks[1].kill()
    _join(threads)
    # every expert had a copy elsewhere: in-flight requests finish, output unchanged
    assert [results[i]["error"] for i in range(3)] == [None] * 3
    assert [results[i]["token_ids"] for i in range(3)] == reference(400)
    st = f.client().call("ep.status")
    assert not st["ranks"][1]["alive"] and st["missing"] == []
    assert f.generate(PROMPTS[0], 16)["token_ids"] == reference(400)[0][:16]
    # a replacement on the same address rejoins and gets experts again
    cluster.replace(1)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        st = f.client().call("ep.status")
        # alive flips in the re-balance's switch phase, before its replan is recorded (as in
        # test_stopped_rank_is_timed_out_then_rejoins): wait for the rejoin's own replan
        if st["ranks"][1]["alive"] and st["replans"][-1][0] == "rank 1 rejoined":
            break
        time.sleep(0.2)
    assert st["ranks"][1]["alive"] and st["replans"][-1][0] == "rank 1 rejoined", st
    assert any(1 in rs for layer in st["placement"] for rs in layer.values())
    threads, results = generate_all(f, 24)
    _join(threads)
    assert [results[i]["token_ids"] for i in range(3)] == reference(24)


def test_cli_serve_and_generate(cluster, capsys) -> None:
    """``pymooncake ep serve`` over the ranks, ``ep generate`` and ``ep status`` against it."""
    import json
    import os
    import subprocess
    import sys

    from pymooncake.cli.main import main
    from tests.ep.conftest import ready_line
    cluster.restore()
    ranks = ",".join(f"127.0.0.1:{r.port}" for r in cluster.ranks)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    serve = subprocess.Popen([sys.executable, "-m", "pymooncake", "ep", "serve", "--ranks",
                              ranks], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=env)
    try:
        port = ready_line(serve)["port"]
        out = subprocess.run([sys.executable, "-m", "pymooncake", "ep", "generate", "--server",
                              f"127.0.0.1:{port}", "--ids",
                              ",".join(map(str, PROMPTS[2])), "--max-tokens", "12", "--json"],
                             capture_output=True, text=True, env=env, timeout=60)
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["token_ids"] == reference(400)[2][:12]
        # a usage error, in process (the run above covered the entry point)
        assert main(["ep", "generate", "--server", "nohost", "--ids", "1"]) == 2
        assert capsys.readouterr().err.startswith("pymooncake: error:")
    finally:
        serve.terminate()
        serve.wait(20)


def test_stopped_rank_is_timed_out_then_rejoins(cluster, front) -> None:
    """A rank that hangs (SIGSTOP) costs at most the call timeout: its rows go to the other
    copies, nothing hangs; once it continues it answers pings again and is re-admitted."""
    import os
    import signal
    cluster.restore()
    ranks = cluster.ranks
    f = front(ranks, options=EPOptions(slots_per_rank=4, call_timeout_s=1.0, deadline_s=0.6))
    pid = ranks[3].proc.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        threads, results = generate_all(f, 24)
        _join(threads)
        assert [results[i]["error"] for i in range(3)] == [None] * 3
        assert [results[i]["token_ids"] for i in range(3)] == reference(24)
        assert not f.client().call("ep.status")["ranks"][3]["alive"]
    finally:
        os.kill(pid, signal.SIGCONT)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        st = f.client().call("ep.status")
        # alive flips in the re-balance's switch phase, before its replan is recorded; a
        # re-balance for the death that was still running may re-admit the rank first
        if st["ranks"][3]["alive"] and st["replans"][-1][0] == "rank 3 rejoined":
            break
        time.sleep(0.2)
    assert st["ranks"][3]["alive"] and st["replans"][-1][0] == "rank 3 rejoined"
    threads, results = generate_all(f, 24)
    _join(threads)
    assert [results[i]["token_ids"] for i in range(3)] == reference(24)


def test_kill_rank_without_replicas_fails_cleanly(cluster, front) -> None:
    cluster.restore()
    ranks = cluster.ranks
    f = front(ranks, options=EPOptions(slots_per_rank=2, replan_on_failure=False))
    threads, results = generate_all(f, 400)
    time.sleep(0.3)
    ranks[2].kill()
    _join(threads)
    errors = [results[i] for i in range(3) if results[i]["error"] is not None]
    assert errors, "every request avoided rank 2's experts for 400 tokens"
    for r in errors:
        assert r["finish_reason"] == "error"
        assert "without a live replica" in r["error"] and r["missing_experts"]
    for i in range(3):  # those that finished are unchanged
        if results[i]["error"] is None:
            assert results[i]["token_ids"] == reference(400)[i]
    t0 = time.monotonic()
    again = f.generate(PROMPTS[1], 16)  # the server still answers, at once
    assert again["error"] is not None and time.monotonic() - t0 < 5.0
    st = f.client().call("ep.status")
    assert len(st["missing"]) == 4  # 2 experts per layer lived only on rank 2


def test_degraded_topk_is_reported(cluster, front) -> None:
    cluster.restore()
    ranks = cluster.ranks
    f = front(ranks, options=EPOptions(slots_per_rank=2, replan_on_failure=False),
              degraded_topk=True)
    assert f.generate(PROMPTS[0], 8)["degraded"] is False
    ranks[0].kill()
    out = f.generate(PROMPTS[0], 8)
    assert out["error"] is None and out["degraded"] is True
    assert len(out["token_ids"]) == 8 and out["missing_experts"]


def test_hf_checkpoint_directory_over_two_ranks(front, tmp_path) -> None:
    """A Qwen2-MoE safetensors directory: the front loads no routed experts, each rank reads
    only its experts' tensors; greedy output equals the single-process ``tiny-moe``'s."""
    from pymooncake.engine.model.moe_io import build_tiny_moe, save_hf_checkpoint
    from tests.ep.conftest import Rank
    d = save_hf_checkpoint(build_tiny_moe(), tmp_path / "tiny-moe-hf")
    ranks = [Rank(model=str(d)) for _ in range(2)]
    try:
        for r in ranks:
            r.wait_ready()
        f = front(ranks, model=str(d), options=EPOptions(slots_per_rank=4))
        threads, results = generate_all(f, 24)
        _join(threads)
        assert [results[i]["token_ids"] for i in range(3)] == reference(24)
    finally:
        for r in ranks:
            r.kill()
