"""Store master fail-over: kill -9 the HA leader under a stream of puts (issue 17).

``python -m pymooncake.bench.failover [--runs 5] [--masters 3] [--lease-ttl 2]
[--put-latency] [--json]``

Each run starts, on loopback: etcd (random free ports, a temporary data directory), N
``pymooncake master --ha`` processes, one ``store-server`` (64 MiB) and a writer
``StoreClient`` in this process, all given ``--master etcd://…/<cluster>``. The writer
puts 4 KiB objects (distinct bytes each) one after another; once ``warm_puts`` returned
OK the leader is killed with SIGKILL. Reported per run:

* ``failover_s`` — from the kill to the return of the first put *started* after it that
  returns OK (what a client sees: lease expiry + election + catch-up + restore + the
  client finding the new leader);
* ``ok_puts``, ``failed_puts`` (puts answered with an error: retryable ones were in
  flight at the kill), ``lost`` — OK puts whose ``get`` through the new leader does not
  return identical bytes (must be 0).

Needs the ``etcd`` binary; ``run`` raises ``RuntimeError`` naming what could not start.
"""

from __future__ import annotations

import argparse
import json
import os
import selectors
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

MiB = 1 << 20


def etcd_binary() -> str | None:
    """The etcd binary on this machine, or ``None``."""
    return shutil.which("etcd") or next(
        (p for p in ("/usr/bin/etcd", "/usr/local/bin/etcd") if Path(p).exists()), None)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Etcd:
    """A single-member etcd on loopback in a temporary directory (``url``: etcd://h:p)."""

    def __init__(self) -> None:
        binary = etcd_binary()
        if binary is None:
            raise RuntimeError("no etcd binary (apt-get install etcd-server)")
        self.dir = tempfile.mkdtemp(prefix="pymooncake-etcd-")
        cport, pport = free_port(), free_port()
        cu, pu = f"http://127.0.0.1:{cport}", f"http://127.0.0.1:{pport}"
        self.proc = subprocess.Popen(
            [binary, "--name", "m", "--data-dir", self.dir, "--listen-client-urls", cu,
             "--advertise-client-urls", cu, "--listen-peer-urls", pu,
             "--initial-advertise-peer-urls", pu, "--initial-cluster", f"m={pu}",
             "--heartbeat-interval", "10", "--election-timeout", "100"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.url = f"etcd://127.0.0.1:{cport}"
        deadline = time.monotonic() + 15
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with status {self.proc.returncode}")
            try:
                socket.create_connection(("127.0.0.1", cport), 0.2).close()
                return
            except OSError:
                if time.monotonic() > deadline:
                    self.close()
                    raise RuntimeError("etcd did not listen within 15 s") from None
                time.sleep(0.05)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)


class Child:
    """A ``pymooncake`` sub-command whose ``ready`` JSON line has been read."""

    def __init__(self, args: list[str], timeout_s: float = 30.0) -> None:
        root = Path(__file__).resolve().parents[2]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = str(root) + os.pathsep + env.get("PYTHONPATH", "")
        self.args = args
        self.popen = subprocess.Popen([sys.executable, "-m", "pymooncake", *args],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        self.info: dict[str, Any] = {}
        sel = selectors.DefaultSelector()
        sel.register(self.popen.stdout, selectors.EVENT_READ)  # type: ignore[arg-type]
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                if self.popen.poll() is not None:
                    err = self.popen.stderr.read().decode()[-2000:]  # type: ignore[union-attr]
                    raise RuntimeError(f"{args[0]} exited {self.popen.returncode}: {err}")
                if sel.select(0.1):
                    line = self.popen.stdout.readline()  # type: ignore[union-attr]
                    if line.startswith(b"{") and json.loads(line).get("event") == "ready":
                        self.info = json.loads(line)
                        break
            else:
                raise RuntimeError(f"{args[0]} not ready in {timeout_s} s")
        except BaseException:
            self.kill()
            raise
        finally:
            sel.close()
        # drain stderr so a chatty child never blocks on a full pipe
        threading.Thread(target=lambda: [None for _ in self.popen.stderr],  # type: ignore
                         daemon=True).start()

    @property
    def port(self) -> int:
        return int(self.info["port"])

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(sig)
            if sig in (signal.SIGKILL, signal.SIGTERM):
                try:
                    self.popen.wait(10)
                except subprocess.TimeoutExpired:
                    self.popen.kill()
                    self.popen.wait(5)


def ha_master(etcd_url: str, cluster: str, lease_ttl_s: float = 2.0, *flags: str) -> Child:
    """Start one ``pymooncake master --ha`` of ``cluster`` on a free port."""
    return Child(["master", "--port", "0", "--ha", "--etcd-endpoints", etcd_url,
                  "--cluster-id", cluster, "--ha-lease-ttl", str(lease_ttl_s), *flags])


def ha_status(port: int, timeout_s: float = 2.0) -> dict[str, Any] | None:
    """A master's ``ha_status`` (``None`` when it does not answer)."""
    from pymooncake.rpc import RpcError, SyncRpcClient

    rpc = SyncRpcClient("127.0.0.1", port, timeout_s)
    try:
        return dict(rpc.call("ha_status"))
    except RpcError:
        return None
    finally:
        rpc.close()


def wait_leader(masters: list[Child], timeout_s: float = 15.0) -> Child:
    """The master that reports itself leader (``TimeoutError`` after ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for m in masters:
            if m.popen.poll() is None:
                st = ha_status(m.port, 1.0)
                if st is not None and st.get("role") == "leader":
                    return m
        time.sleep(0.05)
    raise TimeoutError(f"no master leads after {timeout_s} s")


def pattern(i: int, size: int) -> bytes:
    """Distinct bytes of object ``i``."""
    return (i.to_bytes(4, "little") * (size // 4 + 1))[:size]


def transfer_config() -> Any:
    from pymooncake.transfer import TransferConfig

    return TransferConfig(transports=("local", "shm", "tcp"), max_retries=1,
                          path_retry_interval_s=0.05, connect_timeout_s=1.0,
                          slice_timeout_s=2.0)


def run_once(etcd_url: str, *, masters: int = 3, lease_ttl_s: float = 2.0,
             value_bytes: int = 4096, warm_puts: int = 30, after_s: float = 1.0,
             md_url: str | None = None, client_ttl_s: float = 3.0) -> dict[str, Any]:
    """One fail-over under puts (see the module docstring); returns the run's numbers.

    The masters drop a client silent for ``client_ttl_s``; the objects are read back
    that long after the writer stopped, so the store-server holding them must have
    followed the new leader with its heartbeats (``segments_after`` counts its segment)."""
    from pymooncake.metadata.http import MetadataHttpServer
    from pymooncake.store.client import StoreClient
    from pymooncake.store.errors import StoreError

    cluster = f"failover-{uuid.uuid4().hex[:8]}"
    master_url = f"{etcd_url}/{cluster}"
    md_server = None
    if md_url is None:
        md_server = MetadataHttpServer("127.0.0.1", 0).start()
        md_url = md_server.url
    procs: list[Child] = []
    client = None
    try:
        ms = [ha_master(etcd_url, cluster, lease_ttl_s, "--client-ttl", str(client_ttl_s))
              for _ in range(masters)]
        procs += ms
        leader = wait_leader(ms)
        procs.append(Child(["store-server", "--master", master_url, "--metadata", md_url,
                            "--global-segment-size", str(64 * MiB),
                            "--heartbeat-interval", "0.2"]))
        client = StoreClient(master_url, md_url, transfer_config=transfer_config(),
                             heartbeat_interval_s=0.2).start()
        ok: list[tuple[int, float, float]] = []  # (i, started, returned)
        errors: list[tuple[int, str, float]] = []
        stop = threading.Event()

        def writer() -> None:
            i = 0
            while not stop.is_set():
                t0 = time.monotonic()
                try:
                    client.put(f"obj-{i}", pattern(i, value_bytes))
                    ok.append((i, t0, time.monotonic()))
                except StoreError as e:
                    errors.append((i, e.code.name, time.monotonic()))
                    time.sleep(0.01)
                i += 1

        t = threading.Thread(target=writer, daemon=True)
        t.start()
        deadline = time.monotonic() + 30
        while len(ok) < warm_puts and time.monotonic() < deadline:
            time.sleep(0.01)
        if len(ok) < warm_puts:
            raise RuntimeError(f"only {len(ok)} puts in 30 s before the kill: {errors[-3:]}")
        t_kill = time.monotonic()
        leader.kill()
        first_after = None
        while time.monotonic() < t_kill + 30:
            after = [done for _, started, done in ok if started > t_kill]
            if after:
                first_after = after[0]
                break
            time.sleep(0.01)
        time.sleep(after_s)
        stop.set()
        t.join(10)
        new_leader = wait_leader([m for m in ms if m is not leader])
        time.sleep(client_ttl_s + 0.5)  # a store-server that did not follow is dropped now
        segments_after = int(client.stats()["num_segments"])
        lost = [i for i, _, _ in ok
                if _get_or_none(client, f"obj-{i}") != pattern(i, value_bytes)]
        return {"failover_s": None if first_after is None else first_after - t_kill,
                "ok_puts": len(ok), "failed_puts": len(errors),
                "failed_codes": sorted({c for _, c, ts in errors if ts > t_kill}),
                "lost": len(lost), "lost_keys": [f"obj-{i}" for i in lost[:10]],
                "old_leader": leader.port, "new_leader": new_leader.port,
                "segments_after": segments_after,
                "masters": masters, "lease_ttl_s": lease_ttl_s}
    finally:
        if client is not None:
            client.close()
        for p in reversed(procs):
            p.kill(signal.SIGTERM)
        if md_server is not None:
            md_server.stop()


def put_latency(etcd_url: str | None, *, count: int = 300,
                value_bytes: int = 4096) -> dict[str, float]:
    """Median and p99 latency (s) of ``count`` sequential 4 KiB puts through one master
    with a store-server: HA (``etcd_url`` given: every put is journaled in etcd before
    it is answered) or standalone (``None``)."""
    from pymooncake.metadata.http import MetadataHttpServer
    from pymooncake.store.client import StoreClient

    md_server = MetadataHttpServer("127.0.0.1", 0).start()
    procs: list[Child] = []
    client = None
    try:
        if etcd_url is not None:
            cluster = f"latency-{uuid.uuid4().hex[:8]}"
            procs.append(ha_master(etcd_url, cluster))
            wait_leader(procs)
            master = f"{etcd_url}/{cluster}"
        else:
            procs.append(Child(["master", "--port", "0"]))
            master = f"127.0.0.1:{procs[0].port}"
        procs.append(Child(["store-server", "--master", master, "--metadata", md_server.url,
                            "--global-segment-size", str(64 * MiB)]))
        client = StoreClient(master, md_server.url, transfer_config=transfer_config()).start()
        lat = []
        for i in range(count):
            t0 = time.perf_counter()
            client.put(f"lat-{i}", pattern(i, value_bytes))
            lat.append(time.perf_counter() - t0)
        lat.sort()
        return {"median_s": statistics.median(lat), "p99_s": lat[int(0.99 * (len(lat) - 1))]}
    finally:
        if client is not None:
            client.close()
        for p in reversed(procs):
            p.kill(signal.SIGTERM)
        md_server.stop()


def _get_or_none(client: Any, key: str) -> bytes | None:
    from pymooncake.store.errors import StoreError

    try:
        return client.get(key)
    except StoreError:
        return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pymooncake.bench.failover",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--masters", type=int, default=3)
    ap.add_argument("--lease-ttl", type=float, default=2.0, metavar="S")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--put-latency", action="store_true",
                    help="also time 300 sequential 4 KiB puts, HA vs a standalone master")
    args = ap.parse_args(argv)
    if args.runs < 1 or args.masters < 2:
        ap.error("--runs must be >= 1 and --masters >= 2")
    etcd = Etcd()
    try:
        runs = [run_once(etcd.url, masters=args.masters, lease_ttl_s=args.lease_ttl)
                for _ in range(args.runs)]
    finally:
        etcd.close()
    times = [r["failover_s"] for r in runs if r["failover_s"] is not None]
    out: dict[str, Any] = {
        "runs": runs, "median_failover_s": statistics.median(times) if times else None,
        "max_failover_s": max(times) if times else None,
        "lost_total": sum(r["lost"] for r in runs)}
    if args.put_latency:
        etcd = Etcd()
        try:
            out["put_latency"] = {"ha": put_latency(etcd.url),
                                  "standalone": put_latency(None)}
        finally:
            etcd.close()
    if args.json:
        print(json.dumps(out))
    else:
        for r in runs:
            print(f"failover {r['failover_s']:.3f} s  ok puts {r['ok_puts']}  failed "
                  f"{r['failed_puts']} {r['failed_codes']}  lost {r['lost']}")
        print(f"median {out['median_failover_s']:.3f} s  max {out['max_failover_s']:.3f} s  "
              f"lost {out['lost_total']}")
        for mode, r in out.get("put_latency", {}).items():
            print(f"put 4 KiB {mode}: median {r['median_s'] * 1e3:.2f} ms  "
                  f"p99 {r['p99_s'] * 1e3:.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
