"""What the harness of ``pymooncake bench transfer`` shares: its children's environment,
their CPU seconds (all threads), line I/O with a timeout, stopping a child, and the sending
child of the plain-socket reference (``transfer_subjects.Sockets``)."""

from __future__ import annotations

import os
import select
import socket
import subprocess
import threading

import numpy as np

STREAM_CHUNK_MAX = 4 * 1024 * 1024


def child_env() -> dict[str, str]:
    """The environment of every subject's child process: numpy's BLAS pool kept to one
    thread (its idle worker threads otherwise spin and count as the subject's CPU)."""
    return {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}


def tasks_cpu_s(pid: int) -> float:
    """CPU seconds so far of process ``pid``: the sum over its threads of Linux's
    ``/proc/<pid>/task/<tid>/schedstat`` (nanoseconds on a CPU; ``/proc/<pid>/stat``
    counts in 10 ms ticks, too coarse for one round). 0.0 for a process that is gone."""
    total = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0.0
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, IndexError, ValueError):
            pass
    return total / 1e9


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


def shares(total: int, connections: int) -> list[int]:
    """``total`` bytes split into ``connections`` near-equal shares (the first ones 1 more)."""
    base, extra = divmod(total, connections)
    return [base + (1 if i < extra else 0) for i in range(connections)]


def stream_source(total: int) -> np.ndarray:
    """The bytes ``stream_send`` sends (the socket reference's read-back check)."""
    return np.random.default_rng(1).integers(0, 256, total, dtype=np.uint8)


def stream_send(port: int, total: int, chunk: int, connections: int) -> None:
    """The child of ``transfer_subjects.Sockets``: one sending thread per connection."""
    data = stream_source(total)
    view = memoryview(data)
    parts = shares(total, connections)
    starts = [sum(parts[:i]) for i in range(connections)]
    socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(connections)]
    for s in socks:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def send(i: int) -> None:
        s = socks[i]
        while s.recv(1) == b"g":
            pos, end = starts[i], starts[i] + parts[i]
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
