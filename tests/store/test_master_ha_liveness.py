"""Store master HA stays live across repeated fail-overs (real etcd, real master
processes; soak attempt B of docs/benchmarks.md ended with no Store master leader):

* followers behind a trimmed journal — one frozen while the leader wrote past a snapshot,
  one started after it — load the snapshot, read a tail larger than gRPC's 4 MiB answer
  limit, and each can take over;
* a leader frozen past its lease steps down and campaigns again: after two freezes (each
  master stepped down once) killing the leader still elects the other one;
* a follower whose etcd connections are reset (the soak's path drop) keeps following.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
import uuid
from collections.abc import Iterator

import msgpack
import pytest

from pymooncake.bench.failover import Child, ha_master, ha_status, wait_leader
from pymooncake.rpc import RpcClient, SyncRpcClient
from pymooncake.store.config import MasterConfig
from pymooncake.store.master.ha import HaConfig, HaKeys
from pymooncake.store.master.ha_journal import read_values
from pymooncake.store.master.service import MasterService

from .test_master_ha import _md

LEASE_S = 1.0
SNAPSHOT_EVERY = 40


@pytest.fixture
def procs() -> Iterator[list[Child]]:
    made: list[Child] = []
    yield made
    for p in reversed(made):
        try:
            p.kill(signal.SIGCONT)
            p.kill(signal.SIGTERM)
        except Exception:  # noqa: BLE001 - best-effort cleanup
            pass


def _master(etcd_url: str, cluster: str, procs: list[Child], lease_s: float = LEASE_S) -> Child:
    m = ha_master(etcd_url, cluster, lease_s, "--ha-snapshot-every", str(SNAPSHOT_EVERY))
    procs.append(m)
    return m


class _Writer:
    """Puts objects through the leader's RPCs, one journal entry per call (no data path:
    metadata is what fails over)."""

    def __init__(self, leader: Child, keys: list[str] | None = None) -> None:
        self.rpc = SyncRpcClient("127.0.0.1", leader.port, timeout_s=30.0)
        self.keys: list[str] = keys if keys is not None else []
        if keys is None:  # (a new leader restores the segment)
            self.rpc.call("mount_segment", {"client_id": "w", "segment": "S", "host": "h",
                                            "base_addr": 1 << 20, "size_bytes": 1 << 30})

    def put(self, n: int, batch: int = 1, pad: int = 0) -> None:
        """``n`` calls of ``batch`` keys each (two journal entries a call), each key
        ``pad`` bytes longer (big journal entries from few objects)."""
        for _ in range(n):
            keys = [f"k{len(self.keys) + i}" + "-" * pad for i in range(batch)]
            out = self.rpc.call("batch_put_start", {"client_id": "w", "keys": keys,
                                                    "sizes_bytes": [4096] * batch,
                                                    "config": None})
            gens = [r["r"]["generation"] for r in out]
            assert self.rpc.call("batch_put_end", {"client_id": "w", "keys": keys,
                                                   "generations": gens, "checksums": None}
                                 ) == [{"r": None}] * batch
            self.keys += keys

    def close(self) -> None:
        self.rpc.close()


def _keys_at(m: Child) -> list[str]:
    rpc = SyncRpcClient("127.0.0.1", m.port, timeout_s=10.0)
    try:
        return sorted(rpc.call("list_keys"))
    finally:
        rpc.close()


def _wait_status(m: Child, pred, timeout_s: float = 10.0) -> dict:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    st = None
    while time.monotonic() < deadline:
        st = ha_status(m.port)
        if st is not None and pred(st):
            return st
        time.sleep(0.05)
    raise AssertionError(f"status of master :{m.port} never matched: {st}")


def _took_over(m: Child, keys: list[str]) -> float:
    """Seconds until ``m`` leads (after its leader was killed); it serves every key."""
    t0 = time.monotonic()
    assert wait_leader([m], timeout_s=10.0) is m
    took = time.monotonic() - t0
    assert _keys_at(m) == sorted(keys)
    return took


def test_followers_behind_a_trimmed_journal_load_the_snapshot_and_take_over(
        etcd_url: str, procs: list[Child]) -> None:
    cluster = f"live-{uuid.uuid4().hex[:10]}"
    # a 2 s lease: the leader's loop stalls on the big puts of a loaded CI machine
    ms = [_master(etcd_url, cluster, procs, 2.0) for _ in range(2)]
    leader = wait_leader(ms)
    frozen = next(m for m in ms if m is not leader)
    w = _Writer(leader)
    w.put(3)
    seq0 = _wait_status(frozen, lambda s: s["applied_seq"] >= 7)["applied_seq"]
    frozen.kill(signal.SIGSTOP)
    try:
        w.put(SNAPSHOT_EVERY // 2)  # a snapshot, and the entries up to it trimmed
        # then more than gRPC's 4 MiB answer limit of entries after it (no snapshot yet)
        w.put(SNAPSHOT_EVERY // 2 - 6, batch=100, pad=2000)
        keys = HaKeys.of(cluster)
        head = ha_status(leader.port)["applied_seq"]
        snap = msgpack.unpackb(_md(etcd_url, lambda md: md.get(keys.snapshot)).value)
        log = _md(etcd_url, lambda md: read_values(
            md, [keys.entry(q) for q in range(seq0 + 1, head + 1)]))
        first = seq0 + 1 + log.index(next(v for v in log if v is not None))
        assert first == snap["seq"] + 1 > seq0 + 1, (first, snap, seq0)  # trimmed
        assert None not in log[first - seq0 - 1:] and head < first + SNAPSHOT_EVERY
        assert sum(len(v) for v in log if v) > 4 << 20  # one range read would fail
        late = _master(etcd_url, cluster, procs, 2.0)  # a replacement master starts now
        time.sleep(1.5)  # the frozen one misses idle seconds of its loops
    finally:
        frozen.kill(signal.SIGCONT)
    for m in (frozen, late):
        st = _wait_status(m, lambda s: s["applied_seq"] >= head)
        assert st["role"] == "follower" and st["head"] >= head
        assert st["snapshot_seq"] == snap["seq"] and st["follower_alive"] and st["candidate"]
    w.put(2)  # and both go on following after the snapshot
    head = ha_status(leader.port)["applied_seq"]
    for m in (frozen, late):
        _wait_status(m, lambda s: s["applied_seq"] >= head, 5.0)
    w.close()
    leader.kill()
    new = wait_leader([frozen, late], timeout_s=10.0)
    assert _keys_at(new) == sorted(w.keys)
    other = late if new is frozen else frozen
    new.kill()
    assert _took_over(other, w.keys) < 4 * 2.0 + 3.0


def _freeze_past_lease(old: Child, others: list[Child]) -> Child:
    """SIGSTOP the leader ``old`` until another master leads and its lease is over, then
    SIGCONT it; returns the new leader once ``old`` answers as a follower again."""
    old.kill(signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        new = wait_leader(others, timeout_s=10.0)
        time.sleep(max(0.0, t0 + LEASE_S + 1.5 - time.monotonic()))
    finally:
        old.kill(signal.SIGCONT)
    _wait_status(old, lambda s: s["role"] == "follower")
    return new


def test_masters_that_stepped_down_campaign_again_after_every_freeze(
        etcd_url: str, procs: list[Child]) -> None:
    cluster = f"live-{uuid.uuid4().hex[:10]}"
    a, b = (_master(etcd_url, cluster, procs) for _ in range(2))
    first = wait_leader([a, b])
    second = next(m for m in (a, b) if m is not first)
    w = _Writer(first)
    w.put(5)
    w.close()
    assert _freeze_past_lease(first, [second]) is second  # first stepped down
    time.sleep(3 * LEASE_S)  # idle: each loop waits out its timeouts
    w = _Writer(second, w.keys)
    w.put(5)
    w.close()
    assert _freeze_past_lease(second, [first]) is first  # it campaigned again
    head = ha_status(first.port)["applied_seq"]
    _wait_status(second, lambda s: s["applied_seq"] >= head and s["candidate"])
    time.sleep(3 * LEASE_S)
    first.kill()  # both have stepped down once: the survivor must still take over
    assert len(w.keys) == 10 and _took_over(second, w.keys) < 4 * LEASE_S + 3.0


class _PathDrop:
    """A TCP proxy to ``target`` whose ``drop()`` resets every connection through it (the
    soak's path drop); connections made afterwards pass again."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self._writers: set[asyncio.StreamWriter] = set()
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._on_conn, "127.0.0.1", 0)
        return self._server.sockets[0].getsockname()[1]

    async def _pipe(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        with contextlib.suppress(Exception):
            while data := await r.read(65536):
                w.write(data)
                await w.drain()
        w.close()

    async def _on_conn(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        ur, uw = await asyncio.open_connection(*self.target)
        self._writers |= {w, uw}
        await asyncio.gather(self._pipe(r, uw), self._pipe(ur, w))

    def drop(self) -> None:
        for w in self._writers:
            w.transport.abort()
        self._writers.clear()

    async def close(self) -> None:
        self.drop()
        if self._server is not None:
            self._server.close()


def test_follower_keeps_following_after_its_etcd_connections_drop(etcd_url: str) -> None:
    host, port = etcd_url[len("etcd://"):].split(":")

    async def main() -> None:
        proxy = _PathDrop((host, int(port)))
        pport = await proxy.start()
        cluster = f"drop-{uuid.uuid4().hex[:8]}"
        a = MasterService(MasterConfig(port=0), ha=HaConfig(etcd_url, cluster, LEASE_S))
        await a.start()
        b = None
        loop = asyncio.get_running_loop()

        async def until(pred, what: str, timeout_s: float = 8.0) -> None:  # noqa: ANN001
            deadline = loop.time() + timeout_s
            while not pred():
                assert loop.time() < deadline, what
                await asyncio.sleep(0.02)

        rpc = None
        try:
            await until(lambda: a.ha.leading, "a never led")
            b = MasterService(MasterConfig(port=0),
                              ha=HaConfig(f"etcd://127.0.0.1:{pport}", cluster, LEASE_S))
            await b.start()
            rpc = RpcClient("127.0.0.1", a.port, timeout_s=10.0)
            await rpc.call("mount_segment", {"client_id": "w", "segment": "S", "host": "h",
                                             "base_addr": 1 << 20, "size_bytes": 1 << 26})
            keys: list[str] = []
            for rnd in range(3):
                for _ in range(3):
                    keys.append(f"k{len(keys)}")
                    h = await rpc.call("put_start", {"client_id": "w", "key": keys[-1],
                                                     "size_bytes": 4096, "config": None})
                    await rpc.call("put_end", {"client_id": "w", "key": keys[-1],
                                               "generation": h["generation"]})
                head = a.ha.index.applied_seq
                await until(lambda: b.ha.index.applied_seq == head,  # noqa: B023
                            f"round {rnd}: b stopped at {b.ha.status()}")
                st = b.ha.status()
                assert st["follower_alive"] and st["candidate"] and st["head"] == head, st
                proxy.drop()  # every etcd connection of b is reset
            await asyncio.sleep(2 * LEASE_S)  # b's loops go through their idle waits
            await rpc.close()
            rpc = None
            await a.stop()  # resigns: b must take over with everything
            await until(lambda: b.ha.leading, f"b never led: {b.ha.status()}")
            rpc = RpcClient("127.0.0.1", b.port, timeout_s=10.0)
            assert sorted(await rpc.call("list_keys")) == sorted(keys)
        finally:
            if rpc is not None:
                await rpc.close()
            for s in (b, a):
                if s is not None:
                    await asyncio.wait_for(s.stop(), 30)
            await proxy.close()

    asyncio.run(main())
