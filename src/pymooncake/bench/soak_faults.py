"""The soak benchmark's cluster on 3 namespaced hosts and the faults it injects (issue 17
Build items 5 and 7; the same injections as ``tests/faults``).

Hosts (``bench.netns``): h1 runs two HA Store masters (etcd lease ``MASTER_LEASE_S``) and
the Conductor; h2 and h3 each run a ``store-server``, a prefill and a decode worker; etcd
sits on the bridge. Each fault runs from injection to recovery and returns what it saw:

- ``master_leader_kill``: SIGKILL the leading master; a follower takes over (fail-over
  time measured); a fresh master is started so there are two again;
- ``master_leader_freeze``: SIGSTOP the leader past its lease, resume it; it must step
  down (``split_brain``: both masters said "leader" at once after the resume);
- ``storage_host_kill``: SIGKILL a ``store-server`` (h2, then h3, …) and start it again;
- ``prefill_worker_kill``: SIGKILL a prefill worker mid-replay, start it again;
- ``decode_host_partition``: cut a worker host off the bridge for ``PARTITION_S``
  (frames dropped silently), heal it; recovered once its workers registered again;
- ``path_drop``: ``ss -K`` every TCP connection between h2 and h3 (P→D KV paths, Store
  data paths): slices are retried on fresh connections.
"""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pymooncake.bench.netns import Hosts, Role

MASTER_LEASE_S = 2
PARTITION_S = 6.0
CLUSTER_ID = "soak"
FAULTS = ("master_leader_kill", "master_leader_freeze", "storage_host_kill",
          "prefill_worker_kill", "decode_host_partition", "path_drop")
WORKERS = (("prefill-a", 2, "prefill"), ("decode-a", 2, "decode"),
           ("prefill-b", 3, "prefill"), ("decode-b", 3, "decode"))


def wait_for(pred: Callable[[], Any], timeout_s: float, poll_s: float = 0.05) -> Any:
    """``pred()``'s first truthy value within ``timeout_s``, else ``None``."""
    deadline = time.monotonic() + timeout_s
    while True:
        v = pred()
        if v or time.monotonic() >= deadline:
            return v or None
        time.sleep(poll_s)


def rpc_or_none(host: str, port: int, method: str, timeout_s: float = 1.0) -> Any:
    """``method``'s answer from the RPC server at ``host:port``, or ``None`` when it
    cannot be reached or answers an error within ``timeout_s`` seconds."""
    from pymooncake.rpc import RpcError, SyncRpcClient
    c = SyncRpcClient(host, port, timeout_s)
    try:
        return c.call(method)
    except (RpcError, OSError):
        return None
    finally:
        c.close()


