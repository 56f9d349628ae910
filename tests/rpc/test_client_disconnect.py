"""``RpcClient.on_disconnect``: told at once when its connection ends (peer gone or closed
here), so a service waiting for one-way traffic from that peer stops waiting."""

from __future__ import annotations

import asyncio

from pymooncake.rpc import RpcClient, RpcServer


def test_on_disconnect_when_the_server_goes_and_when_closed_here():
    async def run() -> list[str]:
        server = RpcServer("127.0.0.1", 0)
        server.register("ping", lambda _p: "pong")
        await server.start()
        reasons: list[str] = []
        lost = asyncio.Event()
        client = RpcClient("127.0.0.1", server.port, timeout_s=5.0)
        client.on_disconnect = lambda reason: (reasons.append(reason), lost.set())
        assert await client.call("ping") == "pong"
        assert reasons == []
        await server.stop()                       # the peer goes away
        await asyncio.wait_for(lost.wait(), 5.0)
        await server.start()                      # another one (a new port)
        client2 = RpcClient("127.0.0.1", server.port, timeout_s=5.0)
        client2.on_disconnect = reasons.append
        assert await client2.call("ping") == "pong"
        await client2.close()                     # closed here
        await client.close()                      # not connected: nothing to tell
        await server.stop()
        return reasons

    reasons = asyncio.run(run())
    assert len(reasons) == 2
    assert "closed by the server" in reasons[0]
    assert "closed by the client" in reasons[1]
