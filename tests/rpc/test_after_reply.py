"""``RpcServer.after_reply``: work a plain handler leaves for after its answer is written
(the master's ``remove`` frees its ranges so). The answer is on the caller's socket before
the work runs; the work has run before the server dispatches the next request, even one
that came in the same read; outside a read it runs at once; if it raises, the server logs
it and keeps serving."""

from __future__ import annotations

import asyncio
import contextlib
import socket

import msgpack

from pymooncake.rpc import RpcServer
from pymooncake.rpc.codec import HEADER, pack_frame
from pymooncake.store.config import MasterConfig
from pymooncake.store.master.service import MasterService

MiB = 1 << 20


def _frames(data: bytes) -> list[dict]:
    out, pos = [], 0
    while pos + HEADER.size <= len(data):
        (n,) = HEADER.unpack_from(data, pos)
        out.append(msgpack.unpackb(data[pos + HEADER.size:pos + HEADER.size + n]))
        pos += HEADER.size + n
    assert pos == len(data), "a partial frame"
    return out


async def _answers(sock: socket.socket, n: int) -> dict[int, dict]:
    """The next ``n`` answer frames on a non-blocking socket, by request id."""
    loop, data = asyncio.get_running_loop(), b""
    while True:
        got = {f["i"]: f for f in _frames(data)} if data else {}
        if len(got) >= n:
            return got
        data += await asyncio.wait_for(loop.sock_recv(sock, 1 << 16), 5)


def call(rid: int, m: str, **p: object) -> bytes:
    """One master request frame from client ``c``."""
    return pack_frame({"m": m, "i": rid, "p": {"client_id": "c", **p}})


def _connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setblocking(False)
    return sock


def test_after_reply_runs_after_the_answer_is_written_and_before_the_next_call() -> None:
    async def main() -> None:
        server = RpcServer("127.0.0.1", 0)
        state = {"x": 0}
        seen: list[object] = []
        sock: list[socket.socket] = []

        def later(v: int) -> None:
            try:  # the answer is already in the caller's receive buffer
                seen.append(_frames(sock[0].recv(1 << 16)))
            except BlockingIOError:
                seen.append("nothing written yet")
            state["x"] = v

        def set_later(v: int) -> str:
            server.after_reply(later, v)
            return "queued"

        def boom(_: object) -> None:
            raise RuntimeError("after the reply")

        def fail_later(_: object) -> str:
            server.after_reply(boom, None)
            return "ok"

        async def set_now(v: int) -> int:  # a coroutine handler: not inside a read
            server.after_reply(state.__setitem__, "x", v)
            return state["x"]

        def cancelled(_: object) -> None:  # not an Exception: the server's task ends it
            raise asyncio.CancelledError

        server.register("set_later", set_later)
        server.register("get", lambda _: state["x"])
        server.register("fail_later", fail_later)
        server.register("set_now", set_now)
        server.register("cancelled", cancelled)
        await server.start()
        try:
            sock.append(_connect(server.port))
            s = sock[0]
            s.send(pack_frame({"m": "set_later", "i": 1, "p": 7}))
            for _ in range(200):
                if seen:
                    break
                await asyncio.sleep(0.005)
            assert seen == [[{"i": 1, "r": "queued"}]]
            assert state["x"] == 7

            # two calls in one write, so in one read: the second sees the first's work
            s.send(pack_frame({"m": "set_later", "i": 2, "p": 9})
                   + pack_frame({"m": "get", "i": 3}))
            got = await _answers(s, 2)
            assert got[2]["r"] == "queued" and got[3]["r"] == 9
            # both answers went out in the read's one write, after the work had run
            assert seen[1] == "nothing written yet"

            # outside a read the work runs at once
            s.send(pack_frame({"m": "set_now", "i": 4, "p": 11}))
            assert (await _answers(s, 1))[4]["r"] == 11

            # work that raises is logged; the caller got its answer; the next call is served
            s.send(pack_frame({"m": "fail_later", "i": 5}) + pack_frame({"m": "get", "i": 6}))
            got = await _answers(s, 2)
            assert got[5]["r"] == "ok" and got[6]["r"] == 11
            s.send(pack_frame({"m": "get", "i": 7}))
            assert (await _answers(s, 1))[7]["r"] == 11

            # a plain handler that raised what is no Exception leaves the server deferring
            # nothing: a later coroutine handler's work still runs at once
            with contextlib.suppress(asyncio.CancelledError):
                server._dispatch(pack_frame({"m": "cancelled", "i": 8})[HEADER.size:],
                                 next(iter(server._conns)))
            s.send(pack_frame({"m": "set_now", "i": 9, "p": 13}))
            assert (await _answers(s, 1))[9]["r"] == 13
        finally:
            for x in sock:
                x.close()
            await server.stop()

    asyncio.run(asyncio.wait_for(main(), 30))


