"""RPC layer: round trips, typed params, errors, malformed frames, timeouts, processes."""

from __future__ import annotations

import asyncio
import socket
import struct
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass

import msgpack
import pytest

from pymooncake.rpc import (
    ErrorCode,
    RpcClient,
    RpcConnectionError,
    RpcError,
    RpcServer,
    RpcTimeout,
    SyncRpcClient,
    from_wire,
    to_wire,
)


@dataclass(frozen=True, slots=True)
class PutParams:
    key: str
    size_bytes: int
    replicas: tuple[str, ...] = ()
    tag: str | None = None


def make_server() -> RpcServer:
    server = RpcServer("127.0.0.1", 0)
    server.register("echo", lambda p: p)
    server.register("add", lambda p: p["a"] + p["b"])
    server.register("put", lambda p: {"key": p.key, "n": p.size_bytes * len(p.replicas)},
                    params_type=PutParams)

    def fail(p):
        raise RpcError("NO_SPACE", "segment full", {"free": 3})

    def crash(p):
        raise KeyError("boom")

    async def slow(p):
        await asyncio.sleep(p)
        return "done"

    server.register("fail", fail)
    server.register("crash", crash)
    server.register("slow", slow)
    return server


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_round_trip_and_typed_params() -> None:
    async def main() -> None:
        server = make_server()
        await server.start()
        client = RpcClient("127.0.0.1", server.port)
        try:
            assert await client.call("echo", {"x": b"\x00\xff", "y": [1, 2.5, None]}) == {
                "x": b"\x00\xff", "y": [1, 2.5, None]}
            assert await client.call("add", {"a": 2, "b": 40}) == 42
            got = await client.call("put", PutParams("k", 10, ("s1", "s2")))
            assert got == {"key": "k", "n": 20}
            # many calls in flight on one connection, answered out of order
            results = await asyncio.gather(
                client.call("slow", 0.2), *(client.call("add", {"a": i, "b": i})
                                            for i in range(100)))
            assert results[0] == "done" and results[1:] == [2 * i for i in range(100)]
        finally:
            await client.close()
            await server.stop()

    run(main())


def test_notify_now_sends_on_the_open_connection_in_order() -> None:
    """``notify_now`` writes at once on an open connection (True) and sends nothing
    without one (False): the notices arrive in order with ``notify``'s and before a call
    made after them; an oversized frame raises as ``notify`` does."""
    from pymooncake.rpc.codec import MAX_FRAME_BYTES

    async def main() -> None:
        server = make_server()
        got: list[int] = []
        server.register("note", got.append)
        await server.start()
        client = RpcClient("127.0.0.1", server.port)
        try:
            assert client.notify_now("note", 0) is False     # not connected: nothing sent
            await client.notify("note", 1)                   # connects
            assert [client.notify_now("note", i) for i in range(2, 50)] == [True] * 48
            await client.notify("note", 50)
            assert await client.call("echo", "after") == "after"
            assert got == list(range(1, 51))
            with pytest.raises(ValueError, match="MAX_FRAME_BYTES"):
                client.notify_now("note", b"x" * MAX_FRAME_BYTES)
            await client.close()
            assert client.notify_now("note", 99) is False    # closed: nothing sent
            assert got == list(range(1, 51))
        finally:
            await client.close()
            await server.stop()

    run(main())


@pytest.mark.parametrize("params, fragment", [
    ({"key": "k"}, "missing field 'size_bytes'"),
    ({"key": "k", "size_bytes": "ten"}, "PutParams.size_bytes: expected int"),
    ({"key": "k", "size_bytes": 1, "bogus": 1}, "unknown field(s) ['bogus']"),
    ({"key": "k", "size_bytes": 1, "replicas": [1]}, "PutParams.replicas[0]: expected str"),
    ([1, 2], "expected a map"),
])
def test_bad_params_are_invalid_argument(params, fragment) -> None:
    async def main() -> None:
        server = make_server()
        await server.start()
        client = RpcClient("127.0.0.1", server.port)
        try:
            with pytest.raises(RpcError) as e:
                await client.call("put", params)
            assert e.value.code == ErrorCode.INVALID_ARGUMENT
            assert fragment in e.value.message
            assert await client.call("add", {"a": 1, "b": 1}) == 2  # connection still fine
        finally:
            await client.close()
            await server.stop()

    run(main())


def test_errors_propagate_with_codes() -> None:
    async def main() -> None:
        server = make_server()
        await server.start()
        client = RpcClient("127.0.0.1", server.port, timeout_s=0.2)
        try:
            with pytest.raises(RpcError) as e:
                await client.call("fail")
            assert (e.value.code, e.value.message, e.value.data) == (
                "NO_SPACE", "segment full", {"free": 3})
            with pytest.raises(RpcError) as e:
                await client.call("crash")
            assert e.value.code == ErrorCode.INTERNAL and "KeyError" in e.value.message
            with pytest.raises(RpcError) as e:
                await client.call("nope")
            assert e.value.code == ErrorCode.UNKNOWN_METHOD
            t0 = time.monotonic()
            with pytest.raises(RpcTimeout):
                await client.call("slow", 5)
            assert time.monotonic() - t0 < 2
            assert await client.call("echo", 7) == 7
        finally:
            await client.close()
            await server.stop()

    run(main())


