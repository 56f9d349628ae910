"""Master metadata operations/s for ``pymooncake bench store``: 4 client processes call
``exist`` / ``get_replica_list`` (and their batch forms) on our master through the raw RPC
client, 8 calls in flight each, and on Mooncake's master through its wheel when present.

Holds ``bench_master`` and its worker functions (spawned processes).
"""

from __future__ import annotations

import multiprocessing as mp
import time
from collections.abc import Callable
from typing import Any

from pymooncake.bench.store_procs import MiB, _mooncake_cluster, _pymooncake_cluster


def _meta_worker(addr: str, batch: int, n: int, start: Any, q: Any) -> None:
    """``n`` metadata operations: alternating exist / get_replica_list of one key, 8 calls in
    flight; with ``batch > 1`` each call is the batch form over ``batch`` keys."""
    import asyncio

    from pymooncake.rpc import RpcClient

    host, port = addr.rsplit(":", 1)
    one = {"client_id": "bench", "key": "meta-key"}
    many = {"client_id": "bench", "keys": ["meta-key"] * batch}

    async def main() -> int:
        c = RpcClient(host, int(port))
        await c.call("ping", None)
        start.wait()
        done = 0

        async def lane(m: int) -> None:
            nonlocal done
            for i in range(m):
                if batch > 1:
                    await c.call("batch_exist" if i % 2 else "batch_get_replica_list", many)
                else:
                    await c.call("exist" if i % 2 else "get_replica_list", one)
                done += batch

        await asyncio.gather(*(lane(n // batch // 8) for _ in range(8)))
        await c.close()
        return done

    try:
        import uvloop

        q.put(uvloop.run(main()))
    except ImportError:
        q.put(asyncio.run(main()))


def _mc_meta_worker(addr: str, md: str, batch: int, n: int, start: Any, q: Any) -> None:
    from mooncake.store import MooncakeDistributedStore

    s = MooncakeDistributedStore()
    s.setup("localhost", md, 0, 16 << 20, "tcp", "", addr)
    keys = ["meta-key"] * batch
    start.wait()
    done = 0
    for _ in range(n // batch):
        if batch > 1:
            s.batch_is_exist(keys)
        else:
            s.is_exist("meta-key")
        done += batch
    q.put(done)
    s.close()


def _run_workers(target: Callable, args: tuple, n_total: int, num_clients: int = 4) -> float:
    ctx = mp.get_context("spawn")
    start, q = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args, n_total // num_clients, start, q))
             for _ in range(num_clients)]
    for p in procs:
        p.start()
    time.sleep(3.0)  # let every worker connect
    t0 = time.perf_counter()
    start.set()
    done = sum(q.get(timeout=120) for _ in procs)
    dt = time.perf_counter() - t0
    for p in procs:
        p.join(10)
    return done / dt


def bench_master(ops: int, with_mooncake: bool, batch: int = 16) -> dict[str, Any]:
    """Metadata operations/s from 4 client processes: single-key calls, and batch calls of
    ``batch`` keys (each key counted as one operation)."""
    from pymooncake.store.client import StoreClient

    with _pymooncake_cluster(16 * MiB) as (addr, md, _server):
        c = StoreClient(addr, md, local_buffer_size=MiB).start()
        c.put("meta-key", b"x" * 1024)
        ours = _run_workers(_meta_worker, (addr, 1), ops)
        ours_b = _run_workers(_meta_worker, (addr, batch), ops * 4)
        c.close()
    theirs = theirs_b = None
    if with_mooncake:
        with _mooncake_cluster() as (addr, md):
            from mooncake.store import MooncakeDistributedStore

            s = MooncakeDistributedStore()
            s.setup("localhost", md, 16 * MiB, 16 * MiB, "tcp", "", addr)
            s.put("meta-key", b"x" * 1024)
            theirs = _run_workers(_mc_meta_worker, (addr, md, 1), ops // 4)
            theirs_b = _run_workers(_mc_meta_worker, (addr, md, batch), ops)
            s.close()
    return {"op": "metadata", "num_clients": 4, "ops": ops, "ops_per_s": ours,
            "mooncake_ops_per_s": theirs, "ratio": (ours / theirs) if theirs else None,
            "batch_keys": batch, "batched_ops_per_s": ours_b,
            "mooncake_batched_ops_per_s": theirs_b,
            "batched_ratio": (ours_b / theirs_b) if theirs_b else None}

