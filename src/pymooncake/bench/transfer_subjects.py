"""The subjects of ``pymooncake bench transfer``, each set up once and driven one round at a
time, so that ``bench.transfer.run`` can alternate single rounds of every subject.

Why rounds and not blocks: on a shared host the memory bandwidth and the CPU left to this
process swing by 2-3x within a second (issue 16, session 32's shm repeats: memcpy ran
5.9-15.4 GB/s from one repeat to the next). A subject measured in a block of its own for
half a second then meets other weather than the next subject's block, and the per-repeat
ratio carries that swing (0.39-1.71 for our shm copy against memcpy in that run). Rounds
taken in turn, a few milliseconds each, meet the same weather.

A subject's ``round()`` returns ``(write_s, read_s)`` and moves ``bytes_per_round`` bytes;
``child_cpu_s()`` is the CPU seconds so far of the child processes that work for it, which
the caller reads at a repeat's start and end (so a child that spins while other subjects
run pays for it); the parent process's own CPU is counted around the subject's own rounds
when ``parent_cpu`` (the parent is then the subject's initiator or receiver). ``check()``
compares what the repeat's rounds read back with the source and clears the destination for
the next repeat. Children talk over stdin/stdout lines, never pickle.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from pymooncake.bench import transfer_refs as refs
from pymooncake.transfer.batch import TransferOp, TransferRequest
from pymooncake.transfer.config import TransferConfig
from pymooncake.transfer.memory import view_at

MOONCAKE_SCRIPT = Path(__file__).with_name("mooncake_te.py")


def digest(addr: int, n: int) -> str:
    """BLAKE2b-128 of ``n`` bytes at ``addr`` (the read-back check of a target)."""
    return hashlib.blake2b(view_at(addr, n), digest_size=16).hexdigest()


def spawn_child(*args: str) -> subprocess.Popen[str]:
    """``python -m pymooncake.bench.transfer ARGS`` with line pipes (a target process)."""
    return subprocess.Popen([sys.executable, "-m", "pymooncake.bench.transfer", *args],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env=refs.child_env())


class MooncakeFailed(RuntimeError):
    """Mooncake's initiator failed or answered out of protocol (the run goes on without it)."""


class Subject:
    """One subject: set up at construction, ``round()`` at will, ``close()`` once."""

    name = ""
    bytes_per_round = 0
    parent_cpu = True
    pids: tuple[int, ...] = ()

    def round(self) -> tuple[float, float]:
        raise NotImplementedError

    def child_cpu_s(self) -> float:
        return sum(refs.tasks_cpu_s(p) for p in self.pids)

    def check(self) -> bool:
        return True

    def close(self) -> None:
        return None


