"""BUG-64: the data port trusts no address or length a peer sends, and no half-sent request
holds a thread. A raw client (not our sender) speaks the wire format to engine B."""

from __future__ import annotations

import hashlib
import itertools
import os
import socket
import threading
import time

import numpy as np
import pytest

from pymooncake.transfer import (
    StatusCode,
    TransferConfig,
    TransferEngine,
    TransferOp,
    TransferRequest,
)
from pymooncake.transfer.transports.wire import (
    FLAG_CLOSING,
    REP,
    REP_MAGIC,
    REQ,
    REQ_MAGIC,
    ST_INVALID,
    ST_OK,
)

_ns = itertools.count()
KiB, MiB = 1 << 10, 1 << 20
READ_TIMEOUT_S = 0.5


@pytest.fixture
def pair():  # noqa: ANN201
    url = f"embedded://untrusted-{next(_ns)}"
    cfg = TransferConfig(slice_timeout_s=READ_TIMEOUT_S, num_paths=1)
    a = TransferEngine("a", url, config=cfg).start()
    b = TransferEngine("b", url, config=cfg).start()
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def _header(op: int, addr: int, length: int, seq: int = 1) -> bytes:
    return REQ.pack(REQ_MAGIC, op, 0, 0, seq, addr, length, 0)


def _reply(s: socket.socket) -> tuple[int, int, str]:
    """(status, flags, message) of one reply (no READ payload)."""
    buf = b""
    while len(buf) < REP.size:
        chunk = s.recv(REP.size - len(buf))
        assert chunk, "server closed before replying"
        buf += chunk
    magic, status, flags, msg_len, _, _, _ = REP.unpack(buf)
    assert magic == REP_MAGIC
    msg = b""
    while len(msg) < msg_len:
        msg += s.recv(msg_len - len(msg))
    return status, flags, msg.decode()


def _closed_by_server(s: socket.socket, within_s: float) -> bool:
    s.settimeout(within_s)
    try:
        while True:
            if s.recv(4096) == b"":
                return True
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _conn_threads(port: int) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == f"tcp-data-conn-{port}"]


def _sha(a: np.ndarray) -> str:
    return hashlib.sha256(a.tobytes()).hexdigest()


