"""OpenAI-compatible HTTP server: validate → tokenize → backend.generate() → (stream) reply.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (stream and non-stream),
``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus, the process registry).

Readiness: ``/health`` is 200 only when the server can answer a request — the tokenizer is
loaded (``app.state.codec``; ``create_app`` may start without it) and the backend's
``readiness()`` lists nothing it still waits for (the Conductor: a prefill and a decode
worker registered). Until then it is 503 with ``{"status": "starting", "waiting_for":
[...]}`` and completions are 503 ``not_ready`` with ``Retry-After``.

``model``: requests may name the served model (``ApiConfig.model_name``, what
``/v1/models`` lists) or one of ``model_aliases``; another name is OpenAI's 404
``model_not_found``. An absent ``model`` is accepted and means the served model (OpenAI
requires the field; this server has one model, so nothing is ambiguous).

Every error has the OpenAI shape (``api.errors``); malformed JSON, wrong types and bad
ranges are 400 with ``param`` naming the field; overload is 429/503 with ``Retry-After``
(``api.admission``, or the backend's own early rejection); nothing a client sends gives
a 500. ``usage.prompt_tokens_details.cached_tokens`` is always present: the prompt
tokens whose KV the prefill side reused (CASES BUG-55/BUG-56).

Modules: this one (the app, its routes, parsing and admission of a request),
``api.replies`` (the detokenized token stream, the SSE stream, usage, metrics),
``api.validation`` (pydantic errors and refusals → OpenAI errors).
"""

from __future__ import annotations

import socket
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from pymooncake.api.admission import AdmissionConfig, AdmissionGate
from pymooncake.api.disconnect import CLIENT_CLOSED, collect_or_disconnect
from pymooncake.api.errors import ApiError, invalid
from pymooncake.api.openai_schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    check_common,
    to_sampling,
)
from pymooncake.api.replies import REQUESTS, Job, error_response, sse_stream, usage_of
from pymooncake.api.validation import rejected, validation_error
from pymooncake.obs import metrics
from pymooncake.obs.logging import init_logger
from pymooncake.rpc.messages import GenerateRequest, RequestRejected, TokenEvent

logger = init_logger(__name__)

MAX_TOKEN_ID = 2**32
"""Token ids are < 2**32 whatever the model (the block-key encoding, DESIGN.md §3); a
codec's ``vocab_size`` narrows it."""


class TextCodec(Protocol):
    """The model's tokenizer and chat template (e.g. the engine's tokenizers)."""

    eos_token_ids: tuple[int, ...]

    def encode(self, text: str) -> list[int]: ...
    def decode(self, token_ids: list[int]) -> str: ...
    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]: ...


class Backend(Protocol):
    """What the front door calls: the Conductor (or a single engine for tests)."""

    def generate(self, request: GenerateRequest) -> AsyncIterator[TokenEvent]:
        """Stream the request's tokens; raise ``RequestRejected`` to refuse it."""
        ...


COMPLETIONS_DEFAULT_MAX_TOKENS = 16
"""``/v1/completions`` without ``max_tokens`` (or with null) generates at most this many
tokens, OpenAI's documented default for the legacy endpoint (vLLM's too); chat completions
without it run to the remaining context, as OpenAI's chat endpoint does."""

@dataclass(frozen=True, slots=True)
class ApiConfig:
    model_name: str = "tiny"
    """Model id reported by ``/v1/models`` and accepted in requests."""
    model_aliases: tuple[str, ...] = ()
    """Other names accepted in requests (e.g. the ``--model`` spec ``smollm2``)."""
    context_length: int = 2048
    """Prompt + completion tokens at most."""
    default_max_tokens: int | None = None
    """Cap for requests without ``max_tokens`` (None: the remaining context for chat,
    ``COMPLETIONS_DEFAULT_MAX_TOKENS`` for ``/v1/completions``)."""
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    max_body_bytes: int = 32 << 20
    """Largest request body read (bytes); larger is 413 before it is read."""

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        if self.context_length < 2:
            raise ValueError(f"context_length must be >= 2, got {self.context_length}")
        if self.default_max_tokens is not None and self.default_max_tokens < 1:
            raise ValueError(f"default_max_tokens must be >= 1, got {self.default_max_tokens}")


