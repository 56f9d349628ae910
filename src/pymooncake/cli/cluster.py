"""``LocalCluster``: a whole serving cluster as child processes on 127.0.0.1.

What ``pymooncake serve``, ``bench serving`` and the serving tests start: the Store master
(with its HTTP metadata server, unless ``metadata`` names another service), the Conductor
with the OpenAI front door, then the workers (started together, so their models load in
parallel). ``start()`` returns once every worker registered and ``/health`` is 200
(``cli.readiness``). Each child is ``python -m pymooncake <role> ...`` and prints one JSON
``ready`` line; the children die with this process (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import contextlib
import json
import sys
from typing import Any


class ClusterSpec:
    """What ``serve`` starts (flags of ``pymooncake serve``)."""

    def __init__(self, **kw: Any) -> None:
        self.num_prefill: int = kw.pop("num_prefill", 1)
        self.num_decode: int = kw.pop("num_decode", 1)
        self.colocated: bool = kw.pop("colocated", False)
        self.prefix_cache: bool = kw.pop("prefix_cache", True)
        self.policy: str = kw.pop("policy", "global-cache")
        self.model: str = kw.pop("model", "tiny")
        """``--model`` of every process; ``tiny`` here (tests, ``bench serving``), while
        ``pymooncake serve`` passes its own default (``registry.default_model()``)."""
        self.port: int = kw.pop("port", 0)
        self.num_kv_blocks: int | None = kw.pop("num_kv_blocks", None)
        """None = sized by the workers (``engine.config.size_kv``)."""
        self.block_size: int = kw.pop("block_size", 16)
        self.max_num_seqs: int = kw.pop("max_num_seqs", 64)
        self.max_model_len: int = kw.pop("max_model_len", 8192)
        self.max_num_batched_tokens: int | None = kw.pop("max_num_batched_tokens", None)
        """None = the workers' default (``WorkerConfig.max_num_batched_tokens``)."""
        self.decode_step_tokens: int | None = kw.pop("decode_step_tokens", None)
        """``--decode-step-tokens`` of every worker (None: not given)."""
        self.decode_step_s: float | None = kw.pop("decode_step_s", None)
        """``--decode-step-s`` of every worker (None: not given)."""
        self.prefill_hold_s: float | None = kw.pop("prefill_hold_s", None)
        """``--prefill-hold-s`` of every worker (None: not given)."""
        self.decode_step_interval_s: float = kw.pop("decode_step_interval_s", 0.0)
        """``--decode-step-interval-s`` of the decode workers (0: off; P/D only)."""
        self.prefill_order: str | None = kw.pop("prefill_order", None)
        """``--prefill-order`` of every worker (None: the workers' default)."""
        self.aging_tokens_per_s: float | None = kw.pop("aging_tokens_per_s", None)
        """``--aging-tokens-per-s`` of every worker (None: the workers' default)."""
        self.num_threads: int = kw.pop("num_threads", 1)
        """torch intra-op threads of every worker's engine (``--threads``)."""
        self.startup_profile_tokens: int | None = kw.pop("startup_profile_tokens", None)
        """``--startup-profile-tokens`` of every worker (None: the workers' default)."""
        self.ttft_slo_s: float = kw.pop("ttft_slo_s", 10.0)
        self.tbt_slo_s: float = kw.pop("tbt_slo_s", 1.0)
        self.profile: str | None = kw.pop("profile", None)
        self.max_concurrency: int = kw.pop("max_concurrency", 64)
        self.queue_capacity: int = kw.pop("queue_capacity", 256)
        self.prefill_concurrency_limit: int | None = kw.pop("prefill_concurrency_limit", None)
        self.quiet: bool = kw.pop("quiet", False)
        self.global_store: bool | None = kw.pop("global_store", None)
        self.global_segment_size: int | None = kw.pop("global_segment_size", None)
        """DRAM each prefill worker gives the Store; None = sized by the workers."""
        self.extra_conductor_flags: list[str] = kw.pop("extra_conductor_flags", [])
        self.metadata: str | None = kw.pop("metadata", None)
        """Transfer Engine metadata URL for the workers (``etcd://…``, ``http://…``);
        None = the master's embedded HTTP metadata server."""
        self.otel: str | None = kw.pop("otel", None)
        self.cpp_argv: list[str] = kw.pop("cpp_argv", [])
        """``--cpp-*`` flags of one more prefill instance, a CPP group (``prefill-cpp``;
        ``cli.cpp_worker``); empty: none."""
        if kw:
            raise TypeError(f"unknown ClusterSpec fields {sorted(kw)}")
        if self.colocated and self.decode_step_interval_s:
            raise ValueError("decode_step_interval_s paces decode workers; a colocated "
                             "cluster has none")


