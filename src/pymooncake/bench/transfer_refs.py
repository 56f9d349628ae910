"""The references of ``pymooncake bench transfer``: memcpy and plain sockets (K connections).

Also what the harness shares: median rounds, CPU accounting (seconds of CPU, all threads,
of this process and the given children, per GiB moved), line I/O with a timeout,
stopping a child. Every ``measure_*`` returns ``(bytes/s, CPU seconds per GiB)``.
"""

from __future__ import annotations

import os
import select
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

STREAM_CHUNK_MAX = 4 * 1024 * 1024
GiB = 1024**3


def child_env() -> dict[str, str]:
    """The environment of every subject's child process: numpy's BLAS pool kept to one
    thread (its idle worker threads otherwise spin and count as the subject's CPU)."""
    return {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}


def proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads) from /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class CpuMeter:
    """CPU seconds spent by this process and ``pids`` since construction."""

    def __init__(self, *pids: int) -> None:
        self.pids = pids
        self._t0 = time.process_time()
        self._c0 = [proc_cpu_s(p) for p in pids]

    def seconds(self) -> float:
        own = time.process_time() - self._t0
        return own + sum(proc_cpu_s(p) - c for p, c in zip(self.pids, self._c0, strict=True))


def median_rounds(fn: Callable[[], tuple[float, float]], min_rounds: int,
                  min_time_s: float, max_rounds: int = 10_000) -> tuple[float, float, int]:
    """Run ``fn`` (→ (write_s, read_s)) until both limits are met; the medians."""
    w, r = [], []
    t_end = time.perf_counter() + min_time_s
    while len(w) < max_rounds and (len(w) < min_rounds or time.perf_counter() < t_end):
        ws, rs = fn()
        w.append(ws)
        r.append(rs)
    return statistics.median(w), statistics.median(r), len(w)


def readline(proc: subprocess.Popen[str], timeout_s: float = 60.0) -> str:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    line = proc.stdout.readline() if ready else ""
    if not line:
        proc.kill()
        raise RuntimeError("benchmark child process did not answer")
    return line.strip()


def ask(proc: subprocess.Popen[str], line: str) -> str:
    assert proc.stdin is not None
    proc.stdin.write(line + "\n")
    proc.stdin.flush()
    return readline(proc)


def stop(proc: subprocess.Popen[str]) -> None:
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


def measure_memcpy(size_bytes: int, batch: int, min_time_s: float) -> tuple[float, float]:
    """Bytes/s of numpy copies doing the engine's round: the working set copied in
    ``size_bytes`` pieces from a source into a target buffer ("write"), then from the
    target into a third buffer ("read") — the same bytes through the same three buffers
    as a Transfer Engine round, counted the same way (2 × working set / round)."""
    total = size_bytes * batch
    src = np.random.default_rng(0).integers(0, 256, total, dtype=np.uint8)
    mid = np.zeros_like(src)
    dst = np.zeros_like(src)

    def one() -> tuple[float, float]:
        t0 = time.perf_counter()
        for i in range(batch):
            np.copyto(mid[i * size_bytes:(i + 1) * size_bytes],
                      src[i * size_bytes:(i + 1) * size_bytes])
        t1 = time.perf_counter()
        for i in range(batch):
            np.copyto(dst[i * size_bytes:(i + 1) * size_bytes],
                      mid[i * size_bytes:(i + 1) * size_bytes])
        return t1 - t0, time.perf_counter() - t1

    one()
    cpu = CpuMeter()
    w, r, n = median_rounds(one, 5, min_time_s)
    return 2 * total / (w + r), cpu.seconds() / (2 * total * n / GiB)


def _shares(total: int, connections: int) -> list[int]:
    base, extra = divmod(total, connections)
    return [base + (1 if i < extra else 0) for i in range(connections)]


def measure_socket_stream(size_bytes: int, batch: int, connections: int,
                          min_time_s: float) -> tuple[float, float]:
    """Bytes/s of plain Python sockets from a child process: ``connections`` sockets, each
    streaming its share of the working set (``sendall`` of ``min(size, 4 MiB)`` chunks;
    ``recv_into`` here), one thread per connection on both ends.

    Like the engine's rounds, the bytes come from a working-set-sized source buffer in the
    child and land in a working-set-sized buffer here, each connection at its own offsets
    (not a small buffer sent again and again, which stays in the CPU caches: on this
    machine that alone makes loopback copying ~1.5x cheaper per byte)."""
    total = size_bytes * batch
    chunk = max(1, min(size_bytes, STREAM_CHUNK_MAX))
    shares = _shares(total, connections)
    starts = [sum(shares[:i]) for i in range(connections)]
    with socket.create_server(("127.0.0.1", 0)) as srv:
        port = srv.getsockname()[1]
        proc = subprocess.Popen(
            [sys.executable, "-m", "pymooncake.bench.transfer", "--stream-send", str(port),
             str(total), str(chunk), str(connections)], stdin=subprocess.PIPE, text=True,
            env=child_env())
        conns: list[socket.socket] = []
        try:
            srv.settimeout(60)
            for _ in range(connections):
                conn, _ = srv.accept()
                conn.settimeout(60)
                # as every engine's sockets: without it a round ends in a delayed-ACK stall
                # (~40 ms; 12 MB/s at 4 KiB x 128 in 7 of 9 repeats of one run)
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                conns.append(conn)
            dst = np.zeros(total, dtype=np.uint8)
            view = memoryview(dst)

            def receive(i: int) -> None:
                conn, pos, end = conns[i], starts[i], starts[i] + shares[i]
                conn.sendall(b"g")  # ask for one round of this connection's share
                while pos < end:
                    n = conn.recv_into(view[pos:min(pos + chunk, end)])
                    if n == 0:
                        raise RuntimeError("stream sender closed early")
                    pos += n

            times = []
            with ThreadPoolExecutor(connections) as pool:
                for f in [pool.submit(receive, i) for i in range(connections)]:
                    f.result()  # warm-up round
                cpu = CpuMeter(proc.pid)
                t_end = time.perf_counter() + min_time_s
                while len(times) < 6 or time.perf_counter() < t_end:
                    t0 = time.perf_counter()
                    for f in [pool.submit(receive, i) for i in range(connections)]:
                        f.result()
                    times.append(time.perf_counter() - t0)
                cpu_s = cpu.seconds()
            for conn in conns:
                conn.sendall(b"q")
        finally:
            for conn in conns:
                conn.close()
            stop(proc)
    return total / statistics.median(times), cpu_s / (total * len(times) / GiB)


def stream_send(port: int, total: int, chunk: int, connections: int) -> None:
    """The child of :func:`measure_socket_stream`: one sending thread per connection."""
    data = np.random.default_rng(1).integers(0, 256, total, dtype=np.uint8)
    view = memoryview(data)
    shares = _shares(total, connections)
    starts = [sum(shares[:i]) for i in range(connections)]
    socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(connections)]
    for s in socks:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def send(i: int) -> None:
        s = socks[i]
        while s.recv(1) == b"g":
            pos, end = starts[i], starts[i] + shares[i]
            while pos < end:
                n = min(chunk, end - pos)
                s.sendall(view[pos:pos + n])
                pos += n

    threads = [threading.Thread(target=send, args=(i,)) for i in range(connections)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for s in socks:
        s.close()
