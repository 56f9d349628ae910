"""Same-host RPC over the server's abstract Unix socket (``rpc.local``, issue 16): a
server on a loopback or wildcard address listens there too, a loopback client connects
there first and falls back to TCP; ``PYMOONCAKE_RPC_UNIX=0`` turns it off on both ends.
Real server processes, real sockets."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import textwrap

import pytest

from pymooncake.rpc import RpcClient, RpcTimeout, SyncRpcClient, local

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="abstract Unix sockets are Linux's")

SERVER = textwrap.dedent("""
    import asyncio, sys, uvloop
    from pymooncake.rpc import RpcServer
    async def sleep(p):
        await asyncio.sleep(p)
        return "slept"
    async def main():
        s = RpcServer(sys.argv[1], int(sys.argv[2]))
        s.register("mul", lambda p: p[0] * p[1])
        s.register("sleep", sleep)
        await s.start()
        print(s.port, flush=True)
        await s.serve_forever()
    uvloop.run(main())
""")


def _server(host: str, port: int = 0, env: dict[str, str] | None = None
            ) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen([sys.executable, "-c", SERVER, host, str(port)],
                            stdout=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})
    line = proc.stdout.readline()
    if not line:
        proc.kill()
        raise AssertionError("the server did not start")
    return proc, int(line)


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    proc.wait(10)


def _listens_unix(port: int) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(local.unix_name(port))
        return True
    except OSError:
        return False
    finally:
        probe.close()


def test_names_and_who_uses_them(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(local.ENV, raising=False)
    assert local.unix_name(50051) == "\0pymooncake-rpc-50051"
    assert local.client_name("127.0.0.1", 7) == local.client_name("localhost", 7) \
        == "\0pymooncake-rpc-7"
    assert local.client_name("10.0.0.2", 7) is None          # another host: TCP
    assert local.serves_unix("0.0.0.0") and local.serves_unix("127.0.0.1")
    assert not local.serves_unix("10.0.0.2")
    monkeypatch.setenv(local.ENV, "0")
    assert local.client_name("127.0.0.1", 7) is None and not local.serves_unix("127.0.0.1")


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0"])
def test_a_loopback_client_talks_over_the_unix_socket(host: str) -> None:
    proc, port = _server(host)
    try:
        assert _listens_unix(port)
        c = SyncRpcClient("127.0.0.1", port, timeout_s=5)
        assert c.call("mul", [6, 7]) == 42
        assert c._sock is not None and c._sock.family == socket.AF_UNIX
        # the kernel-side timeout holds on the Unix socket too, and the next call reconnects
        with pytest.raises(RpcTimeout):
            c.call("sleep", 2.0, timeout_s=0.3)
        assert c.call("mul", [3, 5]) == 15 and c._sock.family == socket.AF_UNIX
        # TCP still serves (other hosts, and tools that connect by port)
        t = SyncRpcClient("127.0.0.1", port, timeout_s=5)
        os.environ[local.ENV] = "0"
        try:
            assert t.call("mul", [2, 4]) == 8 and t._sock.family == socket.AF_INET
        finally:
            del os.environ[local.ENV]
        c.close()
        t.close()
    finally:
        _stop(proc)
    assert not _listens_unix(port)                      # gone with the server


def test_the_asyncio_client_takes_the_unix_socket_too(monkeypatch: pytest.MonkeyPatch) -> None:
    proc, port = _server("127.0.0.1")

    async def family(client: RpcClient) -> tuple[int, int]:
        try:
            got = await client.call("mul", [6, 7])
            return got, client._writer.get_extra_info("socket").family
        finally:
            await client.close()

    try:
        assert asyncio.run(family(RpcClient("127.0.0.1", port))) == (42, socket.AF_UNIX)
        monkeypatch.setenv(local.ENV, "0")
        assert asyncio.run(family(RpcClient("127.0.0.1", port))) == (42, socket.AF_INET)
    finally:
        _stop(proc)


def test_a_server_on_another_address_or_turned_off_serves_tcp_only() -> None:
    # turned off in the server: the loopback client finds no Unix socket and uses TCP
    proc, port = _server("127.0.0.1", env={local.ENV: "0"})
    try:
        assert not _listens_unix(port)
        c = SyncRpcClient("127.0.0.1", port, timeout_s=5)
        assert c.call("mul", [6, 7]) == 42 and c._sock.family == socket.AF_INET
        c.close()
    finally:
        _stop(proc)


def test_a_taken_name_leaves_the_second_server_on_tcp() -> None:
    """A server whose port's Unix name is already bound (here by a plain listener) logs it
    and serves TCP: it starts and answers. Only RpcServer binds these names, each for its
    own TCP port, and an abstract name goes with its socket, so in practice none is
    taken."""
    holder = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    port = free.getsockname()[1]
    free.close()
    holder.bind(local.unix_name(port))
    holder.listen()
    try:
        proc, got = _server("127.0.0.1", port)
        try:
            assert got == port
            t = SyncRpcClient("127.0.0.1", port, timeout_s=5)
            os.environ[local.ENV] = "0"
            try:
                assert t.call("mul", [6, 7]) == 42
            finally:
                del os.environ[local.ENV]
            t.close()
        finally:
            _stop(proc)
    finally:
        holder.close()
