"""A leader cut off from etcd (a partition, not a crash) stops serving before its
successor starts, and refuses every write afterwards (real etcd; the leader reaches it
through a proxy that starts dropping every byte)."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid

from pymooncake.rpc import RpcClient, RpcError
from pymooncake.store.config import MasterConfig
from pymooncake.store.master.ha import HaConfig
from pymooncake.store.master.service import MasterService


class _Blackhole:
    """A TCP proxy to ``target``; after ``cut()`` it keeps every connection open but
    forwards nothing (packets lost, as in a partition)."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.cut_at: float | None = None
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._on_conn, "127.0.0.1", 0)
        return self._server.sockets[0].getsockname()[1]

    def cut(self) -> None:
        self.cut_at = time.monotonic()

    async def _pipe(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        with contextlib.suppress(Exception):
            while data := await r.read(65536):
                if self.cut_at is None:
                    w.write(data)
                    await w.drain()

    async def _on_conn(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        if self.cut_at is not None:
            await asyncio.sleep(3600)  # a new connection hangs too
        ur, uw = await asyncio.open_connection(*self.target)
        for t in (self._pipe(r, uw), self._pipe(ur, w)):
            task = asyncio.ensure_future(t)
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        if self._server is not None:
            self._server.close()


def test_partitioned_leader_stops_before_its_successor_and_refuses_writes(
        etcd_url: str) -> None:
    host, port = etcd_url[len("etcd://"):].split(":")

    async def main() -> None:
        proxy = _Blackhole((host, int(port)))
        pport = await proxy.start()
        cluster = f"p-{uuid.uuid4().hex[:8]}"
        a = MasterService(MasterConfig(port=0),
                          ha=HaConfig(f"etcd://127.0.0.1:{pport}", cluster, lease_ttl_s=2.0))
        await a.start()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        while not (a.ha and a.ha.leading):
            assert loop.time() < deadline
            await asyncio.sleep(0.02)
        b = MasterService(MasterConfig(port=0),
                          ha=HaConfig(etcd_url, cluster, lease_ttl_s=2.0))
        await b.start()
        rpc_a = RpcClient("127.0.0.1", a.port, timeout_s=10.0)
        try:
            await rpc_a.call("mount_segment", {"client_id": "w", "segment": "S", "host": "h",
                                               "base_addr": 4096, "size_bytes": 1 << 20})
            proxy.cut()
            a_last_leading = b_first_leading = None
            deadline = loop.time() + 15
            while b_first_leading is None:
                assert loop.time() < deadline, "the successor never took over"
                now = time.monotonic()
                if a.ha.leading:
                    a_last_leading = now
                if b.ha.leading:
                    b_first_leading = now
                await asyncio.sleep(0.005)
            assert a_last_leading is not None and a_last_leading < b_first_leading
            assert not a.ha.leading
            # the successor serves what the old leader journaled (the mounted segment)
            rpc_b = RpcClient("127.0.0.1", b.port)
            h = await rpc_b.call("put_start", {"client_id": "w", "key": "y", "size_bytes": 64,
                                               "config": None})
            assert h["replicas"][0]["segment"] == "S"
            await rpc_b.close()
            # the cut-off master refuses every write from now on, at once
            for i in range(5):
                t0 = time.monotonic()
                try:
                    await rpc_a.call("put_start", {"client_id": "w", "key": f"x{i}",
                                                   "size_bytes": 64, "config": None})
                    raise AssertionError("the partitioned master accepted a write")
                except RpcError as e:
                    assert e.code == "UNAVAILABLE_IN_CURRENT_STATUS"
                assert time.monotonic() - t0 < 2.0
                await asyncio.sleep(0.1)
        finally:
            await rpc_a.close()
            await b.stop()
            await asyncio.wait_for(a.stop(), 30)
            await proxy.close()

    asyncio.run(main())
