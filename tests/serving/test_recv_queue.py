"""Decode receive buffer (issue 14 item 8): a request that finds the arena full queues FIFO
for space freed by earlier requests instead of being refused; one that can never fit gets a
clear ``NO_RECV_SPACE``. The decode worker's real ``_prepare`` and ``KVReceiver`` on a real
tiny engine with a deliberately tiny arena; the Transfer Engine is replaced by a plain
buffer (no sockets)."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("torch")

from pymooncake.rpc import RpcError  # noqa: E402
from pymooncake.rpc.messages import DecodeTask, SamplingOptions  # noqa: E402


class _Shm:
    def __init__(self, n: int) -> None:
        self.buf = bytearray(n)
        self.addr = 0

    def view(self) -> memoryview:
        return memoryview(self.buf)


class _FakeTransfer:
    segment_name = "fake"

    def allocate_shared(self, n: int) -> _Shm:
        return _Shm(n)

    def unregister_memory(self, addr: int) -> None:
        return None


def _worker(arena_blocks: int, timeout_s: float = 5.0):
    from pymooncake.engine.kv_receiver import KVReceiver
    from pymooncake.engine.worker.base import WorkerConfig
    from pymooncake.engine.worker.decode import DecodeWorker
    w = DecodeWorker(WorkerConfig("d0", "decode", "127.0.0.1:1", num_kv_blocks=256,
                                  recv_wait_timeout_s=timeout_s))
    w.engine = w.build_engine("decode")
    w.loop = asyncio.get_running_loop()
    w.receiver = KVReceiver(_FakeTransfer(), w.engine.kv,  # type: ignore[arg-type]
                            arena_blocks * w.engine.kv.block_nbytes)
    w.receiver.on_release = lambda: w.post(w._on_recv_release)
    return w


def _task(rid: str, blocks: int) -> DecodeTask:
    return DecodeTask(rid, tuple([5] * (16 * blocks + 3)), SamplingOptions(max_tokens=4),
                      blocks, 0.0)


def test_a_burst_waits_for_receive_space_in_arrival_order() -> None:
    async def main() -> list[str]:
        w = _worker(arena_blocks=4)
        a = await w._prepare(_task("a", 3))                 # 3 of 4 blocks
        assert a is not None and a.num_blocks == 3
        order: list[str] = []

        async def prep(rid: str, blocks: int) -> None:
            t = await w._prepare(_task(rid, blocks))
            assert t is not None and t.num_blocks == blocks
            order.append(rid)

        b = asyncio.ensure_future(prep("b", 2))               # must wait for "a"
        c = asyncio.ensure_future(prep("c", 1))               # fits now, but FIFO: after b
        await asyncio.sleep(0.05)
        assert order == [] and len(w._recv_waiters) == 2
        w.receiver.release("a")                               # a's KV is in the paged cache
        await asyncio.wait_for(asyncio.gather(b, c), 2)
        assert w.receiver.free_bytes == 1 * w.receiver.block_nbytes
        return order

    assert asyncio.run(main()) == ["b", "c"]


def test_receive_buffer_is_freed_once_the_kv_is_loaded() -> None:
    from pymooncake.engine.sampling import SamplingParams

    async def main() -> None:
        w = _worker(arena_blocks=4)
        prompt = [5] * (16 * 3 + 3)
        assert await w._prepare(_task("a", 3)) is not None
        w.receiver.mark_ready("a", 3)
        w.engine.scheduler.kv_source = w.receiver
        w.engine.runner.hooks.append(w.receiver)
        w.engine.add_request(prompt, SamplingParams(max_tokens=4), "a")
        w.engine.step()                                       # loads all layers, computes
        assert w.receiver.num_loaded_blocks == 3
        assert w.receiver.free_bytes == 4 * w.receiver.block_nbytes   # freed, still decoding
        assert "a" in w.engine.requests

    asyncio.run(main())


def test_a_request_that_can_never_fit_gets_a_clear_error() -> None:
    async def main() -> None:
        w = _worker(arena_blocks=4)
        with pytest.raises(RpcError) as e:
            await w._prepare(_task("big", 5))
        assert e.value.code == "NO_RECV_SPACE" and "never" in str(e.value)
        assert "big" not in w._streams
        # and a wait that outlasts its bound ends with NO_RECV_SPACE, not a hang
        w2 = _worker(arena_blocks=4, timeout_s=0.1)
        assert await w2._prepare(_task("x", 4)) is not None
        with pytest.raises(RpcError) as e2:
            await w2._prepare(_task("y", 1))
        assert e2.value.code == "NO_RECV_SPACE" and "0 s" in str(e2.value)
        assert "y" not in w2._streams and not w2._recv_waiters

    asyncio.run(main())


def test_a_moving_queue_is_waited_for_past_the_stall_bound() -> None:
    """The bound is on a stalled queue: space freed every 0.08 s (not enough for the head)
    keeps a 0.2 s-bounded waiter waiting for 0.5 s until its space is there."""
    async def main() -> float:
        w = _worker(arena_blocks=4, timeout_s=0.2)
        for rid in "abcd":
            assert await w._prepare(_task(rid, 1)) is not None    # arena full
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        big = asyncio.ensure_future(w._prepare(_task("big", 4)))
        for rid in "abcd":                                        # one block freed at a time
            await asyncio.sleep(0.125)
            assert not big.done()
            w.receiver.release(rid)
        t = await asyncio.wait_for(big, 2)
        assert t is not None and t.num_blocks == 4
        return loop.time() - t0

    assert asyncio.run(main()) >= 0.45
