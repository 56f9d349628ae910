"""``SyncRpcClient``'s adaptive wait for an answer (issue 16): when to hand the CPU over
before the first look, and when to look at once."""

from __future__ import annotations

import os
import time

import pytest

from pymooncake.rpc import SyncRpcClient
from pymooncake.rpc import client as rpc_client


class FakeSock:
    """A socket whose answer is there from the ``ready_at``-th receive on; logs each
    receive and each ``sched_yield`` in ``events``."""

    def __init__(self, events: list[str], ready_at: int) -> None:
        self.events = events
        self.ready_at = ready_at
        self.recvs = 0

    def recv(self, want: int, flags: int = 0) -> bytes:
        self.recvs += 1
        self.events.append("recv")
        if self.recvs < self.ready_at:
            raise BlockingIOError
        return b"answer"


@pytest.fixture
def events(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    log: list[str] = []
    monkeypatch.setattr(os, "sched_yield", lambda: log.append("yield"))
    return log


def test_a_fresh_call_hands_the_cpu_over_before_its_first_look(events: list[str]) -> None:
    c = SyncRpcClient("127.0.0.1", 1, poll_s=0.5)
    c._sent_at = time.monotonic()
    assert c._poll(FakeSock(events, ready_at=1), 64) == b"answer"
    assert events == ["yield", "recv"]
    events.clear()
    c._sent_at = time.monotonic()
    assert c._poll(FakeSock(events, ready_at=3), 64) == b"answer"
    assert events == ["yield", "recv", "yield", "recv", "yield", "recv"]


def test_a_call_out_long_looks_first(events: list[str]) -> None:
    c = SyncRpcClient("127.0.0.1", 1, poll_s=0.5)
    c._sent_at = time.monotonic() - 10 * rpc_client.LOOK_FIRST_S
    assert c._poll(FakeSock(events, ready_at=1), 64) == b"answer"
    assert events == ["recv"]                   # no CPU turn handed away for nothing
    events.clear()
    c._sent_at = time.monotonic() - 10 * rpc_client.LOOK_FIRST_S
    assert c._poll(FakeSock(events, ready_at=2), 64) == b"answer"
    assert events == ["recv", "yield", "recv"]  # not there: then as a fresh call


def test_the_poll_ends_after_poll_s_without_an_answer(events: list[str]) -> None:
    c = SyncRpcClient("127.0.0.1", 1, poll_s=0.02)
    c._sent_at = time.monotonic()
    t0 = time.monotonic()
    sock = FakeSock(events, ready_at=10**9)
    assert c._poll(sock, 64) is None            # the caller's receive then sleeps
    assert 0.02 <= time.monotonic() - t0 < 1.0
    assert sock.recvs >= 1 and events[0] == "yield"


def test_send_stamps_the_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """``_sent_at`` is taken just before each request goes out."""
    c = SyncRpcClient("127.0.0.1", 1)
    sent: list[bytes] = []

    class Sock:
        def sendall(self, data: bytes) -> None:
            sent.append(data)

    c._sock = Sock()  # type: ignore[assignment]
    c._sock_timeout = c.timeout_s
    before = time.monotonic()
    c._send("ping", None, c.timeout_s)
    assert sent and before <= c._sent_at <= time.monotonic()
