"""The soak benchmark's load and data checks (issue 17 Build item 7).

``TraceLoad`` replays trace requests (materialised by the workload layer) against the
Conductor's OpenAI front door at a steady rate until stopped, one streamed request per
arrival, on its own event loop thread; the request client and its record come from the
caller (``cli.replay``: the same client as ``pymooncake replay``).

``StoreChecker`` puts objects with two replicas, hard-pinned (never evicted), into the
Store all along and reads earlier
ones back, each checked byte for byte against what was put (``bytes_verified``); at the
end every object is read once more. An object the master no longer knows although a
holder of one of its replicas was never killed is *lost*; one whose every holder was
killed (a storage host, a prefill worker's segment) is counted apart — no replica survived
it; one that only fails to read (no master leader, a transfer error) is *unreadable*.

A read's ``OBJECT_NOT_FOUND`` alone does not make an object lost: the client answers it
too when every replica it was given failed or lies on a segment it marked bad
(``StoreClient(bad_segment_ttl_s)``, case BUG-34: after a timeout during a partition, the
healed host's segment is skipped for that long). Whether the master still knows the key
(``replica_list``) decides; while it does, the read is retried until the marks lapse.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import random
import threading
import time
from collections.abc import Callable
from typing import Any

from pymooncake.bench.netns import Hosts


class TraceLoad:
    """Sends ``requests`` round-robin at ``rps`` (exponential gaps, ``seed``) until
    ``stop()``; ``records`` holds one ``new_record(index, prompt_tokens, max_tokens)`` per
    request sent, filled by ``send_one(client, url, record, prompt, model)``."""

    def __init__(self, url: str, requests: list[Any], rps: float, *,
                 send_one: Callable[..., Any], new_record: Callable[..., Any],
                 timeout_s: float = 60.0, seed: int = 0) -> None:
        if not requests:
            raise ValueError("no requests to replay")
        if not rps > 0:
            raise ValueError(f"rps must be > 0, got {rps}")
        self.url, self.requests, self.rps = url, requests, rps
        self.send_one, self.new_record = send_one, new_record
        self.timeout_s, self.rng = timeout_s, random.Random(seed)
        self.records: list[Any] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()),
                                        daemon=True, name="soak-load")

    def start(self) -> TraceLoad:
        self._thread.start()
        return self

    def stop(self) -> list[Any]:
        """Stop sending; wait for the requests in flight (each ends within its timeout)."""
        self._stop.set()
        self._thread.join(self.timeout_s + 30)
        return self.records

    async def _main(self) -> None:
        import httpx
        limits = httpx.Limits(max_connections=512, max_keepalive_connections=512)
        tasks: set[asyncio.Task[None]] = set()
        async with httpx.AsyncClient(timeout=self.timeout_s, limits=limits) as client:
            i = 0
            nxt = time.monotonic()
            while not self._stop.is_set():
                delay = nxt - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(min(delay, 0.1))
                    continue
                req = self.requests[i % len(self.requests)]
                rec = self.new_record(i, len(req.token_ids), req.max_tokens)
                self.records.append(rec)
                t = asyncio.ensure_future(self.send_one(client, self.url, rec,
                                                        list(req.token_ids), None))
                tasks.add(t)
                t.add_done_callback(tasks.discard)
                i += 1
                nxt += self.rng.expovariate(self.rps)
            if tasks:
                await asyncio.wait(tasks)


FINAL_PASS_MAX_S = 120.0
"""The final read pass stops after this long; objects not read by then are reported as
``objects_unchecked`` (neither verified nor lost)."""
GONE = "GONE"
"""Outcome of a check whose key the master no longer knows (``replica_list`` answered
``OBJECT_NOT_FOUND``); a read's own ``OBJECT_NOT_FOUND`` may be the client's (see the
module docstring)."""
FINAL = ("ok", "corrupt", GONE)
"""Outcomes of a check that a retry would not change."""
SETTLE_MARGIN_S = 2.0
"""The final pass retries a failed read for the client's bad-segment TTL plus this."""


