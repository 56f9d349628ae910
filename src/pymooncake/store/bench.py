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
``mooncake_ops_per_s``, ``num_clients`` and ``batch_keys`` (byte and latency keys null).
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

MiB = 1 << 20


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(argv: list[str], ready: Callable[[bytes], dict | None], timeout_s: float = 30.0
           ) -> tuple[subprocess.Popen, dict]:
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    sel = selectors.DefaultSelector()
    sel.register(p.stdout, selectors.EVENT_READ)  # type: ignore[arg-type]
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline and p.poll() is None:
            if sel.select(0.1):
                info = ready(p.stdout.readline())  # type: ignore[union-attr]
                if info is not None:
                    return p, info
        raise RuntimeError(f"{argv[0]} did not start")
    except BaseException:
        p.kill()
        raise
    finally:
        sel.close()


def _stop(p: subprocess.Popen) -> None:
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(5)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)


def _ready_json(line: bytes) -> dict | None:
    if line.startswith(b"{"):
        info = json.loads(line)
        if info.get("event") == "ready":
            return info
    return None


@contextlib.contextmanager
def _pymooncake_cluster(segment_bytes: int
                        ) -> Iterator[tuple[str, str, subprocess.Popen | None]]:
    exe = [sys.executable, "-m", "pymooncake"]
    master, info = _spawn([*exe, "master", "--port", "0", "--enable-http-metadata-server",
                           "--http-metadata-server-port", str(_free_port()),
                           "--eviction-high-watermark-ratio", "1.0"], _ready_json)
    addr, md = f"127.0.0.1:{info['port']}", info["metadata_url"]
    server = None
    try:
        _HELPERS[:] = [master.pid]
        if segment_bytes:  # 0: no storage process (the client's own segment holds all)
            server, _ = _spawn([*exe, "store-server", "--master", addr, "--metadata", md,
                                "--global-segment-size", str(segment_bytes),
                                "--transports", "local,tcp"], _ready_json)
            _HELPERS.append(server.pid)
        yield addr, md, server
    finally:
        _HELPERS.clear()
        if server is not None:
            _stop(server)
        _stop(master)


_HELPERS: list[int] = []
"""Pids of the running cluster's other processes (master, storage process): their CPU time
is counted with the bench process's in ``cpu_s_per_op``."""


def _cpu_s(pids: list[int]) -> float:
    """CPU seconds so far of this process (all threads) and of ``pids`` (the sum over their
    threads of Linux's ``/proc/<pid>/task/<tid>/schedstat``, nanoseconds on a CPU)."""
    total = time.process_time()
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    total += int(f.read().split()[0]) / 1e9
            except (OSError, IndexError, ValueError):
                pass
    return total


def _stats(lat: list[float], total_bytes: int) -> dict[str, float]:
    arr = np.array(lat)
    return {"throughput_bytes_per_s": total_bytes / float(arr.sum()) if arr.sum() else 0.0,
            "p50_s": float(np.percentile(arr, 50)), "p99_s": float(np.percentile(arr, 99))}


def _values(size: int, count: int) -> list[bytes]:
    rng = np.random.default_rng(size)
    base = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
    return [i.to_bytes(8, "little") + base[8:] if size >= 8 else base for i in range(count)]


def _run_ops(put: Callable[[str, bytes], Any], get: Callable[[str], bytes],
             remove: Callable[[str], Any], size: int, count: int, tag: str
             ) -> tuple[dict, dict]:
    vals = _values(size, count)
    keys = [f"bench-{tag}-{size}-{i}" for i in range(count)]
    # one untimed put/get first: connections to the data's segment are set up on first
    # use on both sides, and the figures are the steady state
    warm = f"bench-{tag}-{size}-warm"
    put(warm, vals[0])
    ok = get(warm) == vals[0]
    remove(warm)
    put_lat, get_lat = [], []
    pids = list(_HELPERS)
    c0 = _cpu_s(pids)
    for k, v in zip(keys, vals, strict=True):
        t0 = time.perf_counter()
        put(k, v)
        put_lat.append(time.perf_counter() - t0)
    c1 = _cpu_s(pids)
    for k, v in zip(keys, vals, strict=True):
        t0 = time.perf_counter()
        got = get(k)
        get_lat.append(time.perf_counter() - t0)
        ok = ok and got == v
    c2 = _cpu_s(pids)
    for k in keys:
        remove(k)
    return ({**_stats(put_lat, size * count), "verified": ok, "count": count,
             "cpu_s_per_op": (c1 - c0) / count},
            {**_stats(get_lat, size * count), "verified": ok, "count": count,
             "cpu_s_per_op": (c2 - c1) / count})


