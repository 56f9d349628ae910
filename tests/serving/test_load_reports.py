"""A worker's load reports (``EngineWorker._report_loop``) to a stand-in Conductor over a
real loopback RPC connection: a changed load goes out at the next look
(``load_report_interval_s``), an unchanged one only as the heartbeat (``load_heartbeat_s``).
The worker is the real base class with its engine left out (``load()`` is set by the test);
``test_idle_decode_worker_sends_heartbeats_only`` runs a real decode worker process."""

from __future__ import annotations

import asyncio
import itertools
import os
import subprocess
import sys
import time
import types
from typing import Any

import pytest

import pymooncake
from pymooncake.engine.worker.base import EngineWorker
from pymooncake.engine.worker.config import WorkerConfig
from pymooncake.metadata.http import MetadataHttpServer
from pymooncake.rpc import RpcServer
from pymooncake.rpc.messages import WorkerInfo, WorkerLoad


class _Worker(EngineWorker):
    """The base class's report loop with a load the test sets."""

    def __init__(self, config: WorkerConfig) -> None:
        super().__init__(config)
        self.current = WorkerLoad(config.instance_id, 0, 0, 100, 100)
        self.engine = types.SimpleNamespace(pool=types.SimpleNamespace(cached_keys=list))

    def worker_info(self) -> WorkerInfo:
        return WorkerInfo(self.config.instance_id, self.config.role, "127.0.0.1", 1, "{}",
                          16, 1600, 8)

    def load(self) -> WorkerLoad:
        return self.current

    def on_engine(self, fn: Any) -> asyncio.Future[Any]:
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(fn())
        return fut


async def _sink() -> tuple[RpcServer, list[tuple[float, WorkerLoad]], list[WorkerInfo]]:
    """A stand-in Conductor that records every load report with its arrival time."""
    loads: list[tuple[float, WorkerLoad]] = []
    infos: list[WorkerInfo] = []

    def load(msg: WorkerLoad) -> bool:
        loads.append((time.monotonic(), msg))
        return True

    def register(info: WorkerInfo) -> bool:
        infos.append(info)
        return True

    sink = RpcServer("127.0.0.1", 0)
    sink.register("register_worker", register, WorkerInfo)
    sink.register("worker_load", load, WorkerLoad)
    sink.register("kv_events", lambda _ev: None)
    await sink.start()
    return sink, loads, infos


def test_unchanged_load_is_sent_as_heartbeat_changed_load_at_next_look() -> None:
    """Looks every 50 ms, heartbeat 1 s: an unchanged load is not sent again before the
    heartbeat, a changed one goes at the next look (well before the heartbeat), and the
    heartbeats then come ~1 s apart (margins for a loaded 2-core machine)."""
    async def main() -> None:
        sink, loads, infos = await _sink()
        w = _Worker(WorkerConfig(instance_id="w0", role="decode",
                                 conductor=f"127.0.0.1:{sink.port}",
                                 load_report_interval_s=0.05, load_heartbeat_s=1.0))
        task = asyncio.ensure_future(w._report_loop())
        try:
            for _ in range(200):
                if loads:
                    break
                await asyncio.sleep(0.01)
            assert infos and loads, "the worker never registered and reported"
            await asyncio.sleep(0.3)          # ~6 looks, load unchanged
            assert len(loads) == 1, [t - loads[0][0] for t, _ in loads]
            changed = WorkerLoad("w0", 1, 0, 90, 100)
            w.current = changed
            t_change = time.monotonic()
            for _ in range(100):
                if len(loads) > 1:
                    break
                await asyncio.sleep(0.01)
            assert len(loads) == 2 and loads[1][1] == changed
            # at a look (50 ms), not at the heartbeat (0.7 s away)
            assert loads[1][0] - t_change < 0.5, loads[1][0] - t_change
            await asyncio.sleep(2.5)          # unchanged again: heartbeats at ~1 and ~2 s
            beats = [t for t, _ in loads[1:]]
            assert 2 <= len(beats) - 1 <= 3, beats
            assert all(b - a > 0.6 for a, b in itertools.pairwise(beats)), beats
            assert all(ld == changed for _, ld in loads[1:])
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            if w._conductor is not None:
                await w._conductor.close()
            await sink.stop()

    asyncio.run(main())


def test_heartbeat_shorter_than_the_look_is_refused() -> None:
    with pytest.raises(ValueError, match="load_heartbeat_s"):
        WorkerConfig(instance_id="w0", role="decode", conductor="127.0.0.1:1",
                     load_report_interval_s=0.2, load_heartbeat_s=0.1)


def test_idle_decode_worker_sends_heartbeats_only() -> None:
    """A real decode worker process (tiny model), idle: 2 load reports a second (the default
    0.5 s heartbeat), not 10 (one each 100 ms look), and each one still its true load."""
    async def main() -> None:
        sink, loads, infos = await _sink()
        metadata = MetadataHttpServer("127.0.0.1", 0).start()
        src = os.path.dirname(os.path.dirname(pymooncake.__file__))
        proc = subprocess.Popen(
            [sys.executable, "-m", "pymooncake", "decode", "--id", "idle-decode",
             "--conductor", f"127.0.0.1:{sink.port}", "--metadata", metadata.url,
             "--model", "tiny",
             "--max-model-len", "1024", "--num-kv-blocks", "128"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            env=dict(os.environ, PYTHONPATH=src + os.pathsep + os.environ.get("PYTHONPATH", "")))
        try:
            for _ in range(1200):
                if loads or proc.poll() is not None:
                    break
                await asyncio.sleep(0.1)
            assert loads, f"the decode worker never reported (exit code {proc.poll()})"
            n0 = len(loads)
            await asyncio.sleep(3.0)
            window = loads[n0:]
            assert 4 <= len(window) <= 8, [round(t, 2) for t, _ in window]
            assert all(ld.num_running == 0 and ld.num_waiting == 0
                       and ld.num_free_blocks == ld.num_kv_blocks == 128 for _, ld in window)
            assert infos[0].instance_id == "idle-decode"
        finally:
            proc.terminate()
            await sink.stop()
            metadata.stop()
            try:
                proc.wait(20)   # a worker's shutdown is bounded at 10 s
            finally:
                proc.kill()     # nothing when it has exited

    asyncio.run(main())