def _raw_frame(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


def _read_frame(sock: socket.socket):
    hdr = sock.recv(4, socket.MSG_WAITALL)
    (n,) = struct.unpack(">I", hdr)
    return msgpack.unpackb(sock.recv(n, socket.MSG_WAITALL), raw=False)


def test_malformed_frames_do_not_disturb_other_clients() -> None:
    async def main() -> None:
        server = make_server()
        await server.start()
        good = RpcClient("127.0.0.1", server.port)
        try:
            def attack() -> list:
                replies = []
                with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
                    s.sendall(_raw_frame(b"\xc1\xc1garbage"))          # not msgpack
                    replies.append(_read_frame(s))
                    s.sendall(_raw_frame(msgpack.packb([1, 2, 3])))     # not a map
                    replies.append(_read_frame(s))
                    s.sendall(_raw_frame(msgpack.packb({"i": "x", "m": "echo"})))  # bad id
                    replies.append(_read_frame(s))
                    s.sendall(_raw_frame(msgpack.packb({"i": 5, "m": "echo", "p": 1})))
                    replies.append(_read_frame(s))                       # still served
                with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
                    s.sendall(struct.pack(">I", 2**31))                  # absurd length
                    replies.append(_read_frame(s))
                    assert s.recv(1) == b""                              # then closed
                return replies

            replies = await asyncio.to_thread(attack)
            assert [r.get("e", {}).get("c") for r in replies] == [
                "MALFORMED_FRAME", "MALFORMED_FRAME", "MALFORMED_FRAME", None,
                "MALFORMED_FRAME"]
            assert replies[3] == {"i": 5, "r": 1}
            # the reply names what was wrong with the frame, not just that it was
            assert replies[0]["e"]["s"] == (
                "malformed msgpack frame of 9 bytes, starting c1 c1 67 61 72 62 61 67: "
                "FormatError (a byte that begins no msgpack value)"), replies[0]
            assert await good.call("add", {"a": 20, "b": 22}) == 42
        finally:
            await good.close()
            await server.stop()

    run(main())


def test_connection_errors() -> None:
    async def main() -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            free_port = s.getsockname()[1]
        client = RpcClient("127.0.0.1", free_port, connect_timeout_s=1)
        with pytest.raises(RpcConnectionError):
            await client.call("echo", 1)
        server = make_server()
        await server.start()
        client = RpcClient("127.0.0.1", server.port)
        fut = asyncio.ensure_future(client.call("slow", 10, timeout_s=20))
        await asyncio.sleep(0.2)
        await server.stop()
        with pytest.raises(RpcConnectionError):
            await fut
        await client.close()

    run(main())


SERVER_SCRIPT = textwrap.dedent("""
    import asyncio, sys
    from pymooncake.rpc import RpcServer
    async def main():
        s = RpcServer("127.0.0.1", 0)
        s.register("mul", lambda p: p[0] * p[1])
        await s.start()
        print(s.port, flush=True)
        await s.serve_forever()
    asyncio.run(main())
""")


def test_sync_client_against_server_process() -> None:
    proc = subprocess.Popen([sys.executable, "-c", SERVER_SCRIPT], stdout=subprocess.PIPE,
                            text=True)
    try:
        port = int(proc.stdout.readline())
        client = SyncRpcClient("127.0.0.1", port, timeout_s=5)
        assert [client.call("mul", [i, 3]) for i in range(50)] == [3 * i for i in range(50)]
        with pytest.raises(RpcError) as e:
            client.call("mul", [1])
        assert e.value.code == ErrorCode.INTERNAL and "IndexError" in e.value.message
        proc.kill()
        proc.wait(10)
        with pytest.raises(RpcConnectionError):
            client.call("mul", [2, 2])
        client.close()
    finally:
        proc.kill()
        proc.wait(10)


def test_wire_conversion_round_trip() -> None:
    p = PutParams("key", 4096, ("a", "b"), None)
    wire = to_wire(p)
    assert wire == {"key": "key", "size_bytes": 4096, "replicas": ["a", "b"], "tag": None}
    assert from_wire(PutParams, msgpack.unpackb(msgpack.packb(wire), raw=False)) == p


@dataclass(frozen=True)
class Windows:
    windows: tuple[tuple[str, float, float], ...] = ()
    pair: tuple[int, str] | None = None


def test_fixed_length_tuple_fields_keep_their_values() -> None:
    """A fixed-length tuple hint converts each value with its own item type (a swapped zip
    once returned the hint's types instead of the values)."""
    w = Windows((("queue", 1.0, 2.5), ("prefill", 2, 3.0)), (7, "x"))
    got = from_wire(Windows, msgpack.unpackb(msgpack.packb(to_wire(w)), raw=False))
    assert got.windows == (("queue", 1.0, 2.5), ("prefill", 2.0, 3.0))
    assert isinstance(got.windows[1][1], float)
    assert got.pair == (7, "x")
    with pytest.raises(ValueError, match=r"Windows.windows\[0\]\[1\]: expected float"):
        from_wire(Windows, {"windows": [["queue", "soon", 2.0]]})
    with pytest.raises(ValueError, match="expected 3 items, got 2"):
        from_wire(Windows, {"windows": [["queue", 1.0]]})
