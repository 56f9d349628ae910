"""Store metadata operations side by side with Mooncake, at equal in-flight depth.

Both sides are driven the same way (issue 16, "symmetric benchmarks"): ``clients`` client
processes, each one thread making blocking calls one after another through the same
Python API — pymooncake's ``MooncakeDistributedStore`` (``pymooncake.store.compat``, on the
native ``StoreClient``) and the wheel's ``mooncake.store.MooncakeDistributedStore`` — so
exactly ``clients`` calls are in flight on each side. Each operation kind runs in its own
phase, cut into ``SUBPHASES`` sub-phases that the two sides take in turn (both clusters
and all their client processes are up at once; the side not measured waits idle), every
client of a side starting a sub-phase at a barrier. So a swing in the host's speed, which
moves within a second on a shared VM, hits both sides alike (issue 16; a side measured for
seconds on its own met other weather than the other: per-round ratios spread 1.07-1.96).
A client's teardown — closing its store, exiting — comes after every sub-phase:

* ``is_exist`` — one present key a call;
* ``batch_is_exist`` — ``batch`` present keys a call (each key counted as one operation),
  as many calls as the other phases make (so ``batch`` × the keys: a phase of only
  ``ops / batch`` calls lasted ~40 ms, where the processes' start and end skew at the
  barrier weighed most on the faster side; a sub-phase of the faster side lasts
  ~125-200 ms with 20,000 ops and 4 clients);
* ``get_size`` — one present key a call (both masters answer from their replica lists);
* ``remove`` — one key a call, of keys the process put (1 KiB, untimed) before the phase.

A sub-phase's wall is its last end − its first start, from ``time.perf_counter``
(``CLOCK_MONOTONIC``, one clock for every process of the host); ops/s = the operations of
a phase's sub-phases / the sum of their walls. Every answer is checked (``verified``: 1
from ``is_exist``, the value size from ``get_size``, 0 from ``remove``). Each round runs a
fresh cluster per side (our master, or ``mooncake_master``, plus one holder client with a
segment); ``repeat`` rounds alternate which side goes first and the figures are medians
with min/max, the ratio the median of the per-round ratios.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import time
from typing import Any

import numpy as np

from pymooncake.bench import store as store_bench

OPS = ("is_exist", "batch_is_exist", "get_size", "remove")
VALUE_BYTES = 1024
MiB = 1 << 20


def _store(side: str) -> Any:
    if side == "mooncake":
        from mooncake.store import MooncakeDistributedStore
    else:
        from pymooncake.store.compat import MooncakeDistributedStore
    return MooncakeDistributedStore()


def _calls(s: Any, op: str, keys: list[str], mine: list[str], groups: list[list[str]],
           lo: int, hi: int) -> tuple[int, bool]:
    """Calls ``lo``..``hi`` of phase ``op`` on store ``s``: (operations, all verified)."""
    ok = True
    if op == "is_exist":
        for i in range(lo, hi):
            ok &= s.is_exist(keys[i % len(keys)]) == 1
        return hi - lo, bool(ok)
    if op == "batch_is_exist":
        for group in groups[lo:hi]:
            ok &= all(x == 1 for x in s.batch_is_exist(group))
        return (hi - lo) * len(groups[0]), bool(ok)
    if op == "get_size":
        for i in range(lo, hi):
            ok &= s.get_size(keys[i % len(keys)]) == VALUE_BYTES
        return hi - lo, bool(ok)
    for k in mine[lo:hi]:
        ok &= s.remove(k) == 0
    return hi - lo, bool(ok)


def _worker(side: str, addr: str, md: str, wid: int, n: int, batch: int, keys: list[str],
            barrier: Any, cmds: Any, q: Any) -> None:
    """One client process: sets up, puts its ``n`` keys of the remove phase (untimed), says
    ``(wid, "ready")`` on ``q``; then for each ``(op, lo, hi)`` from ``cmds`` starts at
    ``barrier`` with the side's other clients and puts ``(wid, (start, end, operations,
    verified))`` on ``q``; ``None`` ends it."""
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
        q.put((wid, "ready"))
        while (cmd := cmds.get()) is not None:
            op, lo, hi = cmd
            barrier.wait(120)
            t0 = time.perf_counter()
            done, ok = _calls(s, op, keys, mine, groups, lo, hi)
            q.put((wid, (t0, time.perf_counter(), done, ok)))
    except BaseException as e:  # noqa: BLE001 - the parent reports it
        q.put((wid, repr(e)))
    finally:
        s.close()


SUBPHASES = 4
"""Each op kind's calls are cut into this many sub-phases, and the two stores take their
sub-phases in turn (issue 16: a swing in the host's speed hits both alike)."""


class _Clients:
    """One side's ``clients`` client processes, driven phase by phase (see ``_worker``)."""

    def __init__(self, side: str, addr: str, md: str, clients: int, n: int, batch: int,
                 keys: list[str]) -> None:
        ctx = mp.get_context("spawn")
        self.side, self.q = side, ctx.Queue()
        barrier = ctx.Barrier(clients)
        self.cmds = [ctx.Queue() for _ in range(clients)]
        self.procs = [ctx.Process(target=_worker, args=(side, addr, md, w, n, batch, keys,
                                                        barrier, self.cmds[w], self.q))
                      for w in range(clients)]
        for p in self.procs:
            p.start()
        try:
            self._collect()
        except BaseException:   # one client failed to start: stop its siblings too
            self.close()
            raise

    def _collect(self) -> list[Any]:
        res = [self.q.get(timeout=300) for _ in self.procs]
        errors = [r for _, r in res if isinstance(r, str) and r != "ready"]
        if errors:
            raise RuntimeError(f"{self.side} metadata client failed: {errors[0]}")
        return [r for _, r in res]

    def phase(self, op: str, lo: int, hi: int) -> tuple[float, int, bool]:
        """Every client's calls ``lo``..``hi`` of ``op``: (wall s from the first start to
        the last end, operations, all verified)."""
        for c in self.cmds:
            c.put((op, lo, hi))
        per = self._collect()
        wall = max(p[1] for p in per) - min(p[0] for p in per)
        return wall, sum(p[2] for p in per), all(p[3] for p in per)

    def close(self) -> None:
        """Ends every client (a client stuck in a call is killed after 30 s)."""
        for c in self.cmds:
            c.put(None)
        for p in self.procs:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join(5)


def _round(sides: list[str], ops: int, clients: int, batch: int
           ) -> dict[str, dict[str, tuple[float, bool]]]:
    """One round: a fresh cluster per side, all up at once (our master or
    ``mooncake_master``, plus one holder client with a segment, plus ``clients`` client
    processes). Each op kind's ``ops // clients`` calls a client run in ``SUBPHASES``
    sub-phases, the sides taking them in turn in ``sides`` order. ``{side: {op: (ops_per_s,
    verified)}}``; ops/s = the sub-phases' operations / the sum of their walls."""
    keys = [f"meta-key-{i}" for i in range(256)]
    n = calls_per_client(ops, clients, batch)
    with contextlib.ExitStack() as stack:
        drivers = {}
        for side in sides:
            addr, md = stack.enter_context(store_bench._mooncake_cluster() if side == "mooncake"
                                           else _ours_cluster())
            holder = _store(side)  # the segment the keys live in
            stack.callback(holder.close)
            if holder.setup("localhost", md, 64 * MiB, 16 * MiB, "tcp", "", addr) != 0:
                raise RuntimeError(f"{side}: holder setup failed")
            for k in keys:
                if holder.put(k, bytes(VALUE_BYTES)) != 0:
                    raise RuntimeError(f"{side}: put of {k} failed")
            drivers[side] = _Clients(side, addr, md, clients, n, batch, keys)
            stack.callback(drivers[side].close)
        return alternate([drivers[side] for side in sides], n)


def alternate(drivers: list[Any], n: int, subphases: int = SUBPHASES
              ) -> dict[str, dict[str, tuple[float, bool]]]:
    """Each op kind's calls ``0..n`` of a client, cut into ``subphases`` sub-phases that the
    ``drivers`` (each with ``side`` and ``phase(op, lo, hi) -> (wall_s, operations,
    verified)``) take in turn: in list order for even sub-phases, reversed for odd ones
    (A B, B A, A B, ...: each side goes first, and follows the other, alike).
    ``{side: {op: (operations / the sum of the walls, all verified)}}``."""
    totals = {d.side: {op: [0.0, 0, True] for op in OPS} for d in drivers}
    bounds = [n * i // subphases for i in range(subphases + 1)]
    for op in OPS:
        for k, (lo, hi) in enumerate(zip(bounds, bounds[1:], strict=False)):
            for d in (drivers if k % 2 == 0 else drivers[::-1]):
                wall, done, ok = d.phase(op, lo, hi)
                t = totals[d.side][op]
                t[0] += wall
                t[1] += done
                t[2] = t[2] and ok
    return {side: {op: (t[1] / t[0], bool(t[2])) for op, t in per.items()}
            for side, per in totals.items()}


def calls_per_client(ops: int, clients: int, batch: int) -> int:
    """Calls a client makes per op kind: ``ops // clients``, at least ``batch`` (the
    ``remove`` phase needs as many keys as a batch has)."""
    return max(batch, ops // clients)


def _ours_cluster() -> Any:
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
    ``num_clients`` = calls in flight on each side, ``batch_keys``, ``verified``, ``ops``
    = the operations each side made per op kind and round (keys for ``batch_is_exist``;
    ``calls_per_client`` × ``clients``, so ``ops`` rounded to a multiple of ``clients``).
    ``ValueError`` unless ``ops``, ``clients``, ``batch`` and ``repeat`` are all >= 1."""
    for name, v in (("ops", ops), ("clients", clients), ("batch", batch), ("repeat", repeat)):
        if type(v) is not int or v < 1:
            raise ValueError(f"store_meta.run: {name}={v!r}, need an int >= 1")
    done = calls_per_client(ops, clients, batch) * clients
    mc = with_mooncake and store_bench.mooncake_available()
    ours_runs, theirs_runs = [], []
    for r in range(repeat):
        sides = ["ours", "mooncake"] if mc else ["ours"]
        got = _round(sides if r % 2 == 0 else sides[::-1], ops, clients, batch)
        ours_runs.append(got["ours"])
        if mc:
            theirs_runs.append(got["mooncake"])
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
            ops=done * batch if op == "batch_is_exist" else done, verified=ok,
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
