"""``mooncake.http_metadata_server`` on pymooncake: ``KVBootstrapServer``, the standalone
HTTP metadata server (``GET|PUT|DELETE /metadata?key=K``) with Mooncake's answers — 400 for
a missing or blank key (keys are stripped), 404 for an unknown key, 400 for a second PUT of
an ``rpc_meta`` key. Served by the standard library (no aiohttp); ``_handle_metadata``
takes any request object with ``method``, ``query`` and an async ``read()``."""

from __future__ import annotations

import argparse
import enum
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit


class KVPoll(enum.Enum):
    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


@dataclass
class Response:
    """What a handler answers (``status``, ``body``, ``content_type``, ``text``)."""

    status: int
    body: bytes
    content_type: str = "application/json"

    @property
    def text(self) -> str:
        return self.body.decode(errors="replace")


class KVBootstrapServer:
    """The metadata store (``store``: key → bytes) and its HTTP server."""

    def __init__(self, port: int, host: str = "0.0.0.0") -> None:
        self.port, self.host = port, host
        self.store: dict[str, bytes] = {}
        self._lock = threading.Lock()
        self._httpd: ThreadingHTTPServer | None = None
        self.thread: threading.Thread | None = None

    def handle(self, method: str, raw_key: str | None, body: bytes) -> Response:
        key = (raw_key or "").strip()
        if not key:
            return Response(400, b"metadata key is required")
        with self._lock:
            if method == "GET":
                value = self.store.get(key)
                return Response(404, b"metadata not found") if value is None else Response(
                    200, value)
            if method == "PUT":
                if "rpc_meta" in key and key in self.store:
                    return Response(400, b"Duplicate rpc_meta key not allowed")
                self.store[key] = bytes(body)
                return Response(200, b"metadata updated")
            if method == "DELETE":
                if self.store.pop(key, None) is None:
                    return Response(404, b"metadata not found")
                return Response(200, b"metadata deleted")
        return Response(405, b"Method not allowed")

    async def _handle_metadata(self, request: Any) -> Response:
        body = await request.read() if request.method == "PUT" else b""
        return self.handle(request.method, request.query.get("key"), body)

    def run(self) -> threading.Thread:
        """Serve on a daemon thread (``port=0``: a free port, then in ``self.port``)."""
        server = self

        class Handler(BaseHTTPRequestHandler):
            def _do(self) -> None:
                url = urlsplit(self.path)
                if url.path != "/metadata":
                    resp = Response(404, b"not found")
                else:
                    n = int(self.headers.get("Content-Length") or 0)
                    body = self.rfile.read(n) if n else b""
                    key = parse_qs(url.query, keep_blank_values=True).get("key", [None])[0]
                    resp = server.handle(self.command, key, body)
                self.send_response(resp.status)
                self.send_header("Content-Type", resp.content_type)
                self.send_header("Content-Length", str(len(resp.body)))
                self.end_headers()
                self.wfile.write(resp.body)

            do_GET = do_PUT = do_DELETE = do_POST = _do

            def log_message(self, *args: Any) -> None:
                pass

        self._httpd = ThreadingHTTPServer((self.host, self.port), Handler)
        self.port = self._httpd.server_address[1]
        self.thread = threading.Thread(target=self._httpd.serve_forever, daemon=True,
                                       name="kv-bootstrap")
        self.thread.start()
        return self.thread

    def close(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
        if self.thread is not None:
            self.thread.join(timeout=2)

    def poll(self) -> KVPoll:
        return KVPoll.Success if self.thread is not None and self.thread.is_alive() \
            else KVPoll.Failed


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Mooncake HTTP metadata server (pymooncake)")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--host", default="0.0.0.0")
    a = p.parse_args(argv)
    s = KVBootstrapServer(a.port, a.host)
    s.run()
    try:
        s.thread.join()  # type: ignore[union-attr]
    except KeyboardInterrupt:
        s.close()


if __name__ == "__main__":
    main()
