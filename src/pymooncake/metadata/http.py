"""HTTP metadata backend: a small stdlib server (``http://h:p/metadata``); its httpx client
is ``metadata.http_client.HttpMetadata``.

Wire format follows Mooncake's HTTP metadata server: ``GET|PUT|DELETE /metadata?key=<k>``
with the raw value as the body (a second PUT of a ``mooncake/rpc_meta/`` key is refused with
HTTP 400, as Mooncake does). pymooncake adds, on the same server:

* ``PUT /metadata?key=k&lease_id=N`` attach to a lease; ``&create=1`` put-if-absent (409);
* ``GET /metadata/prefix?prefix=p`` → msgpack ``[[key, value, mod_revision, lease_id], ...]``;
* ``POST /lease?ttl_s=T`` → lease id; ``POST /lease/keepalive?lease_id=N``;
  ``DELETE /lease?lease_id=N`` (404 for an unknown or expired lease);
* ``POST /txn`` msgpack ``{guard_key, guard_revision, puts: [[k, v]], deletes: [k]}`` →
  new revision, 412 when the guard key's mod revision differs (nothing written);
* ``GET /watch?prefix=p&since=R&timeout_s=T`` long-poll → msgpack
  ``{"revision": R', "events": [[kind, key, value, revision], ...]}``; ``since=-1`` only
  returns the current revision; 410 when the events after ``R`` were compacted.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import msgpack

from pymooncake.metadata.base import (
    LeaseNotFound,
    WatchCompacted,
    WatchEvent,
)
from pymooncake.metadata.embedded import SharedState
from pymooncake.obs.logging import init_logger

logger = init_logger(__name__)

MAX_WATCH_POLL_S = 30.0
"""Longest a watch long-poll is held open by the server."""
WATCH_POLL_S = 25.0
"""How long a client's watch long-poll asks the server to hold (a quiet watch costs one
request per this many seconds; changes answer it at once)."""


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"
    # TCP_NODELAY: a reply is written as headers, then body. With Nagle's algorithm the body
    # waited for the client's delayed ACK of the headers, ~40 ms on Linux loopback, so every
    # call took 44 ms and a watch event 88 ms (docs/benchmarks.md, issue 16, session 40).
    disable_nagle_algorithm = True

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        logger.debug("metadata http: " + format, *args)

    def _reply(self, status: int, body: bytes = b"", ctype: str = "application/octet-stream",
               headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        try:
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):  # client gone (a cancelled watch)
            self.close_connection = True

    def _error(self, status: int, message: str) -> None:
        self._reply(status, message.encode(), "text/plain; charset=utf-8")

    def _params(self) -> tuple[str, dict[str, str]]:
        parts = urlsplit(self.path)
        q = {k: v[-1] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
        return parts.path, q

    def _body(self) -> bytes:
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n > 0 else b""

    def _dispatch(self, method: str) -> None:
        path, q = self._params()
        body = self._body() if method in ("PUT", "POST") else b""
        st = self.server.state
        try:
            if path == "/metadata":
                key = q.get("key", "")
                if not key:
                    return self._error(400, "missing query parameter 'key'")
                if method == "GET":
                    kv = st.run(st.kv.get, key)
                    if kv is None:
                        return self._error(404, f"metadata key not found: {key}")
                    return self._reply(200, kv.value, headers={
                        "X-Mod-Revision": str(kv.mod_revision),
                        "X-Lease-Id": str(kv.lease_id or 0)})
                if method == "PUT":
                    lease = int(q["lease_id"]) if q.get("lease_id") else None
                    create = q.get("create") in ("1", "true")
                    if key.startswith("mooncake/rpc_meta/"):
                        create = True
                    if create:
                        ok = st.run(lambda now: st.kv.create(key, body, now, lease))
                        if not ok:
                            code = 400 if key.startswith("mooncake/rpc_meta/") else 409
                            return self._error(code, f"metadata key already exists: {key}")
                        return self._reply(200, str(st.kv.revision).encode())
                    rev = st.run(lambda now: st.kv.put(key, body, now, lease))
                    return self._reply(200, str(rev).encode())
                if method == "DELETE":
                    if st.run(st.kv.delete, key):
                        return self._reply(200)
                    return self._error(404, f"metadata key not found: {key}")
            elif path == "/metadata/prefix" and method == "GET":
                kvs = st.run(st.kv.get_prefix, q.get("prefix", ""))
                rows = [[kv.key, kv.value, kv.mod_revision, kv.lease_id or 0] for kv in kvs]
                return self._reply(200, msgpack.packb(rows))
            elif path == "/lease":
                if method == "POST":
                    lid = st.run(st.kv.grant_lease, float(q.get("ttl_s", "nan")))
                    return self._reply(200, str(lid).encode())
                if method == "DELETE":
                    st.run(st.kv.revoke_lease, int(q["lease_id"]))
                    return self._reply(200)
            elif path == "/lease/keepalive" and method == "POST":
                st.run(st.kv.keep_alive, int(q["lease_id"]))
                return self._reply(200)
            elif path == "/watch" and method == "GET":
                return self._watch(q)
            elif path == "/txn" and method == "POST":
                req = msgpack.unpackb(body)
                if not isinstance(req, dict):
                    return self._error(400, "txn body must be a msgpack map")
                puts = [(str(k), bytes(v)) for k, v in req.get("puts", [])]
                deletes = [str(k) for k in req.get("deletes", [])]
                rev = st.run(lambda now: st.kv.guarded_write(
                    str(req["guard_key"]), int(req["guard_revision"]), puts, deletes, now))
                if rev is None:
                    return self._error(412, "guard does not hold")
                return self._reply(200, str(rev).encode())
            elif path == "/health" and method == "GET":
                return self._reply(200, b"ok", "text/plain")
            return self._error(404, f"no route {method} {path}")
        except LeaseNotFound as e:
            return self._error(404, str(e))
        except WatchCompacted as e:
            return self._error(410, str(e))
        except (KeyError, ValueError) as e:
            return self._error(400, f"bad request: {e}")

    def _watch(self, q: dict[str, str]) -> None:
        st = self.server.state
        prefix = q.get("prefix", "")
        since = int(q.get("since", "-1"))
        timeout_s = min(float(q.get("timeout_s", "10")), MAX_WATCH_POLL_S)
        deadline = time.monotonic() + timeout_s
        with st.lock:
            st.kv.expire(time.monotonic())
            if since < 0:
                events: list[WatchEvent] = []
            else:
                while True:
                    events = st.kv.events_since(since, prefix)
                    remaining = deadline - time.monotonic()
                    if events or remaining <= 0 or self.server.stopping:
                        break
                    st.lock.wait(timeout=remaining)   # woken by changes and stop()
            revision = st.kv.revision
        rows = [[e.kind.value, e.key, e.value, e.revision] for e in events]
        self._reply(200, msgpack.packb({"revision": revision, "events": rows}))

    def do_GET(self) -> None:  # noqa: N802
        self._dispatch("GET")

    def do_PUT(self) -> None:  # noqa: N802
        self._dispatch("PUT")

    def do_POST(self) -> None:  # noqa: N802
        self._dispatch("POST")

    def do_DELETE(self) -> None:  # noqa: N802
        self._dispatch("DELETE")


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, addr: tuple[str, int]) -> None:
        super().__init__(addr, _Handler)
        self.state = SharedState()
        self.stopping = False
        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()

    def process_request(self, request, client_address) -> None:  # noqa: ANN001
        with self._conns_lock:
            if self.stopping:
                self.shutdown_request(request)
                return
            self._conns.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request) -> None:  # noqa: ANN001
        with self._conns_lock:
            self._conns.discard(request)
        super().shutdown_request(request)

    def close_connections(self) -> None:
        """Shut every open (keep-alive) connection down so its handler thread ends and
        its client reconnects — to whatever serves the port next."""
        with self._conns_lock:
            conns = list(self._conns)
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)

    def handle_error(self, request: object, client_address: object) -> None:
        # A client that hangs up mid-reply is normal (cancelled long-polls); log quietly.
        logger.debug("metadata http: request from %s ended with an error", client_address,
                     exc_info=True)


class MetadataHttpServer:
    """Mooncake-style HTTP metadata server (``pymooncake metadata-server``).

    ``port=0`` picks a free port; :attr:`url` is the ``http://host:port/metadata`` form that
    :func:`~pymooncake.metadata.open_metadata` and Mooncake's ``metadata_server`` accept.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self._server = _Server((host, port))
        self.host = host
        self.port = int(self._server.server_address[1])
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metadata"

    def start(self) -> MetadataHttpServer:
        """Serve on a daemon thread; returns ``self``."""
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        kwargs={"poll_interval": 0.1},
                                        name="metadata-http", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        """Serve on the calling thread until :meth:`stop` (or KeyboardInterrupt)."""
        self._server.serve_forever(poll_interval=0.1)

    def stop(self) -> None:
        self._server.stopping = True
        with self._server.state.lock:
            self._server.state.lock.notify_all()
        self._server.shutdown()
        self._server.server_close()
        self._server.close_connections()
        if self._thread is not None:
            self._thread.join(timeout=5)
