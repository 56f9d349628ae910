"""``pymooncake bench store``: put/get throughput and latency, master metadata ops/s, and
Mooncake's own store side by side when its wheel is importable.

Modes: ``embedded`` — one client whose own segment holds the data (one memcpy each way, as
in Mooncake's local path); ``remote`` — the data lives in a separate ``store-server``
process and every byte crosses the Transfer Engine over TCP. Every value read back is
compared with what was written (``verified``); one untimed put/get per size comes first
on both sides (connection set-up is not in the figures). ``run`` returns (and ``--json`` prints) a
JSON list of rows, every row with the keys ``ROW_KEYS`` (``None``/null where a key does not
apply): ``put``/``get`` rows with ``op``, ``size_bytes``, ``mode``, ``count``,
``throughput_bytes_per_s``, ``p50_s``, ``p99_s``, ``verified``,
``mooncake_throughput_bytes_per_s`` (null without the wheel) and ``ratio``; then the master's
rows, op ``metadata`` / ``metadata_batch`` in mode ``master``, with ``ops_per_s``,
``mooncake_ops_per_s``, ``num_clients`` and ``batch_keys`` (byte and latency keys null):
the master's capacity, ours with 8 calls in flight per process through the raw RPC client,
Mooncake's with one (not the same depth). The side-by-side metadata figures at equal depth,
through the same Python API on both sides, are ``pymooncake.bench.store_meta``'s rows
(mode ``metadata_ops``), which ``pymooncake bench store`` appends.

This module holds the put/get runs, the rows and their table; the processes (clusters,
CPU time) are in ``bench.store_procs``, the master's metadata ops/s in
``bench.store_master``.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from pymooncake.bench.store_master import bench_master
from pymooncake.bench.store_procs import (
    _HELPERS,
    _MC_HOLDER,
    MiB,
    _free_port,
    _helpers_cpu_s,
    _mooncake_cluster,
    _mooncake_master,
    _pymooncake_cluster,
    _spawn,
    _stop,
    mooncake_available,
)
from pymooncake.bench.transfer import spread as transfer_spread

__all__ = ["ROW_KEYS", "MiB", "bench_master", "human", "master_rows", "mooncake_available",
           "run", "_free_port", "_mooncake_cluster", "_mooncake_master", "_pymooncake_cluster",
           "_row"]


def _stats(lat: list[float], total_bytes: int) -> dict[str, float]:
    arr = np.array(lat)
    return {"throughput_bytes_per_s": total_bytes / float(arr.sum()) if arr.sum() else 0.0,
            "p50_s": float(np.percentile(arr, 50)), "p99_s": float(np.percentile(arr, 99))}


def _values(size: int, count: int) -> list[bytes]:
    rng = np.random.default_rng(size)
    base = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
    return [i.to_bytes(8, "little") + base[8:] if size >= 8 else base for i in range(count)]


@dataclass
class _Side:
    """One store under test: its calls, and the pids of its helper processes (master,
    storage process) whose CPU time counts with this process's."""

    tag: str
    put: Callable[[str, bytes], Any]
    get: Callable[[str], bytes]
    remove: Callable[[str], Any]
    pids: list[int]


CHUNKS = 8
"""Each phase (the puts of one size, then their gets) is cut into this many chunks, and the
two stores take their chunks in turn."""