class SoakCluster:
    """The 3-host P/D cluster with HA masters (module docstring)."""

    def __init__(self, model: str = "tiny", context: int = 2048, kv_blocks: int = 512,
                 log_dir: str | None = None) -> None:
        self.model, self.context, self.kv_blocks = model, context, kv_blocks
        self.log_dir = log_dir
        """Where each role's output is kept (``Hosts.log_dir``); ``None``: discarded."""
        self.hosts: Hosts | None = None
        self.masters: list[Role] = []
        self.stores: dict[int, Role] = {}
        self.workers: dict[str, Role] = {}
        self.url = ""
        self.killed: list[tuple[float, str]] = []
        """(monotonic time, segment-name prefix) of every Store segment holder killed: its
        replicas were lost with it (the checker's accounting). A store-server's segment is
        ``host:pid:…``; a prefill worker's is its Transfer Engine's, ``<id>-kv``."""

    # -- lifecycle ------------------------------------------------------------------------
    @property
    def h(self) -> Hosts:
        assert self.hosts is not None, "start() first"
        return self.hosts

    @property
    def store_master(self) -> str:
        return f"{self.h.etcd}/{CLUSTER_ID}"

    def _master(self) -> Role:
        h = self.h
        return h.role(1, "master", "--host", h.ip(1), "--port", "0", "--ha",
                      "--etcd-endpoints", h.etcd, "--cluster-id", CLUSTER_ID,
                      "--ha-lease-ttl", str(MASTER_LEASE_S),
                      # the holders' Transfer Engine addresses: re-replication copies from them
                      "--metadata", h.etcd)

    def _store_server(self, host: int) -> Role:
        h = self.h
        return h.role(host, "store-server", "--master", self.store_master, "--metadata",
                      h.etcd, "--global-segment-size", str(64 << 20), "--local-hostname",
                      h.ip(host), "--transports", "tcp", "--heartbeat-interval", "0.2")

    def start(self) -> SoakCluster:
        self.hosts = h = Hosts(3, self.log_dir).start()
        ip1 = h.ip(1)
        self.masters = [self._master() for _ in range(2)]
        if wait_for(self.leader, 20) is None:
            raise RuntimeError("no Store master became leader in 20 s")
        cond = h.role(1, "conductor", "--host", ip1, "--port", "0", "--worker-port", "0",
                      "--global-store", "--store-master", self.store_master,
                      "--model", self.model, "--context-length", str(self.context)).info
        self.url = cond["url"]
        self._cond_workers = f"{ip1}:{cond['worker_port']}"
        def worker(name: str, host: int, kind: str) -> Role:
            extra = ["--master", self.store_master] if kind == "prefill" else []
            return h.role(
                host, kind, "--id", name, "--host", h.ip(host), *extra,
                "--conductor", self._cond_workers, "--metadata", h.etcd, "--model",
                self.model, "--max-model-len", str(self.context), "--num-kv-blocks",
                str(self.kv_blocks), timeout_s=120)

        # the store-servers and workers start together (each role's start is mostly its
        # imports and waits: one after another they took ~20 s)
        with ThreadPoolExecutor(len(WORKERS) + 2) as pool:
            stores = {host: pool.submit(self._store_server, host) for host in (2, 3)}
            workers = {name: pool.submit(worker, name, host, kind)
                       for name, host, kind in WORKERS}
            for host, f in stores.items():
                self.stores[host] = f.result()
            for name, f in workers.items():
                self.workers[name] = f.result()
        if wait_for(lambda: len(self.registered()) == len(WORKERS), 60) is None:
            raise RuntimeError(f"workers not registered in 60 s: {sorted(self.registered())}")
        return self

    def close(self) -> None:
        if self.hosts is not None:
            self.hosts.close()

    # -- views ----------------------------------------------------------------------------
    def leader(self) -> Role | None:
        ip1 = self.h.ip(1)
        for m in self.masters:
            if m.popen.poll() is None:
                st = rpc_or_none(ip1, m.info["port"], "ha_status")
                if st and st.get("role") == "leader":
                    return m
        return None

    def registered(self) -> set[str]:
        import httpx
        try:
            return {w["instance_id"] for w in
                    httpx.get(self.url + "/health", timeout=5).json()["workers"]}
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            return set()

    def _restart(self, role: Role, give_up_s: float = 40.0) -> Role:
        """Start ``role`` again; retried while it exits at start (a killed worker's
        Transfer Engine segment name stays claimed until its lease ends, ~10 s)."""
        deadline = time.monotonic() + give_up_s
        while True:
            try:
                return self.h.restart(role, timeout_s=120)
            except RuntimeError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(2.0)

    def _killed(self, role: Role, t: float, segment: str = "") -> None:
        """Record ``role`` killed at ``t``; ``segment``: its segment's name when it is not
        the Store client's default ``host:pid:…``."""
        self.killed.append((t, segment or f"{self.h.ip(role.host)}:{role.pid}:"))

    # -- faults ---------------------------------------------------------------------------
    def inject(self, name: str, k: int) -> dict[str, Any]:
        """Run fault ``name`` (its ``k``-th time) through its recovery; what it saw, with
        ``t_inject``/``t_recovered`` (monotonic) and ``recovered``."""
        fn = getattr(self, "_" + name, None)
        if name not in FAULTS or fn is None:
            raise ValueError(f"unknown fault {name!r}; known: {', '.join(FAULTS)}")
        ev: dict[str, Any] = {"fault": name}
        try:
            fn(ev, k)
        except RuntimeError as e:       # a role that did not come back: reported, go on
            ev.update(recovered=False, error=str(e))
            ev.setdefault("t_inject", time.monotonic())
        ev.setdefault("recovered", True)
        ev.setdefault("t_recovered", time.monotonic())
        return ev

    def _master_leader_kill(self, ev: dict[str, Any], k: int) -> None:
        old = self.leader()
        if old is None:
            ev.update(recovered=False, note="no leader to kill", t_inject=time.monotonic())
            return
        old.signal(signal.SIGKILL)
        ev["t_inject"] = t0 = time.monotonic()
        new = wait_for(lambda: (lambda m: m if m is not None and m is not old else None)(
            self.leader()), 15)
        ev["t_recovered"] = time.monotonic()
        ev["recovered"] = new is not None
        ev["failover_s"] = round(ev["t_recovered"] - t0, 3) if new else None
        self.masters.remove(old)
        self.masters.append(self._master())          # two masters again

    def _master_leader_freeze(self, ev: dict[str, Any], k: int) -> None:
        old = self.leader()
        if old is None:
            ev.update(recovered=False, note="no leader to freeze", t_inject=time.monotonic())
            return
        old.signal(signal.SIGSTOP)
        ev["t_inject"] = t0 = time.monotonic()
        try:
            new = wait_for(lambda: (lambda m: m if m is not None and m is not old else None)(
                self.leader()), 15)
            ev["failover_s"] = round(time.monotonic() - t0, 3) if new else None
            time.sleep(max(0.0, t0 + MASTER_LEASE_S + 1.0 - time.monotonic()))
        finally:
            old.signal(signal.SIGCONT)
        ip1 = self.h.ip(1)
        leaders_seen = []

        def stepped_down() -> bool:
            roles = [(rpc_or_none(ip1, m.info["port"], "ha_status") or {}).get("role")
                     for m in self.masters if m.popen.poll() is None]
            leaders_seen.append(roles.count("leader"))
            st = rpc_or_none(ip1, old.info["port"], "ha_status")
            return bool(st) and st.get("role") != "leader"
        ok = wait_for(stepped_down, 10, poll_s=0.1)
        ev["t_recovered"] = time.monotonic()
        ev["recovered"] = bool(ok) and new is not None
        ev["stepped_down"] = bool(ok)
        ev["split_brain"] = max(leaders_seen, default=0) > 1

    def _storage_host_kill(self, ev: dict[str, Any], k: int) -> None:
        host = 2 + k % 2
        role = self.stores[host]
        role.signal(signal.SIGKILL)
        ev["t_inject"] = t0 = time.monotonic()
        self._killed(role, t0)
        ev["host"] = f"h{host}"
        role.popen.wait(10)
        time.sleep(1.0)
        self.stores[host] = self._restart(role)         # rejoins with a fresh segment
        ev["rejoin_s"] = round(time.monotonic() - t0, 3)

    def _prefill_worker_kill(self, ev: dict[str, Any], k: int) -> None:
        name = ("prefill-a", "prefill-b")[k % 2]
        role = self.workers[name]
        role.signal(signal.SIGKILL)
        ev["t_inject"] = t0 = time.monotonic()
        self._killed(role, t0, f"{name}-kv")   # the worker's one Transfer Engine segment
        ev["worker"] = name
        role.popen.wait(10)
        left = wait_for(lambda: name not in self.registered(), 15)
        ev["left_view_s"] = round(time.monotonic() - t0, 3) if left else None
        self.workers[name] = self._restart(role)
        back = wait_for(lambda: name in self.registered(), 60)
        ev["recovered"] = bool(back)
        ev["rejoin_s"] = round(time.monotonic() - t0, 3)

    def _decode_host_partition(self, ev: dict[str, Any], k: int) -> None:
        host = 3 - k % 2
        names = {n for n, hst, _ in WORKERS if hst == host}
        self.h.cut(host)
        ev["t_inject"] = t0 = time.monotonic()
        ev["host"] = f"h{host}"
        try:
            gone = wait_for(lambda: not names & self.registered(), PARTITION_S + 2)
            ev["left_view_s"] = round(time.monotonic() - t0, 3) if gone else None
            time.sleep(max(0.0, t0 + PARTITION_S - time.monotonic()))
        finally:
            self.h.heal(host)
        ev["healed_after_s"] = round(time.monotonic() - t0, 3)
        back = wait_for(lambda: names <= self.registered(), 40)
        ev["recovered"] = bool(back)
        ev["rejoin_s"] = round(time.monotonic() - t0, 3)

    def _path_drop(self, ev: dict[str, Any], k: int) -> None:
        h = self.h
        ev["t_inject"] = time.monotonic()
        n = 0
        for a, b in ((2, 3), (3, 2)):
            out = h.run(a, "ss", "-HK", "state", "established", "dst", h.ip(b))
            n += sum(1 for line in out.splitlines() if line.strip())
        ev["connections_dropped"] = n
        time.sleep(2.0)                 # slices retried on fresh connections meanwhile


def stop_quietly(cluster: SoakCluster) -> None:
    with contextlib.suppress(Exception):
        cluster.close()
