"""Same-host RPC over the server's abstract Unix socket (``rpc.local``, issue 16): a
server on a loopback or wildcard address listens there too, a loopback client connects
there first and falls back to TCP; ``PYMOONCAKE_RPC_UNIX=0`` turns it off on both ends.
Real server processes, real sockets."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest

from pymooncake.rpc import (
    RpcClient,
    RpcConnectionError,
    RpcServer,
    RpcTimeout,
    SyncRpcClient,
    local,
)

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


@contextlib.contextmanager
def _name_taken() -> Iterator[int]:
    """A free TCP port whose v4 Unix name a plain listener holds while the block runs."""
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    port = free.getsockname()[1]
    free.close()
    holder = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    holder.bind(local.unix_name(port))
    holder.listen()
    try:
        yield port
    finally:
        holder.close()


def _listens_unix(port: int, family: str = "v4") -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(local.unix_name(port, family))
        return True
    except OSError:
        return False
    finally:
        probe.close()


def test_names_and_who_uses_them(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(local.ENV, raising=False)
    v4, v6 = "\0pymooncake-rpc-v4-7", "\0pymooncake-rpc-v6-7"
    assert local.unix_name(7) == v4 and local.unix_name(7, "v6") == v6
    with pytest.raises(ValueError, match="family"):
        local.unix_name(7, "v5")
    assert local.client_names("127.0.0.1", 7) == [v4]
    assert local.client_names("::1", 7) == [v6]
    assert local.client_names("localhost", 7) == [v4, v6]
    assert local.client_names("10.0.0.2", 7) == []           # another host: TCP
    assert local.server_names("127.0.0.1", 7) == local.server_names("0.0.0.0", 7) == [v4]
    assert local.server_names("::1", 7) == local.server_names("::", 7) == [v6]
    assert local.server_names(None, 7) == local.server_names("", 7) == [v4, v6]
    assert local.server_names("10.0.0.2", 7) == []
    monkeypatch.setenv(local.ENV, "0")
    assert local.client_names("127.0.0.1", 7) == [] and local.server_names("0.0.0.0", 7) == []


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


def test_a_taken_name_fails_the_start_as_a_taken_port_does() -> None:
    """A server whose Unix name is already bound (here by a plain listener: only a foreign
    process can hold it) does not start, and leaves its TCP port free."""
    with _name_taken() as port:
        proc = subprocess.Popen([sys.executable, "-c", SERVER, "127.0.0.1", str(port)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode != 0 and out == ""
        assert f"its same-host Unix socket 'pymooncake-rpc-v4-{port}' is taken" in err, err
        with socket.socket() as again:    # the TCP port was given back
            again.bind(("127.0.0.1", port))


def test_a_v6_server_is_not_reached_by_a_v4_client() -> None:
    """Over TCP a client of 127.0.0.1 cannot reach a server on ::1 alone; nor over the
    Unix socket (the family is in the name)."""
    proc, port = _server("::1")
    try:
        assert _listens_unix(port, "v6") and not _listens_unix(port, "v4")
        with pytest.raises(RpcConnectionError):
            SyncRpcClient("127.0.0.1", port, timeout_s=2).call("mul", [6, 7])
        c = SyncRpcClient("::1", port, timeout_s=5)
        assert c.call("mul", [6, 7]) == 42 and c._sock.family == socket.AF_UNIX
        c.close()
    finally:
        _stop(proc)


def test_stop_and_a_cancelled_serve_forever_free_the_names() -> None:
    """In process: ``stop()`` closes the Unix listener with the TCP one, and so does a
    ``serve_forever`` that is cancelled (asyncio's closes only the TCP server)."""

    async def scenario() -> None:
        a = RpcServer("127.0.0.1", 0)
        a.register("mul", lambda p: p[0] * p[1])
        await a.start()
        assert _listens_unix(a.port)
        await a.stop()
        assert not _listens_unix(a.port)
        b = RpcServer("127.0.0.1", 0)
        b.register("mul", lambda p: p[0] * p[1])
        task = asyncio.ensure_future(b.serve_forever())
        await asyncio.sleep(0.1)
        assert _listens_unix(b.port)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        assert not _listens_unix(b.port)
        await b.stop()

    asyncio.run(scenario())


def test_the_asyncio_client_falls_back_when_the_unix_connect_leaves_no_connection(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A full Unix backlog: asyncio's connect reports success and hands back a writer on a
    socket that is not connected. The client then goes over TCP (unit test: that writer
    is made by hand)."""
    proc, port = _server("127.0.0.1")

    async def not_connected(name: str, limit: int) -> tuple[object, object]:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # never connected

        class Writer:
            def is_closing(self) -> bool:
                return False

            def get_extra_info(self, key: str) -> object:
                return sock if key == "socket" else None

            def close(self) -> None:
                sock.close()

        return object(), Writer()

    async def call() -> tuple[int, int]:
        client = RpcClient("127.0.0.1", port)
        try:
            got = await client.call("mul", [6, 7])
            return got, client._writer.get_extra_info("socket").family
        finally:
            await client.close()

    try:
        monkeypatch.setattr(asyncio, "open_unix_connection", not_connected)
        assert asyncio.run(call()) == (42, socket.AF_INET)
    finally:
        _stop(proc)


def test_the_master_cli_names_a_taken_unix_socket() -> None:
    """``pymooncake master``: exit 1 with one line naming the flag, the port and the taken
    Unix name (not "address already in use", which would send the user after the TCP
    port)."""
    with _name_taken() as port:
        r = subprocess.run([sys.executable, "-m", "pymooncake", "master", "--port", str(port)],
                           capture_output=True, text=True, timeout=60)
    assert r.returncode == 1, (r.returncode, r.stderr[-2000:])
    assert (f"--port {port}: cannot listen on 127.0.0.1:{port}: RPC server on port {port}: "
            f"its same-host Unix socket 'pymooncake-rpc-v4-{port}' is taken") in r.stderr, r.stderr
