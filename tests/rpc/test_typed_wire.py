"""Typed messages on the wire (issue 16 item 5): ``rpc.Message`` params decoded straight
from the frame with every field checked, errors that name the field, typed replies,
golden bytes, and a server that keeps serving through malformed and oversized frames."""

from __future__ import annotations

import asyncio
import socket
import struct

import msgpack
import pytest

from pymooncake.rpc import (
    MAX_FRAME_BYTES,
    ErrorCode,
    Message,
    RpcClient,
    RpcError,
    RpcServer,
    SyncRpcClient,
    decode_as,
    encode,
)


class Item(Message):
    name: str
    size: int


class Params(Message):
    key: str
    size_bytes: int
    items: tuple[Item, ...] = ()
    tag: bytes | None = None

    def __post_init__(self) -> None:
        if self.size_bytes < 0:
            raise ValueError("size_bytes must be >= 0")


class Answer(Message):
    key: str
    total: int


def make_server() -> RpcServer:
    server = RpcServer("127.0.0.1", 0)
    server.register("put", lambda p: Answer(p.key, p.size_bytes + sum(i.size for i in p.items)),
                    params_type=Params)
    server.register("echo", lambda p: p)
    return server


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_golden_bytes_and_round_trip() -> None:
    """The wire form is msgpack maps of named fields, defaults left out: these exact bytes
    (what any msgpack reader decodes), and back to an equal message."""
    p = Params("k", 7, (Item("a", 1),))
    wire = encode(p)
    assert wire == bytes.fromhex(
        "83a36b6579a16baa73697a655f627974657307a56974656d739182a46e616d65a161a473697a6501")
    assert msgpack.unpackb(wire) == {"key": "k", "size_bytes": 7,
                                     "items": [{"name": "a", "size": 1}]}
    assert decode_as(Params, wire) == p
    full = Params("k", 0, (), b"\x00\xff")
    assert decode_as(Params, encode(full)) == full
    assert decode_as(Params, msgpack.packb({"key": "k", "size_bytes": 0, "tag": b"\x00\xff"},
                                           use_bin_type=True)) == full


@pytest.mark.parametrize("params, message", [
    ({"key": "k"}, "Params: Object missing required field `size_bytes`"),
    ({"key": "k", "size_bytes": "ten"}, "Params.size_bytes: Expected `int`, got `str`"),
    ({"key": "k", "size_bytes": True}, "Params.size_bytes: Expected `int`, got `bool`"),
    ({"key": "k", "size_bytes": 1, "bogus": 1}, "Params: Object contains unknown field `bogus`"),
    ({"key": "k", "size_bytes": 1, "items": [{"name": "a", "size": "x"}]},
     "Params.items[0].size: Expected `int`, got `str`"),
    ({"key": "k", "size_bytes": 1, "tag": "text"},
     "Params.tag: Expected `bytes | null`, got `str`"),
    ({"key": "k", "size_bytes": -1}, "Params: size_bytes must be >= 0"),
    ([1, 2], "Params: Expected `object`, got `array`"),
    (None, "Params: Expected `object`, got `None`"),
])
def test_bad_params_name_the_field_and_the_server_keeps_serving(params, message) -> None:
    async def main() -> None:
        server = make_server()
        await server.start()
        client = RpcClient("127.0.0.1", server.port)
        other = RpcClient("127.0.0.1", server.port)
        try:
            with pytest.raises(RpcError) as e:
                await client.call("put", params)
            assert e.value.code == ErrorCode.INVALID_ARGUMENT
            assert e.value.message == message
            # the same connection and every other one still served
            assert await client.call("put", Params("k", 1, (Item("a", 2),))) == {
                "key": "k", "total": 3}
            assert await other.call("put", {"key": "o", "size_bytes": 5}) == {
                "key": "o", "total": 5}
        finally:
            await client.close()
            await other.close()
            await server.stop()

    run(main())


