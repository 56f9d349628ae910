"""The live Conductor's picture of the cluster: registered workers, their load reports, the
requests it has placed on them, and the prefix index — turned into a fresh
``policy.ClusterView`` for every decision (CASES BUG-51: never a stale snapshot).

State holder only, no I/O: the service feeds it worker messages and its own dispatch
bookkeeping, and passes the clock in (``now_s``, ``time.monotonic`` seconds).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from pymooncake.conductor.config import ConductorConfig
from pymooncake.conductor.kv_events import STORE_HOLDER, apply_kv_events
from pymooncake.conductor.policy import (
    ClusterView,
    CppCostModel,
    DecodeInstanceState,
    InstanceId,
    PrefillInstanceState,
    PrefixIndex,
    shared_prefix_blocks,
)
from pymooncake.conductor.policy.cpp_placement import cpp_model_from_wire
from pymooncake.rpc.messages import KVEvents, WorkerInfo, WorkerLoad


def cpp_model_of(info: WorkerInfo) -> CppCostModel | None:
    """The CPP group's cost model a worker registered (None: a single worker). Raises
    ``ValueError`` when ``info.cpp_json`` is not a valid one."""
    if not info.cpp_json:
        return None
    try:
        d = json.loads(info.cpp_json)
    except ValueError:
        raise ValueError(f"worker {info.instance_id}: cpp_json is not JSON") from None
    if not isinstance(d, dict):
        raise ValueError(f"worker {info.instance_id}: cpp_json must be an object")
    return cpp_model_from_wire(d)


@dataclass(slots=True)
class WorkerEntry:
    """One registered worker."""

    info: WorkerInfo
    last_seen_s: float
    load: WorkerLoad | None = None
    client: Any = None
    """The service's RPC client to it."""
    prefills: dict[str, tuple[float, float]] = field(default_factory=dict)
    """Placed prefills: request id → (dispatch time, predicted prefill seconds)."""
    prefill_keys: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """Placed prefills: request id → its prompt's block keys, blocks this worker's cache
    will hold once that prefill has computed them (``ClusterState.pending_blocks``)."""
    decodes: dict[str, tuple[int, float]] = field(default_factory=dict)
    """Placed decodes: request id → (context tokens, predicted finish time)."""
    held_keys: set[str] = field(default_factory=set)
    """Block keys its local prefix cache holds (from its KV events)."""
    replica_keys: set[str] = field(default_factory=set)
    """Block keys hot-block replication copied to its Store segment (``add_replicas``):
    a hit on this instance for the placement, whatever its prefix cache evicts."""
    cpp: Any = None
    """``policy.CppCostModel`` of a CPP prefill group (from ``info.cpp_json``); None for a
    single worker, and for a group whose last load report said it is unhealthy (a stage
    failed: the instance computes prompts with its own engine, docs/cpp.md)."""
    cpp_state: dict[str, Any] | None = None
    """A CPP instance's last reported group health (``WorkerLoad.cpp_state_json``)."""


