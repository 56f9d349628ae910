"""P/D straight over the Transfer Engine: the decode instance reads the prefill instance's
KV blocks out of the prefill instance's own memory (issue 18, role (b); Mooncake paper §4,
"KVCache transfer" between prefill and decode instances).

The prefill instance's worker registers its paged KV tensors with its Transfer Engine (as
for the Store) and publishes their layout (segment name, per-layer base addresses, bytes
per layer-block, namespace digest) as a small Store object, ``LAYOUT_PREFIX + engine id``.
A P/D prefill request keeps its blocks when it finishes (``request_finished`` returns true)
and returns the engine id, its request id and its block ids in ``kv_transfer_params``. The
decode instance allocates blocks for the prompt, reads every layer of every block with one
batch of Transfer Engine READs (``Move(write=False)``: remote segment → its own blocks),
reports the request as received, and puts a done marker (``DONE_PREFIX + engine/request``);
the prefill instance's worker sees the marker and hands the blocks back to vLLM
(``get_finished``: finished sending). A prefill whose decode never comes gives its blocks
back after its hold time (``pd_hold_s``, default ``HOLD_TIMEOUT_S``).

The hold is a lease: when a P/D prefill finishes, the prefill instance puts a lease record
(``LEASE_PREFIX + engine/request``: a random token, the generation, and an expiry in wall
time) and passes the token in ``kv_transfer_params``. The prefill instance's worker
removes the record *before* it hands the blocks back to vLLM (read or timed out). The
decode checks the record before its read (present, same token, more than
``LEASE_MARGIN_S`` before expiry) and again after it: if the lease is gone or expiring at
either check, every block of the request fails (``get_block_ids_with_load_errors``, so
vLLM's ``kv_load_failure_policy`` applies: ``"fail"``, vLLM's default, fails the request;
``"recompute"`` recomputes the prompt), never a success on blocks the prefill may have
reused. A record still valid after the read means the blocks were still held during it.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgpack

from pymooncake.obs.logging import init_logger
from pymooncake.store.datapath import Move
from pymooncake.store.errors import ErrorCode, StoreError

logger = init_logger(__name__)

LAYOUT_PREFIX = "pymooncake-vllm-layout/"
DONE_PREFIX = "pymooncake-vllm-pd-done/"
LEASE_PREFIX = "pymooncake-vllm-pd-lease/"
HOLD_TIMEOUT_S = 120.0
"""Default hold (s): a prefill instance gives a P/D request's blocks back after this long
without a reader (``kv_connector_extra_config.pd_hold_s``)."""
LEASE_MARGIN_S = 5.0
"""A decode treats a lease expiring within this many seconds as expired (clock skew and
the read's own time, so the prefill never gives back blocks a read still uses)."""
POLL_INTERVAL_S = 0.02
"""Least time between two done-marker lookups of a prefill instance's worker."""


@dataclass(slots=True)
class DirectLoad:
    """One decode request's blocks to read from a prefill instance: its engine id and
    request id, the remote block ids and this instance's block ids, index for index."""

    req_id: str
    engine: str
    remote_req: str
    remote_block_ids: list[int]
    block_ids: list[int]
    lease: str = ""
    """The prefill's lease token (``kv_transfer_params["lease"]``); empty: no lease."""


def pd_mode(params: Mapping[str, Any] | None, req_id: str = "?") -> str | None:
    """``"prefill"`` or ``"decode"`` from a request's ``kv_transfer_params``
    (``{"pymooncake_pd": ...}``), else ``None`` (another value is logged and ignored: the
    request is served as a plain one)."""
    mode = (params or {}).get("pymooncake_pd")
    if mode not in (None, "prefill", "decode"):
        logger.warning("request %s: kv_transfer_params.pymooncake_pd=%r is neither 'prefill' "
                       "nor 'decode'; served as a plain request", req_id, mode)
        return None
    return mode


def direct_tokens(params: Mapping[str, Any], prompt_len: int, num_computed: int,
                  block_size: int) -> int:
    """Tokens a P/D decode reads straight from the prefill instance: every prompt token
    beyond ``num_computed`` (vLLM recomputes the last one), when ``params`` name the
    prefill instance (``engine``) and enough of its blocks; else 0 (the Store is tried)."""
    remote = params.get("remote_block_ids") or ()
    if not params.get("engine") or len(remote) * block_size < prompt_len:
        return 0
    return max(0, prompt_len - num_computed)


def direct_load(req_id: str, params: Mapping[str, Any], prompt_len: int, num_external: int,
                block_size: int, block_ids: list[int]) -> DirectLoad:
    """The read of a P/D decode's ``num_external`` tokens: the blocks after the ones vLLM
    had, remote and local ids index for index (``block_ids``: all the request's blocks)."""
    start, end = (prompt_len - num_external) // block_size, -(-prompt_len // block_size)
    return DirectLoad(req_id, str(params["engine"]), str(params["remote_req"]),
                      [int(b) for b in params["remote_block_ids"][start:end]],
                      list(block_ids[start:end]), str(params.get("lease") or ""))


def done_key(engine: str, remote_req: str) -> str:
    return f"{DONE_PREFIX}{engine}/{remote_req}"


def lease_key(engine: str, remote_req: str) -> str:
    return f"{LEASE_PREFIX}{engine}/{remote_req}"


def _put_replacing(client: Any, key: str, payload: bytes) -> None:
    try:
        client.put(key, payload)
    except StoreError as e:
        if e.code != ErrorCode.OBJECT_ALREADY_EXISTS:
            raise
        client.remove(key, force=True)
        client.put(key, payload)


def grant_lease(client: Any, engine: str, remote_req: str, hold_s: float,
                clock: Any = time.time) -> str | None:
    """Prefill side, when a P/D prefill finishes: put the lease record of ``remote_req``
    (a fresh token, expiry ``clock() + hold_s`` in wall seconds) and return the token for
    ``kv_transfer_params``; ``None`` (logged) when the Store refused it: the prefill must
    then not hold the blocks (the decode goes through the Store)."""
    token = uuid.uuid4().hex
    try:
        _put_replacing(client, lease_key(engine, remote_req),
                       msgpack.packb({"lease": token, "expires": clock() + hold_s}))
    except (StoreError, OSError) as e:
        logger.warning("P/D: cannot put the lease of request %s (%s): its blocks are not "
                       "held, the decode loads through the Store", remote_req, e)
        return None
    return token


def lease_problem(client: Any, ld: DirectLoad, clock: Any = time.time) -> str | None:
    """Decode side: ``None`` while ``ld``'s lease is live (record present, same token,
    more than ``LEASE_MARGIN_S`` before its expiry), else why not (released, expired,
    another generation, unreadable)."""
    if not ld.lease:
        return "no lease in kv_transfer_params"
    try:
        rec = msgpack.unpackb(client.get(lease_key(ld.engine, ld.remote_req)))
    except StoreError as e:
        if e.code == ErrorCode.OBJECT_NOT_FOUND:
            return "released by the prefill instance (read or timed out)"
        return f"lease record unreadable ({e})"
    except (OSError, ValueError, msgpack.ExtraData) as e:
        return f"lease record unreadable ({e})"
    if not isinstance(rec, dict) or rec.get("lease") != ld.lease:
        return "another generation of the lease (the prefill instance reused the request id)"
    left = float(rec.get("expires", 0.0)) - clock()
    if left <= LEASE_MARGIN_S:
        return f"lease expires in {left:.1f} s (<= {LEASE_MARGIN_S} s margin)"
    return None


def publish_layout(client: Any, engine: str, bases: list[int], block_bytes: int,
                   namespace_digest: str) -> None:
    """Put this instance's KV layout under ``LAYOUT_PREFIX + engine`` (replacing one left
    by an earlier run with the same engine id)."""
    key = LAYOUT_PREFIX + engine
    payload = msgpack.packb({"segment": client.segment_name, "bases": bases,
                             "block_bytes": block_bytes, "namespace": namespace_digest})
    _put_replacing(client, key, payload)


def read_layout(client: Any, engine: str) -> dict[str, Any]:
    """A prefill instance's published layout. Raises ``StoreError`` (``OBJECT_NOT_FOUND``)
    when it published none."""
    return msgpack.unpackb(client.get(LAYOUT_PREFIX + engine))


def read_blocks(client: Any, loads: list[DirectLoad], bases: list[int], block_bytes: int,
                namespace_digest: str, layouts: dict[str, dict[str, Any]],
                clock: Any = time.time) -> tuple[set[str], set[int]]:
    """Read every layer of every block of ``loads`` from the prefill instances into this
    instance's blocks (``bases``: this instance's per-layer addresses), then put the done
    markers. Returns (request ids received, this instance's block ids that failed); never
    raises (vLLM would wait for the requests forever): an unexpected error fails them all.
    A layout from another namespace or block size fails its requests' blocks; so does a
    lease (``lease_problem``) not live both before and after the read (logged, no done
    marker: the prefill instance already gave those blocks back)."""
    t0 = time.perf_counter()
    try:
        done, failed = _read_blocks(client, loads, bases, block_bytes, namespace_digest,
                                    layouts, clock)
    except Exception as e:
        logger.warning("P/D read of %d request(s) failed: %s", len(loads), e)
        done = {ld.req_id for ld in loads}
        failed = {b for ld in loads for b in ld.block_ids}
    logger.info("P/D: read %d blocks x %d layers of %d request(s) from prefill instance(s) "
                "%s in %.1f ms (%d failed)", sum(len(ld.block_ids) for ld in loads),
                len(bases), len(loads), sorted({ld.engine for ld in loads}),
                (time.perf_counter() - t0) * 1e3, len(failed))
    return done, failed


def _read_blocks(client: Any, loads: list[DirectLoad], bases: list[int], block_bytes: int,
                 namespace_digest: str, layouts: dict[str, dict[str, Any]], clock: Any
                 ) -> tuple[set[str], set[int]]:
    done = {ld.req_id for ld in loads}
    failed: set[int] = set()
    moves, owners, live = [], [], []
    for ld in loads:
        why = lease_problem(client, ld, clock)
        if why is not None:
            _lease_lost(ld, "before", why)
            failed.update(ld.block_ids)
            continue
        live.append(ld)
        try:
            lay = layouts.get(ld.engine) or layouts.setdefault(ld.engine,
                                                               read_layout(client, ld.engine))
        except (StoreError, OSError):
            failed.update(ld.block_ids)
            continue
        if lay["namespace"] != namespace_digest or lay["block_bytes"] != block_bytes:
            failed.update(ld.block_ids)
            continue
        for layer, base in enumerate(bases):
            for rb, lb in zip(ld.remote_block_ids, ld.block_ids, strict=True):
                moves.append(Move(False, base + lb * block_bytes, lay["segment"],
                                  lay["bases"][layer] + rb * block_bytes, block_bytes))
                owners.append((ld, lb))
    results = client._dp.run(moves) if moves else []  # the client's Transfer Engine door
    for (_ld, lb), r in zip(owners, results, strict=True):
        if not r.ok:
            failed.add(lb)
    for ld in live:
        why = lease_problem(client, ld, clock)   # the blocks were held during the read?
        if why is not None:
            _lease_lost(ld, "after", why)
            failed.update(ld.block_ids)
            continue
        with contextlib.suppress(StoreError, OSError):  # else: given back at the hold's end
            client.put(done_key(ld.engine, ld.remote_req), b"1")
    return done, failed


def _lease_lost(ld: DirectLoad, when: str, why: str) -> None:
    logger.warning("P/D: request %s: the lease of request %s on prefill instance %s is not "
                   "live %s the read: %s; its %d block(s) fail (vLLM's "
                   "kv_load_failure_policy applies)", ld.req_id, ld.remote_req, ld.engine,
                   when, why, len(ld.block_ids))


class Holds:
    """A prefill instance's worker-side record of P/D requests whose blocks it keeps until
    their decode has read them or ``hold_s`` passed (then their lease is removed first)."""

    def __init__(self, engine: str, clock: Any = time.monotonic,
                 hold_s: float = HOLD_TIMEOUT_S) -> None:
        self.engine = engine
        self.clock = clock
        self.hold_s = hold_s
        self.held: dict[str, float] = {}    # request id → deadline
        self._last_poll = 0.0

    def add(self, req_ids: list[str]) -> None:
        now = self.clock()
        for r in req_ids:
            self.held.setdefault(r, now + self.hold_s)

    def released(self, client: Any) -> tuple[set[str], set[str]]:
        """(read, timed out): held requests whose done marker exists, and held requests
        whose hold ended without one; their lease records (and markers) are removed before
        this returns, so the caller may hand the blocks back. At most one lookup per
        ``POLL_INTERVAL_S``. A timed-out request whose lease cannot be removed stays held
        (retried at the next poll) until ``LEASE_MARGIN_S`` past its deadline: by then
        every decode sees the lease as expired."""
        now = self.clock()
        if not self.held or now - self._last_poll < POLL_INTERVAL_S:
            return set(), set()
        self._last_poll = now
        ids = list(self.held)
        try:
            present = client.batch_exist([done_key(self.engine, r) for r in ids])
        except (StoreError, OSError):
            present = [False] * len(ids)
        read = {r for r, p in zip(ids, present, strict=True) if p is True}
        timed_out = set()
        for r in ids:
            if r in read:
                with contextlib.suppress(StoreError, OSError):
                    client.remove(done_key(self.engine, r), force=True)
                with contextlib.suppress(StoreError, OSError):
                    client.remove(lease_key(self.engine, r), force=True)
            elif self.held[r] <= now and (self._revoke(client, r)
                                          or self.held[r] + LEASE_MARGIN_S <= now):
                timed_out.add(r)
        for r in read | timed_out:
            del self.held[r]
        return read, timed_out

    def _revoke(self, client: Any, req: str) -> bool:
        try:
            client.remove(lease_key(self.engine, req), force=True)
        except StoreError as e:
            return e.code == ErrorCode.OBJECT_NOT_FOUND
        except OSError:
            return False
        return True
