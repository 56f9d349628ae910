"""BUG-58 step 6: the Conductor's store-tier view is dropped on a change of the Store's
master leader (watched in a real etcd) and rebuilt from the KV events that follow."""

from __future__ import annotations

import asyncio
import uuid

import msgpack
import pytest

from pymooncake.conductor.config import ConductorConfig
from pymooncake.conductor.service import Conductor
from pymooncake.conductor.store_leader import parse_store_master
from pymooncake.metadata import open_metadata
from pymooncake.rpc.messages import KVEvents


async def _until(pred, timeout_s: float = 5.0) -> None:  # noqa: ANN001
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not pred():
        assert loop.time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


def test_store_view_is_rebuilt_on_a_store_leader_change(etcd_url: str) -> None:
    cluster = f"c-{uuid.uuid4().hex[:8]}"
    key = f"pymooncake/store/{cluster}/leader"

    async def main() -> None:
        md = open_metadata(etcd_url)
        await md.put(key, msgpack.packb({"addr": "127.0.0.1:1", "id": "m1"}))
        cond = Conductor(ConductorConfig(store_master=f"{etcd_url}/{cluster}"))
        await cond.start()
        try:
            await asyncio.sleep(0.3)  # the watch has seen leader m1
            cond._kv_events(KVEvents("store", stored=("a", "b", "c")))
            assert cond.state.store_keys == {"a", "b", "c"}
            assert "store" in cond.state.index.holders("b")
            # the same leader re-announced (a keep-alive does not rewrite it): no change
            await asyncio.sleep(0.2)
            assert cond.state.store_keys == {"a", "b", "c"}
            # fail-over: the key expires, then m2 takes it
            await md.delete(key)
            await md.put(key, msgpack.packb({"addr": "127.0.0.1:2", "id": "m2"}))
            await _until(lambda: not cond.state.store_keys)
            assert cond.state.index.holders("b") == frozenset()
            # events after the change rebuild the view from what the new leader has
            cond._kv_events(KVEvents("store", stored=("b",)))
            assert cond.state.store_keys == {"b"} and "store" in cond.state.index.holders("b")
        finally:
            await cond.stop()
            await md.delete(key)
            await md.close()

    asyncio.run(main())


def test_store_master_address_is_checked() -> None:
    assert parse_store_master("etcd://h:1/blue") == ("etcd://h:1", "pymooncake/store/blue/leader")
    assert parse_store_master("etcd://h:1")[1] == "pymooncake/store/default/leader"
    for bad in ("h:1", "etcd://", "http://h:1/x", "etcd://h:1/a/b"):
        with pytest.raises(ValueError, match="store_master"):
            ConductorConfig(store_master=bad)
