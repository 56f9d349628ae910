"""Request errors of the front door: pydantic validation errors and the backend's
refusals turned into OpenAI-shaped ``ApiError``s.

Holds ``validation_error`` (400 with ``param`` naming the field; a union field says what it
accepts) and ``rejected`` (a ``RequestRejected`` → 4xx, or 429/503 with ``Retry-After``).
Used by ``api.server`` and ``api.replies``.
"""

from __future__ import annotations

from pydantic import ValidationError

from pymooncake.api.errors import ApiError, invalid
from pymooncake.rpc.messages import RequestRejected


def rejected(e: RequestRejected) -> ApiError:
    r = e.rejection
    if 400 <= r.status < 429:      # the request itself is wrong: retrying cannot help
        return ApiError(r.status, r.message, type="invalid_request_error", code=r.code)
    retry = max(1, int(-(-r.retry_after_s // 1)))
    return ApiError(r.status, r.message,
                    type="rate_limit_error" if r.status == 429 else "overloaded_error",
                    code=r.code, headers={"Retry-After": str(retry)})


_UNION_TAGS = {"str": "a string", "int": "an integer", "float": "a number",
               "bool": "a boolean", "list[int]": "a list of token ids (integers)",
               "list[str]": "a list of strings", "list[TextPart]": "a list of text parts"}
"""pydantic's names of union members (they appear in error locations) → plain words."""


def validation_error(e: ValidationError) -> ApiError:
    errors = e.errors()
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ())]
    if first.get("type") == "json_invalid":
        return invalid(f"request body is not valid JSON: {first.get('msg')}", None)
    param = loc[0] if loc else None
    # a union field (e.g. prompt: str | list[int]): one error per member, the member's
    # name in the location; say what is accepted instead of "prompt.str: …"
    cut = next((i for i, part in enumerate(loc) if part in _UNION_TAGS), None)
    if cut is not None:
        field = ".".join(loc[:cut])
        kinds = []
        for err in errors:
            el = [str(p) for p in err.get("loc", ())]
            if el[:cut] == loc[:cut] and len(el) > cut and el[cut] in _UNION_TAGS:
                kind = _UNION_TAGS[el[cut]]
                if kind not in kinds:
                    kinds.append(kind)
        got = type(first.get("input")).__name__
        return invalid(f"{field} must be {' or '.join(kinds)} (got a {got})", param)
    where = ".".join(loc) or "body"
    return invalid(f"{where}: {first.get('msg')}", param)
