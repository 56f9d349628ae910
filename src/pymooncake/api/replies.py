"""The front door's replies: one admitted request's token stream detokenized (``Job``),
the OpenAI server-sent-event stream built from it (``sse_stream``), the ``usage`` object,
an ``ApiError``'s response (``error_response``) and the API's Prometheus metrics (requests
by endpoint and status, TTFT, TBT, tokens).

Used by ``api.server``, whose routes validate and admit the request first.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi.responses import JSONResponse

from pymooncake.api.admission import AdmissionGate
from pymooncake.api.errors import ApiError
from pymooncake.api.streaming import IncrementalDetokenizer
from pymooncake.api.validation import rejected
from pymooncake.obs import metrics
from pymooncake.obs.logging import init_logger
from pymooncake.rpc.messages import GenerateRequest, RequestRejected

if TYPE_CHECKING:
    from pymooncake.api.server import Backend, TextCodec

logger = init_logger("pymooncake.api.server")

REQUESTS = metrics.counter("pymooncake_api_requests_total",
                           "HTTP requests by endpoint and status", ["endpoint", "status"])
TTFT = metrics.histogram("pymooncake_api_ttft_seconds", "time to first token (s)")
TBT = metrics.histogram("pymooncake_api_inter_token_seconds",
                        "time between output tokens (s)")
PROMPT_TOKENS = metrics.counter("pymooncake_api_prompt_tokens_total", "prompt tokens served")
CACHED_TOKENS = metrics.counter("pymooncake_api_cached_tokens_total",
                                "prompt tokens whose KV was reused (prefix cache hits)")
OUTPUT_TOKENS = metrics.counter("pymooncake_api_output_tokens_total", "generated tokens")


def error_response(err: ApiError, endpoint: str) -> JSONResponse:
    REQUESTS.labels(endpoint, str(err.status)).inc()
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def usage_of(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


class Job:
    """One admitted request: runs the backend stream, detokenizes, applies stop strings."""

    def __init__(self, backend: Backend, codec: TextCodec, req: GenerateRequest) -> None:
        self.backend = backend
        self.req = req
        self.detok = IncrementalDetokenizer(codec, req.sampling.stop)
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.finish_reason: str | None = None

    async def deltas(self) -> AsyncIterator[tuple[str, tuple[int, ...]]]:
        """(new text, new token ids) per backend event that carried tokens."""
        start = time.monotonic()
        last = None
        stream = self.backend.generate(self.req)
        try:
            async for ev in stream:
                if ev.cached_tokens is not None:
                    self.cached_tokens = max(0, min(ev.cached_tokens,
                                                    len(self.req.prompt_token_ids) - 1))
                if ev.token_ids:
                    now = time.monotonic()
                    if last is None:
                        TTFT.observe(now - start)
                    else:
                        TBT.observe(now - last)
                    last = now
                    self.completion_tokens += len(ev.token_ids)
                    text, stopped = self.detok.feed(ev.token_ids)
                    yield text, ev.token_ids
                    if stopped:
                        self.finish_reason = "stop"
                        return
                if ev.finish_reason is not None:
                    self.finish_reason = ev.finish_reason
                    tail = self.detok.flush()
                    if tail:
                        yield tail, ()
                    return
            self.finish_reason = self.finish_reason or "abort"
        finally:
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()
            PROMPT_TOKENS.inc(len(self.req.prompt_token_ids))
            CACHED_TOKENS.inc(self.cached_tokens)
            OUTPUT_TOKENS.inc(self.completion_tokens)


async def sse_stream(job: Job, events: AsyncIterator[tuple[str, tuple[int, ...]]],
                     first: tuple[str, tuple[int, ...]] | None, chat: bool,
                     include_usage: bool, return_token_ids: bool, endpoint: str, *,
                     model_name: str, gate: AdmissionGate) -> AsyncIterator[bytes]:
    """The OpenAI stream of ``job`` (``first``: its first event, already awaited); an error
    after the 200 went out is an error event; the gate's slot is released at the end."""
    created = int(time.time())
    obj = "chat.completion.chunk" if chat else "text_completion"
    base = {"id": job.req.request_id, "object": obj, "created": created,
            "model": model_name}

    def chunk(choices: list[dict[str, Any]], usage: Any = None) -> bytes:
        payload = {**base, "choices": choices}
        if include_usage:
            payload["usage"] = usage
        return f"data: {json.dumps(payload)}\n\n".encode()

    def choice(text: str | None, finish: str | None, role: bool = False,
               token_ids: tuple[int, ...] | None = None) -> dict[str, Any]:
        if chat:
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            out = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            out = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        if token_ids is not None:
            out["token_ids"] = list(token_ids)
        return out

    status = "200"
    try:
        if chat:
            yield chunk([choice("", None, role=True)])

        async def all_events() -> AsyncIterator[tuple[str, tuple[int, ...]]]:
            if first is not None:
                yield first
                async for ev in events:
                    yield ev

        async for delta, ids in all_events():
            if return_token_ids:
                yield chunk([choice(delta, None, token_ids=ids)])
            elif delta:
                yield chunk([choice(delta, None)])
        yield chunk([choice("" if not chat else None, job.finish_reason)])
        if include_usage:
            yield chunk([], usage_of(len(job.req.prompt_token_ids), job.completion_tokens,
                                   job.cached_tokens))
    except RequestRejected as e:
        err = rejected(e)
        status = str(err.status)
        yield f"data: {json.dumps(err.body())}\n\n".encode()
    except Exception as e:  # noqa: BLE001 - a stream cannot change its status any more
        logger.exception("stream of %s failed", job.req.request_id)
        status = "500"
        body = ApiError(500, f"generation failed: {type(e).__name__}: {e}",
                        type="internal_error").body()
        yield f"data: {json.dumps(body)}\n\n".encode()
    finally:
        gate.release()
        REQUESTS.labels(endpoint, status).inc()
        await events.aclose()
    yield b"data: [DONE]\n\n"
