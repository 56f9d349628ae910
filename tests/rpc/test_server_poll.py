"""``RpcServer``'s poll for the next request while requests keep coming (issue 16)."""

from __future__ import annotations

import asyncio

import pytest

from pymooncake.rpc import RpcClient, RpcServer


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_server_polls_while_requests_come_within_poll_s_then_sleeps() -> None:
    """``RpcServer(poll_s=...)`` keeps its loop polling for the next request for ``poll_s``
    after a read that brought frames within ``poll_s`` of the one before (issue 16: busy
    clients' next request finds the server awake), answers requests that come while it
    polls, and stops polling when the window has passed; a request after a quiet spell
    starts no poll; ``poll_s=0`` never polls; out-of-range values are refused."""
    for bad in (-1e-6, 1.5):
        with pytest.raises(ValueError, match="poll_s"):
            RpcServer("127.0.0.1", 0, poll_s=bad)

    async def main() -> None:
        polling = RpcServer("127.0.0.1", 0, poll_s=0.05)
        polling.register("echo", lambda p: p)
        quiet = RpcServer("127.0.0.1", 0)
        quiet.register("echo", lambda p: p)
        await polling.start()
        await quiet.start()
        a = RpcClient("127.0.0.1", polling.port)
        b = RpcClient("127.0.0.1", quiet.port)
        try:
            assert polling.polls == 0
            assert await a.call("echo", 1) == 1
            await asyncio.sleep(0.01)
            assert polling.polls == 0                 # one request after a quiet spell
            assert await a.call("echo", 2) == 2       # 10 ms after it: within poll_s
            await asyncio.sleep(0.01)                 # inside the window: polling
            assert polling.polls > 0
            assert await a.call("echo", 3) == 3       # answered while polling
            await asyncio.sleep(0.15)                 # the window has passed
            settled = polling.polls
            await asyncio.sleep(0.1)
            assert polling.polls == settled           # asleep again: no more turns
            assert await a.call("echo", 4) == 4       # after a quiet spell: no poll
            await asyncio.sleep(0.02)
            assert polling.polls == settled
            assert [await b.call("echo", i) for i in range(5)] == list(range(5))
            await asyncio.sleep(0.05)
            assert quiet.polls == 0
        finally:
            await a.close()
            await b.close()
            await polling.stop()
            await quiet.stop()

    run(main())
