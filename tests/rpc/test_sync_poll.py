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


def test_a_fresh_call_hands_the_cpu_over_before_its_first_look(
        events: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    # "fresh" for a whole second: a loaded machine may stop this thread for longer than
    # LOOK_FIRST_S (25 us) between setting _sent_at and the look (CI run, 2 cores)
    monkeypatch.setattr(rpc_client, "LOOK_FIRST_S", 1.0)
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


def test_the_poll_ends_after_poll_s_without_an_answer(
        events: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rpc_client, "LOOK_FIRST_S", 1.0)  # fresh, however slow the machine
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


# -- the poll budget follows this client's answer time (issue 16, session 27) -------------

def test_the_poll_budget_is_four_answer_times_between_poll_s_and_the_cap(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rpc_client, "REPLY_POLL_MAX_S", 300e-6)
    c = SyncRpcClient("127.0.0.1", 1, poll_s=50e-6)
    assert c.poll_budget_s() == 50e-6                     # no answer yet
    for rtt, budget in ((5e-6, 50e-6),                    # 4 x 5 us < poll_s
                        (20e-6, 80e-6), (60e-6, 240e-6),
                        (100e-6, 300e-6),                 # 400 us, capped
                        (300e-6, 300e-6),                 # at the cap still polled
                        (301e-6, 50e-6), (2e-3, 50e-6)):  # slower answers: poll_s only
        c.rtt_s = rtt
        assert c.poll_budget_s() == pytest.approx(budget), rtt
    monkeypatch.setattr(rpc_client, "REPLY_POLL_MAX_S", 0.0)  # adaptation off
    c.rtt_s = 60e-6
    assert c.poll_budget_s() == 50e-6
    monkeypatch.setattr(rpc_client, "REPLY_POLL_MAX_S", 300e-6)
    off = SyncRpcClient("127.0.0.1", 1, poll_s=0.0)       # polling off stays off
    off.rtt_s = 60e-6
    assert off.poll_budget_s() == 0.0


def test_the_poll_lasts_the_budget(events: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """On a clock that each look moves on by 10 us, a never-answered poll looks budget /
    10 us times: 5 for ``poll_s`` (50 us), 30 for a 300 us budget."""
    import types
    now = [1000.0]   # the client module's clock only (not the process's time module)
    monkeypatch.setattr(rpc_client, "time", types.SimpleNamespace(monotonic=lambda: now[0]))

    class SlowSock(FakeSock):
        def recv(self, want: int, flags: int = 0) -> bytes:
            now[0] += 10e-6
            return super().recv(want, flags)

    monkeypatch.setattr(rpc_client, "REPLY_POLL_MAX_S", 300e-6)
    c = SyncRpcClient("127.0.0.1", 1, poll_s=50e-6)
    looks = {}
    for rtt in (0.0, 100e-6, 1e-3):
        c.rtt_s = rtt
        c._sent_at = now[0] - 1.0                         # out long: looks first
        sock = SlowSock(events, ready_at=10**9)
        assert c._poll(sock, 64) is None
        looks[rtt] = sock.recvs
    assert looks[0.0] == looks[1e-3] and looks[0.0] in (5, 6)  # (float rounding: +-1)
    assert looks[100e-6] in (30, 31)


def test_calls_keep_a_running_answer_time_and_begin_does_not() -> None:
    """Against a real server: the first call's answer time is the running mean; each next
    ``call`` moves it 1/8 of the way to its own; ``begin``/``finish`` (the caller works
    in between) leaves it."""
    import subprocess
    import sys

    from tests.rpc.test_sync_uvloop import UVLOOP_SERVER_SCRIPT  # serves "mul" and "sleep"
    proc = subprocess.Popen([sys.executable, "-c", UVLOOP_SERVER_SCRIPT],
                            stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())
        c = SyncRpcClient("127.0.0.1", port, timeout_s=5)
        assert c.rtt_s == 0.0
        assert c.call("sleep", 0.2) == "slept"
        first = c.rtt_s
        assert 0.2 <= first < 2.0
        t0 = time.monotonic()
        assert c.call("mul", [6, 7]) == 42
        dt = time.monotonic() - t0                        # >= this call's answer time
        assert first * 7 / 8 <= c.rtt_s <= first * 7 / 8 + dt / 8
        before = c.rtt_s
        finish = c.begin("sleep", 0.1)
        assert finish() == "slept"
        assert c.rtt_s == before
        c.close()
    finally:
        proc.kill()
        proc.wait(10)
