"""EP test helpers: rank processes (``pymooncake ep rank``) on loopback and an in-process
front (``EPService``) serving its RPC API on a background thread."""

from __future__ import annotations

import asyncio
import json
import os
import select
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from pymooncake.engine.ep.dispatch import EPOptions
from pymooncake.engine.ep.models import build_engine
from pymooncake.engine.ep.service import EPService
from pymooncake.engine.sampling import SamplingParams
from pymooncake.rpc import SyncRpcClient

PROMPTS = [[256, 72, 101, 108, 108, 111], [256, 50, 60, 70], [256, 200, 3, 9, 100, 101, 102]]


def ready_line(proc: subprocess.Popen, timeout_s: float = 60.0) -> dict[str, Any]:
    """The JSON ``ready`` line a ``pymooncake ep`` server prints once it listens."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if select.select([proc.stdout], [], [], 0.1)[0]:
            line = proc.stdout.readline()
            if line.startswith('{"event": "ready"'):
                return json.loads(line)
        if proc.poll() is not None:
            err = proc.stderr.read() if proc.stderr else ""
            pytest.fail(f"exited {proc.returncode}: {err}")
    pytest.fail("no ready line")


class Rank:
    def __init__(self, port: int = 0, model: str = "tiny-moe") -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pymooncake", "ep", "rank", "--port", str(port),
             "--model", model],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=dict(os.environ, PYTHONUNBUFFERED="1"))
        self.port = 0

    def wait_ready(self, timeout_s: float = 60.0) -> Rank:
        self.port = int(ready_line(self.proc, timeout_s)["port"])
        return self

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)


class Cluster:
    """Four rank processes shared by a module's tests (torch imports make a rank take
    seconds to start on a loaded box); a test that kills one calls ``replace``."""

    def __init__(self, n: int) -> None:
        self.ranks = [Rank() for _ in range(n)]
        for r in self.ranks:
            r.wait_ready()

    def replace(self, i: int) -> Rank:
        """A new rank process on rank ``i``'s port (after ``i`` was killed)."""
        self.ranks[i].kill()
        self.ranks[i] = Rank(self.ranks[i].port).wait_ready()
        return self.ranks[i]

    def restore(self) -> None:
        for i, r in enumerate(self.ranks):
            if r.proc.poll() is not None:
                self.replace(i)

    def close(self) -> None:
        for r in self.ranks:
            r.kill()


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    c = Cluster(4)
    yield c
    c.close()


class Front:
    """An ``EPService`` with its RPC API served on a background event loop."""

    def __init__(self, ranks: list[Rank], model: str = "tiny-moe", **kw: Any) -> None:
        opts = kw.pop("options", None) or EPOptions()
        self.svc = EPService(model, [("127.0.0.1", r.port) for r in ranks],
                             options=opts, **kw).start()
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        self.port = 0

        def on_ready(port: int) -> None:
            self.port = port
            ready.set()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

        async def start() -> asyncio.Task[None]:
            return asyncio.get_running_loop().create_task(
                self.svc.serve("127.0.0.1", 0, on_ready))
        self.task = asyncio.run_coroutine_threadsafe(start(), self.loop).result(10)
        assert ready.wait(10)

    def client(self) -> SyncRpcClient:
        return SyncRpcClient("127.0.0.1", self.port, timeout_s=60.0)

    def generate(self, ids: list[int], max_tokens: int) -> dict[str, Any]:
        return self.client().call("ep.generate", {"prompt_token_ids": ids,
                                                  "max_tokens": max_tokens})

    def close(self) -> None:
        async def stop() -> None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()
        self.svc.close()


@pytest.fixture()
def front() -> Iterator[Callable[..., Front]]:
    made: list[Front] = []

    def make(ranks: list[Rank], **kw: Any) -> Front:
        f = Front(ranks, **kw)
        made.append(f)
        return f
    yield make
    for f in made:
        f.close()


_REF: dict[int, list[list[int]]] = {}


def reference(max_tokens: int) -> list[list[int]]:
    """Greedy outputs of ``PROMPTS`` from the single-process engine (experts local)."""
    if max_tokens not in _REF:
        torch.set_num_threads(1)
        outs = build_engine("tiny-moe").generate(PROMPTS, SamplingParams(max_tokens=max_tokens))
        _REF[max_tokens] = [list(o.output_token_ids) for o in outs]
    return _REF[max_tokens]


def generate_all(front: Front, max_tokens: int) -> tuple[list[threading.Thread],
                                                         dict[int, dict[str, Any]]]:
    """Start one client thread per prompt; returns the threads and the results map."""
    results: dict[int, dict[str, Any]] = {}

    def one(i: int) -> None:
        results[i] = front.generate(PROMPTS[i], max_tokens)
    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    return threads, results
