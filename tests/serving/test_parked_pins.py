"""A parked prefill (a ``target_follows`` prefill that ended before its ``KVTarget`` came)
pins its prompt's blocks in the engine's ``BlockPool`` and ships exactly those when the
``SetTarget`` comes: every block, the partial last one included, whatever the prefix cache
did meanwhile. Every way out of the parked state — ship, abort, expiry — gives the pins
back, and a second prefill under a parked request's id is refused rather than left to
orphan them. A real ``PrefillWorker`` on its own engine thread (16 blocks of 16 tokens)
and a real decode-side ``KVReceiver`` on its Transfer Engine (``local`` transport).
Found by session 29's review of issue 16's pins."""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from pymooncake.engine.worker import prefill as prefill_mod
from pymooncake.rpc import RpcError
from pymooncake.rpc.messages import PrefillTask, SamplingOptions, SetTarget

BS = 16
BLOCKS = 16
GREEDY = SamplingOptions(max_tokens=4, temperature=0.0, ignore_eos=True)


def _ids(seed: int, n: int) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(1, 256) for _ in range(n))


def _run(name: str, body: Callable[[Any, Any], Awaitable[None]], **kw: Any) -> None:
    from pymooncake.engine import Engine, EngineConfig
    from pymooncake.engine.kv_receiver import KVReceiver
    from pymooncake.engine.worker.base import WorkerConfig
    from pymooncake.engine.worker.prefill import PrefillWorker

    async def main() -> None:
        w = PrefillWorker(WorkerConfig(name, "prefill", "127.0.0.1:1",
                                       metadata_url=f"embedded://{name}",
                                       num_kv_blocks=BLOCKS, block_size=BS,
                                       startup_profile_tokens=0, **kw))
        w.loop = asyncio.get_running_loop()
        started: asyncio.Future[None] = w.loop.create_future()
        go = threading.Event()
        t = threading.Thread(target=w._engine_thread, args=(started, go), daemon=True)
        t.start()
        await started
        go.set()
        dec = Engine.from_model_name("tiny", EngineConfig(role="decode", block_size=BS,
                                                          num_kv_blocks=32))
        receiver = KVReceiver(w.transfer, dec.kv, 24 * dec.kv.block_nbytes)
        try:
            await body(w, receiver)
        finally:
            w._stop.set()
            await asyncio.to_thread(t.join, 5.0)
            w.close_resources()
    asyncio.run(main())


async def _park(w: Any, rid: str, prompt: tuple[int, ...]) -> asyncio.Future[Any]:
    call = asyncio.ensure_future(w._prefill(PrefillTask(
        rid, prompt, GREEDY, None, use_store=False, target_follows=True)))
    for _ in range(3000):
        if rid in w._parked:
            return call
        await asyncio.sleep(0.01)
    raise AssertionError(f"{rid} never parked")


async def _plain(w: Any, rid: str, prompt: tuple[int, ...]) -> None:
    await asyncio.wait_for(w._prefill(PrefillTask(rid, prompt, GREEDY, None,
                                                  use_store=False)), 30)


async def _free(w: Any) -> int:
    return await w.on_engine(lambda: w.engine.pool.num_free_blocks)


@pytest.mark.parametrize("kw", [{}, {"layerwise_kv": False},
                                {"enable_prefix_caching": False}],
                         ids=["layerwise", "one-batch", "no-prefix-cache"])
def test_a_parked_prefill_ships_every_pinned_block_whatever_the_cache_did(kw) -> None:
    """A 2-block prompt fully in the prefix cache is prefilled again and parks: its last
    block is recomputed into a fresh block (at least one token is computed), a twin of
    the cached one. A 14-block filler then evicts every unpinned block, the cached twin
    too. The target comes: both pinned blocks are sent (2 of 2), not only what the cache
    still holds — and with the prefix cache off, where it holds nothing. A 2.5-block
    prompt ships its partial block as well (3 of 3). No pin is left afterwards."""
    async def body(w: Any, receiver: Any) -> None:
        prompt = _ids(1, 2 * BS)
        await _plain(w, "first", prompt)
        call = await _park(w, "again", prompt)
        assert len(w._parked["again"][4]) == 2
        await _plain(w, "filler", _ids(2, 14 * BS))
        assert await w._set_target(SetTarget("again", receiver.reserve("again", 2)))
        assert (await asyncio.wait_for(call, 30)).num_sent_blocks == 2
        call = await _park(w, "tail", _ids(3, 2 * BS + 8))
        assert await w._set_target(SetTarget("tail", receiver.reserve("tail", 3)))
        assert (await asyncio.wait_for(call, 30)).num_sent_blocks == 3
        assert not w._parked and await _free(w) == BLOCKS
    _run("ppship", body, **kw)


def test_abort_expiry_and_a_duplicate_id_leave_no_pin_behind(monkeypatch) -> None:
    """Parked with 3 blocks pinned (13 of 16 free): a second prefill under the same id is
    refused (``DUPLICATE``) and changes nothing; an abort gives the 3 blocks back; a
    parked prefill whose ``SetTarget`` never comes fails with ``KV_TARGET_MISSING`` after
    ``PARKED_MAX_S`` (patched to 0.2 s; the idle engine thread's turn expires it) and
    gives its blocks back too."""
    monkeypatch.setattr(prefill_mod, "PARKED_MAX_S", 0.2)

    async def body(w: Any, receiver: Any) -> None:
        call = await _park(w, "d", _ids(4, 2 * BS + 8))
        assert await _free(w) == BLOCKS - 3
        with pytest.raises(RpcError) as e:
            await w._prefill(PrefillTask("d", _ids(5, 2 * BS + 8), GREEDY, None,
                                         use_store=False, target_follows=True))
        assert e.value.code == "DUPLICATE"
        assert await _free(w) == BLOCKS - 3 and "d" in w._parked
        await w._abort("d")
        call.cancel()
        assert not w._parked and await _free(w) == BLOCKS
        call = await _park(w, "late", _ids(6, 2 * BS + 8))
        with pytest.raises(RpcError) as e:
            await asyncio.wait_for(call, 10)
        assert e.value.code == "KV_TARGET_MISSING"
        assert not w._parked and await _free(w) == BLOCKS
    _run("pppins", body)
