"""Fixtures of the API tests: the front door as a real uvicorn process."""

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
    import sys, uvicorn
    sys.path.insert(0, sys.argv[1])
    from pymooncake.api.server import ApiConfig, create_app, listen_socket
    from tests.api.fakes import ByteCodec, ScriptedBackend
    app = create_app(ScriptedBackend(reply="ok!"), ByteCodec(), ApiConfig(context_length=2048))
    sock = listen_socket("127.0.0.1", 0)
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
