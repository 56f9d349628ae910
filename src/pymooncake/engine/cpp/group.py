"""``CppGroup``: start N stage processes, prefill long prompts through them, collect KV.

The group is the prefill side of one CPP instance (docs/cpp.md): stage ``i`` holds layers
``split_layers(L, N)[i]``, pinned to ``cores[i]`` with one torch thread. ``prefill`` sends
the prompt to stage 0, which cuts it into chunks; the result (first token, greedy) comes
from the last stage. ``export_kv`` reads every stage's layers of a request back and
``exported_blocks`` turns the full blocks into ``ExportedBlock`` s that a decode ``Engine``
imports (``Engine.import_blocks``) to continue the request.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import select
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pymooncake.engine.cpp.stage import ERROR_PREFIX, READY_PREFIX
from pymooncake.engine.engine import ExportedBlock
from pymooncake.identity import CacheNamespace, block_keys
from pymooncake.rpc import SyncRpcClient


class CppError(RuntimeError):
    """A stage failed to start, or a prefill failed in a stage (message says which)."""


@dataclass(frozen=True, slots=True)
class CppPrefillResult:
    request_id: str
    first_token: int
    ttft_s: float
    """From the ``cpp.prefill`` call to the last stage's answer (coordinator's clock)."""


class CppGroup:
    """A running group of ``num_stages`` stage processes (use as a context manager)."""

    def __init__(self, model: str = "tiny", num_stages: int = 2,
                 cores: Sequence[int] | None = None, num_blocks: int = 1024,
                 block_size: int = 16, chunk_tokens: int = 512, edge_tokens: int = 128,
                 dtype: str = "float32",
                 startup_timeout_s: float = 300.0,
                 nice: int = 0) -> None:
        if chunk_tokens <= 0:
            raise ValueError(f"chunk_tokens must be > 0, got {chunk_tokens}")
        self.model, self.num_stages, self.chunk_tokens = model, num_stages, chunk_tokens
        self.edge_tokens = edge_tokens
        """Chunk size at the prompt's two ends (``runtime.chunk_bounds``); 0: none."""
        self.block_size = block_size
        self.cores = list(cores) if cores is not None else None
        if self.cores is not None and len(self.cores) != num_stages:
            raise ValueError(f"{len(self.cores)} cores for {num_stages} stages")
        self._num_blocks, self._dtype, self._nice = num_blocks, dtype, nice
        self._timeout = startup_timeout_s
        self.procs: list[subprocess.Popen[str]] = []
        self.clients: list[SyncRpcClient] = []
        self.ranges: list[tuple[int, int]] = []
        self.ports: list[int] = []
        self.vocab_size = self.hidden_size = 0
        self._ids = itertools.count()

    def __enter__(self) -> CppGroup:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        """Start the stages and wire each to the next. Raises ``CppError``."""
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        for i in range(self.num_stages):
            cmd = [sys.executable, "-m", "pymooncake.engine.cpp.stage", "--model", self.model,
                   "--stage", str(i), "--num-stages", str(self.num_stages),
                   "--num-blocks", str(self._num_blocks),
                   "--block-size", str(self.block_size), "--dtype", self._dtype]
            if self.cores is not None:
                cmd += ["--core", str(self.cores[i])]
            if self._nice:
                cmd = ["nice", "-n", str(self._nice)] + cmd
            # own session: with autogroup scheduling (Linux) each stage gets its core's
            # fair share like a separate server, not a slice of one group's share
            self.procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True,
                                               env=env, start_new_session=True))
        try:
            ports = [self._wait_ready(p) for p in self.procs]
        except BaseException:
            self.close()
            raise
        self.ports = ports
        self.clients = [SyncRpcClient("127.0.0.1", port, timeout_s=60.0) for port in ports]
        infos = [c.call("cpp.info") for c in self.clients]
        self.ranges = [(int(x["start"]), int(x["stop"])) for x in infos]
        self.vocab_size = int(infos[0]["vocab_size"])
        self.hidden_size = int(infos[0]["hidden_size"])
        for i in range(self.num_stages - 1):
            self.clients[i].call("cpp.connect", {"host": "127.0.0.1", "port": ports[i + 1]})

    def _wait_ready(self, proc: subprocess.Popen[str]) -> int:
        deadline = time.monotonic() + self._timeout
        assert proc.stdout is not None
        while time.monotonic() < deadline:
            ready, _, _ = select.select([proc.stdout], [], [], 0.5)
            if ready:
                line = proc.stdout.readline()
                if line.startswith(READY_PREFIX):
                    return int(line.split()[1])
                if line.startswith(ERROR_PREFIX):
                    raise CppError(f"CPP {line[len(ERROR_PREFIX):].strip()}")
                if not line and proc.poll() is not None:
                    break
            elif proc.poll() is not None:
                break
        raise CppError(f"CPP stage (pid {proc.pid}) did not start (exit status "
                       f"{proc.poll()}); see its stderr")

    def stage_label(self, i: int) -> str:
        """``stage I (127.0.0.1:PORT, pid P, layers [a, b))``: how errors name a stage."""
        port = self.ports[i] if i < len(self.ports) else "?"
        pid = self.procs[i].pid if i < len(self.procs) else "?"
        layers = f", layers [{self.ranges[i][0]}, {self.ranges[i][1]})" \
            if i < len(self.ranges) else ""
        return f"stage {i} (127.0.0.1:{port}, pid {pid}{layers})"

    def prefill(self, token_ids: Sequence[int], request_id: str | None = None,
                timeout_s: float = 600.0) -> CppPrefillResult:
        """Prefill ``token_ids`` through the pipeline; the first token is greedy.
        Raises ``CppError`` when a stage failed (the message names the stage index, its
        address and pid: ``stage_label``)."""
        rid = request_id or f"cpp-{next(self._ids)}"
        t0 = time.perf_counter()
        self._call(0, "cpp.prefill", {"rid": rid, "token_ids": list(token_ids),
                                      "chunk_tokens": self.chunk_tokens,
                                      "edge_tokens": self.edge_tokens}, rid)
        res = self._call(self.num_stages - 1, "cpp.result", {"rid": rid}, rid,
                         timeout_s=timeout_s)
        return CppPrefillResult(rid, int(res["token"]), time.perf_counter() - t0)

    def _call(self, i: int, method: str, params: dict, rid: str,
              timeout_s: float | None = None) -> Any:
        from pymooncake.rpc.errors import RpcError
        try:
            return self.clients[i].call(method, params, timeout_s=timeout_s)
        except RpcError as e:
            raise CppError(f"CPP group {rid}: {method} to {self.stage_label(i)} failed: "
                           f"{e.message}") from None

    def stats(self, request_id: str) -> list[dict]:
        """Per stage: ``compute_s`` and ``send_s`` per chunk, ``recv_at`` (unix s)."""
        return [c.call("cpp.stats", {"rid": request_id}) for c in self.clients]

    def export_kv(self, request_id: str) -> torch.Tensor:
        """``[num_layers, 2, kv_heads, num_blocks, block_size, head_dim]``: the request's KV
        from every stage, layers in order (one RPC per layer; the stages are read at the
        same time, one thread each: a 1,500-token SmolLM2 prompt is 69 MB)."""
        from concurrent.futures import ThreadPoolExecutor
        dtype = _torch_dtype(self._dtype)

        def stage_layers(i: int) -> list[torch.Tensor]:
            a, b = self.ranges[i]
            out = []
            for j in range(b - a):
                r = self._call(i, "cpp.export_kv", {"rid": request_id, "layer": j},
                               request_id)
                raw = torch.frombuffer(bytearray(r["data"]), dtype=torch.uint8)
                out.append(raw.view(dtype).view(*r["shape"]))
            return out

        with ThreadPoolExecutor(len(self.clients), thread_name_prefix="cpp-export") as pool:
            per_stage = list(pool.map(stage_layers, range(len(self.clients))))
        return torch.stack([t for layers in per_stage for t in layers])

    def release(self, request_id: str) -> None:
        """Free the request's blocks on every stage. Raises ``CppError`` naming the first
        stage that could not be reached (after trying all of them)."""
        err = None
        for i in range(len(self.clients)):
            try:
                self._call(i, "cpp.release", {"rid": request_id}, request_id, timeout_s=5.0)
            except CppError as e:
                err = err or e
        if err is not None:
            raise err

    def close(self) -> None:
        """Stop every stage (shutdown RPC, then terminate/kill what is left)."""
        for c in self.clients:
            with contextlib.suppress(Exception):  # it is going away anyway
                c.call("cpp.shutdown", timeout_s=2.0)
            c.close()
        for p in self.procs:
            try:
                p.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                p.terminate()
                try:
                    p.wait(timeout=5.0)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
            if p.stdout is not None:
                p.stdout.close()
        self.procs, self.clients = [], []


def exported_blocks(kv: torch.Tensor, token_ids: Sequence[int],
                    namespace: CacheNamespace) -> list[ExportedBlock]:
    """The full blocks of a prompt's KV (``CppGroup.export_kv``) as ``ExportedBlock`` s of
    ``namespace`` (the decode engine's: same model, dtype, layout and block size)."""
    bs = namespace.block_size
    keys = block_keys(list(token_ids), namespace)
    digest = namespace.digest()
    out = []
    for i, key in enumerate(keys):
        block = kv[:, :, :, i:i + 1].contiguous()
        out.append(ExportedBlock(key, tuple(token_ids[i * bs:(i + 1) * bs]),
                                 block.view(torch.uint8).numpy().tobytes(), digest))
    return out


def _torch_dtype(name: str) -> torch.dtype:
    from pymooncake.engine.kv.kv_tensors import torch_dtype
    return torch_dtype(name)
