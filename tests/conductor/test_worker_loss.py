"""``conductor.worker_loss.WorkerLossWatch``: a guarded worker call ends with
``WORKER_LOST`` as soon as a worker its request involves is lost (issue 17 Build item 5),
and only those requests; unit test (the fault tests run it against real hosts)."""

from __future__ import annotations

import asyncio
import time

import pytest

from pymooncake.conductor.worker_loss import WorkerLossWatch
from pymooncake.rpc import RpcError


def test_loss_fails_only_the_requests_that_involve_the_worker() -> None:
    async def main() -> None:
        w = WorkerLossWatch()
        w.watch("r1", ("prefill-a", "decode-b"))
        w.watch("r2", ("prefill-a", "decode-a"))
        slow = asyncio.get_running_loop().create_future()     # a prefill stuck in a write
        fast = asyncio.get_running_loop().create_future()
        t1 = asyncio.ensure_future(w.guard("r1", slow))
        t2 = asyncio.ensure_future(w.guard("r2", fast))
        await asyncio.sleep(0.01)
        t0 = time.monotonic()
        assert w.lost("decode-b", "no load report for 3.0 s") == ["r1"]
        with pytest.raises(RpcError) as e:
            await t1
        assert time.monotonic() - t0 < 0.1
        assert e.value.code == "WORKER_LOST" and "decode-b" in e.value.message
        assert not t2.done() and not slow.cancelled()   # the caller cancels its own call
        fast.set_result(42)
        assert await t2 == 42
        w.forget("r1")
        w.forget("r2")
        assert len(w) == 0
        # unwatched requests just await; a loss before the call still fails it
        assert await w.guard("r3", asyncio.sleep(0, result=7)) == 7
        w.watch("r4", ("decode-c", None))
        w.lost("decode-c", "connection lost")
        with pytest.raises(RpcError):
            await w.guard("r4", asyncio.sleep(5))
        w.forget("r4")

    asyncio.run(main())


def test_a_guarded_coroutine_is_cancelled_when_its_worker_is_lost() -> None:
    """The Conductor guards its prepare_decode, set_target and start_decode calls too (a
    request for a lost host must not wait on it anywhere): the call it handed in as a
    coroutine is cancelled on the loss, nothing is left running."""
    async def main() -> None:
        w = WorkerLossWatch()
        w.watch("r1", ("prefill-a", "decode-b"))
        ran: list[str] = []

        async def call() -> int:          # a set_target stuck behind a write, say
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                ran.append("cancelled")
                raise
            return 1
        t = asyncio.ensure_future(w.guard("r1", call()))
        await asyncio.sleep(0.01)
        w.lost("decode-b", "no load report for 3.0 s")
        with pytest.raises(RpcError) as e:
            await t
        assert e.value.code == "WORKER_LOST"
        await asyncio.sleep(0)
        assert ran == ["cancelled"]
        w.forget("r1")

    asyncio.run(main())
