"""The master's typed wire (issue 16 item 5): every hot call's params are ``store.protocol``
messages checked field by field as they are decoded — a malformed request is refused with
``INVALID_ARGUMENT`` naming the field while the master serves the others — and answers are
typed messages with named fields (replicas included), decoded as such by the client."""

from __future__ import annotations

import asyncio

import msgpack
import pytest

from pymooncake.rpc import RpcClient, RpcError, decode_as, encode
from pymooncake.store.checksum import digests
from pymooncake.store.client_master import MasterOps
from pymooncake.store.config import MasterConfig
from pymooncake.store.errors import ErrorCode, StoreError
from pymooncake.store.master.service import MasterService
from pymooncake.store.protocol import (
    ExistRequest,
    PutHandle,
    ReadAnswer,
    ReplicaDesc,
    ReplicaList,
)

BAD = [
    ("exist", {"client_id": "c", "key": 5}, "ExistRequest.key: Expected `str`, got `int`"),
    ("exist", {"client_id": "c", "key": "k", "exclude_segments": "s"},
     "ExistRequest.exclude_segments: Expected `array`, got `str`"),
    ("exist", {"key": "k"}, "ExistRequest: Object missing required field `client_id`"),
    ("batch_exist", {"client_id": "c", "keys": ["a", 2]},
     "BatchExistRequest.keys[1]: Expected `str`, got `int`"),
    ("get_replica_list", {"client_id": "c", "key": "k", "lease": 1},
     "KeyRequest: Object contains unknown field `lease`"),
    ("remove", {"client_id": "c", "key": "k", "force": 1},
     "RemoveRequest.force: Expected `bool`, got `int`"),
    ("put_start", {"client_id": "c", "key": "k", "size_bytes": 1.5},
     "PutStartRequest.size_bytes: Expected `int`, got `float`"),
    ("put_end", {"client_id": "c", "key": "k", "generation": 1, "checksum": "ab"},
     "PutEndRequest.checksum: Expected `bytes | null`, got `str`"),
    ("batch_put_end", {"client_id": "c", "keys": ["a"], "generations": [1, 2]},
     "BatchPutEndRequest: generations has 2 items for 1 keys"),
    ("batch_put_start", {"client_id": "c", "keys": ["a", "b"], "sizes_bytes": [1]},
     "BatchPutStartRequest: sizes_bytes has 1 items for 2 keys"),
]


def test_golden_request_and_answer_bytes() -> None:
    """What travels: maps of named fields, defaults left out (a replica on DRAM with its
    default status is four fields)."""
    assert encode(ExistRequest("c", "k")) == bytes.fromhex("82a9636c69656e745f6964a163a36b6579a16b")
    rl = ReplicaList("k", 4, 9, (ReplicaDesc(1, "S", 4096, 4),), 1000.0, b"\x01")
    wire = encode(rl)
    assert msgpack.unpackb(wire) == {
        "key": "k", "size_bytes": 4, "generation": 9, "lease_ttl_ms": 1000.0,
        "checksum": b"\x01",
        "replicas": [{"replica_id": 1, "segment": "S", "addr": 4096, "length": 4}]}
    assert decode_as(ReplicaList, wire) == rl
    item = decode_as(list[ReadAnswer], encode([{"r": rl}, {"e": [-704, "gone"]}]))
    assert item == [ReadAnswer(r=rl), ReadAnswer(e=(-704, "gone"))]


def test_malformed_master_requests_name_the_field() -> None:
    async def main() -> None:
        svc = MasterService(MasterConfig(port=0), tick_interval_s=3600)
        await svc.start()
        c = RpcClient("127.0.0.1", svc.port)
        other = RpcClient("127.0.0.1", svc.port)
        try:
            await c.call("mount_segment", {"client_id": "c", "segment": "S", "host": "h",
                                           "base_addr": 4096, "size_bytes": 1 << 20})
            h = await c.call("put_start", {"client_id": "c", "key": "k", "size_bytes": 64},
                             reply_type=PutHandle)
            assert isinstance(h, PutHandle) and h.replicas[0].segment == "S"
            sums = digests(bytes(64))
            assert await c.call("put_end", {"client_id": "c", "key": "k",
                                            "generation": h.generation, "checksum": sums})
            for method, params, message in BAD:
                with pytest.raises(RpcError) as e:
                    await c.call(method, params)
                assert (e.value.code, e.value.message) == ("INVALID_ARGUMENT", message)
                # the master serves this connection and the others
                assert await c.call("exist", ExistRequest("c", "k")) is True
                rl = await other.call("get_replica_list", {"client_id": "r", "key": "k"},
                                      reply_type=ReplicaList)
                assert (rl.size_bytes, rl.generation, rl.checksum) == (64, h.generation, sums)
                assert rl.replicas == (ReplicaDesc(h.replicas[0].replica_id, "S",
                                                   h.replicas[0].addr, 64, host="h"),)
            assert await c.call("exist", {"client_id": "c", "key": "k",
                                          "exclude_segments": ["S"]}) is False
            # batch_exist answers bare bools, a refused key its error (the client's
            # _batch_item reads both)
            got = await c.call("batch_exist", {"client_id": "c", "keys": ["k", "nope", ""]})
            assert got[:2] == [True, False]
            assert got[2] == {"e": [int(ErrorCode.INVALID_KEY), "empty key"]}
            assert [MasterOps._batch_item(x) for x in got[:2]] == [True, False]
            err = MasterOps._batch_item(got[2])
            assert isinstance(err, StoreError) and err.code is ErrorCode.INVALID_KEY
        finally:
            await c.close()
            await other.close()
            await svc.stop()

    asyncio.run(asyncio.wait_for(main(), 30))
