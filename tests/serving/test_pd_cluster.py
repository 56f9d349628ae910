"""P/D serving end to end: 2 prefill + 2 decode workers, Store master, Conductor — real
processes on 127.0.0.1 (DESIGN.md §1; issue #6 "Done when"; CASES BUG-53, BUG-55, BUG-56).

The Conductor runs the round-robin prefill policy with the global Store on, so consecutive
requests land on different prefill workers and cross-instance reuse through the Store is
observable.
Tests run in file order; the decode-kill test is last.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time

import httpx
import pytest

from tests.serving.conftest import (
    complete,
    metric_value,
    settled_store_blocks,
    stream_token_ids,
    wait_for,
    wait_store_blocks,
    workers,
)

CONTEXT = 2048
B = 16


@pytest.fixture(scope="module")
def cluster(make_cluster):
    return make_cluster(num_prefill=2, num_decode=2, policy="round-robin", global_store=True,
                        max_model_len=CONTEXT, num_kv_blocks=512)


def _ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


def _prefill_tokens(url: str) -> dict[str, int]:
    return {k: w["num_prefill_tokens_total"] for k, w in workers(url).items()
            if w["role"] == "prefill"}


def _quiet_counts(url: str) -> dict[str, int]:
    """Prefill-token counters once the earlier tests' last load reports have arrived."""
    def stable() -> dict[str, int] | None:
        a = _prefill_tokens(url)
        time.sleep(0.3)
        b = _prefill_tokens(url)
        return b if a == b else None
    return wait_for(stable, 10.0, "stable load reports")


def _settled(url: str, before: dict[str, int], extra: int) -> dict[str, int]:
    """Wait until the prefill-token counters (load reports lag ~0.1 s) grew by ``extra``."""
    return wait_for(lambda: (lambda now: now if sum(now.values()) - sum(before.values())
                             == extra else None)(_prefill_tokens(url)), 5.0,
                    f"prefill token counters +{extra}")