def test_master_remove_frees_before_the_next_call_in_the_same_read() -> None:
    """A 1 MiB segment holds one 1 MiB object, leased (so not evictable). ``remove``
    answers before its ranges are freed; an ``exist`` and a ``put_start`` of 1 MiB sent in
    the same write as the remove still find the key gone and the space free."""
    async def main() -> None:
        svc = MasterService(MasterConfig(port=0), tick_interval_s=3600)
        await svc.start()
        s = _connect(svc.port)
        try:
            s.send(call(1, "mount_segment", segment="S", host="h", base_addr=4096,
                        size_bytes=MiB)
                   + call(2, "put_start", key="a", size_bytes=MiB))
            got = await _answers(s, 2)
            assert "r" in got[1] and got[2]["r"]["replicas"][0]["segment"] == "S", got
            s.send(call(3, "put_end", key="a", generation=got[2]["r"]["generation"]))
            assert (await _answers(s, 1))[3]["r"] is True
            # a reader's lease keeps "a" from eviction: a second object finds no room
            s.send(call(40, "get_replica_list", key="a")
                   + call(4, "put_start", key="b", size_bytes=MiB))
            got = await _answers(s, 2)
            assert got[40]["r"]["size_bytes"] == MiB
            assert got[4]["e"]["c"] == "NO_AVAILABLE_HANDLE", got[4]

            s.send(call(5, "remove", key="a", force=True) + call(6, "exist", key="a")
                   + call(7, "put_start", key="b", size_bytes=MiB))
            got = await _answers(s, 3)
            assert got[5]["r"] is True and got[6]["r"] is False
            assert got[7]["r"]["replicas"][0]["addr"] == 4096
            # a remove refused (not found) changes nothing and frees nothing
            s.send(call(8, "remove", key="a") + call(9, "exist", key="b"))
            got = await _answers(s, 2)
            assert got[8]["e"]["c"] == "OBJECT_NOT_FOUND" and got[9]["r"] is False
        finally:
            s.close()
            await svc.stop()

    asyncio.run(asyncio.wait_for(main(), 30))


def test_master_remove_of_an_ssd_object_still_deletes_its_file() -> None:
    """The work after the answer carries out the remove's effects: an object whose only
    copy is on a holder's SSD is deleted there (``ssd_delete`` to the holder's RPC)."""
    async def main() -> None:
        holder = RpcServer("127.0.0.1", 0)
        deleted: list[str] = []

        def ssd_delete(p: dict) -> dict:
            deleted.extend(p["keys"])
            return {"ok": True}

        holder.register("ssd_delete", ssd_delete)
        await holder.start()
        svc = MasterService(MasterConfig(port=0), tick_interval_s=3600)
        await svc.start()
        s = _connect(svc.port)
        try:
            s.send(call(1, "mount_segment", segment="S", host="h", base_addr=4096,
                        size_bytes=MiB, ssd_capacity_bytes=MiB, rpc_host="127.0.0.1",
                        rpc_port=holder.port)
                   + call(2, "put_start", key="a", size_bytes=64))
            got = await _answers(s, 2)
            gen = got[2]["r"]["generation"]
            s.send(call(3, "put_end", key="a", generation=gen))
            assert (await _answers(s, 1))[3]["r"] is True
            # the holder spilled "a" to its SSD and dropped the DRAM copy
            assert svc.core.spill_done("a", gen, "S", True, now_ms=svc.now_ms())
            assert [r.tier for r in svc.core.objects.get("a").replicas] == ["ssd"]

            s.send(call(4, "remove", key="a"))
            assert (await _answers(s, 1))[4]["r"] is True
            for _ in range(500):
                if deleted:
                    break
                await asyncio.sleep(0.01)
            assert deleted == ["a"]
            assert svc.core.objects.get("a") is None and svc.core.ssd_used["S"] == 0
        finally:
            s.close()
            await svc.stop()
            await holder.stop()

    asyncio.run(asyncio.wait_for(main(), 30))