class Ours(Subject):
    """Our Transfer Engine: ``batch`` writes of ``size_bytes`` into the target (the same
    engine for ``local``, another process's shared memory for ``shm``, another process's
    ordinary memory for ``cma``, another process over ``paths`` connections for ``tcp``),
    then ``batch`` reads back into a second buffer. tcp rounds use ``batch_transfer_sync``
    (as Mooncake's bench does), local/shm/cma rounds ``submit`` + ``wait`` (the
    asynchronous copy thread)."""

    name = "pymooncake"

    def __init__(self, transport: str, size_bytes: int, batch: int, paths: int) -> None:
        from pymooncake.metadata.http import MetadataHttpServer
        from pymooncake.transfer.engine import TransferEngine

        self.total = total = size_bytes * batch
        self.bytes_per_round = 2 * total
        self.proc: subprocess.Popen[str] | None = None
        self.server = MetadataHttpServer("127.0.0.1", 0).start()
        transports = {"local": ("local",), "shm": ("local", "shm"), "cma": ("local", "cma"),
                      "tcp": ("local", "tcp")}
        cfg = TransferConfig(num_paths=paths, transports=transports[transport])
        self.eng = eng = TransferEngine(f"bench-initiator-{os.getpid()}", self.server.url,
                                        config=cfg).start()
        try:
            self.src = np.random.default_rng(2).integers(0, 256, total, dtype=np.uint8)
            self.dst = np.zeros(total, dtype=np.uint8)
            self.src_addr = eng.register_memory(self.src)
            dst_addr = eng.register_memory(self.dst)
            if transport == "local":
                target = eng.segment_name
                self.tbuf = np.zeros(total, dtype=np.uint8)
                taddr = eng.register_memory(self.tbuf)
            else:
                target = f"bench-target-{os.getpid()}"
                self.proc = spawn_child("--serve", self.server.url, target, str(total),
                                        transport if transport in ("shm", "cma") else "plain")
                self.pids = (self.proc.pid,)
                taddr = int(refs.readline(self.proc))
            self.writes = [TransferRequest(TransferOp.WRITE, self.src_addr + i * size_bytes,
                                           target, taddr + i * size_bytes, size_bytes)
                           for i in range(batch)]
            self.reads = [TransferRequest(TransferOp.READ, dst_addr + i * size_bytes,
                                          target, taddr + i * size_bytes, size_bytes)
                          for i in range(batch)]
            self._do = self._sync if transport == "tcp" else self._async
            self.ok = True
            self.round()  # warm-up: connections, mappings
            self.dst[:] = 0
        except BaseException:
            self.close()
            raise

    def _async(self, reqs: list[TransferRequest]) -> bool:
        eng = self.eng
        bid = eng.allocate_batch(len(reqs))
        eng.submit(bid, reqs)
        st = eng.wait(bid)
        eng.free_batch(bid)
        return all(s.ok for s in st)

    def _sync(self, reqs: list[TransferRequest]) -> bool:
        return all(s.ok for s in self.eng.batch_transfer_sync(reqs))

    def round(self) -> tuple[float, float]:
        t0 = time.perf_counter()
        okw = self._do(self.writes)
        t1 = time.perf_counter()
        okr = self._do(self.reads)
        t2 = time.perf_counter()
        self.ok = self.ok and okw and okr
        return t1 - t0, t2 - t1

    def check(self) -> bool:
        """Every round since the last check succeeded, the read-back equals the source, and
        so does the target's copy (its digest, asked of the target process); then the
        read-back buffer is cleared for the next repeat."""
        ok = self.ok and bool(np.array_equal(self.dst, self.src))
        if self.proc is not None:
            ok = ok and refs.ask(self.proc, "digest") == digest(self.src_addr, self.total)
        self.dst[:] = 0
        self.ok = True
        return ok

    def close(self) -> None:
        if self.proc is not None:
            refs.stop(self.proc)
        self.eng.close()
        self.server.stop()


class Memcpy(Subject):
    """numpy copies doing the engine's round: the working set copied in ``size_bytes``
    pieces from a source into a target buffer ("write"), then from the target into a third
    buffer ("read") — the same bytes through the same three buffers as an engine round."""

    name = "memcpy"

    def __init__(self, size_bytes: int, batch: int) -> None:
        total = size_bytes * batch
        self.bytes_per_round = 2 * total
        self.size, self.batch = size_bytes, batch
        self.src = np.random.default_rng(0).integers(0, 256, total, dtype=np.uint8)
        self.mid = np.zeros_like(self.src)
        self.dst = np.zeros_like(self.src)
        self.round()
        self.dst[:] = 0

    def check(self) -> bool:
        ok = bool(np.array_equal(self.dst, self.src))
        self.dst[:] = 0
        return ok

    def round(self) -> tuple[float, float]:
        n = self.size
        t0 = time.perf_counter()
        for i in range(self.batch):
            np.copyto(self.mid[i * n:(i + 1) * n], self.src[i * n:(i + 1) * n])
        t1 = time.perf_counter()
        for i in range(self.batch):
            np.copyto(self.dst[i * n:(i + 1) * n], self.mid[i * n:(i + 1) * n])
        return t1 - t0, time.perf_counter() - t1


