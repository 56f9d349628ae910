"""OpenAI API front door against a scripted backend (in-process ASGI)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from pymooncake.api.admission import AdmissionConfig
from pymooncake.api.server import ApiConfig, create_app
from pymooncake.rpc.messages import Rejection
from tests.api.fakes import ByteCodec, ScriptedBackend

CHAT = "/v1/chat/completions"
COMPL = "/v1/completions"


def make_client(backend=None, **cfg) -> tuple[httpx.AsyncClient, ScriptedBackend]:
    backend = backend or ScriptedBackend()
    app = create_app(backend, ByteCodec(), ApiConfig(**cfg))
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t",
                               timeout=30)
    return client, backend


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def chat_body(content="hi", **kw):
    return {"messages": [{"role": "user", "content": content}], **kw}


def compl_body(prompt="hi", **kw):
    return {"prompt": prompt, **kw}


def parse_sse(text: str) -> list:
    events = []
    for line in text.splitlines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def assert_error(resp: httpx.Response, status: int, param: str | None,
                 etype: str = "invalid_request_error"):
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert err["type"] == etype
    assert err["param"] == param
    assert err["message"]
    return err


class TestBug54MaxTokensAndParams:
    @pytest.mark.parametrize("path, body", [(CHAT, chat_body), (COMPL, compl_body)])
    def test_max_tokens_null_is_the_remaining_context(self, path, body) -> None:
        """Chat: the remaining context; completions: OpenAI's 16, or the remaining context
        when less is left (absent and null alike)."""
        async def main():
            for context in (64, 36 if path == CHAT else 12):   # 12: less than 16 left
                client, backend = make_client(context_length=context)
                async with client:
                    r = await client.post(path, json=body("hey", max_tokens=None))
                    absent = body("hey")
                    absent.pop("max_tokens", None)
                    r2 = await client.post(path, json=absent)
                assert r.status_code == 200 and r2.status_code == 200, r.text
                prompt_tokens = r.json()["usage"]["prompt_tokens"]
                want = context - prompt_tokens if path == CHAT else min(
                    16, context - prompt_tokens)
                assert r.json()["choices"][0]["finish_reason"] in ("length", "stop")
                assert [q.sampling.max_tokens for q in backend.requests] == [want, want]
                assert r.json()["usage"]["completion_tokens"] == want
        run(main())

    @pytest.mark.parametrize("path, body", [(CHAT, chat_body), (COMPL, compl_body)])
    @pytest.mark.parametrize("value", [0, -1, "abc", True, 1.5])
    def test_bad_max_tokens_is_400(self, path, body, value) -> None:
        async def main():
            client, backend = make_client()
            async with client:
                r = await client.post(path, json=body(max_tokens=value))
            assert_error(r, 400, "max_tokens")
            assert backend.requests == []
        run(main())

    @pytest.mark.parametrize("path, body", [(CHAT, chat_body), (COMPL, compl_body)])
    def test_max_tokens_over_context_is_400_on_both_endpoints(self, path, body) -> None:
        async def main():
            client, _ = make_client(context_length=100)
            async with client:
                r = await client.post(path, json=body("x", max_tokens=1000))
            err = assert_error(r, 400, "max_tokens")
            assert "100" in err["message"] and "1000" in err["message"]
            assert err["code"] == "context_length_exceeded"
        run(main())

    @pytest.mark.parametrize("path, body", [(CHAT, chat_body), (COMPL, compl_body)])
    @pytest.mark.parametrize("field, value", [
        ("temperature", -1), ("temperature", 2.5), ("temperature", "hot"), ("top_p", 0),
        ("top_p", 1.5), ("n", 2), ("stop", ["a", "b", "c", "d", "e"]), ("seed", "x"),
        ("stream_options", {"include_usage": True}),
    ])
    def test_bad_fields_are_400_naming_the_field(self, path, body, field, value) -> None:
        async def main():
            client, _ = make_client()
            async with client:
                r = await client.post(path, json=body(**{field: value}))
            assert_error(r, 400, field)
        run(main())

    def test_malformed_json_and_wrong_model(self) -> None:
        async def main():
            client, _ = make_client()
            async with client:
                r = await client.post(CHAT, content=b"{not json",
                                      headers={"content-type": "application/json"})
                assert_error(r, 400, None)
                r = await client.post(CHAT, json=[1, 2])
                assert r.status_code == 400
                r = await client.post(CHAT, json=chat_body(model="gpt-9"))
                assert_error(r, 404, "model")
                r = await client.post(CHAT, json={"messages": [{"role": "wizard",
                                                                "content": "x"}]})
                assert_error(r, 400, "messages")
                r = await client.post(COMPL, json={"prompt": [1, -5]})
                assert_error(r, 400, "prompt")
                r = await client.post(CHAT, json=chat_body())   # still serving
                assert r.status_code == 200
        run(main())


class TestBug53ContextLength:
    def test_over_long_prompts_are_400_and_the_server_keeps_serving(self) -> None:
        async def main():
            client, backend = make_client(context_length=2048)
            codec = ByteCodec()
            overhead = len(codec.apply_chat_template([{"role": "user", "content": ""}]))
            async with client:
                # 1. 2033 prompt tokens + max_tokens 16 = 2049 > 2048
                r = await client.post(CHAT, json=chat_body("a" * (2033 - overhead),
                                                           max_tokens=16))
                err = assert_error(r, 400, "max_tokens")
                assert "2048" in err["message"] and "2049" in err["message"]
                assert "2033" in err["message"]
                # 2. 5000-token prompt
                r = await client.post(CHAT, json=chat_body("a" * (5000 - overhead),
                                                           max_tokens=16))
                err = assert_error(r, 400, "messages")
                assert "2048" in err["message"] and "5000" in err["message"]
                # 3. empty messages
                r = await client.post(CHAT, json={"messages": []})
                assert_error(r, 400, "messages")
                # 4. a normal short request
                r = await client.post(CHAT, json=chat_body("hello", max_tokens=4))
                assert r.status_code == 200
            assert len(backend.requests) == 1
        run(main())


class TestBug55Usage:
    def test_cached_tokens_present_and_streamed_once_at_the_end(self) -> None:
        async def main():
            client, _ = make_client()
            prompt = list(range(1, 25))  # 24 token ids, block size 16
            async with client:
                r1 = await client.post(COMPL, json={"prompt": prompt, "max_tokens": 3})
                r2 = await client.post(COMPL, json={"prompt": prompt, "max_tokens": 3})
                r3 = await client.post(COMPL, json={"prompt": prompt, "max_tokens": 3,
                                                    "stream": True,
                                                    "stream_options": {"include_usage": True}})
            u1, u2 = r1.json()["usage"], r2.json()["usage"]
            assert u1["prompt_tokens_details"] == {"cached_tokens": 0}
            assert u2["prompt_tokens_details"]["cached_tokens"] == 16
            for u in (u1, u2):
                assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
                assert u["prompt_tokens"] == 24 and u["completion_tokens"] == 3
            events = parse_sse(r3.text)
            assert events[-1] == "[DONE]"
            chunks = events[:-1]
            assert chunks[-1]["choices"] == []
            assert chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 16
            assert chunks[-1]["usage"]["total_tokens"] == 27
            assert all(c.get("usage") is None for c in chunks[:-1])
            assert sum(1 for c in chunks if c.get("usage")) == 1
        run(main())

    def test_chat_stream_shape_and_text(self) -> None:
        async def main():
            client, _ = make_client(ScriptedBackend(reply="héllo"))
            async with client:
                r = await client.post(CHAT, json=chat_body(max_tokens=6, stream=True))
                full = await client.post(CHAT, json=chat_body(max_tokens=6))
            events = parse_sse(r.text)
            assert events[-1] == "[DONE]"
            chunks = events[:-1]
            assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
            text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
            # "héllo" is 6 UTF-8 bytes; the multi-byte é is never split into U+FFFD
            assert text == "héllo" == full.json()["choices"][0]["message"]["content"]
            assert "\ufffd" not in "".join(json.dumps(c) for c in chunks)
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"
            assert all(c["object"] == "chat.completion.chunk" for c in chunks)
        run(main())

    def test_stop_string_cuts_output_and_ends_generation(self) -> None:
        async def main():
            backend = ScriptedBackend(reply="abc STOP def")
            client, _ = make_client(backend)
            async with client:
                r = await client.post(COMPL, json=compl_body(max_tokens=12, stop="STOP"))
                rs = await client.post(COMPL, json=compl_body(max_tokens=12, stop=["ST0", "STOP"],
                                                              stream=True))
            body = r.json()
            assert body["choices"][0]["text"] == "abc "
            assert body["choices"][0]["finish_reason"] == "stop"
            assert body["usage"]["completion_tokens"] == 8  # "abc STOP" generated, then cut
            streamed = "".join(c["choices"][0]["text"] for c in parse_sse(rs.text)[:-1])
            assert streamed == "abc "
        run(main())


class TestBug52And51Overload:
    def test_full_queue_429_and_queue_timeout_503_with_retry_after(self) -> None:
        async def main():
            backend = ScriptedBackend(hold_s=1.0)
            client, _ = make_client(backend, admission=AdmissionConfig(
                max_concurrency=1, queue_capacity=2, queue_timeout_s=0.1))
            async with client:
                rs = await asyncio.gather(*(client.post(CHAT, json=chat_body(max_tokens=2))
                                            for _ in range(10)))
            codes = sorted(r.status_code for r in rs)
            assert codes == [200] + [429] * 7 + [503] * 2
            for r in rs:
                assert r.status_code != 408
                if r.status_code == 200:
                    continue
                assert int(r.headers["retry-after"]) >= 1
                err = r.json()["error"]
                assert err["code"] == ("queue_full" if r.status_code == 429 else "queue_timeout")
                assert err["message"] and err["type"]
        run(main())

    def test_sheddable_requests_rejected_fast_high_priority_queued(self) -> None:
        async def main():
            backend = ScriptedBackend(hold_s=0.5)
            client, _ = make_client(backend, admission=AdmissionConfig(
                max_concurrency=4, queue_capacity=16, queue_timeout_s=5))
            app_gate = client._transport.app.state.gate
            async with client:
                low = [asyncio.ensure_future(client.post(CHAT, json=chat_body(
                    max_tokens=2, priority=1))) for _ in range(4)]
                await asyncio.sleep(0.2)
                assert app_gate.saturation >= 1.0
                t0 = time.monotonic()
                extra = await asyncio.gather(*(client.post(CHAT, json=chat_body(
                    max_tokens=2, priority=1)) for _ in range(6)))
                assert time.monotonic() - t0 < 0.05 * 6 + 0.2
                assert [r.status_code for r in extra] == [429] * 6
                assert {r.json()["error"]["code"] for r in extra} == {"saturated"}
                assert all(int(r.headers["retry-after"]) >= 1 for r in extra)
                high = await client.post(CHAT, json=chat_body(max_tokens=2, priority=0))
                assert high.status_code == 200
                assert [r.status_code for r in await asyncio.gather(*low)] == [200] * 4
            assert app_gate.saturation == 0.0 and app_gate.num_queued == 0
        run(main())

    def test_backend_early_rejection_maps_to_429(self) -> None:
        async def main():
            backend = ScriptedBackend()
            backend.reject_with = Rejection(429, "slo_ttft", "predicted TTFT 40 s > SLO 30 s",
                                            retry_after_s=2.5)
            client, _ = make_client(backend)
            async with client:
                r = await client.post(CHAT, json=chat_body())
                rs = await client.post(CHAT, json=chat_body(stream=True))
            assert r.status_code == 429 and r.headers["retry-after"] == "3"
            assert r.json()["error"]["code"] == "slo_ttft"
            # a stream refused before its first token gets the same status, not a 200
            # with an error event (newcomer check, session 2)
            assert rs.status_code == 429 and rs.headers["retry-after"] == "3"
            assert rs.json()["error"]["code"] == "slo_ttft"
            assert client._transport.app.state.gate.in_flight == 0
        run(main())


def test_models_health_metrics() -> None:
    async def main():
        client, _ = make_client(model_name="tiny", context_length=512)
        async with client:
            await client.post(CHAT, json=chat_body(max_tokens=3))
            models = (await client.get("/v1/models")).json()
            health = (await client.get("/health")).json()
            text = (await client.get("/metrics")).text
        assert models["data"][0]["id"] == "tiny" and models["data"][0]["max_model_len"] == 512
        assert health["status"] == "ok" and health["in_flight"] == 0
        assert "pymooncake_api_ttft_seconds_bucket" in text
        assert "pymooncake_api_inter_token_seconds_bucket" in text
        assert "pymooncake_api_cached_tokens_total" in text
    run(main())


@pytest.mark.parametrize("path", [COMPL])
@pytest.mark.parametrize("prompt", [[1, 2**32], [2**70], [5, 2**40, 7]])
def test_token_ids_beyond_any_vocabulary_are_400(path, prompt) -> None:
    """Ids >= 2**32 cannot be keyed (DESIGN.md §3); with no codec vocabulary that is the
    bound (newcomer check: 2**70 was a 500)."""
    async def main():
        client, backend = make_client()
        async with client:
            r = await client.post(path, json={"model": "tiny", "prompt": prompt,
                                              "max_tokens": 2})
        err = assert_error(r, 400, "prompt")
        assert "vocabulary" in err["message"]
        assert backend.requests == []
    run(main())


def test_unknown_paths_methods_and_huge_bodies_get_the_openai_error_shape() -> None:
    async def main():
        client, backend = make_client(max_body_bytes=4096)
        async with client:
            r404 = await client.post("/v1/nope", json={})
            r405 = await client.get(CHAT)
            big = await client.post(COMPL, content=b'{"prompt": "' + b"a" * 10_000 + b'"}',
                                    headers={"content-type": "application/json"})

            async def chunks():
                for _ in range(5):
                    yield b"a" * 2000
            nolen = await client.post(COMPL, content=chunks())
            ok = await client.post(COMPL, json={"model": "tiny", "prompt": "hi",
                                                "max_tokens": 2})
        assert r404.status_code == 404 and r404.json()["error"]["type"] == "not_found_error"
        assert r405.status_code == 405 and "error" in r405.json()
        for r in (big, nolen):
            assert r.status_code == 413, r.text
            assert r.json()["error"]["code"] == "request_too_large" and "4096" in r.text
        assert ok.status_code == 200 and len(backend.requests) == 1
    run(main())


@pytest.mark.parametrize("path, body", [(CHAT, chat_body), (COMPL, compl_body)])
@pytest.mark.parametrize("field, value", [
    ("tools", [{"type": "function", "function": {"name": "f"}}]),
    ("response_format", {"type": "json_object"}), ("logit_bias", {"5": 10}),
    ("frequency_penalty", 0.5), ("presence_penalty", 5), ("best_of", 3),
    ("logprobs", True), ("top_logprobs", 3),
])
def test_unimplemented_openai_features_are_refused_by_name(path, body, field, value) -> None:
    """Newcomer check: these were accepted and silently ignored (a 200 that did not do what
    was asked). Neutral defaults stay accepted."""
    if field == "logprobs" and path == COMPL:
        value = 2
    async def main():
        client, backend = make_client()
        async with client:
            r = await client.post(path, json=body(**{field: value}))
            ok = await client.post(path, json=body(frequency_penalty=0, presence_penalty=0.0,
                                                   logit_bias={}, tools=[], best_of=1,
                                                   response_format={"type": "text"},
                                                   vendor_extension={"x": 1}))
        err = assert_error(r, 400, field)
        assert err["code"] == "unsupported_parameter"
        assert ok.status_code == 200, ok.text
    run(main())


def test_union_field_errors_say_what_is_accepted() -> None:
    """Not pydantic's member paths (``prompt.str: Input should be a valid string``)."""
    async def main():
        client, _ = make_client()
        async with client:
            r1 = await client.post(COMPL, json={"model": "tiny", "prompt": [True, 2]})
            r2 = await client.post(CHAT, json={"model": "tiny", "messages": [
                {"role": "user", "content": 5}]})
        e1 = assert_error(r1, 400, "prompt")
        assert e1["message"] == ("prompt must be a string or a list of token ids (integers) "
                                 "(got a list)")
        e2 = assert_error(r2, 400, "messages")
        assert e2["message"].startswith("messages.0.content must be a string or a list of "
                                        "text parts")
    run(main())