def listen_socket(host: str, port: int, backlog: int = 1024) -> socket.socket:
    """A listening TCP socket for the HTTP server (``port`` 0 = any free port).

    Created with ``proto=IPPROTO_TCP`` on purpose: asyncio turns on ``TCP_NODELAY`` only for
    accepted sockets whose protocol is TCP, and a socket made with proto 0 hands that 0 on to
    every accepted connection. Without it each keep-alive response (headers and body are
    separate writes) waited ~40 ms for the client's delayed ACK (Nagle). Raises ``OSError``
    when the address is in use or cannot be bound.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    return sock


def create_app(backend: Backend, codec: TextCodec | None, config: ApiConfig | None = None,
               health: Callable[[], dict[str, Any]] | None = None,
               readiness: Callable[[], list[str]] | None = None) -> FastAPI:
    """Build the FastAPI app serving ``backend`` with tokenizer ``codec``.

    ``codec`` may be None while it loads: set ``app.state.codec`` when it is there.
    ``health`` adds fields to ``/health``; ``readiness`` lists what the backend still waits
    for before it can serve (empty: ready).
    """
    cfg = config or ApiConfig()
    gate = AdmissionGate(cfg.admission)
    app = FastAPI(title="pymooncake", version="0.1.0")
    app.state.gate = gate
    app.state.codec = codec
    model_names = {cfg.model_name, *cfg.model_aliases}

    def waiting_for() -> list[str]:
        waits = ["the model's tokenizer to load"] if app.state.codec is None else []
        return waits + (readiness() if readiness is not None else [])

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        """Unknown paths and methods in the OpenAI error shape too (404, 405)."""
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        body = {"error": {"message": str(exc.detail), "type": kind, "param": None,
                          "code": None}}
        return JSONResponse(body, status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.get("/health")
    async def _health() -> JSONResponse:
        waits = waiting_for()
        body: dict[str, Any] = {"status": "starting" if waits else "ok"}
        if waits:
            body["waiting_for"] = waits
        body.update({"model": cfg.model_name, "in_flight": gate.in_flight,
                     "queued": gate.num_queued, "saturation": gate.saturation})
        if health is not None:
            body.update(health())
        return JSONResponse(body, status_code=503 if waits else 200)

    @app.get("/metrics")
    async def _metrics() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def _models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [
            {"id": cfg.model_name, "object": "model", "created": 0, "owned_by": "pymooncake",
             "max_model_len": cfg.context_length}]})

    async def _parse(request: Request, model_cls: type) -> Any:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > cfg.max_body_bytes:
            raise ApiError(413, f"request body of {declared} bytes exceeds the "
                           f"{cfg.max_body_bytes}-byte limit", code="request_too_large")
        chunks = []
        size = 0
        async for part in request.stream():      # also bounds bodies sent without a length
            size += len(part)
            if size > cfg.max_body_bytes:
                raise ApiError(413, f"request body exceeds the {cfg.max_body_bytes}-byte "
                               "limit", code="request_too_large")
            chunks.append(part)
        body = b"".join(chunks)
        try:
            req = model_cls.model_validate_json(body)
        except ValidationError as e:
            raise validation_error(e) from None
        if req.model is not None and req.model not in model_names:
            raise ApiError(404, f"The model `{req.model}` does not exist.",
                           type="invalid_request_error", param="model",
                           code="model_not_found")
        check_common(req)
        return req

    async def _serve(request: Request, endpoint: str, chat: bool) -> Response:
        try:
            waits = waiting_for()
            if waits:
                raise ApiError(503, f"the server is not ready yet: waiting for "
                               f"{'; '.join(waits)}", type="overloaded_error",
                               code="not_ready", headers={"Retry-After": "1"})
            codec: TextCodec = app.state.codec
            req = await _parse(request, ChatCompletionRequest if chat else CompletionRequest)
            t_tok = time.monotonic()
            if chat:
                if not req.messages:
                    raise invalid("messages must hold at least one message", "messages")
                ids = codec.apply_chat_template(
                    [{"role": m.role, "content": m.text()} for m in req.messages])
                prompt_param = "messages"
            elif isinstance(req.prompt, str):
                if not req.prompt:
                    raise invalid("prompt must not be empty", "prompt")
                ids = codec.encode(req.prompt)
                prompt_param = "prompt"
            else:
                if not req.prompt or min(req.prompt) < 0:
                    raise invalid("prompt token ids must be a non-empty list of ids >= 0",
                                  "prompt")
                vocab = getattr(codec, "vocab_size", None) or MAX_TOKEN_ID
                if max(req.prompt) >= vocab:
                    bad = [t for t in req.prompt if t >= vocab][:5]
                    raise invalid(f"prompt token ids {bad} are outside the model's vocabulary "
                                  f"[0, {vocab})", "prompt")
                ids = list(req.prompt)
                prompt_param = "prompt"
            default = cfg.default_max_tokens
            if not chat and default is None:    # OpenAI's legacy completions default
                default = COMPLETIONS_DEFAULT_MAX_TOKENS
            sampling = to_sampling(req, len(ids), cfg.context_length, default, prompt_param)
            greq = GenerateRequest(request_id=f"{'chatcmpl' if chat else 'cmpl'}-"
                                   f"{uuid.uuid4().hex}", prompt_token_ids=tuple(ids),
                                   sampling=sampling, priority=req.priority,
                                   arrival_time_s=time.monotonic(),
                                   tokenize_s=time.monotonic() - t_tok)
            try:
                await gate.acquire(req.priority)
            except RequestRejected as e:
                raise rejected(e) from None
        except ApiError as err:
            return error_response(err, endpoint)
        job = Job(backend, app.state.codec, greq)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            # Wait for the first event before the 200 goes out: a request the backend
            # refuses (placement, decode admission) must get its 429/503 + Retry-After,
            # not an error event inside a 200 stream (nothing has been streamed yet).
            events = job.deltas()
            try:
                first = await events.__anext__()
            except StopAsyncIteration:
                first = None
            except BaseException as e:
                gate.release()
                await events.aclose()
                if isinstance(e, RequestRejected):
                    return error_response(rejected(e), endpoint)
                raise
            return StreamingResponse(sse_stream(job, events, first, chat, include_usage,
                                                req.return_token_ids, endpoint,
                                                model_name=cfg.model_name, gate=gate),
                                     media_type="text/event-stream")
        try:
            parts = await collect_or_disconnect(job.deltas(), request.receive)
        except RequestRejected as e:
            return error_response(rejected(e), endpoint)
        finally:
            gate.release()
        if parts is None:              # the client hung up: generation stopped (BUG-73)
            REQUESTS.labels(endpoint, str(CLIENT_CLOSED)).inc()
            return Response(status_code=CLIENT_CLOSED)
        text = "".join(d for d, _ in parts)
        REQUESTS.labels(endpoint, "200").inc()
        usage = usage_of(len(greq.prompt_token_ids), job.completion_tokens, job.cached_tokens)
        created = int(time.time())
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": None, "finish_reason": job.finish_reason}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None,
                      "finish_reason": job.finish_reason}
            obj = "text_completion"
        return JSONResponse({"id": greq.request_id, "object": obj, "created": created,
                             "model": cfg.model_name, "choices": [choice], "usage": usage})

    @app.post("/v1/completions")
    async def _completions(request: Request) -> Response:
        return await _serve(request, "completions", chat=False)

    @app.post("/v1/chat/completions")
    async def _chat(request: Request) -> Response:
        return await _serve(request, "chat_completions", chat=True)

    return app