def _value(key: str, size: int) -> bytes:
    seed = hashlib.blake2b(key.encode(), digest_size=16).digest()
    return (seed * (size // 16 + 1))[:size]


class StoreChecker:
    """Puts and verifies objects all along (module docstring); ``every_s`` between puts."""

    bad_segment_ttl_s = 10.0
    """The checker client's ``StoreClient(bad_segment_ttl_s)`` (its default)."""

    def __init__(self, hosts: Hosts, master: str, size: int = 8 << 10,
                 every_s: float = 0.5) -> None:
        self.h, self.master, self.size, self.every_s = hosts, master, size, every_s
        self.client: Any = None
        self.objects: dict[str, tuple[float, tuple[str, ...]]] = {}
        """key → (put time, segments of its replicas right after the put)."""
        self.bytes_verified = 0
        self.reads_verified = 0
        self.corrupt: list[str] = []
        self.errors: collections.Counter[str] = collections.Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="soak-store")
        self._rng = random.Random(1)

    def start(self) -> StoreChecker:
        from pymooncake.store.client import StoreClient
        from pymooncake.transfer import TransferConfig
        cfg = TransferConfig(transports=("tcp",), topology_file=self.h.topology,
                             max_retries=2, path_retry_interval_s=0.05,
                             connect_timeout_s=4.0, slice_timeout_s=4.0)
        self.client = StoreClient(self.master, self.h.etcd, local_hostname=f"{self.h.net}.1",
                                  transfer_config=cfg, heartbeat_interval_s=0.2,
                                  bad_segment_ttl_s=self.bad_segment_ttl_s).start()
        self._thread.start()
        return self

    def _read(self, key: str) -> str:
        """``ok``, ``corrupt`` or the error code of one checked read."""
        from pymooncake.store.errors import StoreError
        try:
            got = self.client.get(key)
        except StoreError as e:
            return e.code.name
        if got != _value(key, self.size):
            self.corrupt.append(key)
            return "corrupt"
        self.bytes_verified += len(got)
        self.reads_verified += 1
        return "ok"

    def _check(self, key: str) -> str:
        """``_read``, except that an ``OBJECT_NOT_FOUND`` read becomes ``GONE`` only when
        the master no longer knows ``key`` (else the read stays ``OBJECT_NOT_FOUND``: a
        replica the client could not reach or skipped)."""
        from pymooncake.store.errors import ErrorCode, StoreError
        out = self._read(key)
        if out != "OBJECT_NOT_FOUND":
            return out
        try:
            self.client.replica_list(key)
        except StoreError as e:
            return GONE if e.code == ErrorCode.OBJECT_NOT_FOUND else out
        return out

    def _run(self) -> None:
        from pymooncake.store.config import ReplicateConfig
        from pymooncake.store.errors import StoreError
        i = 0
        while not self._stop.wait(self.every_s):
            key = f"soak/{i}"
            i += 1
            try:
                # hard-pinned: the prefill workers' KV puts fill the Store, and eviction
                # of the checker's objects would read as losses
                self.client.put(key, _value(key, self.size),
                                ReplicateConfig(replica_num=2, hard_pin=True))
                segs = tuple(r.segment for r in self.client.replica_list(key).replicas)
                self.objects[key] = (time.monotonic(), segs)
            except StoreError as e:
                self.errors[f"put {e.code.name}"] += 1
            if self.objects:
                out = self._read(self._rng.choice(list(self.objects)))
                if out != "ok":
                    self.errors[f"get {out}"] += 1

    def stop(self, killed: list[tuple[float, str]]) -> dict[str, Any]:
        """Stop putting; read every object once more (a failed read retried while the
        cluster settles: the client's bad-segment TTL plus ``SETTLE_MARGIN_S``, at least
        10 s); the checker's report. ``killed``: (time, segment-name prefix) of every
        segment holder killed."""
        self._stop.set()
        self._thread.join(30)
        lost: list[str] = []
        with_holders: list[str] = []
        final_errors: collections.Counter[str] = collections.Counter()
        settle_s = max(10.0, self.bad_segment_ttl_s + SETTLE_MARGIN_S)
        settle_until = time.monotonic() + settle_s   # transient errors: retried meanwhile
        give_up = time.monotonic() + FINAL_PASS_MAX_S
        unchecked = unreadable = 0
        for key, (t_put, segs) in self.objects.items():
            if time.monotonic() > give_up:       # e.g. no master leader: each read waits
                unchecked += 1
                continue
            out = self._check(key)
            while out not in FINAL and time.monotonic() < settle_until:
                time.sleep(0.5)
                out = self._check(key)
            if out in ("ok", "corrupt"):
                continue
            final_errors[out] += 1
            if out != GONE:      # the master still knows it (or cannot say): unreadable now
                unreadable += 1
                continue
            dead = {p for t, p in killed if t >= t_put}
            if segs and all(any(s.startswith(p) for p in dead) for s in segs):
                with_holders.append(key)
            else:
                lost.append(key)
        if self.client is not None:
            self.client.close()
        return {"objects_put": len(self.objects), "bytes_verified": self.bytes_verified,
                "reads_verified": self.reads_verified, "objects_lost": len(lost),
                "objects_lost_examples": lost[:5],
                "objects_gone_with_every_holder": len(with_holders),
                "corrupt_reads": len(self.corrupt),
                "final_read_errors": dict(sorted(final_errors.items())),
                "objects_unchecked": unchecked,
                "objects_unreadable_at_end": unreadable,
                "errors_by_kind": dict(sorted(self.errors.items()))}