def _segment_for(sizes: list[int], count: int) -> int:
    return max(64 * MiB, 2 * max(sizes) * min(count, 8) + 16 * MiB)


def _bench_pymooncake(sizes: list[int], count: int, mode: str) -> dict[int, tuple[dict, dict]]:
    from pymooncake.store.client import StoreClient
    from pymooncake.transfer import TransferConfig

    seg = _segment_for(sizes, count)
    out: dict[int, tuple[dict, dict]] = {}
    # embedded: as Mooncake's embedded run, the client's segment is the only one (no
    # storage process, no preferred-segment config to send with every put)
    with _pymooncake_cluster(seg if mode == "remote" else 0) as (addr, md, _server):
        own = mode == "embedded"
        client = StoreClient(addr, md, global_segment_size=seg if own else 0,
                             local_buffer_size=max(sizes) * 2 + MiB,
                             transfer_config=TransferConfig(transports=("local", "tcp"))).start()
        try:
            for size in sizes:
                n = max(4, min(count, (256 * MiB) // size))
                out[size] = _run_ops(client.put, client.get,
                                     lambda k: client.remove(k, force=True), size, n, mode)
        finally:
            client.close()
    return out


_MC_HOLDER = """
import sys, time
sys.path.append(sys.argv[4])
from mooncake.store import MooncakeDistributedStore
s = MooncakeDistributedStore()
rc = s.setup("localhost", sys.argv[1], int(sys.argv[3]), 16 << 20, "tcp", "", sys.argv[2])
print("ready" if rc == 0 else f"failed {rc}", flush=True)
time.sleep(3600)
"""


def mooncake_available() -> bool:
    try:
        import mooncake.store  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "absent"
        return False
    return _mooncake_master() is not None


def _mooncake_master() -> str | None:
    exe = shutil.which("mooncake_master") or os.path.join(os.path.dirname(sys.executable),
                                                          "mooncake_master")
    return exe if os.path.exists(exe) else None


@contextlib.contextmanager
def _mooncake_cluster() -> Iterator[tuple[str, str]]:
    mport, hport = _free_port(), _free_port()
    exe = _mooncake_master()
    assert exe is not None
    master = subprocess.Popen([exe, f"--rpc_port={mport}", "--enable_http_metadata_server=true",
                               "--http_metadata_server_host=127.0.0.1",
                               f"--http_metadata_server_port={hport}",
                               f"--metrics_port={_free_port()}",
                               "--eviction_high_watermark_ratio=1.0"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", mport), 1):
                break
            time.sleep(0.1)
        time.sleep(0.3)
        _HELPERS[:] = [master.pid]
        yield f"127.0.0.1:{mport}", f"http://127.0.0.1:{hport}/metadata"
    finally:
        _HELPERS.clear()
        _stop(master)


def _bench_mooncake(sizes: list[int], count: int, mode: str) -> dict[int, tuple[dict, dict]]:
    from mooncake.store import MooncakeDistributedStore

    seg = _segment_for(sizes, count)
    out: dict[int, tuple[dict, dict]] = {}
    with _mooncake_cluster() as (addr, md):
        holder = None
        if mode == "remote":
            import mooncake

            site = os.path.dirname(os.path.dirname(os.path.abspath(mooncake.__file__)))
            holder, _ = _spawn([sys.executable, "-c", _MC_HOLDER, md, addr, str(seg), site],
                               lambda line: {} if line.startswith(b"ready") else None)
            _HELPERS.append(holder.pid)
        try:
            store = MooncakeDistributedStore()
            rc = store.setup("localhost", md, seg if mode == "embedded" else 0,
                             max(sizes) * 2 + MiB, "tcp", "", addr)
            if rc != 0:
                raise RuntimeError(f"Mooncake setup returned {rc}")
            try:
                for size in sizes:
                    n = max(4, min(count, (256 * MiB) // size))

                    def put(k: str, v: bytes) -> None:
                        if store.put(k, v) != 0:
                            raise RuntimeError("Mooncake put failed")

                    out[size] = _run_ops(put, store.get, lambda k: store.remove(k, True),
                                         size, n, "mc" + mode)
            finally:
                store.close()
        finally:
            if holder is not None:
                _stop(holder)
    return out


# -- master metadata ops/s ---------------------------------------------------------------

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


ROW_KEYS = ("op", "size_bytes", "mode", "count", "throughput_bytes_per_s", "p50_s", "p99_s",
            "verified", "mooncake_throughput_bytes_per_s", "mooncake_p50_s", "ratio",
            "ops_per_s", "mooncake_ops_per_s", "num_clients", "batch_keys", "ops",
            "mooncake_available", "machine", "repeats", "throughput_min", "throughput_max",
            "mooncake_throughput_min", "mooncake_throughput_max", "ratio_min", "ratio_max",
            "cpu_s_per_op", "mooncake_cpu_s_per_op")
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


def run(sizes: list[int], count: int, modes: list[str], metadata_ops: int = 20_000,
        with_mooncake: bool = True, repeat: int = 1) -> list[dict[str, Any]]:
    """Run the benchmark; returns a list of rows (keys ``ROW_KEYS``): one ``put`` and one
    ``get`` row per (mode, size) — throughput in bytes/s (bytes / sum of per-op latencies),
    p50/p99 in s, ``verified`` (every value read back equal) and Mooncake's figures
    (``None`` without the wheel) — then, unless ``metadata_ops`` is 0, the master's
    ``metadata`` and ``metadata_batch`` rows (``ops_per_s`` from 4 client processes).

    ``repeat`` > 1 interleaves the two stores (ours, Mooncake, ours, ... with the order
    swapped every round) and reports medians over the rounds: throughput, p50 and the
    per-round ratio, with the spread (min/max) in ``throughput_min``/``throughput_max``,
    ``mooncake_throughput_min``/``_max`` and ``ratio_min``/``ratio_max``.
    ``cpu_s_per_op`` / ``mooncake_cpu_s_per_op``: CPU seconds (user + system) per operation
    of all the processes of a run — the bench process with its client, the master and
    the storage process (``remote``) — medians over the rounds: the cost of an operation
    that a loaded machine does not blur as it does latency."""
    mc = with_mooncake and mooncake_available()
    machine = f"{os.cpu_count()} CPUs, loopback"
    rows = []
    for mode in modes:
        ours_runs: list[dict[int, tuple[dict, dict]]] = []
        theirs_runs: list[dict[int, tuple[dict, dict]]] = []
        for r in range(max(1, repeat)):
            order = [False, True] if r % 2 == 0 else [True, False]
            for mooncake in order:
                if not mooncake:
                    ours_runs.append(_bench_pymooncake(sizes, count, mode))
                elif mc:
                    theirs_runs.append(_bench_mooncake(sizes, count, mode))
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
                    ratio, r_lo, r_hi = _spread(ratios)
                    extra = {"mooncake_cpu_s_per_op": _spread(
                                 [x["cpu_s_per_op"] for x in theirs])[0],
                             "mooncake_throughput_bytes_per_s": mt,
                             "mooncake_throughput_min": mt_lo, "mooncake_throughput_max": mt_hi,
                             "mooncake_p50_s": _spread([x["p50_s"] for x in theirs])[0],
                             "ratio": ratio, "ratio_min": r_lo, "ratio_max": r_hi}
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
            ratio += f" [{r['ratio_min']:.2f}-{r['ratio_max']:.2f}]"
        lines.append(
            f"{r['op']:4} {r['mode']:8} {r['size_bytes']:>9} "
            f"{r['throughput_bytes_per_s'] / MiB:>9.1f} {r['p50_s'] * 1e6:>9.0f} "
            f"{r['p99_s'] * 1e6:>9.0f} {'yes' if r['verified'] else 'NO':>3} "
            f"{'-' if mt is None else f'{mt / MiB:.1f}':>15} "
            f"{ratio:>6} {_us(r['cpu_s_per_op']):>10} {_us(r['mooncake_cpu_s_per_op']):>9}")
    return "\n".join(lines)
