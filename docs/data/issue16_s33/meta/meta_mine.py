"""Store metadata operations side by side with Mooncake, at equal in-flight depth.

Both sides are driven the same way (issue 16, "symmetric benchmarks"): ``clients`` client
processes, each one thread making blocking calls one after another through the same
Python API — pymooncake's ``MooncakeDistributedStore`` (``pymooncake.store.compat``, on the
native ``StoreClient``) and the wheel's ``mooncake.store.MooncakeDistributedStore`` — so
exactly ``clients`` calls are in flight on each side. Each operation kind runs in its own
phase, every process starting it at a barrier (and a last barrier holds every process
until all have finished the last phase: a client's teardown — closing its store, exiting
— is not in another client's measured window):

* ``is_exist`` — one present key a call;
* ``batch_is_exist`` — ``batch`` present keys a call (each key counted as one operation),
  as many calls as the other phases make (so ``batch`` × the keys: a phase of only
  ``ops / batch`` calls lasted ~40 ms, where the processes' start and end skew at the
  barrier weighed most on the faster side);
* ``get_size`` — one present key a call (both masters answer from their replica lists);
* ``remove`` — one key a call, of keys the process put (1 KiB, untimed) before the phase.

ops/s = operations of all processes / (last end − first start), from ``time.perf_counter``
(``CLOCK_MONOTONIC``, one clock for every process of the host). Every answer is checked
(``verified``: 1 from ``is_exist``, the value size from ``get_size``, 0 from ``remove``).
Each round runs a fresh cluster per side (our master, or ``mooncake_master``, plus one
holder client with a segment); ``repeat`` rounds alternate the order of the two sides and
the figures are medians with min/max, the ratio the median of the per-round ratios.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from typing import Any

import numpy as np

from pymooncake.bench import store as store_bench
import sys

OPS = ("is_exist", "exist_mine", "get_size_mine", "remove")
VALUE_BYTES = 1024
MiB = 1 << 20


def _store(side: str) -> Any:
    if side == "mooncake":
        from mooncake.store import MooncakeDistributedStore
    else:
        from pymooncake.store.compat import MooncakeDistributedStore
    return MooncakeDistributedStore()


def _worker(side: str, addr: str, md: str, wid: int, n: int, batch: int, keys: list[str],
            barrier: Any, q: Any) -> None:
    """One client process: ``n`` calls of each op kind, each phase started at ``barrier``;
    puts ``(wid, {op: (start, end, operations, verified)})`` on ``q``."""
    s = _store(side)
    try:
        if s.setup("localhost", md, 0, 16 * MiB, "tcp", "", addr) != 0:
            raise RuntimeError(f"{side}: setup failed")
        value = bytes(VALUE_BYTES)
        mine = [f"meta-rm-{wid}-{i}" for i in range(n)]
        for k in mine:  # the remove phase's keys, put before any timing
            if s.put(k, value) != 0:
                raise RuntimeError(f"{side}: put of {k} failed")
        groups = [[keys[(i * batch + j) % len(keys)] for j in range(batch)]
                  for i in range(n)]
        out: dict[str, tuple[float, float, int, bool]] = {}
        for op in OPS:
            barrier.wait(120)
            ok = True
            t0 = time.perf_counter()
            if op == "is_exist":
                for i in range(n):
                    ok &= s.is_exist(keys[i % len(keys)]) == 1
                done = n
            elif op == "batch_is_exist":
                for group in groups:
                    ok &= all(x == 1 for x in s.batch_is_exist(group))
                done = n * batch
            elif op == "exist_mine":
                for k in mine:
                    ok &= s.is_exist(k) == 1
                done = n
            elif op == "get_size_mine":
                for k in mine:
                    ok &= s.get_size(k) == VALUE_BYTES
                done = n
            else:
                for k in mine:
                    ok &= s.remove(k) == 0
                done = n
            out[op] = (t0, time.perf_counter(), done, bool(ok))
        barrier.wait(120)  # nobody tears down while another still measures
        q.put((wid, out))
    except BaseException as e:  # noqa: BLE001 - the parent reports it
        q.put((wid, repr(e)))
    finally:
        s.close()


def _round(side: str, ops: int, clients: int, batch: int) -> dict[str, tuple[float, bool]]:
    """One cluster of ``side``; ``{op: (ops_per_s, verified)}``."""
    keys = [f"meta-key-{i}" for i in range(256)]
    if side == "mooncake":
        cluster = store_bench._mooncake_cluster()
    else:
        cluster = _ours_cluster()
    with cluster as (addr, md):
        holder = _store(side)  # the segment the keys live in
        if holder.setup("localhost", md, 64 * MiB, 16 * MiB, "tcp", "", addr) != 0:
            raise RuntimeError(f"{side}: holder setup failed")
        try:
            for k in keys:
                if holder.put(k, bytes(VALUE_BYTES)) != 0:
                    raise RuntimeError(f"{side}: put of {k} failed")
            ctx = mp.get_context("spawn")
            barrier, q = ctx.Barrier(clients), ctx.Queue()
            n = max(batch, ops // clients)
            procs = [ctx.Process(target=_worker, args=(side, addr, md, w, n, batch, keys,
                                                       barrier, q)) for w in range(clients)]
            for p in procs:
                p.start()
            try:
                res = [q.get(timeout=300) for _ in procs]
            finally:
                for p in procs:
                    p.join(30)
                    if p.is_alive():
                        p.kill()
        finally:
            holder.close()
    errors = [r for _, r in res if isinstance(r, str)]
    if errors:
        raise RuntimeError(f"{side} metadata client failed: {errors[0]}")
    out = {}
    for op in OPS:
        per = [r[op] for _, r in res]
        wall = max(p[1] for p in per) - min(p[0] for p in per)
        out[op] = (sum(p[2] for p in per) / wall, all(p[3] for p in per))
    return out


def _ours_cluster() -> Any:
    import contextlib

    @contextlib.contextmanager
    def cm() -> Any:
        with store_bench._pymooncake_cluster(0) as (addr, md, _server):
            yield addr, md

    return cm()


def run(ops: int = 20_000, clients: int = 4, batch: int = 16, repeat: int = 3,
        with_mooncake: bool = True) -> list[dict[str, Any]]:
    """Rows of mode ``metadata_ops`` (keys ``store_bench.ROW_KEYS``), one per op kind:
    ``ops_per_s``/``mooncake_ops_per_s`` (medians of ``repeat`` rounds, min/max in
    ``throughput_min``/``_max`` and ``mooncake_throughput_min``/``_max``, here ops/s),
    ``ratio`` (median of the per-round ratios, with ``ratio_min``/``ratio_max``),
    ``num_clients`` = calls in flight on each side, ``batch_keys``, ``verified``."""
    mc = with_mooncake and store_bench.mooncake_available()
    ours_runs, theirs_runs = [], []
    for r in range(max(1, repeat)):
        for side in (("ours", "mooncake") if r % 2 == 0 else ("mooncake", "ours")):
            if side == "ours":
                ours_runs.append(_round("ours", ops, clients, batch))
            elif mc:
                theirs_runs.append(_round("mooncake", ops, clients, batch))
    rows = []
    for op in OPS:
        ours = [x[op][0] for x in ours_runs]
        theirs = [x[op][0] for x in theirs_runs]
        ok = all(x[op][1] for x in ours_runs + theirs_runs)
        extra: dict[str, Any] = {}
        if theirs:
            ratios = [a / b for a, b in zip(ours, theirs, strict=True)]
            extra = {"mooncake_ops_per_s": float(np.median(theirs)),
                     "mooncake_throughput_min": min(theirs),
                     "mooncake_throughput_max": max(theirs),
                     **store_bench.ratio_fields(ratios)}
        rows.append(store_bench._row(
            op=op, mode="metadata_ops", ops_per_s=float(np.median(ours)),
            throughput_min=min(ours), throughput_max=max(ours), num_clients=clients,
            batch_keys=batch if op == "batch_is_exist" else 1,
            ops=ops * batch if op == "batch_is_exist" else ops, verified=ok,
            repeats=len(ours), mooncake_available=mc,
            machine=f"{mp.cpu_count()} CPUs, loopback", **extra))
    return rows


def human(rows: list[dict[str, Any]]) -> str:
    lines = []
    for r in rows:
        theirs = r["mooncake_ops_per_s"]
        ratio = "" if r["ratio"] is None else (
            f"  ratio {r['ratio']:.2f} [{r['ratio_min']:.2f}-{r['ratio_max']:.2f}, quartiles "
            f"{r['ratio_q1']:.2f}-{r['ratio_q3']:.2f}]")
        lines.append(f"metadata {r['op']:14} ({r['num_clients']} in flight): "
                     f"{r['ops_per_s']:.0f} ops/s"
                     + (f"  mooncake {theirs:.0f}" if theirs else "") + ratio
                     + ("" if r["verified"] else "  NOT VERIFIED"))
    return "\n".join(lines)

if __name__ == "__main__":
    for _ in range(int(sys.argv[1])):
        r = _round("ours", 20000, 4, 16)
        print(" ".join(f"{op}={r[op][0]:.0f}" for op in OPS), flush=True)
