"""Bounded waits that never lose a cancellation (``pymooncake.metadata.aio``), and the HA
journal tail built on them: a tail cancelled just as a journal event arrives ends.

On Python 3.11, ``wait_for(watch.__anext__(), t)`` returned the event and dropped a
cancellation that came with it; the tail then never ended and a master's ``stop()``
hung (a CI run of ``test_master_ha_snapshot`` waited 300 s). Every case below tries
each interleaving of "event ready" and "cancel" within a few loop steps."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid

import pytest

from pymooncake.metadata import open_metadata
from pymooncake.metadata.aio import cancel_and_wait, next_within, wait_set
from pymooncake.metadata.election import LeaderElection
from pymooncake.store.master.ha_follow import JournalTail
from pymooncake.store.master.ha_journal import HaKeys
from pymooncake.store.master.journal import encode_entry

STEPS = range(6)  # loop iterations between the event and the cancel


class _Items:
    """Items of a queue (like a metadata watch: a cancelled read loses nothing; an async
    generator would be closed by it)."""

    def __init__(self, q: asyncio.Queue[int]) -> None:
        self.q = q

    def __aiter__(self) -> _Items:
        return self

    async def __anext__(self) -> int:
        return await self.q.get()


@pytest.mark.parametrize("steps", STEPS)
def test_a_loop_on_next_within_ends_when_cancelled_as_an_item_arrives(steps: int) -> None:
    async def main() -> None:
        q: asyncio.Queue[int] = asyncio.Queue()
        got: list[int] = []

        async def loop() -> None:
            it = _Items(q)
            while True:
                item = await next_within(it, 1.0)
                if item is not None:
                    got.append(item)

        t = asyncio.ensure_future(loop())
        await asyncio.sleep(0.01)
        q.put_nowait(7)
        for _ in range(steps):
            await asyncio.sleep(0)
        t.cancel()
        await asyncio.wait({t}, timeout=2.0)
        assert t.cancelled(), f"the loop lost its cancellation (got {got})"

    asyncio.run(main())


def test_next_within_returns_the_item_or_none_and_raises_the_end() -> None:
    async def main() -> None:
        q: asyncio.Queue[int] = asyncio.Queue()
        it = _Items(q)
        assert await next_within(it, 0.05) is None
        q.put_nowait(3)
        assert await next_within(it, 1.0) == 3  # the timed-out read did not eat it

        async def two():  # noqa: ANN202
            yield 1

        it2 = two()
        assert await next_within(it2, 1.0) == 1
        with pytest.raises(StopAsyncIteration):
            await next_within(it2, 1.0)

    asyncio.run(main())


def test_cancel_and_wait_is_bounded_and_lets_the_callers_cancellation_through(
        caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        async def swallows_once() -> None:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(10)
            await asyncio.sleep(10)  # cancelled again by cancel_and_wait

        t = asyncio.ensure_future(swallows_once())
        await asyncio.sleep(0)
        assert await cancel_and_wait(t, "once", timeout_s=3.0) and t.cancelled()

        release = asyncio.Event()

        async def never_ends() -> None:  # swallows every cancellation until released
            while not release.is_set():
                with contextlib.suppress(asyncio.CancelledError):
                    await release.wait()

        stuck = asyncio.ensure_future(never_ends())
        await asyncio.sleep(0)
        with caplog.at_level(logging.ERROR):
            assert not await cancel_and_wait(stuck, "the stuck loop", timeout_s=0.3)
        assert "the stuck loop did not end within 0.3 s" in caplog.text
        assert not stuck.done()

        # the caller is cancelled while it waits: the caller ends (nothing swallowed it)
        inner = asyncio.ensure_future(never_ends())
        await asyncio.sleep(0)
        caller = asyncio.ensure_future(cancel_and_wait(inner, "inner", timeout_s=30.0))
        await asyncio.sleep(0.01)
        caller.cancel()
        await asyncio.wait({caller}, timeout=2.0)
        assert caller.cancelled()
        release.set()
        await asyncio.wait({stuck, inner}, timeout=2.0)
        assert stuck.done() and inner.done()

        ev = asyncio.Event()
        assert not await wait_set(ev, 0.02)
        asyncio.get_running_loop().call_later(0.01, ev.set)
        assert await wait_set(ev, 2.0)
        assert await cancel_and_wait(None)

    asyncio.run(main())


@pytest.mark.parametrize("steps", STEPS)
def test_a_journal_tail_cancelled_as_an_entry_arrives_ends(steps: int) -> None:
    async def main() -> None:
        md = open_metadata(f"embedded://tail-{uuid.uuid4().hex[:8]}")
        keys = HaKeys.of("c")
        tail = JournalTail(md, keys)
        t = asyncio.ensure_future(tail.run())
        for _ in range(100):  # until the tail waits on its watch
            await asyncio.sleep(0.01)
            if md._state.watchers:  # noqa: SLF001 - the watch is open
                break
        await asyncio.sleep(0.05)
        await md.put(keys.entry(1), encode_entry(1, []))
        await md.put(keys.head, b"1")
        for _ in range(steps):
            await asyncio.sleep(0)
        t.cancel()
        await asyncio.wait({t}, timeout=3.0)
        assert t.done(), f"the tail lost its cancellation (applied {tail.index.applied_seq})"

    asyncio.run(main())


@pytest.mark.parametrize("steps", STEPS)
def test_a_campaign_cancelled_as_a_watch_event_arrives_ends(steps: int) -> None:
    async def main() -> None:
        md = open_metadata(f"embedded://elect-{uuid.uuid4().hex[:8]}")
        a = LeaderElection(md, "lead", b"a", ttl_s=5.0)
        b = LeaderElection(md, "lead", b"b", ttl_s=5.0)
        assert await a.campaign(timeout_s=1.0)
        t = asyncio.ensure_future(b.campaign())
        for _ in range(100):  # until b waits on its watch of the key
            await asyncio.sleep(0.01)
            if md._state.watchers:  # noqa: SLF001 - the watch is open
                break
        await asyncio.sleep(0.05)
        await md.put("lead/x", b"1")  # an event under the key's prefix, not its delete
        for _ in range(steps):
            await asyncio.sleep(0)
        t.cancel()
        await asyncio.wait({t}, timeout=3.0)
        assert t.cancelled(), "the campaign lost its cancellation"
        await a.resign()

    asyncio.run(main())
