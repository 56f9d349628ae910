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


def test_listen_socket_gives_nodelay_connections() -> None:
    """asyncio sets TCP_NODELAY only on accepted sockets whose proto is TCP; a listening socket
    made with proto 0 left Nagle on and every keep-alive response waited ~40 ms for the
    client's delayed ACK."""
    import asyncio
    import socket

    from pymooncake.api.server import listen_socket

    async def main() -> tuple[int, int]:
        seen: list[int] = []

        def on_conn(_r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            s = w.get_extra_info("socket")
            seen.append(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            w.close()

        plain = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        plain.bind(("127.0.0.1", 0))
        plain.listen(8)
        result = []
        for sock in (listen_socket("127.0.0.1", 0), plain):
            port = sock.getsockname()[1]
            server = await asyncio.start_server(on_conn, sock=sock)
            _, w = await asyncio.open_connection("127.0.0.1", port)
            for _ in range(200):
                if len(seen) > len(result):
                    break
                await asyncio.sleep(0.01)
            result.append(seen[-1])
            w.close()
            server.close()
            await server.wait_closed()
        return result[0], result[1]

    ours, plain_proto0 = asyncio.run(main())
    assert ours != 0
    assert plain_proto0 == 0  # the fault this guards against is real on this Python


def test_listen_socket_refuses_a_used_port() -> None:
    from pymooncake.api.server import listen_socket
    a = listen_socket("127.0.0.1", 0)
    try:
        with pytest.raises(OSError):
            listen_socket("127.0.0.1", a.getsockname()[1])
    finally:
        a.close()
