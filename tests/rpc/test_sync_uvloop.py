"""``SyncRpcClient`` against a uvloop RPC server process (the master's setting):
kernel-side timeouts, pipelined frames, the reply poll and ``begin``/``finish``."""

from __future__ import annotations

import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time

import msgpack
import pytest

from pymooncake.rpc import ErrorCode, RpcConnectionError, RpcError, RpcTimeout, SyncRpcClient

UVLOOP_SERVER_SCRIPT = textwrap.dedent("""
    import asyncio, uvloop
    from pymooncake.rpc import RpcServer
    async def later(p):
        await asyncio.sleep(0.05)
        return p + 1
    async def sleep(p):
        await asyncio.sleep(p)
        return "slept"
    async def main():
        s = RpcServer("127.0.0.1", 0)
        s.register("mul", lambda p: p[0] * p[1])
        # a plain handler whose slow path is a coroutine (as the master's put_start)
        s.register("maybe_later", lambda p: p + 1 if p >= 0 else later(p))
        s.register("sleep", sleep)
        await s.start()
        print(s.port, flush=True)
        await s.serve_forever()
    uvloop.run(main())
""")


def test_sync_client_timeouts_and_pipelined_frames_on_uvloop() -> None:
    """The master's setting (uvloop): kernel-side timeouts of ``SyncRpcClient`` (set per
    call, the connection dropped and re-made after one), a plain handler answering through
    a coroutine, and several frames in one segment each answered."""
    proc = subprocess.Popen([sys.executable, "-c", UVLOOP_SERVER_SCRIPT],
                            stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())
        client = SyncRpcClient("127.0.0.1", port, timeout_s=5)
        assert client.call("maybe_later", 4) == 5          # inline
        assert client.call("maybe_later", -4) == -3        # through the coroutine
        t0 = time.monotonic()
        with pytest.raises(RpcTimeout):
            client.call("sleep", 2.0, timeout_s=0.3)
        assert 0.25 < time.monotonic() - t0 < 1.5
        # the late answer of the timed-out call is not taken for the next call's
        assert client.call("mul", [6, 7], timeout_s=5) == 42
        assert client.call("sleep", 0.4) == "slept"        # back at the 5 s default
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            frames = b"".join(
                struct.pack(">I", len(b)) + b for b in (
                    msgpack.packb({"i": i, "m": "mul", "p": [i, 10]}) for i in range(1, 4)))
            s.sendall(frames)
            buf = b""
            got = {}
            while len(got) < 3:
                buf += s.recv(65536)
                while len(buf) >= 4 and len(buf) >= 4 + struct.unpack(">I", buf[:4])[0]:
                    n = struct.unpack(">I", buf[:4])[0]
                    msg = msgpack.unpackb(buf[4:4 + n])
                    got[msg["i"]] = msg["r"]
                    buf = buf[4 + n:]
            assert got == {1: 10, 2: 20, 3: 30}
        client.close()
    finally:
        proc.kill()
        proc.wait(10)


def test_sync_client_polls_for_quick_answers_and_falls_back_to_sleeping() -> None:
    """``SyncRpcClient`` polls ``poll_s`` for an answer before its receive sleeps (issue
    16): an answer inside the window, one after it, a timeout longer than the window, a
    server gone while polling, and no polling at all all give what the sleeping receive
    gives."""
    proc = subprocess.Popen([sys.executable, "-c", UVLOOP_SERVER_SCRIPT],
                            stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())
        wide = SyncRpcClient("127.0.0.1", port, timeout_s=5, poll_s=0.5)
        assert wide.call("maybe_later", -4) == -3        # 50 ms later: inside the window
        assert wide.call("sleep", 0.6) == "slept"        # past the window: slept for it
        narrow = SyncRpcClient("127.0.0.1", port, timeout_s=5, poll_s=0.0)
        assert [narrow.call("mul", [i, 3]) for i in range(20)] == [3 * i for i in range(20)]
        t0 = time.monotonic()
        with pytest.raises(RpcTimeout):
            wide.call("sleep", 2.0, timeout_s=0.7)        # the window, then the timeout
        assert 0.65 < time.monotonic() - t0 < 2.0
        assert wide.call("mul", [6, 7]) == 42
        t0 = time.monotonic()
        threading.Timer(0.1, proc.kill).start()
        with pytest.raises(RpcConnectionError):
            wide.call("sleep", 5.0)                       # the server dies mid-window
        assert time.monotonic() - t0 < 2.0
        wide.close()
        narrow.close()
    finally:
        proc.kill()
        proc.wait(10)


def test_sync_client_begin_sends_now_and_finish_takes_the_answer() -> None:
    """``SyncRpcClient.begin`` sends at once and ``finish`` blocks for the answer (a Store
    get reads its bytes in between, issue 16): the server works while the caller does,
    errors and timeouts come from ``finish`` as from ``call``, and the client is usable
    again after each (its lock released on every path)."""
    proc = subprocess.Popen([sys.executable, "-c", UVLOOP_SERVER_SCRIPT],
                            stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())
        client = SyncRpcClient("127.0.0.1", port, timeout_s=5)
        t0 = time.monotonic()
        finish = client.begin("sleep", 0.3)
        time.sleep(0.3)                                  # the caller's own work meanwhile
        assert finish() == "slept"
        assert time.monotonic() - t0 < 0.55              # overlapped, not 0.3 + 0.3
        assert client.begin("mul", [6, 7])(int) == 42    # typed as call's reply_type
        finish = client.begin("nope")
        with pytest.raises(RpcError) as e:
            finish()
        assert e.value.code == ErrorCode.UNKNOWN_METHOD
        finish = client.begin("sleep", 2.0, timeout_s=0.3)
        with pytest.raises(RpcTimeout):
            finish()
        assert client.call("mul", [3, 3]) == 9           # reconnected, lock free
        client.close()
    finally:
        proc.kill()
        proc.wait(10)
