"""The master service shell in-process (real RPC over loopback, fake clock): metrics for
objects, bytes per tier, evictions by reason, leases/pins and per-namespace capacity."""

from __future__ import annotations

import asyncio
import threading

from prometheus_client.parser import text_string_to_metric_families

from pymooncake.obs import metrics
from pymooncake.rpc import RpcClient, RpcError
from pymooncake.store.config import MasterConfig
from pymooncake.store.master.service import MasterService


def sample(name: str, **labels: str) -> float:
    for fam in text_string_to_metric_families(metrics.render().decode()):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    raise KeyError(name)


def test_metrics_and_malformed_requests() -> None:
    async def main() -> None:
        now = {"t": 100.0}
        svc = MasterService(MasterConfig(port=0, default_kv_lease_ttl_ms=1000),
                            clock=lambda: now["t"], tick_interval_s=3600)
        await svc.start()
        c = RpcClient("127.0.0.1", svc.port)
        try:
            await c.call("mount_segment", {"client_id": "c", "segment": "s", "host": "h",
                                           "base_addr": 4096, "size_bytes": 3 * 4096})
            before = sample("pymooncake_store_evictions_total", reason="no_space") \
                if "no_space" in metrics.render().decode() else 0.0
            for key in ("nsA/k1", "nsA/k2", "nsB:k3", "nsB:k4"):
                h = await c.call("put_start", {"client_id": "c", "key": key,
                                               "size_bytes": 4096,
                                               "config": {"soft_pin": key == "nsB:k3"}})
                await c.call("put_end", {"client_id": "c", "key": key,
                                         "generation": h["generation"]})
                now["t"] += 1.0
            await c.call("get_replica_list", {"client_id": "r", "key": "nsB:k4"})  # leases
            # malformed requests are refused; the master keeps serving
            for bad in (None, [], {"client_id": 3, "key": "x"}, {"key": "x"}):
                try:
                    await c.call("exist", bad)
                    raise AssertionError("accepted")
                except RpcError as e:
                    assert e.code == "INVALID_ARGUMENT"
            # (no explicit refresh: every render() below is a scrape, which computes them)
            # 3 slots, 4 puts: the LRU unpinned, unleased object (nsA/k1) was evicted
            assert sample("pymooncake_store_objects") == 3
            assert sample("pymooncake_store_used_bytes", tier="dram") == 3 * 4096
            assert sample("pymooncake_store_evictions_total", reason="no_space") == before + 1
            assert sample("pymooncake_store_namespace_bytes", namespace="nsA") == 4096
            assert sample("pymooncake_store_namespace_bytes", namespace="nsB") == 2 * 4096
            assert sample("pymooncake_store_leased_objects") == 1
            assert sample("pymooncake_store_pinned_objects", kind="soft") == 1
            assert await c.call("exist", {"client_id": "r", "key": "nsA/k1"}) is False
        finally:
            await c.close()
            await svc.stop()

    asyncio.run(main())


def test_gauges_are_computed_per_scrape_on_the_loop_and_never_on_the_tick() -> None:
    """The object-table scan runs once per collection (a scrape from another thread hands
    it to the event loop), never on the tick loop; a stopped master drops its hook."""
    async def main() -> None:
        svc = MasterService(MasterConfig(port=0), tick_interval_s=0.01)
        calls: list[int] = []
        real_stats = svc.core.stats

        def counting_stats(now_ms: float) -> dict[str, object]:
            calls.append(threading.get_ident())
            return real_stats(now_ms)
        svc.core.stats = counting_stats  # type: ignore[method-assign]
        await svc.start()
        c = RpcClient("127.0.0.1", svc.port)
        try:
            await c.call("mount_segment", {"client_id": "c", "segment": "s", "host": "h",
                                           "base_addr": 4096, "size_bytes": 8 * 4096})
            for i in range(5):
                h = await c.call("put_start", {"client_id": "c", "key": f"scrape/k{i}",
                                               "size_bytes": 4096, "config": {}})
                await c.call("put_end", {"client_id": "c", "key": f"scrape/k{i}",
                                         "generation": h["generation"]})
            await asyncio.sleep(0.3)          # ~30 ticks
            assert calls == []
            loop_thread = threading.get_ident()
            text = (await asyncio.to_thread(metrics.render)).decode()   # another thread
            assert len(calls) == 1 and calls[0] == loop_thread
            fams = {s.name: s.value for fam in text_string_to_metric_families(text)
                    for s in fam.samples if not s.labels}
            assert fams["pymooncake_store_objects"] == 5
            assert sample("pymooncake_store_namespace_bytes", namespace="scrape") == 5 * 4096
            assert len(calls) == 2          # that render() was a scrape too
            # a filtered scrape (/metrics?name[]=...) is refreshed as well
            from prometheus_client import generate_latest
            h = await c.call("put_start", {"client_id": "c", "key": "scrape/k5",
                                           "size_bytes": 4096, "config": {}})
            await c.call("put_end", {"client_id": "c", "key": "scrape/k5",
                                     "generation": h["generation"]})
            only = generate_latest(metrics.REGISTRY.restricted_registry(
                ["pymooncake_store_objects"])).decode()
            assert len(calls) == 3 and "pymooncake_store_objects 6.0" in only
            # scrapes while the loop is blocked time out and queue one scan, not one each
            import pymooncake.store.master.service as service_mod
            old_timeout = service_mod.GAUGE_REFRESH_TIMEOUT_S
            service_mod.GAUGE_REFRESH_TIMEOUT_S = 0.1
            try:
                scraper = threading.Thread(target=lambda: [metrics.render() for _ in range(3)])
                scraper.start()
                import time
                time.sleep(0.6)             # the loop is blocked; 3 scrapes give up
                scraper.join(5)
                assert not scraper.is_alive() and len(calls) == 3
                await asyncio.sleep(0.05)   # the loop runs the one queued scan
                assert len(calls) == 4
            finally:
                service_mod.GAUGE_REFRESH_TIMEOUT_S = old_timeout
        finally:
            await c.close()
            await svc.stop()
        metrics.render()
        assert len(calls) == 4              # stopped: no longer refreshed

    asyncio.run(main())
