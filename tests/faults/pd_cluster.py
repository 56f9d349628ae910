"""The P/D clusters of ``test_pd_faults`` on namespaced hosts, kept between its tests
(``Clusters``), and the small helpers its tests share."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from pymooncake.bench.soak_faults import rpc_or_none

from .conftest import CONTEXT
from .netns import Hosts


def _rpc(host: str, port: int, method: str, timeout_s: float = 2.0) -> Any:
    return rpc_or_none(host, port, method, timeout_s)


def _health(url: str) -> dict[str, Any]:
    return httpx.get(url + "/health", timeout=10).json()


def _wait(pred: Any, timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.05)
    raise AssertionError(f"{what} not reached in {timeout_s} s")


def _cluster(h: Hosts, master: str, *, workers: tuple[tuple[int, str, str], ...],
             cond_flags: tuple[str, ...] = ()) -> str:
    """Conductor on h1 plus ``workers`` (host, id, kind); its URL once all registered."""
    ip1 = h.ip(1)
    cond = h.role(1, "conductor", "--host", ip1, "--port", "0", "--worker-port", "0",
                  "--policy", "round-robin", "--global-store", "--model", "tiny",
                  "--context-length", str(CONTEXT), *cond_flags).info
    common = ["--conductor", f"{ip1}:{cond['worker_port']}", "--metadata", h.etcd,
              "--model", "tiny", "--max-model-len", str(CONTEXT), "--num-kv-blocks", "512"]

    def start(host: int, name: str, kind: str) -> None:
        extra = ["--master", master] if kind == "prefill" else []
        h.role(host, kind, "--id", name, "--host", h.ip(host), *extra, *common)

    with ThreadPoolExecutor(len(workers)) as pool:      # together: each start is mostly
        for f in [pool.submit(start, *w) for w in workers]:  # imports and waits
            f.result()
    url = cond["url"]
    _wait(lambda: len(_health(url)["workers"]) == len(workers), 30, "workers registered")
    return url


class Clusters:
    """One cluster at a time, kept between tests: ``"ha"`` (two HA masters; prefill-a on
    h2, prefill-b and decode-c on h3) or ``"pd"`` (one master; prefill-a and decode-a on
    h2, decode-b on h3). A test ``use``s one and leaves it as it found it (a killed master
    replaced, a frozen one resumed); one that cannot (a worker killed, a host cut) says
    ``restores=False`` and the next test gets a fresh one, as does any test after one
    that failed."""

    def __init__(self) -> None:
        self.kind: str | None = None
        self.h: Hosts | None = None
        self.c: dict[str, Any] = {}

    def close(self) -> None:
        if self.h is not None:
            self.h.close()
        self.kind, self.h, self.c = None, None, {}

    @contextlib.contextmanager
    def use(self, kind: str, restores: bool = True) -> Iterator[dict[str, Any]]:
        if kind != self.kind:
            self.close()
            self.h = Hosts(3).start()
            self.c = _ha_cluster(self.h) if kind == "ha" else _pd_cluster(self.h)
            self.kind = kind
        try:
            yield self.c
        except BaseException:
            self.close()
            raise
        if not restores:
            self.close()


def _pd_cluster(h: Hosts) -> dict[str, Any]:
    ip1 = h.ip(1)
    master = h.role(1, "master", "--host", ip1, "--port", "0").info
    url = _cluster(h, f"{ip1}:{master['port']}",
                   workers=((2, "prefill-a", "prefill"), (2, "decode-a", "decode"),
                            (3, "decode-b", "decode")))
    return {"h": h, "url": url}


def _ha_cluster(h: Hosts) -> dict[str, Any]:
    """Two HA masters on h1 (lease 2 s), the P/D cluster following their leader: the URL,
    the masters, ``leader()`` (the one that says it leads, or ``None``) and
    ``new_master()`` (one more master, started)."""
    ip1, cid = h.ip(1), "faults"

    def new_master() -> Any:
        return h.role(1, "master", "--host", ip1, "--port", "0", "--ha", "--etcd-endpoints",
                      h.etcd, "--cluster-id", cid, "--ha-lease-ttl", "2")
    masters = [new_master() for _ in range(2)]

    def leader() -> Any:
        for m in masters:
            if m.popen.poll() is None:
                st = _rpc(ip1, m.info["port"], "ha_status", 1.0)
                if st and st.get("role") == "leader":
                    return m
        return None

    _wait(leader, 15, "a master leads")
    store = f"{h.etcd}/{cid}"
    url = _cluster(h, store, cond_flags=("--store-master", store),
                   workers=((2, "prefill-a", "prefill"), (3, "prefill-b", "prefill"),
                            (3, "decode-c", "decode")))
    return {"h": h, "url": url, "masters": masters, "leader": leader,
            "new_master": new_master}