def _run_pair(sides: list[_Side], size: int, count: int) -> list[tuple[dict, dict]]:
    """``count`` puts of ``size`` bytes on every side, then their gets, then removes; the
    puts (and then the gets) of the sides alternate chunk by chunk (``CHUNKS`` a phase;
    ``sides`` order in even chunks, reversed in odd ones), so a swing in the host's speed,
    which moves within a second here, hits both stores alike (issue 16). CPU: this
    process's (it holds both clients) and the side's helpers', around the side's own
    chunks. One ``(put, get)`` stats pair per side."""
    # each side its own copy of the values: the second side of a chunk would otherwise
    # read a source the first one just brought into the CPU caches
    vals = {sd.tag: _values(size, count) for sd in sides}
    step = -(-count // CHUNKS)
    chunks = [range(lo, min(lo + step, count)) for lo in range(0, count, step)]
    ok = {}
    lat: dict[str, tuple[list[float], list[float]]] = {}
    cpu = {}
    for sd in sides:
        # one untimed put/get first: connections to the data's segment are set up on
        # first use on both sides, and the figures are the steady state
        warm = f"bench-{sd.tag}-{size}-warm"
        sd.put(warm, vals[sd.tag][0])
        ok[sd.tag] = sd.get(warm) == vals[sd.tag][0]
        sd.remove(warm)
        lat[sd.tag], cpu[sd.tag] = ([], []), [0.0, 0.0]
    for j in (0, 1):   # puts, then gets
        for n, idx in enumerate(chunks):
            # A B, B A, A B, ...: each side goes first, and follows the other, alike
            for sd in (sides if n % 2 == 0 else sides[::-1]):
                keys = [f"bench-{sd.tag}-{size}-{i}" for i in idx]
                out, mine = lat[sd.tag][j], vals[sd.tag]
                # the helpers' /proc scan before this process's clock is read, and after
                # it at the end: the scan's own CPU stays out of the chunk's
                h0 = _helpers_cpu_s(sd.pids)
                c0 = time.process_time()
                for k, i in zip(keys, idx, strict=True):
                    t0 = time.perf_counter()
                    if j == 0:
                        sd.put(k, mine[i])
                        out.append(time.perf_counter() - t0)
                    else:
                        got = sd.get(k)
                        out.append(time.perf_counter() - t0)
                        ok[sd.tag] = ok[sd.tag] and got == mine[i]
                c1 = time.process_time()
                cpu[sd.tag][j] += (c1 - c0) + (_helpers_cpu_s(sd.pids) - h0)
    for sd in sides:
        for i in range(count):
            sd.remove(f"bench-{sd.tag}-{size}-{i}")
    return [tuple({**_stats(lat[sd.tag][j], size * count), "verified": ok[sd.tag],
                   "count": count, "cpu_s_per_op": cpu[sd.tag][j] / count}
                  for j in (0, 1)) for sd in sides]  # type: ignore[misc]


def _objects(size: int, count: int) -> int:
    """Objects of ``size`` bytes one run puts (all of them before it reads any back)."""
    return max(4, min(count, (256 * MiB) // size))


def _segment_for(sizes: list[int], count: int) -> int:
    """A segment that holds every object of the largest size's run at once with room to
    spare (an object evicted before it is read back would fail the run), at least 64 MiB."""
    need = max(size * _objects(size, count) for size in sizes)
    return max(64 * MiB, need + need // 8 + 16 * MiB)


@contextlib.contextmanager
def _ours(sizes: list[int], count: int, mode: str) -> Iterator[_Side]:
    from pymooncake.store.client import StoreClient
    from pymooncake.transfer import TransferConfig

    seg = _segment_for(sizes, count)
    # embedded: as Mooncake's embedded run, the client's segment is the only one (no
    # storage process, no preferred-segment config to send with every put)
    with _pymooncake_cluster(seg if mode == "remote" else 0) as (addr, md, _server):
        pids = list(_HELPERS)   # (the other store's cluster resets the list)
        own = mode == "embedded"
        client = StoreClient(addr, md, global_segment_size=seg if own else 0,
                             local_buffer_size=max(sizes) * 2 + MiB,
                             transfer_config=TransferConfig(transports=("local", "tcp"))).start()
        try:
            yield _Side(mode, client.put, client.get, lambda k: client.remove(k, force=True),
                        pids)
        finally:
            client.close()


@contextlib.contextmanager
def _mooncake(sizes: list[int], count: int, mode: str) -> Iterator[_Side]:
    from mooncake.store import MooncakeDistributedStore

    seg = _segment_for(sizes, count)
    with _mooncake_cluster() as (addr, md):
        pids = list(_HELPERS)
        holder = None
        if mode == "remote":
            import mooncake

            site = os.path.dirname(os.path.dirname(os.path.abspath(mooncake.__file__)))
            holder, _ = _spawn([sys.executable, "-c", _MC_HOLDER, md, addr, str(seg), site],
                               lambda line: {} if line.startswith(b"ready") else None)
            pids.append(holder.pid)
        try:
            store = MooncakeDistributedStore()
            rc = store.setup("localhost", md, seg if mode == "embedded" else 0,
                             max(sizes) * 2 + MiB, "tcp", "", addr)
            if rc != 0:
                raise RuntimeError(f"Mooncake setup returned {rc}")

            def put(k: str, v: bytes) -> None:
                if store.put(k, v) != 0:
                    raise RuntimeError("Mooncake put failed")

            try:
                yield _Side("mc" + mode, put, store.get, lambda k: store.remove(k, True), pids)
            finally:
                store.close()
        finally:
            if holder is not None:
                _stop(holder)


def _round(sizes: list[int], count: int, mode: str, with_mooncake: bool, first: str
           ) -> tuple[dict[int, tuple[dict, dict]], dict[int, tuple[dict, dict]] | None]:
    """One round: both stores up at once (fresh clusters), every size run by
    ``_run_pair`` with ``first`` (``"ours"`` or ``"mooncake"``) taking the first chunk.
    ``({size: (put, get)} ours, the same for Mooncake or None)``."""
    with contextlib.ExitStack() as stack:
        ours = stack.enter_context(_ours(sizes, count, mode))
        theirs = stack.enter_context(_mooncake(sizes, count, mode)) if with_mooncake else None
        sides = [ours] if theirs is None else (
            [ours, theirs] if first == "ours" else [theirs, ours])
        a: dict[int, tuple[dict, dict]] = {}
        b: dict[int, tuple[dict, dict]] = {}
        for size in sizes:
            got = dict(zip((sd.tag for sd in sides),
                           _run_pair(sides, size, _objects(size, count)), strict=True))
            a[size] = got[ours.tag]
            if theirs is not None:
                b[size] = got[theirs.tag]
    return a, (b if theirs is not None else None)


ROW_KEYS = ("op", "size_bytes", "mode", "count", "throughput_bytes_per_s", "p50_s", "p99_s",
            "verified", "mooncake_throughput_bytes_per_s", "mooncake_p50_s", "ratio",
            "ops_per_s", "mooncake_ops_per_s", "num_clients", "batch_keys", "ops",
            "mooncake_available", "machine", "repeats", "throughput_min", "throughput_max",
            "mooncake_throughput_min", "mooncake_throughput_max", "ratio_min", "ratio_max",
            "ratio_q1", "ratio_q3", "cpu_s_per_op", "mooncake_cpu_s_per_op")
"""Every row of ``run`` has exactly these keys; a key that does not apply is ``None``."""


def _row(**fields: Any) -> dict[str, Any]:
    extra = set(fields) - set(ROW_KEYS)
    assert not extra, extra
    return {k: fields.get(k) for k in ROW_KEYS}


def master_rows(m: dict[str, Any]) -> list[dict[str, Any]]:
    """``bench_master``'s figures as two rows: op ``metadata`` (single-key ``exist`` /
    ``get_replica_list`` calls) and op ``metadata_batch`` (``batch_exist`` /
    ``batch_get_replica_list`` of ``batch_keys`` keys, each key one operation); mode
    ``master``; byte/latency keys ``None``."""
    return [
        _row(op="metadata", mode="master", ops_per_s=m["ops_per_s"],
             mooncake_ops_per_s=m["mooncake_ops_per_s"], ratio=m["ratio"],
             num_clients=m["num_clients"], batch_keys=1, ops=m["ops"]),
        _row(op="metadata_batch", mode="master", ops_per_s=m["batched_ops_per_s"],
             mooncake_ops_per_s=m["mooncake_batched_ops_per_s"], ratio=m["batched_ratio"],
             num_clients=m["num_clients"], batch_keys=m["batch_keys"], ops=m["ops"] * 4),
    ]


def _spread(xs: list[float]) -> tuple[float, float, float]:
    """(median, min, max)."""
    return float(np.median(xs)), float(min(xs)), float(max(xs))


def ratio_fields(ratios: list[float]) -> dict[str, float]:
    """The per-round ratios' ``ratio`` (median), ``ratio_min``/``ratio_max`` and quartiles
    ``ratio_q1``/``ratio_q3`` (``bench.transfer.spread``: the spread its verdicts use, so
    that one disturbed round of seven does not decide a verdict alone)."""
    s = transfer_spread(ratios)
    return {"ratio": float(s["median"]), "ratio_min": float(s["min"]),
            "ratio_max": float(s["max"]), "ratio_q1": float(s["q1"]),
            "ratio_q3": float(s["q3"])}


def run(sizes: list[int], count: int, modes: list[str], metadata_ops: int = 20_000,
        with_mooncake: bool = True, repeat: int = 1) -> list[dict[str, Any]]:
    """Run the benchmark; returns a list of rows (keys ``ROW_KEYS``): one ``put`` and one
    ``get`` row per (mode, size) — throughput in bytes/s (bytes / sum of per-op latencies),
    p50/p99 in s, ``verified`` (every value read back equal) and Mooncake's figures
    (``None`` without the wheel) — then, unless ``metadata_ops`` is 0, the master's
    ``metadata`` and ``metadata_batch`` rows (``ops_per_s`` from 4 client processes).

    Both stores run side by side in every round (fresh clusters each round): the puts of
    a size alternate between them in ``CHUNKS`` chunks, then the gets (``_run_pair``), the
    store that starts swapped every round. ``repeat`` > 1 reports medians over the
    rounds: throughput, p50 and the per-round ratio, with the spread (min/max) in
    ``throughput_min``/``throughput_max``,
    ``mooncake_throughput_min``/``_max`` and ``ratio_min``/``ratio_max``, and the ratio's
    quartiles in ``ratio_q1``/``ratio_q3``.
    ``cpu_s_per_op`` / ``mooncake_cpu_s_per_op``: CPU seconds per operation of the bench
    process (which holds both stores' clients) and of that store's master and storage
    process (``remote``), counted around that store's own chunks — medians over the
    rounds: the cost of an operation that a loaded machine does not blur as it does
    latency."""
    mc = with_mooncake and mooncake_available()
    machine = f"{os.cpu_count()} CPUs, loopback"
    rows = []
    for mode in modes:
        ours_runs: list[dict[int, tuple[dict, dict]]] = []
        theirs_runs: list[dict[int, tuple[dict, dict]]] = []
        for r in range(max(1, repeat)):
            a, b = _round(sizes, count, mode, mc, "ours" if r % 2 == 0 else "mooncake")
            ours_runs.append(a)
            if b is not None:
                theirs_runs.append(b)
        for size in sizes:
            for j, op in enumerate(("put", "get")):
                ours = [run_[size][j] for run_ in ours_runs]
                theirs = [run_[size][j] for run_ in theirs_runs]
                tp, tp_lo, tp_hi = _spread([x["throughput_bytes_per_s"] for x in ours])
                extra: dict[str, Any] = {}
                if theirs:
                    mt, mt_lo, mt_hi = _spread([x["throughput_bytes_per_s"] for x in theirs])
                    ratios = [a["throughput_bytes_per_s"] / b["throughput_bytes_per_s"]
                              for a, b in zip(ours, theirs, strict=True)]
                    extra = {**ratio_fields(ratios),
                             "mooncake_cpu_s_per_op": _spread(
                                 [x["cpu_s_per_op"] for x in theirs])[0],
                             "mooncake_throughput_bytes_per_s": mt,
                             "mooncake_throughput_min": mt_lo, "mooncake_throughput_max": mt_hi,
                             "mooncake_p50_s": _spread([x["p50_s"] for x in theirs])[0]}
                rows.append(_row(op=op, size_bytes=size, mode=mode, count=ours[0]["count"],
                                 throughput_bytes_per_s=tp, throughput_min=tp_lo,
                                 throughput_max=tp_hi,
                                 p50_s=_spread([x["p50_s"] for x in ours])[0],
                                 p99_s=_spread([x["p99_s"] for x in ours])[0],
                                 verified=all(x["verified"] for x in ours + theirs),
                                 cpu_s_per_op=_spread([x["cpu_s_per_op"] for x in ours])[0],
                                 repeats=len(ours), mooncake_available=mc, machine=machine,
                                 **extra))
    if metadata_ops > 0:
        for row in master_rows(bench_master(metadata_ops, mc)):
            row.update(mooncake_available=mc, machine=machine)
            rows.append(row)
    return rows


def _us(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e6:.0f}"


def human(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'op':4} {'mode':8} {'size':>9} {'MiB/s':>9} {'p50 µs':>9} {'p99 µs':>9} "
             f"{'ok':>3} {'mooncake MiB/s':>15} {'ratio':>6} {'cpu µs/op':>10} {'mooncake':>9}"]
    for r in rows:
        if r["mode"] == "master":
            theirs = r["mooncake_ops_per_s"]
            what = ("single-key calls" if r["op"] == "metadata"
                    else f"batched ({r['batch_keys']} keys a call), keys/s")
            lines.append(f"master {what} ({r['num_clients']} clients): {r['ops_per_s']:.0f}"
                         + (f"  mooncake {theirs:.0f}" if theirs else ""))
            continue
        mt = r["mooncake_throughput_bytes_per_s"]
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}"
        if r["ratio"] is not None and (r["repeats"] or 1) > 1:
            ratio += (f" [{r['ratio_min']:.2f}-{r['ratio_max']:.2f}, quartiles "
                      f"{r['ratio_q1']:.2f}-{r['ratio_q3']:.2f}]")
        lines.append(
            f"{r['op']:4} {r['mode']:8} {r['size_bytes']:>9} "
            f"{r['throughput_bytes_per_s'] / MiB:>9.1f} {r['p50_s'] * 1e6:>9.0f} "
            f"{r['p99_s'] * 1e6:>9.0f} {'yes' if r['verified'] else 'NO':>3} "
            f"{'-' if mt is None else f'{mt / MiB:.1f}':>15} "
            f"{ratio:>6} {_us(r['cpu_s_per_op']):>10} {_us(r['mooncake_cpu_s_per_op']):>9}")
    return "\n".join(lines)
