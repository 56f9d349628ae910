"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from typing import Any


class ApiError(Exception):
    """An error response: HTTP ``status`` with the OpenAI error body.

    ``type`` is ``invalid_request_error`` for 4xx caused by the request,
    ``rate_limit_error``/``overloaded_error`` for 429/503, ``internal_error`` for 500.
    """

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def invalid(message: str, param: str | None, code: str | None = None) -> ApiError:
    """A 400 ``invalid_request_error`` naming the offending field."""
    return ApiError(400, message, param=param, code=code)