PARENT_ENV = "PYMOONCAKE_DIE_WITH_PARENT"
"""Set by ``LocalCluster`` to its pid in each child's environment: the child's ``main``
asks the kernel for SIGTERM when that parent dies (``die_with_parent``)."""


def die_with_parent() -> None:
    """In a child started by ``LocalCluster`` (``PARENT_ENV`` set): ``PR_SET_PDEATHSIG``
    SIGTERM, and exit at once when the parent is already gone. Done by the child itself
    after exec, not in a ``preexec_fn``: Python code between fork and exec in a parent
    that runs gRPC threads (the etcd client) let gRPC's fork handlers poll a closed epoll
    fd and abort the child (CI: "conductor exited with status -6 … epoll_wait error: Bad
    file descriptor"); without ``preexec_fn`` the spawn is a vfork + exec."""
    import ctypes
    import os
    import signal
    parent = os.environ.pop(PARENT_ENV, None)
    if not parent or not parent.isdigit():
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != int(parent):      # it died before the request above
        raise SystemExit(1)


def _proc_cpu_s(pid: int) -> float | None:
    """utime + stime of ``pid`` in seconds from ``/proc/<pid>/stat``; None if unreadable."""
    import os
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(b")") + 2:].split()   # after "pid (comm) "; state is fields[0]
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class LocalCluster:
    """Master, Conductor and workers as child processes on 127.0.0.1.

    ``start()`` returns when every worker has registered with the Conductor; ``stop()``
    sends SIGTERM to every child (workers first), waits, and kills what is left — always
    call it (``finally``). Raises ``RuntimeError``/``TimeoutError`` from ``start()`` when a
    process exits or is not ready in time (what was started is stopped).
    """

    def __init__(self, spec: ClusterSpec) -> None:
        self.spec = spec
        self.procs: dict[str, Any] = {}
        self._stderr: dict[str, Any] = {}
        """Quiet mode: each child's stderr, kept in an unlinked temporary file so that a
        child that dies while starting is reported with its last lines."""
        self.url = ""
        self.model_name = ""
        """What ``/v1/models`` lists (the Conductor's ``ready`` line)."""
        self.master_addr = ""
        self.metadata_url = ""
        self.worker_addr = ""

    def _spawn(self, name: str, argv: list[str], timeout_s: float = 60.0) -> dict[str, Any]:
        self._popen(name, argv)
        return self._await_ready(name, timeout_s)

    def _popen(self, name: str, argv: list[str]) -> None:
        import os
        import subprocess
        env = dict(os.environ, PYTHONUNBUFFERED="1", **{PARENT_ENV: str(os.getpid())})
        src = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
        stderr = None
        if self.spec.quiet:
            import tempfile
            stderr = self._stderr[name] = tempfile.TemporaryFile()  # noqa: SIM115 - closed in stop()
        p = subprocess.Popen([sys.executable, "-m", "pymooncake", *argv],
                             stdout=subprocess.PIPE, stderr=stderr, env=env)
        self.procs[name] = p

    def _await_ready(self, name: str, timeout_s: float) -> dict[str, Any]:
        """The child's ``ready`` line (JSON); its stdout is drained from then on."""
        import selectors
        import threading
        import time
        p = self.procs[name]
        sel = selectors.DefaultSelector()
        sel.register(p.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                if sel.select(0.1):
                    line = p.stdout.readline()
                    if not line and p.poll() is not None:
                        break
                    if line.startswith(b"{"):
                        info = json.loads(line)
                        if info.get("event") == "ready":
                            threading.Thread(target=_drain, args=(p.stdout,),
                                             daemon=True).start()
                            return info
                elif p.poll() is not None:
                    break
        finally:
            sel.close()
        if p.poll() is not None:
            raise RuntimeError(f"{name} exited with status {p.returncode}{self._tail(name)}")
        raise TimeoutError(f"{name} not ready in {timeout_s:.0f} s")

    def _tail(self, name: str, lines: int = 15) -> str:
        """``"; its stderr ended: …"`` with the last ``lines`` lines (quiet mode), else ""."""
        f = self._stderr.get(name)
        if f is None:
            return ""
        f.seek(0, 2)
        f.seek(max(0, f.tell() - 8192))
        tail = f.read().decode("utf-8", "replace").strip().splitlines()[-lines:]
        return "; its stderr ended:\n  " + "\n  ".join(tail) if tail else "; no stderr"

    def start(self) -> None:
        s = self.spec
        try:
            if s.metadata:
                m = self._spawn("master", ["master", "--port", "0", "--metadata", s.metadata])
                self.metadata_url = s.metadata
            else:
                m = self._spawn("master", ["master", "--port", "0",
                                           "--enable-http-metadata-server",
                                           "--http-metadata-server-port", "0"])
                self.metadata_url = m["metadata_url"]
            self.master_addr = f"127.0.0.1:{m['port']}"
            cflags = ["conductor", "--port", str(s.port), "--worker-port", "0", "--policy",
                      s.policy, "--model", s.model, "--context-length", str(s.max_model_len),
                      "--ttft-slo", str(s.ttft_slo_s), "--tbt-slo", str(s.tbt_slo_s),
                      "--max-concurrency", str(s.max_concurrency),
                      "--queue-capacity", str(s.queue_capacity), "--master",
                      self.master_addr, *s.extra_conductor_flags]
            if s.colocated:
                cflags.append("--colocated")
            if s.profile:
                cflags += ["--profile", s.profile]
            if s.global_store is not None:
                cflags.append("--global-store" if s.global_store else "--no-global-store")
            if s.prefill_concurrency_limit:
                cflags += ["--prefill-concurrency-limit", str(s.prefill_concurrency_limit)]
            if s.otel:
                cflags += ["--otel", s.otel]
            c = self._spawn("conductor", cflags)
            self.url = c["url"]
            self.model_name = c.get("model", s.model)
            self.worker_addr = f"127.0.0.1:{c['worker_port']}"
            common = ["--conductor", self.worker_addr, "--metadata", self.metadata_url,
                      "--model", s.model, "--block-size", str(s.block_size),
                      "--max-num-seqs", str(s.max_num_seqs),
                      "--max-model-len", str(s.max_model_len)]
            if s.num_kv_blocks is not None:
                common += ["--num-kv-blocks", str(s.num_kv_blocks)]
            if s.max_num_batched_tokens is not None:
                common += ["--max-num-batched-tokens", str(s.max_num_batched_tokens)]
            if s.decode_step_tokens is not None:
                common += ["--decode-step-tokens", str(s.decode_step_tokens)]
            if s.decode_step_s is not None:
                common += ["--decode-step-s", repr(s.decode_step_s)]
            if s.prefill_hold_s is not None:
                common += ["--prefill-hold-s", repr(s.prefill_hold_s)]
            if s.prefill_order is not None:
                common += ["--prefill-order", s.prefill_order]
            if s.aging_tokens_per_s is not None:
                common += ["--aging-tokens-per-s", repr(s.aging_tokens_per_s)]
            if s.num_threads != 1:
                common += ["--threads", str(s.num_threads)]
            if s.startup_profile_tokens is not None:
                common += ["--startup-profile-tokens", str(s.startup_profile_tokens)]
            if not s.prefix_cache:
                common.append("--no-prefix-cache")
            if s.otel:
                common += ["--otel", s.otel]
            names = []
            for i in range(s.num_prefill):
                name = f"colocated-{i}" if s.colocated else f"prefill-{i}"
                if s.colocated:
                    argv = ["decode", "--colocated", "--id", name, *common]
                else:
                    argv = ["prefill", "--id", name, "--master", self.master_addr, *common]
                    if s.global_segment_size is not None:
                        argv += ["--global-segment-size", str(s.global_segment_size)]
                self._popen(name, argv)
                names.append(name)
            if s.cpp_argv and not s.colocated:
                self._popen("prefill-cpp", ["prefill", "--id", "prefill-cpp", "--master",
                                            self.master_addr, *common, *s.cpp_argv])
                names.append("prefill-cpp")
            for i in range(0 if s.colocated else s.num_decode):   # colocated: none
                pace = (["--decode-step-interval-s", str(float(s.decode_step_interval_s))]
                        if s.decode_step_interval_s else [])
                self._popen(f"decode-{i}", ["decode", "--id", f"decode-{i}", *common, *pace])
                names.append(f"decode-{i}")
            worker_timeout_s = 60.0 if s.model == "tiny" else 180.0   # a real model loads
            for name in names:
                self._await_ready(name, worker_timeout_s)
            self._wait_serving(names, 30.0)
        except BaseException:
            self.stop()
            raise

    def _wait_serving(self, names: list[str], timeout_s: float) -> None:
        """Until ``/health`` is 200 and lists every worker in ``names``."""
        import time

        from pymooncake.cli.readiness import wait_ready

        def exited() -> str | None:
            dead = [n for n, p in self.procs.items() if p.poll() is not None]
            return f"{dead[0]} exited with status {self.procs[dead[0]].returncode}" \
                if dead else None

        deadline = time.monotonic() + timeout_s
        while True:
            h = wait_ready(self.url, max(0.0, deadline - time.monotonic()), alive=exited)
            missing = set(names) - {w["instance_id"] for w in h.get("workers", [])}
            if not missing:
                return
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{', '.join(sorted(missing))} did not register with the "
                                   f"Conductor in {timeout_s:.0f} s")
            time.sleep(0.1)

    def pids(self) -> dict[str, int]:
        return {n: p.pid for n, p in self.procs.items()}

    def cpu_seconds(self) -> dict[str, float]:
        """User + system CPU seconds each live child has used so far (Linux ``/proc``;
        children whose ``stat`` cannot be read are left out)."""
        return {n: t for n, p in self.procs.items() if (t := _proc_cpu_s(p.pid)) is not None}

    def wait(self) -> None:
        """Block while the cluster can serve. A worker that exits is reported on stderr and
        the others of its role serve on (the Conductor drops it after its load reports
        stop); return when the Store master or the Conductor exits, or when every worker
        of a role (prefill, decode or colocated) has."""
        import time
        reported: set[str] = set()
        pools: dict[str, set[str]] = {}
        for n in self.procs:
            if n not in ("master", "conductor"):
                pools.setdefault(n.rsplit("-", 1)[0], set()).add(n)
        while True:
            dead = {n for n, p in self.procs.items() if p.poll() is not None}
            for n in sorted(dead - reported):
                sys.stderr.write(f"pymooncake: {n} exited with status "
                                 f"{self.procs[n].returncode}\n")
            reported |= dead
            gone = [role for role, names in pools.items() if names <= dead]
            if dead & {"master", "conductor"} or gone:
                why = f"no {gone[0]} worker is left" if gone else \
                    f"{', '.join(sorted(dead & {'master', 'conductor'}))} exited"
                sys.stderr.write(f"pymooncake: {why}; stopping the cluster\n")
                return
            time.sleep(0.5)

    def stop(self) -> None:
        """SIGTERM every child (workers, then conductor, then master), then kill leftovers."""
        import signal
        import subprocess
        import time
        order = list(reversed(list(self.procs.items())))
        for _, p in order:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.send_signal(signal.SIGTERM)
        # One deadline for all children (not 8 s each in turn): the whole stop is bounded
        # by ~8 s + the kills, however many children there are.
        deadline = time.monotonic() + 8.0
        for _, p in order:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
        for _, p in order:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(5)
        for f in self._stderr.values():
            f.close()
        self._stderr.clear()


def _drain(stream: Any) -> None:
    try:
        while stream.read(65536):
            pass
    except (OSError, ValueError):
        pass
