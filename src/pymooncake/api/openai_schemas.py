"""Request models for ``/v1/completions`` and ``/v1/chat/completions`` (OpenAI API).

pydantic checks the JSON types (strict: ``"abc"`` or ``true`` is not an int); the
semantic rules (ranges, combinations, context length) are in ``to_sampling`` and the
server, each raising a 400 ``invalid_request_error`` that names the field (``param``).

Rules where the OpenAI reference leaves room (CASES BUG-53/BUG-54):

* ``max_tokens: null`` (or absent) = the remaining context, capped by the server's
  ``default_max_tokens`` when set; ``/v1/completions`` without a server default caps it at
  16, OpenAI's default for that endpoint (``server.COMPLETIONS_DEFAULT_MAX_TOKENS``).
* ``max_tokens`` < 1 → 400 (0 is not "echo only" here).
* prompt + ``max_tokens`` over the context length → 400 on both endpoints (no clamping),
  with the limit and the counts in the message; ``param`` is ``max_tokens`` when the
  prompt alone fits, else ``messages``/``prompt``.
* ``stream_options`` without ``stream: true`` → 400; ``n`` other than 1 → 400.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, StrictBool, StrictFloat, StrictInt, StrictStr

from pymooncake.api.errors import invalid
from pymooncake.rpc.messages import SamplingOptions

Number = StrictInt | StrictFloat


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool = False


class _Common(BaseModel):
    # unknown fields are kept (``model_extra``) so that OpenAI features this server does not
    # implement can be refused by name (``check_unsupported``); other unknown fields —
    # vendor extensions — are ignored
    model_config = ConfigDict(extra="allow")

    model: StrictStr | None = None
    max_tokens: StrictInt | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: StrictInt | None = None
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    n: StrictInt | None = 1
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    priority: StrictInt = 0
    ignore_eos: StrictBool = False
    return_token_ids: StrictBool = False
    """Extension (as in vLLM): every streamed chunk carries the ``token_ids`` it adds, one
    chunk per engine step even when its text is still held back; used for exact TBT."""
    user: StrictStr | None = None


class CompletionRequest(_Common):
    """``POST /v1/completions``: ``prompt`` is a string or a list of token ids."""

    prompt: StrictStr | list[StrictInt]
    logprobs: StrictInt | None = None
    echo: StrictBool = False


class TextPart(BaseModel):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_Common):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage]
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool | None = False


def requested_max_tokens(req: _Common) -> int | None:
    """``max_tokens`` (or chat's ``max_completion_tokens``) after the ≥ 1 check."""
    value = req.max_tokens
    param = "max_tokens"
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        value, param = req.max_completion_tokens, "max_completion_tokens"
    if value is not None and value < 1:
        raise invalid(f"{param} must be at least 1, got {value}", param)
    return value


_UNSUPPORTED: dict[str, Any] = {
    "tools": lambda v: v not in (None, []),
    "tool_choice": lambda v: v not in (None, "none", "auto"),
    "functions": lambda v: v not in (None, []),
    "function_call": lambda v: v not in (None, "none", "auto"),
    "response_format": lambda v: v not in (None, {"type": "text"}),
    "logit_bias": lambda v: v not in (None, {}),
    "frequency_penalty": lambda v: v not in (None, 0, 0.0),
    "presence_penalty": lambda v: v not in (None, 0, 0.0),
    "repetition_penalty": lambda v: v not in (None, 1, 1.0),
    "best_of": lambda v: v not in (None, 1),
    "suffix": lambda v: v not in (None, ""),
    "top_logprobs": lambda v: v not in (None, 0),
    "logprobs": lambda v: v not in (None, False, 0),
    "echo": lambda v: v not in (None, False),
}
"""OpenAI request fields this server does not implement, with the test for a value that
would change the result. Such a value is refused (400 naming the field) rather than
silently ignored; the neutral values clients send by default are accepted."""


def check_unsupported(req: _Common) -> None:
    """400 naming the first OpenAI feature requested that this server does not implement."""
    values = dict(req.model_extra or {})
    for name in ("logprobs", "echo"):
        if name in type(req).model_fields:
            values[name] = getattr(req, name)
    for name, changes in _UNSUPPORTED.items():
        if name in values and changes(values[name]):
            raise invalid(f"{name}={values[name]!r} is not supported by this server",
                          name, code="unsupported_parameter")


def check_common(req: _Common) -> None:
    """Range and combination checks shared by both endpoints (400 naming the field)."""
    check_unsupported(req)
    if req.n not in (None, 1):
        raise invalid(f"only n=1 is supported, got n={req.n}", "n")
    if req.temperature is not None and not 0.0 <= req.temperature <= 2.0:
        raise invalid(f"temperature must be in [0, 2], got {req.temperature}", "temperature")
    if req.top_p is not None and not 0.0 < req.top_p <= 1.0:
        raise invalid(f"top_p must be in (0, 1], got {req.top_p}", "top_p")
    if req.top_k is not None and req.top_k < -1:
        raise invalid(f"top_k must be -1, 0 (off) or positive, got {req.top_k}", "top_k")
    if req.stream_options is not None and not req.stream:
        raise invalid("stream_options is only allowed when stream is true", "stream_options")
    stops = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    if len(stops) > 4:
        raise invalid(f"at most 4 stop sequences, got {len(stops)}", "stop")
    if any(s == "" for s in stops):
        raise invalid("stop sequences must not be empty", "stop")
    requested_max_tokens(req)


def to_sampling(req: _Common, prompt_tokens: int, context_length: int,
                default_max_tokens: int | None, prompt_param: str) -> SamplingOptions:
    """Resolve ``max_tokens`` against the context and build ``SamplingOptions``.

    Raises ``ApiError`` (400) when the prompt, or prompt + ``max_tokens``, exceeds
    ``context_length`` tokens.
    """
    if prompt_tokens < 1:
        raise invalid("the prompt is empty (0 tokens)", prompt_param)
    if prompt_tokens >= context_length:
        raise invalid(
            f"this model's maximum context length is {context_length} tokens; the prompt has "
            f"{prompt_tokens} tokens, which leaves no room for output", prompt_param,
            code="context_length_exceeded")
    remaining = context_length - prompt_tokens
    max_tokens = requested_max_tokens(req)
    if max_tokens is None:
        max_tokens = remaining if default_max_tokens is None else min(remaining,
                                                                      default_max_tokens)
    elif prompt_tokens + max_tokens > context_length:
        param = ("max_completion_tokens" if isinstance(req, ChatCompletionRequest)
                 and req.max_completion_tokens is not None else "max_tokens")
        raise invalid(
            f"this model's maximum context length is {context_length} tokens; you requested "
            f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the prompt, "
            f"{max_tokens} for the completion)", param, code="context_length_exceeded")
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    logprobs = bool(req.logprobs) if req.logprobs is not None else False
    return SamplingOptions(
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else float(req.temperature),
        top_p=1.0 if req.top_p is None else float(req.top_p),
        top_k=0 if req.top_k in (None, -1) else int(req.top_k),
        seed=req.seed,
        stop=tuple(stops),
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
    )
