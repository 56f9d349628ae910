"""The front door as a real HTTP server (uvicorn in its own process) over loopback."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]

SERVER = textwrap.dedent("""
    import socket, sys, uvicorn
    sys.path.insert(0, sys.argv[1])
    from pymooncake.api.server import ApiConfig, create_app
    from tests.api.fakes import ByteCodec, ScriptedBackend
    app = create_app(ScriptedBackend(reply="ok!"), ByteCodec(), ApiConfig(context_length=256))
    sock = socket.socket(); sock.bind(("127.0.0.1", 0)); sock.listen(64)
    print(sock.getsockname()[1], flush=True)
    config = uvicorn.Config(app, log_level="warning")
    uvicorn.Server(config).run(sockets=[sock])
""")


@pytest.fixture()
def server_url():
    proc = subprocess.Popen([sys.executable, "-c", SERVER, str(ROOT)], stdout=subprocess.PIPE,
                            text=True)
    try:
        port = int(proc.stdout.readline())
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(f"{url}/health", timeout=1)
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


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
