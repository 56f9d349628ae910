"""A CPP prefill group as a live prefill instance (issue 19, docs/cpp.md "Conductor"): Store
master, Conductor, one single prefill worker, one 2-stage CPP instance (``prefill-cpp``) and
one decode worker — real processes on 127.0.0.1, the tiny model.

The CPP instance's break-even is set low (``--cpp-min-tokens 128``) and its chunks small
(64 tokens) so that a 400-token prompt crosses it: the Conductor must send that prompt to
the group and a 40-token one to the single worker, and both answers must equal one
colocated engine's greedy tokens.

The ``test_fault_*`` tests run last (they stop and kill the group's stages; docs/cpp.md
"When a stage fails"): a stalled stage (SIGSTOP) and a killed one (SIGKILL) must be seen
within seconds in the Conductor's ``/health`` (the instance's ``cpp`` state names the
stage), and long prompts — one sent just as the stage stalls included — must still be
answered with one engine's greedy tokens, well before the 60 s RPC timeout.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import httpx
import pytest

from tests.serving.conftest import complete, health, stream_token_ids, wait_for, workers

CONTEXT = 1024
MIN_TOKENS = 128
LONG = 400


@pytest.fixture(scope="module")
def cluster(make_cluster):
    return make_cluster(num_prefill=1, num_decode=1, policy="global-cache", global_store=True,
                        max_model_len=CONTEXT, num_kv_blocks=256,
                        cpp_argv=["--cpp-stages", "2", "--cpp-min-tokens", str(MIN_TOKENS),
                                  "--cpp-chunk-tokens", "64", "--cpp-edge-tokens", "0"])


def _ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


def _samples(url: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """Every sample of ``name`` on ``url/metrics``, by its labels."""
    from prometheus_client.parser import text_string_to_metric_families
    out = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for s in fam.samples:
            if s.name == name:
                out[tuple(sorted(s.labels.items()))] = s.value
    return out


def _placed(url: str) -> dict[str, float]:
    return {dict(k)["prefill_instance"]: v
            for k, v in _samples(url, "pymooncake_conductor_placements_total").items()}


def _cpp_pipeline_runs(url: str) -> float:
    """Prefills whose worker reported a ``cpp_prefill`` window (the pipeline ran)."""
    return _samples(url, "pymooncake_conductor_stage_seconds_count").get(
        (("stage", "cpp_prefill"),), 0.0)


def _stage_count(url: str, stage: str) -> float:
    return _samples(url, "pymooncake_conductor_stage_seconds_count").get(
        (("stage", stage),), 0.0)


@pytest.mark.parametrize(("argv", "message"), [
    (["prefill", "--id", "c", "--conductor", "127.0.0.1:1", "--cpp-stages", "0"],
     "--cpp-stages must be >= 2 (a pipeline of stages), got 0"),
    (["prefill", "--id", "c", "--conductor", "127.0.0.1:1", "--cpp-stages", "5"],
     "--cpp-stages 5: the model has 4 layers (2 to 4 stages)"),
    (["prefill", "--id", "c", "--conductor", "127.0.0.1:1", "--cpp-stages", "2",
      "--cpp-chunk-tokens", "0"], "--cpp-chunk-tokens must be >= 1, got 0"),
    (["serve", "--cpp-stages", "1"], "--cpp-stages must be >= 2"),
    (["serve", "--colocated", "--cpp-stages", "2"], "does not apply with --colocated"),
    (["serve", "--cpp-min-tokens", "100"],
     "--cpp-min-tokens sets up a CPP prefill group: add --cpp-stages N"),
    (["serve", "--cpp-stages", "2", "--cpp-min-tokens", "99999999999"],
     "--cpp-min-tokens 99999999999 is above --max-model-len (8192 tokens)"),
    (["serve", "--cpp-stages", "2", "--cpp-min-tokens", "-1"],
     "--cpp-min-tokens must be >= 0, got -1"),
    (["serve", "--cpp-stages", "2", "--cpp-edge-tokens", "-1"],
     "--cpp-edge-tokens must be >= 0, got -1"),
])
def test_bad_cpp_flags_exit_2_naming_the_flag(argv, message, capsys):
    """The first case of each command (prefill, serve) runs the real entry point in a fresh
    Python; the others call ``main(argv)`` in this process (same exit code and stderr)."""
    if argv in (["prefill", "--id", "c", "--conductor", "127.0.0.1:1", "--cpp-stages", "0"],
                ["serve", "--cpp-stages", "1"]):
        r = subprocess.run([sys.executable, "-m", "pymooncake", *argv, "--model", "tiny"],
                           capture_output=True, text=True, timeout=60)
        rc, stderr = r.returncode, r.stderr
    else:
        from pymooncake.cli.main import main
        try:
            rc = main([*argv, "--model", "tiny"])
        except SystemExit as e:   # argparse's own usage errors
            rc = e.code
        stderr = capsys.readouterr().err
    assert rc == 2, stderr
    assert message in stderr
    assert "Traceback" not in stderr


def test_cpp_instance_registers(cluster):
    ws = workers(cluster.url)
    assert {"prefill-0", "prefill-cpp", "decode-0"} <= set(ws)
    assert ws["prefill-cpp"]["role"] == "prefill"


def test_long_prompt_to_group_short_to_single_worker_same_greedy(cluster):
    from pymooncake.engine import Engine, EngineConfig, SamplingParams
    url = cluster.url
    long, short = _ids(1, 400), _ids(2, 40)
    max_tokens = 10
    ref = Engine.from_model_name("tiny", EngineConfig(max_model_len=CONTEXT)).generate(
        [long, short], SamplingParams(max_tokens=max_tokens, ignore_eos=True))

    placed0, runs0 = _placed(url), _cpp_pipeline_runs(url)
    loads0 = _stage_count(url, "decode_load")
    got, usage, errors = stream_token_ids(url, long, max_tokens, ignore_eos=True)
    assert not errors
    assert got == list(ref[0].output_token_ids)
    assert usage["prompt_tokens"] == len(long)
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0
    # the decode worker loaded the prompt KV the CPP instance sent (it did not recompute)
    assert _stage_count(url, "decode_load") == loads0 + 1
    placed1 = _placed(url)
    assert placed1.get("prefill-cpp", 0) - placed0.get("prefill-cpp", 0) == 1
    assert placed1.get("prefill-0", 0) == placed0.get("prefill-0", 0)
    assert _cpp_pipeline_runs(url) == runs0 + 1
    # the group computed the whole prompt (nothing cached before): its load report says so
    wait_for(lambda: workers(url)["prefill-cpp"]["num_prefill_tokens_total"] >= len(long),
             5.0, "the CPP instance's prefill-token counter")

    got, usage, errors = stream_token_ids(url, short, max_tokens, ignore_eos=True)
    assert not errors
    assert got == list(ref[1].output_token_ids)
    placed2 = _placed(url)
    assert placed2.get("prefill-0", 0) - placed1.get("prefill-0", 0) == 1
    assert placed2.get("prefill-cpp", 0) == placed1.get("prefill-cpp", 0)
    assert _cpp_pipeline_runs(url) == runs0 + 1


def test_prompt_ending_inside_a_block_ships_its_partial_block_too(cluster):
    """A 405-token prompt (25 full blocks + 5 tokens) through the group: the instance
    computes the 5-token tail and ships the prompt's blocks in one batch (layer-wise
    writes are off on a CPP instance) — with the target already there, the partial last
    block too, from the step that just ended — and the decode worker's tokens equal one
    colocated engine's greedy tokens."""
    from pymooncake.engine import Engine, EngineConfig, SamplingParams
    url = cluster.url
    prompt = _ids(6, LONG + 5)
    max_tokens = 8
    (ref,) = Engine.from_model_name("tiny", EngineConfig(max_model_len=CONTEXT)).generate(
        [prompt], SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    placed0, loads0 = _placed(url), _stage_count(url, "decode_load")
    got, _, errors = stream_token_ids(url, prompt, max_tokens, ignore_eos=True)
    assert not errors
    assert got == list(ref.output_token_ids)
    assert _placed(url).get("prefill-cpp", 0) - placed0.get("prefill-cpp", 0) == 1
    assert _stage_count(url, "decode_load") == loads0 + 1


def test_group_blocks_reach_the_store(cluster):
    """The blocks the group computed were put into the Store (reusable by any worker)."""
    url = cluster.url
    prompt = _ids(3, 320)
    before = health(url)["num_store_blocks"]
    r = complete(url, prompt, 2)
    assert r.status_code == 200, r.text
    assert _placed(url).get("prefill-cpp", 0) >= 2
    wait_for(lambda: health(url)["num_store_blocks"] >= before + 320 // 16, 10.0,
             "the group's 20 blocks in the Store")


def test_cpp_instance_prefill_rpc_long_and_short(cluster):
    """Straight to the CPP instance's ``prefill`` RPC (no decode target): a prompt over
    ``--cpp-min-tokens`` runs through the pipeline (``cpp_*`` windows, all its tokens
    computed), one under it on the instance's own engine (a plain ``prefill`` window); both
    first tokens are one engine's greedy first token."""
    from pymooncake.engine import Engine, EngineConfig, SamplingParams
    from pymooncake.rpc import SyncRpcClient, from_wire
    from pymooncake.rpc.messages import PrefillResult, PrefillTask, SamplingOptions
    port = workers(cluster.url)["prefill-cpp"]["rpc_port"]
    long, short = _ids(4, 200), _ids(5, MIN_TOKENS - 8)
    ref = Engine.from_model_name("tiny", EngineConfig(max_model_len=CONTEXT)).generate(
        [long, short], SamplingParams(max_tokens=1))
    client = SyncRpcClient("127.0.0.1", port, timeout_s=60.0)
    try:
        results = []
        for rid, ids in (("direct-long", long), ("direct-short", short)):
            raw = client.call("prefill", PrefillTask(rid, tuple(ids), SamplingOptions(
                max_tokens=1, temperature=0.0), use_store=False))
            results.append(from_wire(PrefillResult, raw))
    finally:
        client.close()
    rl, rs = results
    assert rl.first_token_id == ref[0].output_token_ids[0]
    assert rs.first_token_id == ref[1].output_token_ids[0]
    assert rl.cached_tokens == 0
    assert {w[0] for w in rl.stages} >= {"cpp_queue", "cpp_prefill", "cpp_kv_import",
                                         "cpp_tail"}
    assert "prefill" not in {w[0] for w in rl.stages}
    assert "prefill" in {w[0] for w in rs.stages}
    assert not {w[0] for w in rs.stages} & {"cpp_prefill", "cpp_tail"}


@pytest.fixture(scope="module")
def reference():
    """Greedy tokens of one colocated engine for prompts ``_ids(seed)``, by seed."""
    from pymooncake.engine import Engine, EngineConfig, SamplingParams
    eng = Engine.from_model_name("tiny", EngineConfig(max_model_len=CONTEXT))
    seeds = (11, 12, 13, 14)
    outs = eng.generate([_ids(s, LONG) for s in seeds],
                        SamplingParams(max_tokens=6, ignore_eos=True))
    return {s: list(o.output_token_ids) for s, o in zip(seeds, outs, strict=True)}


def _cpp(url: str) -> dict:
    state = workers(url)["prefill-cpp"].get("cpp")
    assert state is not None, "the CPP instance reports no group state"
    return state


def _served(url: str, seed: int, reference: dict[int, list[int]], limit_s: float) -> None:
    t0 = time.monotonic()
    got, _, errors = stream_token_ids(url, _ids(seed, LONG), 6, ignore_eos=True)
    took = time.monotonic() - t0
    assert not errors, errors
    assert got == reference[seed]
    assert took < limit_s, f"a long prompt took {took:.1f} s"


def test_fault_stalled_stage_detected_and_long_prompts_not_stuck(cluster, reference):
    url = cluster.url
    wait_for(lambda: _cpp(url)["healthy"], 15.0, "a healthy CPP group")
    _served(url, 11, reference, 30.0)           # through the pipeline, as usual
    stage1 = _cpp(url)["stages"][1]
    os.kill(stage1["pid"], signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        # sent at once: the Conductor still sees a healthy group, the prompt goes down the
        # stalled pipeline and must leave it when the watch sees the stall
        _served(url, 12, reference, 30.0)
        wait_for(lambda: not _cpp(url)["healthy"], 15.0, "the stall in /health")
        assert time.monotonic() - t0 < 30.0
        state = _cpp(url)
        assert "stage 1" in state["reason"] and stage1["address"] in state["reason"]
        assert "did not answer 2 pings in a row" in state["reason"]
        _served(url, 13, reference, 30.0)       # while stalled: not placed on the group
    finally:
        os.kill(stage1["pid"], signal.SIGCONT)
    wait_for(lambda: _cpp(url)["healthy"], 15.0, "the group healthy again after SIGCONT")


def test_fault_killed_stage_group_unhealthy_long_prompt_served(cluster, reference):
    url = cluster.url
    wait_for(lambda: _cpp(url)["healthy"], 15.0, "a healthy CPP group")
    stage0 = _cpp(url)["stages"][0]
    os.kill(stage0["pid"], signal.SIGKILL)
    wait_for(lambda: not _cpp(url)["healthy"], 10.0, "the dead stage in /health")
    state = _cpp(url)
    assert "stage 0" in state["reason"] and "exited" in state["reason"]
    assert stage0["address"] in state["reason"]
    assert [s["ok"] for s in state["stages"]] == [False, True]
    _served(url, 14, reference, 30.0)
    assert not _cpp(url)["healthy"]             # a dead stage is not restarted
