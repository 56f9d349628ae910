"""Loop metrics (issue 16): lock-free children bumped in place on the RPC server's event
loop, exported in the Prometheus text format like ``prometheus_client``'s own; the RPC
server's request counts and latency histogram through a real loopback connection."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pymooncake.obs import metrics
from pymooncake.rpc import RpcClient, RpcError, RpcServer


def sample(name: str, **labels: str) -> float:
    for fam in text_string_to_metric_families(metrics.render().decode()):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0


def test_loop_counter_and_histogram_render() -> None:
    c = metrics.loop_counter("pymooncake_test_loop_things_total", "things", ["kind"])
    assert metrics.loop_counter("pymooncake_test_loop_things_total", "things", ["kind"]) is c
    c.labels("a").value += 2
    c.labels("a").inc()
    c.labels("b").inc(0.5)
    with pytest.raises(ValueError):
        c.labels("a").inc(-1)
    with pytest.raises(ValueError):
        c.labels("a", "extra")
    assert sample("pymooncake_test_loop_things_total", kind="a") == 3
    assert sample("pymooncake_test_loop_things_total", kind="b") == 0.5
    h = metrics.loop_histogram("pymooncake_test_loop_seconds", "latency", ["m"],
                               buckets=(0.001, 0.01))
    child = h.labels("x")
    for v in (0.0005, 0.001, 0.005, 3.0):
        child.observe(v)
    name = "pymooncake_test_loop_seconds"
    assert sample(f"{name}_bucket", m="x", le="0.001") == 2   # le: bound included
    assert sample(f"{name}_bucket", m="x", le="0.01") == 3
    assert sample(f"{name}_bucket", m="x", le="+Inf") == 4
    assert sample(f"{name}_count", m="x") == 4
    assert sample(f"{name}_sum", m="x") == pytest.approx(3.0065)
    with pytest.raises(ValueError, match="already registered"):
        metrics.counter("pymooncake_test_loop_seconds", "clash")


def test_rpc_server_counts_requests_by_method_and_code() -> None:
    async def main() -> None:
        server = RpcServer("127.0.0.1", 0)
        server.register("t_loop_ok", lambda p: p)

        def boom(p: object) -> None:
            raise RpcError("NOPE", "refused")

        server.register("t_loop_err", boom)
        await server.start()
        c = RpcClient("127.0.0.1", server.port)
        name = "pymooncake_rpc_server_requests_total"
        ok0 = sample(name, method="t_loop_ok", code="OK")
        n0 = sample("pymooncake_rpc_server_latency_seconds_count", method="t_loop_ok")
        try:
            for i in range(3):
                assert await c.call("t_loop_ok", i) == i
            with pytest.raises(RpcError):
                await c.call("t_loop_err")
            with pytest.raises(RpcError):
                await c.call("t_loop_missing")
        finally:
            await c.close()
            await server.stop()
        assert sample(name, method="t_loop_ok", code="OK") == ok0 + 3
        assert sample("pymooncake_rpc_server_latency_seconds_count",
                      method="t_loop_ok") == n0 + 3
        assert sample(name, method="t_loop_err", code="NOPE") >= 1
        assert sample(name, method="t_loop_missing", code="UNKNOWN_METHOD") >= 1

    asyncio.run(asyncio.wait_for(main(), 30))
