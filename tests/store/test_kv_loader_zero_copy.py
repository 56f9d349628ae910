"""The prefill worker's Store path without ``bytes``: blocks put from tensors, read by the
fetch thread (ranged reads, layer group by layer group) into the loader's registered
staging slots, equal to what was put; a lookup larger than the staging falls back to
``bytes`` reads with the same result."""

from __future__ import annotations

import time

import pytest
import torch

pytestmark = pytest.mark.integration


def _matched(loader, req, timeout_s: float = 20.0) -> int:
    """``get_num_matched_tokens`` asked until the asynchronous load is in (as the
    scheduler asks, once per step)."""
    deadline = time.monotonic() + timeout_s
    while (n := loader.get_num_matched_tokens(req, 0)) is None:
        assert time.monotonic() < deadline, "store load never landed"
        time.sleep(0.005)
    return n


def _views(loader, rid):
    """The fetched blocks, once every layer group has landed."""
    f = loader._fetches[rid]
    assert f.wait_layer(loader.kv.num_layers - 1, 20.0) is None and f.all_landed
    return f.views


def test_kv_loader_reads_blocks_into_registered_staging(cluster_factory) -> None:
    from pymooncake.engine import Engine, EngineConfig
    from pymooncake.engine.kv_loader import StoreKVLoader
    from pymooncake.engine.request import Request
    from pymooncake.engine.sampling import SamplingParams

    from .procs import MiB

    cl = cluster_factory()
    cl.store_server(32 * MiB)
    eng = Engine.from_model_name("tiny", EngineConfig(num_kv_blocks=32))
    ns = eng.namespace.digest()
    prompt = list(range(3, 3 + 80))  # 5 full blocks
    req = Request("r", prompt, SamplingParams(max_tokens=1), eng.namespace)
    torch.manual_seed(0)
    eng.kv.buffer.copy_(torch.randn_like(eng.kv.buffer))
    ids = [4, 9, 2]
    blocks = eng.kv.export_blocks(ids)  # [L, 2, H, n, bs, D]
    writer = StoreKVLoader(cl.client(), eng.kv, ns)
    keys = [str(k) for k in req.block_keys[:3]]
    vals = [blocks[:, :, :, j:j + 1].contiguous() for j in range(3)]
    assert writer.put_blocks(keys, vals) == keys  # tensors in, no bytes

    reader = StoreKVLoader(cl.client(), eng.kv, ns, staging_blocks=4)
    assert _matched(reader, req) == 3 * eng.kv.block_size
    got = _views(reader, "r")
    assert len(reader._fetches["r"].slots) == 3 and len(reader._free_slots) == 1  # zero copy
    for j in range(3):
        assert torch.equal(got[j], vals[j])
        assert got[j].data_ptr() >= reader._staging_addr  # a view of the staging slot
    reader.forget("r")
    assert len(reader._free_slots) == 4 and "r" not in reader._fetches

    small = StoreKVLoader(cl.client(), eng.kv, ns, staging_blocks=2)
    assert _matched(small, req) == 3 * eng.kv.block_size
    assert len(small._fetches["r"].slots) == 2  # room for 2: the third is read as bytes
    for j in range(3):
        assert torch.equal(_views(small, "r")[j], vals[j])
    other = Request("o", prompt, SamplingParams(max_tokens=1), eng.namespace)
    assert _matched(small, other) == 3 * eng.kv.block_size
    assert not small._fetches["o"].slots  # no free slot left: all three as bytes
    assert all(torch.equal(a, b) for a, b in zip(_views(small, "o"), vals, strict=True))
    small.forget("r")
    small.forget("o")
    assert len(small._free_slots) == 2


