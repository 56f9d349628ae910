"""The replay client's record of one streamed request (``cli.replay._one``) and the soak's
classification of it (``bench.soak.error_kind``): a stream cut before ``[DONE]`` is no
response, an error event after tokens is named by its code."""

from __future__ import annotations

import asyncio
import json

import httpx

from pymooncake.bench.soak import error_kind, failure_list
from pymooncake.cli.replay import ReplayRecord, _one


def _sse(*events: object) -> bytes:
    return b"".join(f"data: {json.dumps(e)}\n\n".encode() for e in events)


TOKENS = {"choices": [{"index": 0, "text": "ab", "token_ids": [97, 98],
                       "finish_reason": None}]}
ERROR = {"error": {"message": "decode: worker decode-b lost", "type": "overloaded_error",
                   "param": None, "code": "worker_failed"}}


def _send(body: bytes) -> ReplayRecord:
    def handler(_request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=body,
                              headers={"content-type": "text/event-stream"})

    rec = ReplayRecord(0, 4, 8)

    async def go() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            await _one(client, "http://api", rec, [1, 2, 3, 4], None)

    asyncio.run(go())
    return rec


def test_a_complete_stream_is_served() -> None:
    rec = _send(_sse(TOKENS) + b"data: [DONE]\n\n")
    assert rec.served and len(rec.token_times_s) == 2 and rec.error is None


def test_a_stream_cut_before_done_is_no_response() -> None:
    rec = _send(_sse(TOKENS))
    assert rec.status == 0 and not rec.served
    assert error_kind(rec) == "no response: IncompleteStream"


def test_an_error_event_after_tokens_is_named_by_its_code() -> None:
    rec = _send(_sse(TOKENS, ERROR) + b"data: [DONE]\n\n")
    assert (rec.status, rec.code, rec.error) == (500, "worker_failed",
                                                 "decode: worker decode-b lost")
    assert error_kind(rec) == "stream error worker_failed"
    rec.sent_s = 12.5
    fails = failure_list([rec], [{"fault": "decode_host_partition", "t_inject": 11.0}], 10.0)
    assert fails == [{"index": 0, "sent_at_s": 2.5, "kind": "stream error worker_failed",
                      "tokens_streamed": 2, "error": "decode: worker decode-b lost",
                      "last_fault": "decode_host_partition"}]
