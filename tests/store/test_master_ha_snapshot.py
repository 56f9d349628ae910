"""HA masters in one process on embedded metadata: snapshots trim the journal, and both a
master started after the trim restores every object from snapshot +
log."""

from __future__ import annotations

import asyncio
import uuid

from pymooncake.metadata import open_metadata
from pymooncake.rpc import RpcClient, RpcError
from pymooncake.store.config import MasterConfig
from pymooncake.store.master.ha import HaConfig, HaKeys
from pymooncake.store.master.service import MasterService


async def _leader(services: list[MasterService], timeout_s: float = 10.0) -> MasterService:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while loop.time() < deadline:
        for s in services:
            if s.ha is not None and s.ha.leading:
                return s
        await asyncio.sleep(0.02)
    raise TimeoutError("no leader")


def test_snapshots_trim_the_log_and_every_master_restores_from_them() -> None:
    async def main() -> None:
        name = f"snap-{uuid.uuid4().hex[:8]}"
        cfg = HaConfig(f"embedded://{name}", cluster_id="c", lease_ttl_s=1.0,
                       snapshot_every=8)
        a = MasterService(MasterConfig(port=0), ha=cfg)
        b = MasterService(MasterConfig(port=0), ha=cfg)
        await a.start()
        await b.start()
        c = None
        try:
            lead = await _leader([a, b])
            rpc = RpcClient("127.0.0.1", lead.port)
            await rpc.call("mount_segment", {"client_id": "w", "segment": "S", "host": "h",
                                             "base_addr": 1 << 20, "size_bytes": 64 << 20})
            gens = {}
            for i in range(40):
                h = await rpc.call("put_start", {"client_id": "w", "key": f"k{i}",
                                                 "size_bytes": 4096, "config": None})
                await rpc.call("put_end", {"client_id": "w", "key": f"k{i}",
                                           "generation": h["generation"]})
                gens[f"k{i}"] = h["generation"]
            await rpc.call("remove", {"client_id": "w", "key": "k0", "force": False})
            await rpc.close()
            md = open_metadata(f"embedded://{name}")
            keys = HaKeys.of("c")
            head = int((await md.get(keys.head)).value)
            log = await md.get_prefix(keys.log)
            assert head >= 81 and 0 < len(log) <= 8  # trimmed up to the last snapshot
            assert await md.get(keys.snapshot) is not None
            # a master that starts now finds only snapshot + tail, and must lead
            c = MasterService(MasterConfig(port=0), ha=cfg)
            await c.start()
            await (b if lead is a else a).stop()
            await lead.ha.election.abandon()  # the leader "freezes": its lease runs out
            new = await _leader([c])
            assert not lead.ha.leading
            await lead.stop()
            rpc = RpcClient("127.0.0.1", new.port)
            assert sorted(await rpc.call("list_keys")) == sorted(f"k{i}" for i in range(1, 40))
            r = await rpc.call("get_replica_list", {"client_id": "w", "key": "k39"})
            assert r["generation"] == gens["k39"] and r["size_bytes"] == 4096
            try:
                await rpc.call("get_replica_list", {"client_id": "w", "key": "k0"})
                raise AssertionError("k0 was removed before the fail-over")
            except RpcError as e:
                assert e.code == "OBJECT_NOT_FOUND"
            await rpc.close()
        finally:
            for s in (a, b, c):
                if s is not None:
                    await s.stop()

    asyncio.run(main())