def test_kv_loader_puts_blocks_from_staging_slots(cluster_factory) -> None:
    """``stage_for_put`` copies blocks out of the paged cache straight into registered
    slots (engine thread); ``put_blocks`` writes them with ``batch_put_from`` and gives the
    slots back; with puts already holding half the slots, plain tensors instead."""
    from pymooncake.engine import Engine, EngineConfig
    from pymooncake.engine.kv_loader import StagedBlock, StoreKVLoader
    from pymooncake.engine.request import Request
    from pymooncake.engine.sampling import SamplingParams

    from .procs import MiB

    cl = cluster_factory()
    cl.store_server(32 * MiB)
    eng = Engine.from_model_name("tiny", EngineConfig(num_kv_blocks=32))
    ns = eng.namespace.digest()
    req = Request("r", list(range(3, 3 + 80)), SamplingParams(max_tokens=1), eng.namespace)
    torch.manual_seed(1)
    eng.kv.buffer.copy_(torch.randn_like(eng.kv.buffer))
    ids = [7, 1, 30]
    want = [eng.kv.export_blocks([b]) for b in ids]
    writer = StoreKVLoader(cl.client(), eng.kv, ns, staging_blocks=8)
    staged = writer.stage_for_put(ids)
    assert all(isinstance(v, StagedBlock) for v in staged) and len(writer._free_slots) == 5
    eng.kv.buffer.zero_()  # the paged blocks may be reused at once: the slots hold copies
    big = writer.stage_for_put(list(range(4)))  # 4 more would leave < half: tensors
    assert all(isinstance(v, torch.Tensor) for v in big) and len(writer._free_slots) == 5
    dup = writer.stage_for_put([7])
    assert len(writer._free_slots) == 4
    writer.discard_staged([*dup, *big])  # not put (a duplicate key): its slot comes back
    assert len(writer._free_slots) == 5
    keys = [str(k) for k in req.block_keys[:3]]
    asked: list[list[str]] = []
    exist = writer.store.batch_exist
    writer.store.batch_exist = lambda ks: (asked.append(list(ks)), exist(ks))[1]
    assert writer.put_blocks(keys, staged) == keys
    assert len(writer._free_slots) == 8  # given back
    assert writer.num_put_blocks == 3
    assert asked == []      # new keys: one put round trip, no exist
    # put again: put_start answers OBJECT_ALREADY_EXISTS, nothing is written, and only
    # those keys are asked with batch_exist, which says the Store holds them
    again = writer.stage_for_put(ids)
    assert writer.put_blocks(keys, again) == keys
    assert asked == [[f"kv/{ns[:16]}/{k}" for k in keys]]
    assert writer.num_put_blocks == 3 and len(writer._free_slots) == 8
    reader = StoreKVLoader(cl.client(), eng.kv, ns)
    assert _matched(reader, req) == 3 * eng.kv.block_size
    for got, w in zip(_views(reader, "r"), want, strict=True):
        assert torch.equal(got, w)


def test_put_blocks_counts_as_held_only_what_the_store_holds(cluster_factory) -> None:
    """A key ``put_start`` refuses as existing is held only if ``batch_exist`` agrees: not
    while another client is still writing it (that write may yet fail), and not when its
    only replica lies on a segment this client knows has failed (docs/store.md, "exist
    agrees with get")."""
    from pymooncake.engine import Engine, EngineConfig
    from pymooncake.engine.kv_loader import StoreKVLoader, store_key

    from .procs import MiB

    cl = cluster_factory()
    cl.store_server(32 * MiB)
    eng = Engine.from_model_name("tiny", EngineConfig(num_kv_blocks=32))
    ns = eng.namespace.digest()
    nb = eng.kv.block_nbytes
    writer = StoreKVLoader(cl.client(), eng.kv, ns, staging_blocks=8)
    # another client has started a write of "a" and not finished it
    other = cl.client()
    h = other.put_start(store_key(ns, "a"), nb)
    assert writer.put_blocks(["a", "b"], writer.stage_for_put([1, 2])) == ["b"]
    other.put_revoke(store_key(ns, "a"), h.generation)   # ...and it fails after all
    assert writer.store.batch_exist([store_key(ns, "a")]) == [False]
    assert writer.put_blocks(["a"], writer.stage_for_put([1])) == ["a"]  # now put for real
    # the Store holds "b", but only on a segment this client has seen fail
    (seg,) = {r.segment for r in writer.store.replica_list(store_key(ns, "b")).replicas}
    writer.store._bad[seg] = writer.store._clock() + 60.0
    assert writer.put_blocks(["b"], writer.stage_for_put([2])) == []
    writer.store._bad.clear()
    assert writer.put_blocks(["b"], writer.stage_for_put([2])) == ["b"]
    assert writer.num_put_blocks == 2 and len(writer._free_slots) == 8
