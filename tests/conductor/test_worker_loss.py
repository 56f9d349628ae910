"""``conductor.worker_loss.WorkerLossWatch``: a guarded worker call ends with
``WORKER_LOST`` as soon as a worker its request involves is lost (issue 17 Build item 5),
and only those requests; unit test (the fault tests run it against real hosts)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

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


def test_the_guard_turns_only_its_own_cancel_into_the_loss() -> None:
    """The guard cancels the awaiting task on a loss (no task of its own). Its own cancel
    becomes ``WORKER_LOST`` and leaves the task with nothing pending; a cancel from
    elsewhere still propagates; a loss noticed after the call returned cancels nothing."""
    async def main() -> None:
        loop = asyncio.get_running_loop()
        w = WorkerLossWatch()

        # a loss: WORKER_LOST, and the task can await (and time out) normally afterwards
        w.watch("r1", ("decode-b",))

        async def lose() -> str:
            try:
                await w.guard("r1", asyncio.sleep(30))
            except RpcError as e:
                me = asyncio.current_task()
                assert me is not None and me.cancelling() == 0
                await asyncio.sleep(0.01)          # no cancel left pending
                try:
                    async with asyncio.timeout(0.01):
                        await asyncio.sleep(1)
                except TimeoutError:
                    return e.code
            return "no error"
        t = asyncio.ensure_future(lose())
        await asyncio.sleep(0.01)
        w.lost("decode-b", "gone")
        assert await t == "WORKER_LOST"
        w.forget("r1")

        # a cancel from elsewhere: alone, just after the loss, just before it
        for order in ("cancel", "loss, cancel", "cancel, loss"):
            w.watch("r2", ("decode-c",))
            t = asyncio.ensure_future(w.guard("r2", asyncio.sleep(30)))
            await asyncio.sleep(0.01)
            for step in order.split(", "):
                if step == "cancel":
                    t.cancel()
                else:
                    w.lost("decode-c", "gone")
            with pytest.raises(asyncio.CancelledError):
                await t
            w.forget("r2")

        # a call that returns despite the cancel: its answer is used, nothing left pending
        w.watch("r3", ("decode-d",))

        async def stubborn() -> int:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(30)
            return 5

        async def run3() -> tuple[int, int]:
            got = await w.guard("r3", stubborn())
            me = asyncio.current_task()
            assert me is not None
            return got, me.cancelling()
        t3 = asyncio.ensure_future(run3())
        await asyncio.sleep(0.01)
        w.lost("decode-d", "gone")
        assert await t3 == (5, 0)
        w.forget("r3")

        # the answer and the loss in one loop turn, the answer first: the call's result,
        # and the loss's callback (already queued) must not cancel the task's next await
        w.watch("r4", ("decode-e",))
        answer = loop.create_future()

        async def rpc() -> int:
            return await answer

        async def run4() -> tuple[int, str]:
            got = await w.guard("r4", rpc())
            await asyncio.sleep(0.05)
            return got, "slept"
        t4 = asyncio.ensure_future(run4())
        await asyncio.sleep(0.01)
        answer.set_result(7)
        w.lost("decode-e", "gone")
        assert await t4 == (7, "slept")
        w.forget("r4")

        # the same through the hops the Conductor's calls take: a Task (the prefill call)
        # or a coroutine around wait_for (RpcClient.call). A prefill worker that answers
        # and then closes its connection: the answer wins, as it did with the old guard
        for form in ("task", "coroutine"):
            w.watch("r5", ("prefill-f",))
            reply = loop.create_future()

            async def rpc_call(reply: asyncio.Future[int] = reply) -> int:
                return await asyncio.wait_for(reply, 5)
            call = asyncio.ensure_future(rpc_call()) if form == "task" else rpc_call()

            async def run5(call: Any = call) -> tuple[int, int]:
                got = await w.guard("r5", call)
                me = asyncio.current_task()
                assert me is not None
                return got, me.cancelling()
            t5 = asyncio.ensure_future(run5())
            await asyncio.sleep(0.01)
            reply.set_result(9)
            w.lost("prefill-f", "connection closed after its answer")
            assert await t5 == (9, 0), form
            w.forget("r5")

    asyncio.run(main())


def test_a_call_guarded_after_the_loss_is_never_sent() -> None:
    """A worker already lost: a coroutine call is closed unsent (no request reaches a
    worker for a request that has failed), a pending future is left to its owner, and
    an answer already in is still returned."""
    async def main() -> None:
        loop = asyncio.get_running_loop()
        w = WorkerLossWatch()
        w.watch("r", ("decode-b",))
        w.lost("decode-b", "gone")
        sent: list[str] = []

        async def call() -> int:
            sent.append("sent")
            return 1
        coro = call()
        with pytest.raises(RpcError, match="WORKER_LOST"):
            await w.guard("r", coro)
        assert sent == [] and coro.cr_frame is None          # closed, never ran
        pending = loop.create_future()
        with pytest.raises(RpcError, match="WORKER_LOST"):
            await w.guard("r", pending)
        assert not pending.done()
        answered = loop.create_future()
        answered.set_result(3)
        assert await w.guard("r", answered) == 3
        w.forget("r")

    asyncio.run(main())