class Sockets(Subject):
    """Plain Python sockets from a child process: ``connections`` sockets, each streaming
    its share of the working set (``sendall`` of ``min(size, 4 MiB)`` chunks; ``recv_into``
    here), one thread per connection on both ends. A round moves the working set once
    (``(seconds, 0.0)``).

    Like the engine's rounds, the bytes come from a working-set-sized source buffer in the
    child and land in a working-set-sized buffer here, each connection at its own offsets
    (not a small buffer sent again and again, which stays in the CPU caches: on this
    machine that alone makes loopback copying ~1.5x cheaper per byte)."""

    name = "socket"

    def __init__(self, size_bytes: int, batch: int, connections: int) -> None:
        total = size_bytes * batch
        self.bytes_per_round = total
        self.chunk = max(1, min(size_bytes, refs.STREAM_CHUNK_MAX))
        self.shares = refs.shares(total, connections)
        self.starts = [sum(self.shares[:i]) for i in range(connections)]
        self.conns: list[socket.socket] = []
        self.pool = ThreadPoolExecutor(connections)
        self.srv = socket.create_server(("127.0.0.1", 0))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pymooncake.bench.transfer", "--stream-send",
             str(self.srv.getsockname()[1]), str(total), str(self.chunk), str(connections)],
            stdin=subprocess.PIPE, text=True, env=refs.child_env())
        self.pids = (self.proc.pid,)
        try:
            self.srv.settimeout(60)
            for _ in range(connections):
                conn, _ = self.srv.accept()
                conn.settimeout(60)
                # as every engine's sockets: without it a round ends in a delayed-ACK stall
                # (~40 ms; 12 MB/s at 4 KiB x 128 in 7 of 9 repeats of one run)
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self.conns.append(conn)
            self.dst = np.zeros(total, dtype=np.uint8)
            self.view = memoryview(self.dst)
            self.round()  # warm-up
            self.want = refs.stream_source(total)
            self.dst[:] = 0
        except BaseException:
            self.close()
            raise

    def _receive(self, i: int) -> None:
        conn, pos = self.conns[i], self.starts[i]
        end = pos + self.shares[i]
        conn.sendall(b"g")  # ask for one round of this connection's share
        while pos < end:
            n = conn.recv_into(self.view[pos:min(pos + self.chunk, end)])
            if n == 0:
                raise RuntimeError("stream sender closed early")
            pos += n

    def round(self) -> tuple[float, float]:
        t0 = time.perf_counter()
        for f in [self.pool.submit(self._receive, i) for i in range(len(self.conns))]:
            f.result()
        return time.perf_counter() - t0, 0.0

    def check(self) -> bool:
        ok = bool(np.array_equal(self.dst, self.want))
        self.dst[:] = 0
        return ok

    def close(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.sendall(b"q")
            conn.close()
        self.pool.shutdown(wait=False)
        self.srv.close()
        refs.stop(self.proc)


class Mooncake(Subject):
    """Mooncake's engine doing the same rounds, driven round by round: ``mooncake_te.py
    rounds`` under ``python`` (the wheel's interpreter) is the initiator and starts its
    own target. Its CPU (itself and its target, which it reads) is asked for with ``cpu``;
    this process only waits on the pipe meanwhile, which is harness, not Mooncake
    (``parent_cpu`` False). Any failure or answer out of protocol raises
    ``MooncakeFailed``."""

    name = "mooncake"
    parent_cpu = False

    def __init__(self, python: str, size_bytes: int, batch: int) -> None:
        self.bytes_per_round = 2 * size_bytes * batch
        self.proc = subprocess.Popen([python, str(MOONCAKE_SCRIPT), "rounds", str(size_bytes),
                                      str(batch)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     text=True, env=refs.child_env())
        try:
            if self._reply(lambda: refs.readline(self.proc, timeout_s=120)) != "ready":
                raise MooncakeFailed("mooncake initiator did not get ready")
        except BaseException:
            refs.stop(self.proc)
            raise

    @staticmethod
    def _reply(read: Callable[[], str]) -> str:
        try:
            return read()
        except (OSError, RuntimeError) as e:
            raise MooncakeFailed(f"mooncake initiator: {e}") from e

    def _numbers(self, line: str, n: int) -> list[float]:
        """The ``n`` numbers the initiator answers to ``line``."""
        answer = self._reply(lambda: refs.ask(self.proc, line))
        try:
            got = [float(x) for x in answer.split()]
        except ValueError:
            got = []
        if len(got) != n:
            raise MooncakeFailed(f"mooncake initiator answered {answer!r} to {line!r}")
        return got

    def round(self) -> tuple[float, float]:
        w, r = self._numbers("r", 2)
        return w, r

    def child_cpu_s(self) -> float:
        return self._numbers("cpu", 1)[0]

    def check(self) -> bool:
        return self._reply(lambda: refs.ask(self.proc, "verify")) == "1"

    def close(self) -> None:
        refs.stop(self.proc)