def test_bug_64_peer_supplied_address_and_length_are_checked(pair) -> None:  # noqa: ANN001
    a, b = pair
    region = np.random.default_rng(64).integers(0, 256, MiB, dtype=np.uint8)
    base = b.register_memory(region)
    port = b.tcp_port
    payload = np.random.default_rng(65).integers(0, 256, 4 * KiB, dtype=np.uint8).tobytes()

    # (a) a valid WRITE of 4 KiB to base: byte-exact.
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(_header(1, base, 4 * KiB) + payload)
        assert _reply(s)[0] == ST_OK
    assert region[:4 * KiB].tobytes() == payload
    outside = _sha(region[4 * KiB:])

    rss0 = _rss_bytes()
    refused = {
        "b": (_header(1, base + MiB - 100, 4 * KiB) + payload, "outside every registered"),
        "c": (_header(0, 0x10_0000_0000, 4 * KiB), "outside every registered"),
        "d": (_header(0, base, 1 << 40), "exceeds the limit"),
        "e": (_header(0, (1 << 64) - 100, 4 * KiB), "overflows 64 bits"),
    }
    for case, (frame, reason) in refused.items():
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(frame)
            status, flags, msg = _reply(s)
            assert (status, case) == (ST_INVALID, case) and flags & FLAG_CLOSING, msg
            assert reason in msg, (case, msg)
            assert _closed_by_server(s, 2.0), f"({case}) the session stayed open"
    # (d) allocated nothing in proportion to 2^40 bytes; nothing outside (a) was touched.
    assert _rss_bytes() - rss0 < MiB
    assert _sha(region[4 * KiB:]) == outside

    # (f) half-sent requests are dropped after the read deadline, held open or closed;
    # meanwhile B serves everyone else.
    src = np.random.default_rng(66).integers(0, 256, 64 * KiB, dtype=np.uint8)
    src_addr = a.register_memory(src)
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(_header(1, base, 4 * KiB)[:10])  # truncated header, connection kept open
        st = a.transfer_sync(TransferOp.WRITE, src_addr, "b", base + 32 * KiB, 4 * KiB)
        assert st.ok and time.monotonic() - t0 < READ_TIMEOUT_S, st
        assert _closed_by_server(s, 5 * READ_TIMEOUT_S)
    assert time.monotonic() - t0 < 5 * READ_TIMEOUT_S
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(_header(1, base + 8 * KiB, 4 * KiB) + payload[:1000])  # short body, open
        assert _closed_by_server(s, 5 * READ_TIMEOUT_S)
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(_header(1, base, 4 * KiB)[:10])  # truncated header, then close
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(_header(1, base + 16 * KiB, 4 * KiB) + payload[:1000])  # short body, close
    # Partial bodies land only inside their declared, registered slice.
    mask = np.ones(MiB, dtype=bool)
    mask[:4 * KiB] = mask[8 * KiB:12 * KiB] = mask[16 * KiB:20 * KiB] = False
    mask[32 * KiB:36 * KiB] = False  # A's write while the half header was held
    before = np.random.default_rng(64).integers(0, 256, MiB, dtype=np.uint8)
    assert np.array_equal(region[mask], before[mask])

    # One second later the raw sessions' threads are gone (what is left serves A's one
    # pooled connection, idle) and the process is idle, not spinning.
    deadline = time.monotonic() + 3 * READ_TIMEOUT_S
    while len(_conn_threads(port)) > 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(_conn_threads(port)) == 1
    cpu0 = time.process_time()
    time.sleep(1.0)
    assert time.process_time() - cpu0 < 0.2

    # (g) a normal engine transfer from A still works.
    st = a.transfer_sync(TransferOp.WRITE, src_addr, "b", base + 64 * KiB, 64 * KiB)
    assert st.ok, st
    assert np.array_equal(region[64 * KiB:128 * KiB], src)


def test_refusal_mid_window_fails_only_that_request(pair) -> None:  # noqa: ANN001
    """The target refuses one slice of a pipelined window and hangs up: that request
    fails INVALID_ARGUMENT, the rest of the window is re-sent and lands exactly."""
    a, b = pair
    keep = np.zeros(MiB, dtype=np.uint8)
    gone = np.zeros(MiB, dtype=np.uint8)
    kaddr, gaddr = b.register_memory(keep), b.register_memory(gone)
    src = np.random.default_rng(7).integers(0, 256, 64 * KiB, dtype=np.uint8)
    saddr = a.register_memory(src)
    assert a.transfer_sync(TransferOp.WRITE, saddr, "b", gaddr, 16).ok  # cache B's buffers
    stale = a._peers["b"]
    b.unregister_memory(gaddr)
    deadline = time.monotonic() + 2.0
    while a._peers.get("b") is stale and time.monotonic() < deadline:
        time.sleep(0.01)  # let A's segment watch see the change, then undo it:
    a._peers["b"] = stale  # A still believes in the buffer; only B's check can refuse
    reqs = [TransferRequest(TransferOp.WRITE, saddr + i * 4 * KiB, "b",
                            (gaddr if i == 2 else kaddr) + i * 4 * KiB, 4 * KiB)
            for i in range(8)]
    st = a.batch_transfer_sync(reqs)
    assert [s.code for s in st] == [StatusCode.OK] * 2 + [StatusCode.INVALID_ARGUMENT] + \
        [StatusCode.OK] * 5
    assert "refused by target" in st[2].reason
    for i in (0, 1, 3, 4, 5, 6, 7):
        assert np.array_equal(keep[i * 4 * KiB:(i + 1) * 4 * KiB],
                              src[i * 4 * KiB:(i + 1) * 4 * KiB])
    assert not gone[16:].any()  # only the 16 bytes written while it was registered
