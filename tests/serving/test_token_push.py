"""Tokens pushed by the decode worker (``TokenFrames``) and routed by the Conductor's
``TokenRouter``: in-order delivery, a lost frame fails the request (sequence gap), frames
nobody waits for are reported for abort, a lost worker fails its streams; and, on real
processes, a client that goes away mid-stream stops the decode worker's work at once."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from pymooncake.conductor.token_streams import TokenRouter
from pymooncake.rpc import RpcError
from pymooncake.rpc.codec import from_wire, to_wire
from pymooncake.rpc.messages import TokenFrame, TokenFrames
from tests.serving.conftest import health, metric_value, wait_for, workers


def _drain(router_stream) -> tuple[list[TokenFrame], RpcError | None]:
    async def run() -> tuple[list[TokenFrame], RpcError | None]:
        got: list[TokenFrame] = []
        try:
            async for f in router_stream.frames():
                got.append(f)
        except RpcError as e:
            return got, e
        return got, None
    return asyncio.run(asyncio.wait_for(run(), 5))


def test_frames_in_order_reach_the_stream_until_the_last():
    r = TokenRouter()
    s = r.open("a", "d0")
    assert r.deliver(TokenFrames("d0", (TokenFrame("a", 0, (1, 2)), TokenFrame("a", 1, (3,)),
                                        TokenFrame("a", 2, (4,), "length", stages=(
                                            ("decode", 1.0, 2.0),))))) == []
    got, err = _drain(s)
    assert err is None
    assert [t for f in got for t in f.token_ids] == [1, 2, 3, 4]
    assert got[-1].finish_reason == "length" and got[-1].stages == (("decode", 1.0, 2.0),)


def test_sequence_gap_fails_the_request_after_the_frames_before_it():
    r = TokenRouter()
    s = r.open("a", "d0")
    r.deliver(TokenFrames("d0", (TokenFrame("a", 0, (1,)), TokenFrame("a", 1, (2,)))))
    r.deliver(TokenFrames("d0", (TokenFrame("a", 3, (4,)),)))     # frame 2 was lost
    r.deliver(TokenFrames("d0", (TokenFrame("a", 4, (5,), "length"),)))   # ignored
    got, err = _drain(s)
    assert [f.token_ids for f in got] == [(1,), (2,)]
    assert err is not None and err.code == "TOKEN_GAP"
    assert "frame 3" in err.message and "frame 2 was due" in err.message
    assert s.queue.empty()


def test_duplicate_frame_is_a_gap_too():
    r = TokenRouter()
    s = r.open("a", "d0")
    r.deliver(TokenFrames("d0", (TokenFrame("a", 0, (1,)), TokenFrame("a", 0, (1,)))))
    _got, err = _drain(s)
    assert err is not None and err.code == "TOKEN_GAP"


def test_frames_nobody_waits_for_are_returned_for_abort():
    r = TokenRouter()
    r.open("mine", "d0")
    orphans = r.deliver(TokenFrames("d0", (
        TokenFrame("gone", 5, (1,)),                 # client left: abort it on d0
        TokenFrame("done", 9, (), "stop"),           # its last frame: nothing to abort
        TokenFrame("failed", 2, (), error="boom"),   # ended on the worker already
        TokenFrame("mine", 0, (7,)))))
    assert orphans == ["gone"]
    # a frame for a request from a worker that does not run it is not delivered
    assert r.deliver(TokenFrames("d1", (TokenFrame("mine", 1, (8,)),))) == ["mine"]
    r.close("mine")
    assert len(r) == 0
    assert r.deliver(TokenFrames("d0", (TokenFrame("mine", 1, (8,)),))) == ["mine"]


def test_worker_error_frame_and_lost_worker_fail_their_streams():
    r = TokenRouter()
    a, b, c = r.open("a", "d0"), r.open("b", "d0"), r.open("c", "d1")
    r.deliver(TokenFrames("d0", (TokenFrame("a", 0, (), "abort", "generation failed"),)))
    _got, err = _drain(a)
    assert err is not None and err.code == "DECODE_FAILED"
    assert r.fail_instance("d0", "connection lost") == 1        # b only: a failed already
    _got, err = _drain(b)
    assert err is not None and err.code == "CONNECTION" and "d0" in err.message
    assert r.fail_instance("d0", "again") == 0
    r.deliver(TokenFrames("d1", (TokenFrame("c", 0, (1,), "stop"),)))
    got, err = _drain(c)
    assert err is None and got[-1].finish_reason == "stop"


def test_token_frames_round_trip_the_codec_typed():
    msg = TokenFrames("d0", (TokenFrame("a", 3, (1, 2), "stop", None, 16,
                                        (("decode", 1.0, 2.5),)),))
    assert from_wire(TokenFrames, to_wire(msg)) == msg
    with pytest.raises(ValueError, match=r"TokenFrames.frames\[0\].seq"):
        from_wire(TokenFrames, {"instance_id": "d0", "frames": [
            {"request_id": "a", "seq": "3"}]})


# -- real processes -------------------------------------------------------------------------


def test_client_disconnect_mid_stream_stops_the_decode_worker_promptly(make_cluster):
    url = make_cluster(num_prefill=1, num_decode=1).url
    decode_id = next(k for k, w in workers(url).items() if w["role"] == "decode")
    max_tokens = 8000      # ~25 s of decoding for the tiny model on this machine
    body = {"model": "tiny", "prompt": list(range(1, 65)), "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        chunks = 0
        for line in r.iter_lines():
            chunks += line.startswith("data: {")
            if chunks == 20:
                wait_for(lambda: workers(url)[decode_id]["num_running"] == 1, 10.0,
                         "the request decoding")
                break           # leaving the stream closes the connection
    gone = time.monotonic()
    wait_for(lambda: workers(url)[decode_id]["num_running"] == 0
             and not health(url)["requests"], 5.0,
             "the decode worker stopping the abandoned request")
    assert time.monotonic() - gone < 5.0


def test_tokens_nobody_waits_for_get_their_request_aborted_on_the_worker(make_cluster):
    """A request the Conductor does not know (here started on the worker behind its back;
    in life, one whose client left before the stream's own abort got through) pushes
    frames; the Conductor drops them and aborts the request on the worker."""
    from pymooncake.rpc import RpcClient
    from pymooncake.rpc.messages import DecodeTask, SamplingOptions, StartDecode

    url = make_cluster(colocated=True, num_prefill=1).url
    wid, w = next(iter(workers(url).items()))
    before = metric_value(url, "pymooncake_conductor_orphan_aborts_total")
    task = DecodeTask("nobody-waits", tuple(range(1, 65)),
                      SamplingOptions(max_tokens=8000, temperature=0.0, ignore_eos=True))

    async def start() -> None:
        c = RpcClient("127.0.0.1", w["rpc_port"], timeout_s=20)
        try:
            await c.call("prepare_decode", task)
            assert await c.call("start_decode", StartDecode("nobody-waits"))
        finally:
            await c.close()

    asyncio.run(start())
    started = time.monotonic()
    wait_for(lambda: metric_value(url, "pymooncake_conductor_orphan_aborts_total") > before,
             5.0, "the Conductor aborting the orphan")

    async def gone() -> bool:     # the worker forgot it: it may be admitted afresh
        c = RpcClient("127.0.0.1", w["rpc_port"], timeout_s=20)
        try:
            await c.call("prepare_decode", task)
            await c.call("abort", task.request_id)
            return True
        except RpcError as e:
            assert e.code == "DUPLICATE", e
            return False
        finally:
            await c.close()

    wait_for(lambda: asyncio.run(gone()), 5.0, "the worker dropping the orphan")
    wait_for(lambda: workers(url)[wid]["num_running"] == 0, 5.0, "the worker idle")
    assert time.monotonic() - started < 10.0     # 8000 tokens would take ~25 s


def test_push_keeps_a_request_frames_in_order_across_the_direct_and_task_paths() -> None:
    """``DecodeWorker._push`` writes a step's frames at once when the Conductor connection
    is open and otherwise leaves them to the ``_send_frames`` task, which connects. While
    that task has not sent yet — here it waits on the connect lock that another call (the
    report loop's) holds — later pushes must queue behind it, not write past it: 200
    frames, pushed one a loop turn over both paths, reach a real server in order."""
    from types import SimpleNamespace

    from pymooncake.engine.worker.decode import DecodeWorker, _Stream
    from pymooncake.rpc import RpcClient, RpcServer

    async def main() -> tuple[list[int], int]:
        got: list[int] = []
        server = RpcServer("127.0.0.1", 0)
        server.register("tokens", lambda m: got.extend(f.seq for f in m.frames), TokenFrames)
        server.register("noop", lambda p: None)
        await server.start()
        client = RpcClient("127.0.0.1", server.port)
        w = object.__new__(DecodeWorker)     # the push path only: no engine, no loop thread
        w.config = SimpleNamespace(instance_id="decode-0")
        w._streams = {"r": _Stream(task=None)}
        w._outbox, w._sender, w._conductor = [], None, client
        try:
            report = asyncio.ensure_future(client.call("noop"))   # connects first
            await asyncio.sleep(0)
            w._push([("r", [0], None, None, ())])    # no connection yet: the sender task
            queued_behind = 0     # pushes made with the connection open, the task not done
            for i in range(1, 200):
                if client._writer is not None and not w._sender.done():
                    queued_behind += 1
                w._push([("r", [i], None, None, ())])
                await asyncio.sleep(0)
            await report
            for _ in range(100):
                if len(got) == 200:
                    break
                await asyncio.sleep(0.01)
        finally:
            await client.close()
            await server.stop()
        return got, queued_behind

    got, queued_behind = asyncio.run(asyncio.wait_for(main(), 10))
    assert got == list(range(200))
    assert queued_behind >= 1         # the race this test is about did happen
