"""The HTTP metadata server speaks Mooncake's protocol and survives malformed requests."""

from __future__ import annotations

import httpx


def test_mooncake_wire_protocol_and_bad_requests(http_metadata_url: str) -> None:
    base = http_metadata_url.rsplit("/metadata", 1)[0]
    with httpx.Client(base_url=base, timeout=5) as c:
        # Mooncake's GET/PUT/DELETE /metadata?key=...
        assert c.get("/metadata", params={"key": "mooncake/ram/x"}).status_code == 404
        assert c.put("/metadata", params={"key": "mooncake/ram/x"},
                     content=b'{"name":"x"}').status_code == 200
        r = c.get("/metadata", params={"key": "mooncake/ram/x"})
        assert (r.status_code, r.content) == (200, b'{"name":"x"}')
        # A second PUT of an rpc_meta key is refused with 400, as Mooncake does.
        key = {"key": "mooncake/rpc_meta/x"}
        assert c.put("/metadata", params=key, content=b"a").status_code == 200
        assert c.put("/metadata", params=key, content=b"b").status_code == 400
        assert c.get("/metadata", params=key).content == b"a"
        # Malformed requests get a clear 4xx and the server keeps serving.
        assert c.put("/metadata", content=b"v").status_code == 400  # no key
        bad = c.put("/metadata", params={"key": "k", "lease_id": "abc"}, content=b"v")
        assert bad.status_code == 400 and "bad request" in bad.text
        assert c.post("/lease", params={"ttl_s": "-1"}).status_code == 400
        assert c.post("/lease/keepalive", params={"lease_id": "999999"}).status_code == 404
        assert c.get("/nope").status_code == 404
        assert c.delete("/metadata", params={"key": "mooncake/ram/x"}).status_code == 200
        assert c.delete("/metadata", params={"key": "mooncake/ram/x"}).status_code == 404
        assert c.get("/health").text == "ok"


def test_replies_leave_with_tcp_nodelay() -> None:
    """A reply is written as headers, then body: with Nagle's algorithm on the server's
    socket the body waited for the client's delayed ACK (~40 ms on Linux loopback), and
    every call took 44 ms (docs/benchmarks.md, issue 16, session 40). Every connection the
    server accepted must have TCP_NODELAY set."""
    import socket

    from pymooncake.metadata.http import MetadataHttpServer

    srv = MetadataHttpServer("127.0.0.1", 0).start()
    try:
        with httpx.Client(timeout=5) as c:
            base = srv.url.rsplit("/metadata", 1)[0]
            assert c.get(base + "/health").text == "ok"
            assert c.put(srv.url, params={"key": "k"}, content=b"v").status_code == 200
            conns = list(srv._server._conns)   # the keep-alive connection just used
            assert len(conns) == 1
            assert conns[0].getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
    finally:
        srv.stop()


_NO_FAILED_IMPORT = r"""
import asyncio, sys
from pymooncake.metadata.http import MetadataHttpServer
from pymooncake.metadata.http_client import HttpMetadata

srv = MetadataHttpServer("127.0.0.1", 0).start()
imported = []

async def main():
    md = HttpMetadata(srv.url)
    lease = await md.grant_lease(10.0)
    await md.keep_alive(lease)              # the client's first request imports what it uses
    sys.addaudithook(lambda ev, args: imported.append(args[0]) if ev == "import" else None)
    for _ in range(5):
        await md.keep_alive(lease)
        await md.get("nope")
    try:                                    # the check's own control: a failed import
        import _pmk_no_such_module  # noqa: F401
    except ImportError:
        pass

asyncio.run(main())
srv.stop()
print(sorted({m for m in imported if m not in sys.modules}))
"""


def test_async_metadata_requests_attempt_no_failing_import() -> None:
    """Every async httpx request asks ``httpcore`` which async library runs, by importing
    ``sniffio``; without it installed (recent anyio no longer brings it) that import fails
    on every request and scans each ``sys.path`` entry (~0.2 ms of CPU per request, a
    stat per entry, measured in issue 16). ``sniffio`` is a dependency now: a warm client's
    keep-alives and gets import nothing that is not loaded already. Run in a fresh
    interpreter (an audit hook cannot be removed)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _NO_FAILED_IMPORT], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['_pmk_no_such_module']"   # only the control failed