class ClusterState:
    """Workers, placements and the prefix index (see module docstring)."""

    def __init__(self, config: ConductorConfig) -> None:
        self.config = config
        self.workers: dict[str, WorkerEntry] = {}
        self.index = PrefixIndex()
        self.store_keys: set[str] = set()
        """Block keys the global Store holds (from the ``store`` KV events)."""

    # -- worker messages ------------------------------------------------------------------
    def register(self, info: WorkerInfo, now_s: float) -> WorkerEntry:
        old = self.workers.get(info.instance_id)
        if old is not None:
            self.index.evict(InstanceId(info.instance_id), old.held_keys | old.replica_keys)
        entry = WorkerEntry(info, now_s, cpp=cpp_model_of(info))
        self.workers[info.instance_id] = entry
        return entry

    def report(self, load: WorkerLoad, now_s: float) -> bool:
        """A load report; ``False`` when the worker is unknown (it must register again)."""
        w = self.workers.get(load.instance_id)
        if w is None:
            return False
        w.load = load
        w.last_seen_s = now_s
        if load.cpp_state_json:
            _apply_cpp_state(w, load.cpp_state_json)
        return True

    def kv_events(self, ev: KVEvents) -> None:
        w = self.workers.get(ev.holder)
        if w is not None:
            w.held_keys.difference_update(ev.removed)
            w.held_keys.update(ev.stored)
        elif ev.holder == "store":
            self.store_keys.difference_update(ev.removed)
            self.store_keys.update(ev.stored)
        else:
            return  # an unregistered worker's events would never be dropped again
        apply_kv_events(self.index, ev)
        if w is not None and ev.removed and w.replica_keys:
            # its prefix cache dropped them, its Store segment still holds a replica
            self.index.insert(InstanceId(ev.holder), w.replica_keys.intersection(ev.removed))
        elif w is None and ev.removed:
            self.drop_replicas(ev.removed)

    def add_replicas(self, instance_id: str, keys: list[str]) -> bool:
        """Hot-block replication copied ``keys`` to ``instance_id``'s Store segment: the
        placement counts them as its own from now on. False when it left meanwhile."""
        w = self.workers.get(instance_id)
        if w is None:
            return False
        w.replica_keys.update(keys)
        self.index.insert(InstanceId(instance_id), keys)
        return True

    def drop_replicas(self, keys: Any) -> dict[str, int]:
        """The Store lost ``keys`` (every replica): forget the replicas of them; returns
        instance → how many it lost."""
        lost: dict[str, int] = {}
        for w in self.workers.values():
            gone = w.replica_keys.intersection(keys)
            if gone:
                w.replica_keys.difference_update(gone)
                self.index.evict(InstanceId(w.info.instance_id), gone - w.held_keys)
                lost[w.info.instance_id] = len(gone)
        return lost

    def reset_store_view(self) -> int:
        """The Store's master leader changed: forget every block the Store was known to
        hold (the new leader may hold fewer); KV events that follow rebuild the view.
        Returns how many keys were dropped."""
        n = len(self.store_keys)
        if n:
            self.index.evict(STORE_HOLDER, self.store_keys)
            self.drop_replicas(self.store_keys)
        self.store_keys = set()
        return n

    def expire(self, now_s: float) -> list[WorkerEntry]:
        """Drop workers silent for ``worker_timeout_s``; returns them."""
        gone = [w for w in self.workers.values()
                if now_s - w.last_seen_s > self.config.worker_timeout_s]
        for w in gone:
            self.remove(w.info.instance_id)
        return gone

    def remove(self, instance_id: str) -> WorkerEntry | None:
        w = self.workers.pop(instance_id, None)
        if w is not None:
            self.index.evict(InstanceId(instance_id), w.held_keys | w.replica_keys)
        return w

    # -- views ----------------------------------------------------------------------------
    def prefill_pool(self) -> list[WorkerEntry]:
        role = "colocated" if self.config.colocated else "prefill"
        return sorted((w for w in self.workers.values() if w.info.role == role),
                      key=lambda w: w.info.instance_id)

    def decode_pool(self) -> list[WorkerEntry]:
        if self.config.colocated:
            return []
        return sorted((w for w in self.workers.values() if w.info.role == "decode"),
                      key=lambda w: w.info.instance_id)

    def pending_blocks(self, keys: list[str], instance_ids: list[str]) -> tuple[int, ...]:
        """Per instance, the leading blocks of ``keys`` that a prefill placed there and not
        yet finished shares (``policy.prefix_index.shared_prefix_blocks``): they are not in
        its cache yet (no KV event), but a request queued behind that prefill finds them
        there. (A request placed on the instance first runs after it, FCFS; shortest-first
        too, since such a request — a later turn of the same conversation, a retried prompt
        — is rarely the shorter one.)"""
        return tuple(shared_prefix_blocks(keys, w.prefill_keys.values() if w is not None
                                          else ()) for w in map(self.workers.get,
                                                                instance_ids))

    def view(self, now_s: float) -> ClusterView:
        """A fresh ``ClusterView`` of the live workers at ``now_s``."""
        prefill = []
        for w in self.prefill_pool():
            # The requests placed on it run one after another: the earliest has been
            # running since its dispatch, the others wait.
            items = sorted(w.prefills.values())
            busy_until = now_s
            queued = 0.0
            if items:
                start, pred = items[0]
                busy_until = max(now_s, start + pred)
                queued = sum(p for _, p in items[1:])
            prefill.append(PrefillInstanceState(
                InstanceId(w.info.instance_id), busy_until, queued, len(w.prefills),
                self.config.prefill_concurrency_limit,
                tuple(p for _, p in items[1:]), w.info.prefill_order in ("shortest", "srpt"),
                w.cpp))
        decode = []
        for w in self.decode_pool():
            ctx = sum(c for c, _ in w.decodes.values())
            finish = tuple(sorted(f for _, f in w.decodes.values()))
            decode.append(DecodeInstanceState(
                InstanceId(w.info.instance_id), len(w.decodes), ctx,
                w.info.kv_capacity_tokens, w.info.max_batch_size, finish))
        return ClusterView(now_s, tuple(prefill), tuple(decode))


def _apply_cpp_state(w: WorkerEntry, state_json: str) -> None:
    """A CPP instance's group health from its load report: while it is unhealthy the
    instance is placed as a single worker (``cpp`` None), back to a group once healthy."""
    try:
        state = json.loads(state_json)
        healthy = bool(state["healthy"])
    except (ValueError, TypeError, KeyError):
        return      # a report the Conductor cannot read changes nothing
    w.cpp_state = state
    if not healthy:
        w.cpp = None
    elif w.cpp is None:
        w.cpp = cpp_model_of(w.info)
