"""Store faults on namespaced hosts under a stream of reads and puts (issue 17 Build
item 5): a storage host killed; one of two TCP paths dropped mid-transfer (``ss -K`` on
one of the Transfer Engine's two connections); a segment filled to its watermark by
concurrent puts.

Hosts: h1 runs the Store master, h2 and h3 a ``store-server`` each (TCP only: they are
different hosts); the test process, on the bridge, is the client. Every read is checked
against the digest of the bytes put under its key: no corrupt byte ever comes back.
"""

from __future__ import annotations

import hashlib
import signal
import subprocess
import threading
import time
from typing import Any

import pytest

from pymooncake.store.config import ReplicateConfig
from pymooncake.store.errors import StoreError
from pymooncake.transfer import TransferConfig

from .netns import Hosts

pytestmark = pytest.mark.integration

KiB, MiB = 1 << 10, 1 << 20
BOUND_S = 10.0      # no read or put may take longer


def _value(key: str, size: int) -> bytes:
    seed = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return (seed * (size // 8 + 1))[:size]


def _digest(b: bytes) -> str:
    return hashlib.blake2b(b, digest_size=16).hexdigest()


def _store(h: Hosts, *master_flags: str, size: int = 8 * MiB) -> tuple[str, list[Any]]:
    ip1 = h.ip(1)
    m = h.role(1, "master", "--host", ip1, "--port", "0", *master_flags).info
    master = f"{ip1}:{m['port']}"
    servers = [h.role(i, "store-server", "--master", master, "--metadata", h.etcd,
                      "--global-segment-size", str(size), "--local-hostname", h.ip(i),
                      "--transports", "tcp", "--heartbeat-interval", "0.2")
               for i in (2, 3)]
    return master, servers


def _client(h: Hosts, master: str, **cfg_kw: Any) -> Any:
    from pymooncake.store.client import StoreClient
    kw: dict[str, Any] = {"max_retries": 2, "path_retry_interval_s": 0.05,
                          "connect_timeout_s": 4.0, "slice_timeout_s": 4.0, **cfg_kw}
    cfg = TransferConfig(transports=("tcp",), topology_file=h.topology, **kw)
    return StoreClient(master, h.etcd, local_hostname=f"{h.net}.1", transfer_config=cfg,
                       heartbeat_interval_s=0.2).start()


def _timed(fn: Any, *args: Any, **kw: Any) -> tuple[Any, float]:
    """``(result or StoreError code name, seconds)``."""
    t0 = time.monotonic()
    try:
        out: Any = fn(*args, **kw)
    except StoreError as e:
        out = e.code.name
    return out, time.monotonic() - t0


# -- fault 3: a storage host is killed while objects are read ---------------------------

def test_storage_host_killed_replicas_elsewhere_served_and_every_byte_verified(hosts):
    h = hosts(3)
    master, servers = _store(h, "--client-ttl", "2")
    c = _client(h, master)
    try:
        seg2 = servers[0].info["segment"]
        both = [f"two/{i}" for i in range(12)]           # a replica on h2 and one on h3
        only = [f"one/{i}" for i in range(6)]            # only on h2
        want = {k: _digest(_value(k, 256 * KiB)) for k in both + only}
        for k in both:
            c.put(k, _value(k, 256 * KiB), ReplicateConfig(replica_num=2))
            assert len({r.segment for r in c.replica_list(k).replicas}) == 2
        for k in only:
            c.put(k, _value(k, 256 * KiB), ReplicateConfig(preferred_segment=seg2))
            assert [r.segment for r in c.replica_list(k).replicas] == [seg2]
        reads: list[tuple[str, Any, float, float]] = []
        stop = threading.Event()

        def reader(keys: list[str]) -> None:
            i = 0
            while not stop.is_set():
                k = keys[i % len(keys)]
                t0 = time.monotonic()
                out, dt = _timed(c.get, k)
                reads.append((k, _digest(out) if isinstance(out, bytes) else out, t0, dt))
                i += 1

        threads = [threading.Thread(target=reader, args=(ks,), daemon=True)
                   for ks in (both, both[::-1], only)]
        for t in threads:
            t.start()
        time.sleep(1.0)
        servers[0].signal(signal.SIGKILL)               # h2's store-server: no goodbye
        killed = time.monotonic()
        time.sleep(4.0)                                 # past the master's client TTL
        stop.set()
        for t in threads:
            t.join(BOUND_S + 5)
            assert not t.is_alive(), "a read hung after the storage host died"
        assert reads and any(t0 > killed for _, _, t0, _ in reads)
        for k, got, _t0, dt in reads:
            assert dt < BOUND_S, (k, got, dt)
            if k in want and len(got) == 32:            # bytes came back: exactly the put
                assert got == want[k], f"corrupt bytes for {k}"
        # objects with a replica elsewhere: every read served, before and after the kill
        assert all(got == want[k] for k, got, _, _ in reads if k.startswith("two/"))
        late = [got for k, got, t0, _ in reads if k.startswith("one/") and t0 > killed + 3]
        print("fault 3: reads", len(reads), "only-on-h2 after the TTL", set(late))
        assert late, "no read of an object held only by the dead host"
        # objects only on the dead host: exact bytes or an error, never anything else
        assert {got for k, got, t0, _ in reads if k.startswith("one/") and t0 > killed + 3
                } <= {"OBJECT_NOT_FOUND", "NOT_FOUND", "TRANSFER_FAIL", "NO_AVAILABLE_HANDLE",
                      "REPLICA_IS_NOT_READY"}
        # still serving: new objects land on the surviving host and read back exactly
        for i in range(4):
            k = f"after/{i}"
            c.put(k, _value(k, 128 * KiB))
            assert c.get(k) == _value(k, 128 * KiB)
    finally:
        c.close()


# -- fault 7: a segment filled to the watermark under concurrent puts -------------------

def test_segment_filled_under_concurrent_puts_no_overwrite_and_rejected_puts_succeed_later(
        hosts):
    h = hosts(3)
    master, _servers = _store(h, "--eviction-high-watermark-ratio", "0.9",
                              "--default-kv-lease-ttl", "4000", size=4 * MiB)
    c = _client(h, master)
    try:
        size = 256 * KiB            # 2 x 4 MiB segments hold 32 objects
        for i in range(28):         # 7/8 full, under the 0.9 watermark; each one looked up:
            k = f"old/{i}"          # a reader's lease (4 s) keeps it from eviction for now
            c.put(k, _value(k, size))
        for i in range(28):
            c.replica_list(f"old/{i}")
        pin = ReplicateConfig(hard_pin=True)    # the new objects are not evictable either
        outcome: dict[str, Any] = {}
        lock = threading.Lock()

        def writer(w: int) -> None:
            for i in range(5):     # 20 concurrent puts into room for 4
                k = f"w{w}/{i}"
                out, dt = _timed(c.put, k, _value(k, size), pin)
                assert dt < BOUND_S, (k, out, dt)
                with lock:
                    outcome[k] = out
        threads = [threading.Thread(target=writer, args=(w,), daemon=True) for w in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
            assert not t.is_alive(), "a put hung on a full segment"
        kinds = {("ok" if v is None else v) for v in outcome.values()}
        assert kinds <= {"ok", "NO_AVAILABLE_HANDLE"}, outcome
        print("fault 7: put outcomes", {k: sum(1 for v in outcome.values()
                                                  if ("ok" if v is None else v) == k)
                                        for k in kinds})
        # nothing overwritten: every key still readable holds its own bytes, none another's
        held = []
        for k, v in outcome.items():
            got, dt = _timed(c.get, k)
            assert dt < BOUND_S
            if isinstance(got, bytes):
                assert got == _value(k, size), f"{k} holds other bytes"
                held.append(k)
            else:
                assert v is not None or got in ("OBJECT_NOT_FOUND", "NOT_FOUND"), (k, v, got)
        rejected = [k for k, v in outcome.items() if v is not None]
        assert rejected, "no put was refused: the segments never filled"
        for i in range(28):         # the older objects were never overwritten (evicted at
            got = _timed(c.get, f"old/{i}")[0]          # most, once their lease ended)
            assert got == _value(f"old/{i}", size) or got == "OBJECT_NOT_FOUND", (i, got)
        # once the leases end, eviction frees space: every rejected put is retried until
        # it is stored
        deadline = time.monotonic() + 20
        while rejected:
            assert time.monotonic() < deadline, f"{len(rejected)} puts never found room"
            out = [(k, _timed(c.put, k, _value(k, size), pin)[0]) for k in rejected]
            assert {v for _, v in out} <= {None, "NO_AVAILABLE_HANDLE"}, out
            rejected = [k for k, v in out if v is not None]
            time.sleep(0.2)
        for k in outcome:                  # all 20 stored (pinned), each with its own bytes
            assert c.get(k) == _value(k, size), k
    finally:
        c.close()


# -- fault 6: one of two TCP paths dropped mid-transfer ----------------------------------

def _lanes_to(ip: str, busy: bool = False) -> list[str]:
    """Local ports of the root namespace's established TCP connections to ``ip``, but
    etcd's (the server side of the host's own etcd client); ``busy``: only those with
    bytes in flight (a non-empty send queue)."""
    out = subprocess.run(["ss", "-Htn", "state", "established", "dst", ip],
                         capture_output=True, text=True).stdout
    rows = [line.split() for line in out.splitlines() if line.strip()]
    return [r[-2].rsplit(":", 1)[1] for r in rows
            if r[-2].rsplit(":", 1)[1] not in ("2379", "2380") and (not busy or r[1] != "0")]


def test_one_of_two_tcp_paths_dropped_mid_transfer_slices_retried_bytes_verified(hosts):
    from pymooncake.obs.metrics import REGISTRY

    def counted(name: str) -> float:
        return sum(s.value for fam in REGISTRY.collect() for s in fam.samples
                   if s.name == name)

    h = hosts(3)
    master, servers = _store(h, size=160 * MiB)
    c = _client(h, master, num_paths=2, slice_timeout_s=8.0)
    ip2 = h.ip(2)
    try:
        seg2 = servers[0].info["segment"]
        c.put("warm", _value("warm", 4 * MiB), ReplicateConfig(preferred_segment=seg2))
        lanes = _lanes_to(ip2)          # only the Transfer Engine (and etcd) talk to h2
        assert len(lanes) == 2, f"expected two TCP paths to h2, got {lanes}"
        # h2 receives at 400 Mbit/s: a 64 MiB put takes >= 1.3 s however fast this machine
        # is, so a path can be dropped while most of it is still to be sent
        h.shape(2, 400)
        size = 64 * MiB
        r0 = counted("pymooncake_transfer_retries_total")
        # a drop can land just after the path's last slice (nothing left to retry): up to
        # three puts, each dropped mid-transfer and each checked; one must show a retry
        for attempt in range(3):
            key = f"big{attempt}"
            big = _value(key, size)
            done: dict[str, Any] = {}

            def put(key: str = key, big: bytes = big, done: dict = done) -> None:
                done["out"], done["dt"] = _timed(
                    c.put, key, big, ReplicateConfig(preferred_segment=seg2))
            b0 = counted("pymooncake_transfer_bytes_total")
            t = threading.Thread(target=put, daemon=True)
            t.start()
            moved = 0.0     # in flight: the transfer's first window is acknowledged
            while t.is_alive() and not moved:
                time.sleep(0.005)
                moved = counted("pymooncake_transfer_bytes_total") - b0
            assert t.is_alive() and moved < size, \
                f"the transfer ended before a path could be dropped ({moved:.0f} B moved)"
            lanes = _lanes_to(ip2, busy=True) or _lanes_to(ip2)   # prefer one with unsent bytes
            assert lanes, "no TCP path to h2 while the transfer is in flight"
            subprocess.run(["ss", "-K", "dst", ip2, "sport", "=", f":{lanes[0]}"],
                           capture_output=True, check=True)   # drop that path, mid-transfer
            t.join(BOUND_S * 3)
            assert not t.is_alive(), "the transfer hung after a path was dropped"
            assert done["out"] is None, done
            print(f"fault 6: attempt {attempt}: dropped after {moved / MiB:.0f} of "
                  f"{size // MiB} MiB; put took {done['dt']:.2f} s")
            assert _digest(c.get(key)) == _digest(big)    # every byte as put
            if counted("pymooncake_transfer_retries_total") > r0:
                break
        assert counted("pymooncake_transfer_retries_total") > r0, \
            "no slice was retried in 3 mid-transfer path drops"
        h.shape(2, 0)
        c.put("after", _value("after", MiB))            # still serving
        assert c.get("after") == _value("after", MiB)
    finally:
        c.close()