def test_pd_output_equals_colocated_engine_greedy(cluster):
    """KV moved correctly: P/D greedy output == one colocated engine's greedy output. The
    prompts end inside a block (40, 101, 159: the partial last block moves too, and 159's
    is filled by the first token on the decode side), on a block boundary (48) and before
    the first block ends (7: a one-block receive buffer holding only a partial block)."""
    from pymooncake.engine import Engine, EngineConfig, SamplingParams
    prompts = [_ids(1, 40), _ids(2, 48), _ids(3, 101), _ids(4, 7), _ids(5, B * 9 + B - 1)]
    max_tokens = 12
    ref = Engine.from_model_name("tiny", EngineConfig(max_model_len=CONTEXT)).generate(
        prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    for p, r in zip(prompts, ref, strict=True):
        got, usage, errors = stream_token_ids(cluster.url, p, max_tokens, ignore_eos=True)
        assert not errors
        assert got == list(r.output_token_ids), f"prompt of {len(p)} tokens"
        assert usage["completion_tokens"] == max_tokens
        assert usage["prompt_tokens"] == len(p)


def test_prefix_reused_through_store_on_another_prefill_worker(cluster):
    url = cluster.url
    a = _ids(10, 200)
    b = a[:160] + _ids(11, 40)
    before = _quiet_counts(url)
    stored = settled_store_blocks(url)
    ra = complete(url, a, 4)
    assert ra.status_code == 200, ra.text
    assert ra.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    wait_store_blocks(url, stored + 200 // B)
    mid = _settled(url, before, 200)
    worker_a = next(k for k in mid if mid[k] != before[k])
    rb = complete(url, b, 4)
    assert rb.status_code == 200, rb.text
    # shared prefix 160 tokens = 10 full blocks of 16, all reusable (B's length 200 > 160)
    assert rb.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 160
    after = _settled(url, mid, 200 - 160)
    worker_b = next(k for k in after if after[k] != mid[k])
    assert worker_b != worker_a, "round-robin should have used the other prefill worker"


def test_bug_55_cached_tokens_always_present(cluster):
    url = cluster.url
    p = _ids(20, 24)
    stored = settled_store_blocks(url)
    r1 = complete(url, p, 3).json()
    wait_store_blocks(url, stored + 1)
    r2 = complete(url, p, 3).json()
    assert r1["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert r2["usage"]["prompt_tokens_details"]["cached_tokens"] == 16
    _, usage, _ = stream_token_ids(url, p, 3)
    assert usage["prompt_tokens_details"]["cached_tokens"] == 16
    for u in (r1["usage"], r2["usage"], usage):
        assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
        assert 0 <= u["prompt_tokens_details"]["cached_tokens"] <= u["prompt_tokens"] - 1


@pytest.mark.parametrize("stream", [False, True])
def test_bug_56_cached_tokens_are_the_prefill_side_hit(cluster, stream):
    """A 77-token prompt whose first 48 tokens (3 blocks) the prefill side has cached:
    cached_tokens = 48 — not 76 (KV moved P→D) and not 0 (decode side)."""
    url = cluster.url
    prefix = _ids(30 + stream, 48)
    stored = settled_store_blocks(url)
    assert complete(url, prefix, 1).status_code == 200
    wait_store_blocks(url, stored + 3)
    prompt = prefix + _ids(40 + stream, 29)
    if stream:
        _, usage, errors = stream_token_ids(url, prompt, 5, ignore_eos=True)
        assert not errors
    else:
        r = complete(url, prompt, 5, ignore_eos=True)
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
    assert usage == {"prompt_tokens": 77, "completion_tokens": 5, "total_tokens": 82,
                     "prompt_tokens_details": {"cached_tokens": 48}}


def _chat(url: str, content: str, max_tokens: int | None = 16) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", timeout=60, json={
        "model": "tiny", "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens})


def test_bug_53_over_long_prompts_are_400_and_workers_survive(cluster):
    from pymooncake.engine.model.tokenizer import ByteTokenizer
    url = cluster.url
    tok = ByteTokenizer()
    overhead = len(tok.apply_chat_template([{"role": "user", "content": ""}]))
    _quiet_counts(url)  # load reports of the earlier tests' last steps have arrived
    before = wait_for(lambda: (lambda w: w if all(x["num_running"] == 0 for x in w.values())
                               else None)(workers(url)), 5.0, "idle workers")
    r1 = _chat(url, "a" * (2033 - overhead))          # 2033 + 16 = 2049 > 2048
    r2 = _chat(url, "a" * (5000 - overhead))
    r3 = httpx.post(url + "/v1/chat/completions", timeout=60,
                    json={"model": "tiny", "messages": [], "max_tokens": 16})
    for r in (r1, r2, r3):
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error"
        assert err["param"] in ("messages", "max_tokens")
    assert "2048" in r1.json()["error"]["message"] and "2033" in r1.json()["error"]["message"]
    assert _chat(url, "hello").status_code == 200
    after = wait_for(lambda: (lambda w: w if all(
        w[k]["num_free_blocks"] == before[k]["num_free_blocks"] for k in before) else None)(
        workers(url)), 5.0, f"free KV blocks back to {before}")
    assert {k: w["pid"] for k, w in after.items()} == {k: w["pid"] for k, w in before.items()}


def test_bug_54_max_tokens_and_params_against_the_real_cluster(cluster):
    """CASES BUG-54 end to end (P/D workers behind the front door): ``max_tokens: null``
    means "the rest of the context" (2048 here), bad values are 400 naming the field, and
    nothing is a 500."""
    from pymooncake.engine.model.tokenizer import ByteTokenizer
    url = cluster.url
    prompt = _ids(54, CONTEXT - 8)
    r = httpx.post(url + "/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": prompt, "max_tokens": None, "temperature": 0})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] == CONTEXT - 8
    assert r.json()["choices"][0]["finish_reason"] in ("length", "stop")
    assert usage["completion_tokens"] <= 8
    if r.json()["choices"][0]["finish_reason"] == "length":
        assert usage["completion_tokens"] == 8
    overhead = len(ByteTokenizer().apply_chat_template([{"role": "user", "content": ""}]))
    r = httpx.post(url + "/v1/chat/completions", timeout=60, json={
        "model": "tiny", "max_tokens": None,
        "messages": [{"role": "user", "content": "a" * (CONTEXT - 8 - overhead)}]})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] <= 8
    for path, base in (("/v1/completions", {"prompt": "hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user",
                                                               "content": "hi"}]})):
        for field, value in (("max_tokens", 0), ("max_tokens", -1), ("max_tokens", "abc"),
                             ("max_tokens", CONTEXT + 1), ("temperature", -1),
                             ("stream_options", {"include_usage": True})):
            r = httpx.post(url + path, timeout=60, json={"model": "tiny", **base,
                                                          field: value})
            assert r.status_code == 400, (path, field, value, r.text)
            assert r.json()["error"]["param"] == field
    # token ids the model cannot embed: 400 naming the prompt, never a 500 or a 503
    for prompt in ([1, 2, 300], [1180591620717411303424], [4294967295]):
        r = httpx.post(url + "/v1/completions", timeout=60,
                       json={"model": "tiny", "prompt": prompt, "max_tokens": 2})
        assert r.status_code == 400, (prompt, r.text)
        assert r.json()["error"]["param"] == "prompt" and "[0, 259)" in r.text
    assert complete(url, _ids(55, 20), 3).status_code == 200