def test_typed_replies() -> None:
    """``reply_type`` decodes the result as a message, checked field by field; a result of
    another shape is ``MALFORMED_FRAME`` naming the field, and the connection stays."""
    async def main() -> None:
        server = make_server()
        await server.start()
        client = RpcClient("127.0.0.1", server.port)
        try:
            got = await client.call("put", Params("k", 2), reply_type=Answer)
            assert got == Answer("k", 2) and isinstance(got, Answer)
            with pytest.raises(RpcError) as e:
                await client.call("echo", {"key": "k", "total": "x"}, reply_type=Answer)
            assert (e.value.code, e.value.message) == (
                ErrorCode.MALFORMED_FRAME, "Answer.total: Expected `int`, got `str`")
            assert await client.call("echo", [Answer("a", 1)], reply_type=list[Answer]) == [
                Answer("a", 1)]

            def sync() -> None:
                c = SyncRpcClient("127.0.0.1", server.port)
                try:
                    assert c.call("put", Params("s", 3), reply_type=Answer) == Answer("s", 3)
                    with pytest.raises(RpcError) as e:
                        c.call("echo", {"key": 1, "total": 1}, reply_type=Answer)
                    assert e.value.message == "Answer.key: Expected `str`, got `int`"
                    assert c.call("echo", 5) == 5
                finally:
                    c.close()

            await asyncio.to_thread(sync)
        finally:
            await client.close()
            await server.stop()

    run(main())


def _frame(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


def _read(sock: socket.socket) -> dict:
    (n,) = struct.unpack(">I", sock.recv(4, socket.MSG_WAITALL))
    return msgpack.unpackb(sock.recv(n, socket.MSG_WAITALL), raw=False)


def test_malformed_and_oversized_frames_against_a_typed_method() -> None:
    """Raw frames at a typed method: params of the wrong shape, bytes that are no msgpack,
    a request without a method, then a frame over ``MAX_FRAME_BYTES`` (refused, that
    connection closed): each answered with what is wrong, and a client on another
    connection is served throughout."""
    async def main() -> None:
        server = make_server()
        await server.start()
        good = RpcClient("127.0.0.1", server.port)
        try:
            def attack() -> list:
                out = []
                with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
                    s.sendall(_frame(msgpack.packb({"i": 1, "m": "put",
                                                    "p": {"key": 3, "size_bytes": 1}})))
                    out.append(_read(s))
                    s.sendall(_frame(b"\x83\xa1i\x02\xa1m\xa3put\xa1p\xc1"))  # bad params byte
                    out.append(_read(s))
                    s.sendall(_frame(msgpack.packb({"i": 3, "p": {}})))       # no method
                    out.append(_read(s))
                    s.sendall(_frame(msgpack.packb({"i": 4, "m": "put",
                                                    "p": {"key": "k", "size_bytes": 4}})))
                    out.append(_read(s))                                       # still served
                with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
                    s.sendall(struct.pack(">I", MAX_FRAME_BYTES + 1) + b"x" * 64)
                    out.append(_read(s))
                    assert s.recv(1) == b""                                    # then closed
                return out

            got = await asyncio.to_thread(attack)
            assert got[0] == {"i": 1, "e": {"c": "INVALID_ARGUMENT", "d": None,
                                            "s": "Params.key: Expected `str`, got `int`"}}
            assert got[1]["e"]["c"] == "MALFORMED_FRAME" and got[1]["i"] is None
            assert got[2]["e"] == {"c": "MALFORMED_FRAME", "d": None,
                                   "s": "a request is a map with a str 'm' (method)"}
            assert got[2]["i"] == 3
            assert got[3] == {"i": 4, "r": {"key": "k", "total": 4}}
            assert got[4]["e"]["c"] == "MALFORMED_FRAME"
            assert str(MAX_FRAME_BYTES + 1) in got[4]["e"]["s"]
            assert await good.call("put", Params("g", 9)) == {"key": "g", "total": 9}
        finally:
            await good.close()
            await server.stop()

    run(main())
