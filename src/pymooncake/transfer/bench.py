"""``pymooncake bench transfer``: Transfer Engine throughput against physical references.

Writes a working set of ``batch`` requests of ``size_bytes`` each from this process into a
target process's registered memory and reads it back into a second buffer, repeatedly;
the figure is the median round (write batch + read batch). In the same run it measures
the references of issue #3: memcpy (numpy copy of the same working set in ``size_bytes``
pieces), a plain single-socket loopback stream between two processes, and, when the
``mooncake-transfer-engine-non-cuda`` wheel is importable, Mooncake's own Transfer Engine
(TCP transport, P2P handshake) doing the same rounds.

Child processes are started with ``python -m pymooncake.transfer.bench --serve ...`` and
talk over stdin/stdout lines (no pickle).
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np

from pymooncake.transfer.batch import TransferOp, TransferRequest
from pymooncake.transfer.config import TransferConfig
from pymooncake.transfer.memory import view_at

STREAM_CHUNK_MAX = 4 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class TransferBenchResult:
    transport: str
    size_bytes: int
    batch: int
    paths: int
    rounds: int
    throughput_bytes_per_s: float
    """Median round: (write + read of the working set) bytes / seconds."""
    write_bytes_per_s: float
    read_bytes_per_s: float
    requests_per_s: float
    verified: bool
    memcpy_bytes_per_s: float
    socket_bytes_per_s: float
    mooncake_bytes_per_s: float | None
    mooncake_requests_per_s: float | None
    mooncake_note: str
    ratio_vs_memcpy: float
    ratio_vs_socket: float
    ratio_vs_mooncake: float | None


def _median_rounds(fn: Callable[[], tuple[float, float]], min_rounds: int,
                   min_time_s: float, max_rounds: int = 10_000) -> tuple[float, float, int]:
    """Run ``fn`` (→ (write_s, read_s)) until both limits are met; the medians."""
    w, r = [], []
    t_end = time.perf_counter() + min_time_s
    while len(w) < max_rounds and (len(w) < min_rounds or time.perf_counter() < t_end):
        ws, rs = fn()
        w.append(ws)
        r.append(rs)
    return statistics.median(w), statistics.median(r), len(w)


def _spawn(*args: str, quiet: bool = False) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "pymooncake.transfer.bench", *args],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            stderr=subprocess.DEVNULL if quiet else None)


def _readline(proc: subprocess.Popen[str], timeout_s: float = 60.0) -> str:
    assert proc.stdout is not None
    import select

    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    line = proc.stdout.readline() if ready else ""
    if not line:
        proc.kill()
        raise RuntimeError("benchmark child process did not answer")
    return line.strip()


def _ask(proc: subprocess.Popen[str], line: str) -> str:
    assert proc.stdin is not None
    proc.stdin.write(line + "\n")
    proc.stdin.flush()
    return _readline(proc)


def _stop(proc: subprocess.Popen[str]) -> None:
    try:
        if proc.poll() is None and proc.stdin is not None:
            proc.stdin.write("exit\n")
            proc.stdin.flush()
            proc.wait(timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        pass
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=5)


def _digest(addr: int, n: int) -> str:
    return hashlib.blake2b(view_at(addr, n), digest_size=16).hexdigest()


# --------------------------------------------------------------------------- references
def measure_memcpy(size_bytes: int, batch: int, min_time_s: float) -> float:
    """Bytes/s of numpy copies of the working set in ``size_bytes`` pieces."""
    total = size_bytes * batch
    src = np.random.default_rng(0).integers(0, 256, total, dtype=np.uint8)
    dst = np.empty_like(src)

    def one() -> tuple[float, float]:
        t0 = time.perf_counter()
        for i in range(batch):
            np.copyto(dst[i * size_bytes:(i + 1) * size_bytes],
                      src[i * size_bytes:(i + 1) * size_bytes])
        return time.perf_counter() - t0, 0.0

    one()
    med, _, _ = _median_rounds(one, 5, min_time_s)
    return total / med


def measure_socket_stream(size_bytes: int, batch: int, min_time_s: float) -> float:
    """Bytes/s of a plain Python socket stream from a child process (``sendall`` of
    ``min(size, 4 MiB)`` chunks, ``recv_into`` here)."""
    total = size_bytes * batch
    chunk = max(1, min(size_bytes, STREAM_CHUNK_MAX))
    with socket.create_server(("127.0.0.1", 0)) as srv:
        port = srv.getsockname()[1]
        proc = _spawn("--stream-send", str(port), str(total), str(chunk))
        try:
            conn, _ = srv.accept()
            conn.settimeout(60)
            buf = bytearray(chunk)
            view = memoryview(buf)
            times = []
            t_end = time.perf_counter() + min_time_s
            rounds = 0
            while True:
                t0 = time.perf_counter()
                conn.sendall(b"g")  # ask for one round of `total` bytes
                left = total
                while left:
                    n = conn.recv_into(view[:min(chunk, left)])
                    if n == 0:
                        raise RuntimeError("stream sender closed early")
                    left -= n
                times.append(time.perf_counter() - t0)
                rounds += 1
                if rounds >= 5 and time.perf_counter() > t_end:
                    break
            conn.sendall(b"q")
            conn.close()
        finally:
            _stop(proc)
    return total / statistics.median(times[1:] if len(times) > 2 else times)


def _stream_send(port: int, total: int, chunk: int) -> None:
    data = np.random.default_rng(1).integers(0, 256, chunk, dtype=np.uint8)
    view = memoryview(data)
    with socket.create_connection(("127.0.0.1", port)) as s:
        while s.recv(1) == b"g":
            left = total
            while left:
                n = min(chunk, left)
                s.sendall(view[:n])
                left -= n


# ------------------------------------------------------------------------ pymooncake
def measure_pymooncake(transport: str, size_bytes: int, batch: int, paths: int,
                       min_time_s: float) -> tuple[float, float, int, bool]:
    """(write_s, read_s, rounds, verified) medians for the Transfer Engine."""
    from pymooncake.metadata.http import MetadataHttpServer
    from pymooncake.transfer.engine import TransferEngine

    total = size_bytes * batch
    server = MetadataHttpServer("127.0.0.1", 0).start()
    proc = None
    transports = {"local": ("local",), "shm": ("local", "shm"), "tcp": ("local", "tcp")}
    cfg = TransferConfig(num_paths=paths, transports=transports[transport])
    eng = TransferEngine(f"bench-initiator-{os.getpid()}", server.url, config=cfg).start()
    try:
        src = np.random.default_rng(2).integers(0, 256, total, dtype=np.uint8)
        dst = np.zeros(total, dtype=np.uint8)
        src_addr, dst_addr = eng.register_memory(src), eng.register_memory(dst)
        if transport == "local":
            target = eng.segment_name
            tbuf = np.zeros(total, dtype=np.uint8)
            taddr = eng.register_memory(tbuf)
        else:
            target = f"bench-target-{os.getpid()}"
            proc = _spawn("--serve", server.url, target, str(total),
                          "shm" if transport == "shm" else "plain")
            taddr = int(_readline(proc))
        writes = [TransferRequest(TransferOp.WRITE, src_addr + i * size_bytes, target,
                                  taddr + i * size_bytes, size_bytes) for i in range(batch)]
        reads = [TransferRequest(TransferOp.READ, dst_addr + i * size_bytes, target,
                                 taddr + i * size_bytes, size_bytes) for i in range(batch)]
        ok = True

        def one() -> tuple[float, float]:
            nonlocal ok
            t0 = time.perf_counter()
            sw = eng.batch_transfer_sync(writes)
            t1 = time.perf_counter()
            sr = eng.batch_transfer_sync(reads)
            t2 = time.perf_counter()
            ok = ok and all(s.ok for s in sw) and all(s.ok for s in sr)
            return t1 - t0, t2 - t1

        one()  # warm-up: connections, mappings
        dst[:] = 0
        w, r, rounds = _median_rounds(one, 3, min_time_s)
        verified = ok and bool(np.array_equal(dst, src))
        if proc is not None:
            verified = verified and _ask(proc, "digest") == _digest(src_addr, total)
        return w, r, rounds, verified
    finally:
        if proc is not None:
            _stop(proc)
        eng.close()
        server.stop()


def _serve(metadata_url: str, name: str, total: int, kind: str) -> None:
    from pymooncake.transfer.engine import TransferEngine

    eng = TransferEngine(name, metadata_url).start()
    if kind == "shm":
        addr = eng.allocate_shared(total).addr
    else:
        buf = np.zeros(total, dtype=np.uint8)
        addr = eng.register_memory(buf)
    print(addr, flush=True)
    for line in sys.stdin:
        if line.strip() == "digest":
            print(_digest(addr, total), flush=True)
        elif line.strip() == "exit":
            break
    eng.close()


# -------------------------------------------------------------------------- mooncake
def mooncake_available() -> tuple[bool, str]:
    try:
        from mooncake.engine import TransferEngine  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means "absent"
        return False, f"mooncake-transfer-engine-non-cuda not importable ({e.__class__.__name__})"
    return True, "mooncake-transfer-engine-non-cuda, tcp transport, P2PHANDSHAKE metadata"


def measure_mooncake(size_bytes: int, batch: int, min_time_s: float
                     ) -> tuple[float, float, int, bool]:
    """Same rounds through Mooncake's Python TransferEngine (tcp), initiator and target
    each in a child process (their C++ logging goes to /dev/null)."""
    proc = _spawn("--mooncake-initiate", str(size_bytes), str(batch), str(min_time_s),
                  quiet=True)
    try:
        out = json.loads(_readline(proc, timeout_s=120 + 4 * min_time_s))
    finally:
        _stop(proc)
    return out["write_s"], out["read_s"], out["rounds"], out["verified"]


def _mooncake_initiate(size_bytes: int, batch: int, min_time_s: float) -> None:
    from mooncake.engine import TransferEngine as MooncakeEngine

    total = size_bytes * batch
    proc = _spawn("--mooncake-serve", str(total), quiet=True)
    try:
        target, taddr_s = _readline(proc).split()
        taddr = int(taddr_s)
        te = MooncakeEngine()
        if te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
            raise RuntimeError("mooncake initialize failed")
        src_addr = te.allocate_managed_buffer(total)
        dst_addr = te.allocate_managed_buffer(total)
        if not src_addr or not dst_addr:
            raise RuntimeError("mooncake allocate_managed_buffer failed")
        data = np.random.default_rng(3).integers(0, 256, total, dtype=np.uint8)
        ctypes.memmove(src_addr, data.ctypes.data, total)
        ctypes.memset(dst_addr, 0, total)
        locs = [src_addr + i * size_bytes for i in range(batch)]
        dsts = [dst_addr + i * size_bytes for i in range(batch)]
        rems = [taddr + i * size_bytes for i in range(batch)]
        lens = [size_bytes] * batch
        ok = True

        def one() -> tuple[float, float]:
            nonlocal ok
            t0 = time.perf_counter()
            rw = te.batch_transfer_sync_write(target, locs, rems, lens)
            t1 = time.perf_counter()
            rr = te.batch_transfer_sync_read(target, dsts, rems, lens)
            t2 = time.perf_counter()
            ok = ok and rw == 0 and rr == 0
            return t1 - t0, t2 - t1

        one()
        w, r, rounds = _median_rounds(one, 3, min_time_s)
        verified = ok and bytes(view_at(dst_addr, total)) == data.tobytes()
        print(json.dumps({"write_s": w, "read_s": r, "rounds": rounds, "verified": verified}),
              flush=True)
    finally:
        _stop(proc)


def _mooncake_serve(total: int) -> None:
    from mooncake.engine import TransferEngine as MooncakeEngine

    te = MooncakeEngine()
    if te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        raise SystemExit("mooncake initialize failed")
    addr = te.allocate_managed_buffer(total)
    print(f"127.0.0.1:{te.get_rpc_port()} {addr}", flush=True)
    for line in sys.stdin:
        if line.strip() == "exit":
            break


# ------------------------------------------------------------------------------ main
def run(transport: str, size_bytes: int, batch: int, paths: int, min_time_s: float = 1.0,
        compare_mooncake: bool = True, repeat: int = 1) -> TransferBenchResult:
    """Run the benchmark and its references ``repeat`` times, interleaved (so that load
    from other processes hits all subjects alike); every figure is the median over the
    repeats. Raises ``ValueError`` for bad arguments."""
    if transport not in ("local", "shm", "tcp"):
        raise ValueError(f"transport must be local, shm or tcp, got {transport!r}")
    if size_bytes <= 0 or batch <= 0 or paths <= 0 or repeat <= 0:
        raise ValueError("size, batch, paths and repeat must be positive")
    if size_bytes * batch > 2 * 1024**3:
        raise ValueError("working set size*batch must be <= 2 GiB")
    total = size_bytes * batch
    available, note = mooncake_available()
    use_mooncake = compare_mooncake and available and transport == "tcp"
    if available and transport != "tcp":
        note = "Mooncake comparison runs for --transport tcp only"
    elif available and not compare_mooncake:
        note = "Mooncake comparison disabled (--no-mooncake)"
    ws, rs, memcpys, socks, mcs = [], [], [], [], []
    rounds, verified = 0, True
    for _ in range(repeat):
        w, r, n, ok = measure_pymooncake(transport, size_bytes, batch, paths, min_time_s)
        ws.append(w)
        rs.append(r)
        rounds += n
        verified = verified and ok
        memcpys.append(measure_memcpy(size_bytes, batch, min_time_s / 2))
        socks.append(measure_socket_stream(size_bytes, batch, min_time_s / 2))
        if use_mooncake:
            try:
                mw, mr, _, mok = measure_mooncake(size_bytes, batch, min_time_s)
                mcs.append(mw + mr)
                if not mok:
                    note += "; Mooncake's read-back did not verify"
            except Exception as e:  # noqa: BLE001 - report, do not fail the benchmark
                note = f"mooncake run failed: {e!r}"
                use_mooncake = False
    w, r = statistics.median(ws), statistics.median(rs)
    rt = statistics.median([a + b for a, b in zip(ws, rs, strict=True)])
    thr = 2 * total / rt
    memcpy, sock = statistics.median(memcpys), statistics.median(socks)
    mc_bps = 2 * total / statistics.median(mcs) if mcs else None
    mc_rps = 2 * batch / statistics.median(mcs) if mcs else None
    return TransferBenchResult(
        transport=transport, size_bytes=size_bytes, batch=batch, paths=paths, rounds=rounds,
        throughput_bytes_per_s=thr, write_bytes_per_s=total / w, read_bytes_per_s=total / r,
        requests_per_s=2 * batch / rt, verified=verified, memcpy_bytes_per_s=memcpy,
        socket_bytes_per_s=sock, mooncake_bytes_per_s=mc_bps, mooncake_requests_per_s=mc_rps,
        mooncake_note=note, ratio_vs_memcpy=thr / memcpy, ratio_vs_socket=thr / sock,
        ratio_vs_mooncake=(thr / mc_bps) if mc_bps else None)


def to_json(result: TransferBenchResult) -> dict[str, object]:
    return asdict(result)


def _child_main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="pymooncake.transfer.bench")
    ap.add_argument("--serve", nargs=4, metavar=("URL", "NAME", "BYTES", "KIND"))
    ap.add_argument("--stream-send", nargs=3, type=int, metavar=("PORT", "BYTES", "CHUNK"))
    ap.add_argument("--mooncake-serve", type=int, metavar="BYTES")
    ap.add_argument("--mooncake-initiate", nargs=3, metavar=("SIZE", "BATCH", "MIN_TIME_S"))
    a = ap.parse_args(argv)
    if a.serve:
        _serve(a.serve[0], a.serve[1], int(a.serve[2]), a.serve[3])
    elif a.stream_send:
        _stream_send(*a.stream_send)
    elif a.mooncake_serve:
        _mooncake_serve(a.mooncake_serve)
    elif a.mooncake_initiate:
        size, batch, min_time_s = a.mooncake_initiate
        _mooncake_initiate(int(size), int(batch), float(min_time_s))
    else:
        print(json.dumps(to_json(run("tcp", 1 << 20, 16, 2))))


if __name__ == "__main__":
    _child_main(sys.argv[1:])
