"""Wait until a server's ``/health`` says it can serve — for ``serve``, ``replay``,
``bench serving`` and the demo, instead of a fixed sleep.

A pymooncake front door answers 503 with ``{"waiting_for": [...]}`` while it starts and
200 once ready (``api.server``). A server without ``/health`` (404, another OpenAI-
compatible server) is taken as ready: there is nothing to wait for.
"""

from __future__ import annotations

import time
from typing import Any


class NotReadyError(TimeoutError):
    """The server did not become ready in time; the message says what it still waited
    for (or that it never answered)."""


def wait_ready(url: str, timeout_s: float = 60.0, interval_s: float = 0.1,
               alive: Any = None, connect_timeout_s: float | None = None) -> dict[str, Any]:
    """Poll ``url/health`` until it is 200 (or not served at all); return its JSON body.

    Connection errors are retried (the server may not listen yet) for ``connect_timeout_s``
    (default: all of ``timeout_s``); a server that answers 503 is waited for up to
    ``timeout_s``. ``alive()``, when given, is called each round: return a reason string to
    stop early (e.g. a child process exited). Raises ``NotReadyError`` naming what
    ``/health`` last said it waited for, or the connection error ("no response from").
    """
    import httpx

    start = time.monotonic()
    deadline = start + timeout_s
    connect_deadline = start + (timeout_s if connect_timeout_s is None
                                else min(timeout_s, connect_timeout_s))
    last = "no answer yet"
    while True:
        answered = False
        try:
            r = httpx.get(url.rstrip("/") + "/health", timeout=5)
            answered = True
            if r.status_code == 200:
                try:
                    return dict(r.json())
                except ValueError:
                    return {}
            if r.status_code == 404:
                return {}
            try:
                waits = r.json().get("waiting_for") or []
            except (ValueError, AttributeError):
                waits = []
            last = ("waiting for " + "; ".join(waits)) if waits else f"HTTP {r.status_code}"
        except httpx.HTTPError as e:
            last = f"{type(e).__name__}: {e}"
        if alive is not None and (why := alive()):
            raise NotReadyError(f"{url} will not get ready: {why} ({last})")
        now = time.monotonic()
        if not answered and now >= connect_deadline:
            raise NotReadyError(f"no response from {url} in {now - start:.0f} s: {last}")
        if now >= deadline:
            raise NotReadyError(f"{url} not ready after {timeout_s:g} s: {last}")
        time.sleep(interval_s)
