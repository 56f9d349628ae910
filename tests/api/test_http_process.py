"""The front door as a real HTTP server (uvicorn in its own process) over loopback."""

from __future__ import annotations

import httpx
import pytest


@pytest.mark.integration
def test_chat_over_real_http(server_url: str) -> None:
    body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 5}
    r = httpx.post(f"{server_url}/v1/chat/completions", json=body, timeout=10)
    assert r.status_code == 200
    assert r.json()["choices"][0]["message"]["content"] == "ok!ok"
    with httpx.stream("POST", f"{server_url}/v1/chat/completions",
                      json={**body, "stream": True}, timeout=10) as s:
        assert s.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in s.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    bad = httpx.post(f"{server_url}/v1/completions", content=b"\x00garbage", timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
    assert httpx.get(f"{server_url}/health", timeout=10).json()["status"] == "ok"