def _stage_counts(url: str) -> dict[str, tuple[float, float]]:
    from prometheus_client.parser import text_string_to_metric_families
    out: dict[str, list[float]] = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        if fam.name != "pymooncake_conductor_stage_seconds":
            continue
        for smp in fam.samples:
            cell = out.setdefault(smp.labels["stage"], [0.0, 0.0])
            if smp.name.endswith("_count"):
                cell[0] = smp.value
            elif smp.name.endswith("_sum"):
                cell[1] = smp.value
    return {k: (v[0], v[1]) for k, v in out.items()}


def test_every_stage_of_a_request_is_measured(cluster):
    """Issue #6 item 7: tokenize, schedule, prefix lookup, cache load, prefill, P→D transfer,
    decode-side load, decode queue and decode are each recorded for a P/D request."""
    url = cluster.url
    a = _ids(90, 96)              # 6 blocks no other test uses
    stored = settled_store_blocks(url)
    assert complete(url, a, 4).status_code == 200
    # b is placed on what the Conductor knows the Store holds: wait for a's first 4 blocks
    # (the count is cumulative over the module's tests, so "at least 1" would not wait)
    wait_store_blocks(url, stored + 4)
    before = _stage_counts(url)
    # b shares a's first 4 blocks; round-robin puts it on the prefill worker that did not
    # run a, where they come from the Store. Should it land where a ran (a request the
    # policy placed twice), the next b with another suffix lands on the other worker.
    for attempt in range(3):
        b = a[:64] + _ids(91 + attempt, 40)
        assert complete(url, b, 5).status_code == 200
        grew = {k for k, (n, _) in _stage_counts(url).items()
                if n > before.get(k, (0.0, 0.0))[0]}
        if {"store_lookup", "store_load", "cache_load"} <= grew:
            break
    r = httpx.post(url + "/v1/chat/completions", timeout=30, json={
        "model": "tiny", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200, r.text
    after = _stage_counts(url)
    grew = {k for k, (n, _) in after.items() if n > before.get(k, (0.0, 0.0))[0]}
    want = {"tokenize", "schedule", "prepare_decode", "prefill_rpc", "ttft", "queue",
            "store_lookup", "store_load", "cache_load", "prefill", "p2d_transfer",
            "decode_queue",
            "decode_load", "decode", "decode_stream"}
    assert want <= grew, f"missing stages: {sorted(want - grew)}"
    # the worker-measured prefill is part of what the Conductor waited for
    d = {k: (after[k][0] - before.get(k, (0, 0))[0], after[k][1] - before.get(k, (0, 0))[1])
         for k in want}
    assert d["prefill"][1] <= d["prefill_rpc"][1] <= d["ttft"][1]




def test_burst_overlaps_decode_admission_and_output_stays_exact(cluster):
    """A burst queues prompts on the prefill workers, so the Conductor admits on the decode
    side while they wait and sends the KVTarget later (SetTarget): the KV still arrives
    intact (greedy output == one colocated engine's) and no prompt is recomputed."""
    from concurrent.futures import ThreadPoolExecutor

    from pymooncake.engine import Engine, EngineConfig, SamplingParams
    url = cluster.url
    prompts = [_ids(40 + i, 600 + 37 * i) for i in range(8)]
    ref = Engine.from_model_name("tiny", EngineConfig(max_model_len=CONTEXT)).generate(
        prompts, SamplingParams(max_tokens=6, ignore_eos=True))
    before = metric_value(url, "pymooncake_conductor_overlapped_admissions_total")
    late0 = metric_value(url, "pymooncake_conductor_late_targets_total")
    with ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(lambda p: stream_token_ids(url, p, 6, ignore_eos=True), prompts))
    for (ids, _usage, errors), r in zip(got, ref, strict=True):
        assert not errors
        assert ids == list(r.output_token_ids)
    assert metric_value(url, "pymooncake_conductor_overlapped_admissions_total") > before
    assert metric_value(url, "pymooncake_conductor_late_targets_total") == late0


def test_prefill_done_before_its_late_target_ships_all_its_pinned_blocks(cluster):
    """A ``target_follows`` prefill that ends before its ``SetTarget`` waits for it with
    its blocks pinned, then writes them all: the decode worker gets the 10 it reserved,
    the partial last block too (which the prefix cache does not keep), so it computes
    only the first token's KV, not the 5-token tail, and the greedy output equals one
    colocated engine's.

    The test drives the workers itself, so it plays the Conductor for a decode worker of
    its own (a real process on the cluster's metadata service): the tokens that worker
    pushes (numbered ``TokenFrame``s) come to the test."""
    import asyncio
    import subprocess
    import sys

    import pymooncake
    from pymooncake.engine import Engine, EngineConfig, SamplingParams
    from pymooncake.rpc import RpcClient, RpcServer
    from pymooncake.rpc.codec import from_wire
    from pymooncake.rpc.messages import (
        DecodeTask,
        KVTarget,
        PrefillResult,
        PrefillTask,
        SamplingOptions,
        SetTarget,
        StartDecode,
        TokenFrame,
        TokenFrames,
        WorkerInfo,
    )
    prompt = _ids(77, 16 * 9 + 5)        # 9 full blocks and a partial one
    max_tokens = 6
    (ref,) = Engine.from_model_name("tiny", EngineConfig(max_model_len=CONTEXT)).generate(
        [prompt], SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    pre = next(w for k, w in sorted(workers(cluster.url).items()) if w["role"] == "prefill")
    sampling = SamplingOptions(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    async def run() -> tuple[PrefillResult, list[TokenFrame]]:
        registered: asyncio.Future[WorkerInfo] = asyncio.get_running_loop().create_future()
        frames: asyncio.Queue[TokenFrame] = asyncio.Queue()

        def register(info: WorkerInfo) -> bool:
            if not registered.done():
                registered.set_result(info)
            return True

        def tokens(msg: TokenFrames) -> None:
            for f in msg.frames:
                frames.put_nowait(f)

        sink = RpcServer("127.0.0.1", 0)
        sink.register("register_worker", register, WorkerInfo)
        sink.register("worker_load", lambda _load: True)
        sink.register("kv_events", lambda _ev: None)
        sink.register("tokens", tokens, TokenFrames)
        await sink.start()
        src = os.path.dirname(os.path.dirname(pymooncake.__file__))
        proc = subprocess.Popen(
            [sys.executable, "-m", "pymooncake", "decode", "--id", "late-decode",
             "--conductor", f"127.0.0.1:{sink.port}", "--metadata", cluster.metadata_url,
             "--model", "tiny", "--max-model-len", str(CONTEXT), "--num-kv-blocks", "512"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            env=dict(os.environ, PYTHONPATH=src + os.pathsep + os.environ.get("PYTHONPATH", "")))
        pc = RpcClient("127.0.0.1", pre["rpc_port"], timeout_s=20)
        dc = None
        try:
            info = await asyncio.wait_for(registered, 120)
            dc = RpcClient("127.0.0.1", info.rpc_port, timeout_s=20)
            call = asyncio.ensure_future(pc.call("prefill", PrefillTask(
                "late-target", tuple(prompt), sampling, None, False, target_follows=True)))
            await asyncio.sleep(1.0)       # the prefill (~20 ms) is over: parked
            assert not call.done(), "a target_follows prefill returned before its target"
            target = from_wire(KVTarget, await dc.call("prepare_decode", DecodeTask(
                "late-target", tuple(prompt), sampling, 10)))
            assert target.num_blocks == 10
            assert await pc.call("set_target", SetTarget("late-target", target))
            res = from_wire(PrefillResult, await asyncio.wait_for(call, 20))
            await dc.call("start_decode", StartDecode("late-target", res.first_token_id,
                                                      res.num_sent_blocks))
            got: list[TokenFrame] = []
            while not got or got[-1].finish_reason is None:
                got.append(await asyncio.wait_for(frames.get(), 20))
            return res, got
        finally:
            proc.kill()
            proc.wait()
            await pc.close()
            if dc is not None:
                await dc.close()
            await sink.stop()

    res, got = asyncio.run(run())
    assert res.num_sent_blocks == 10
    assert [f.seq for f in got] == list(range(len(got)))
    assert all(f.request_id == "late-target" and f.error is None for f in got)
    toks = [res.first_token_id] + [t for f in got for t in f.token_ids]
    assert toks == list(ref.output_token_ids)


def test_decode_worker_killed_mid_request_fails_cleanly_and_cluster_serves_on(cluster):
    url = cluster.url
    result: dict = {}

    def run() -> None:
        try:
            result["out"] = stream_token_ids(url, _ids(50, 64), 1500, ignore_eos=True)
        except Exception as e:  # noqa: BLE001 - reported below
            result["exc"] = e
        result["end"] = time.monotonic()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    placed = wait_for(lambda: next(iter(workers_requests(url).values()), None), 20.0,
                      "the long request placed")
    decode_id = placed[1]
    pid = workers(url)[decode_id]["pid"]
    # the decode worker runs it: its KV arrived and tokens are streaming
    wait_for(lambda: workers(url)[decode_id]["num_running"] >= 1 or None, 20.0,
             "the long request decoding")
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    t.join(30)
    assert not t.is_alive(), "the request hung after its decode worker died"
    assert "exc" not in result, result.get("exc")
    # the decode worker pushes tokens: its death is noticed on the Conductor's connection
    # to it at once, not only when its load reports are missed (worker_timeout_s = 3 s)
    assert result["end"] - killed < 2.5
    ids, usage, errors = result["out"]
    assert errors and errors[0]["code"] == "worker_failed"
    assert 0 < len(ids) < 1500
    wait_for(lambda: decode_id not in workers(url), 10.0, "dead worker leaves the view")
    for i in range(4):
        r = complete(url, _ids(60 + i, 30), 6)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] >= 1


def workers_requests(url: str) -> dict:
    return httpx.get(url + "/health", timeout=10).json()["requests"]

