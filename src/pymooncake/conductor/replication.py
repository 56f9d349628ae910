"""Live hot-block replication (FAST'25 §4.2, Figure 11; DESIGN.md §7).

After each placement the Conductor records the request's reused blocks (its leading block
keys some holder has) in a ``ReuseWindow`` and asks ``policy.plan_replication`` — built on
``blocks_to_replicate``, the function the simulator uses — which prefill instance should
gain which hot blocks: the request's own instance first (it fetches them now), then the
others, least loaded first. The Store master copies them (``replicate`` RPC,
``store.master.copier``) to that instance's Store segment, ``<instance id>-store`` (the
name prefill workers mount theirs under). Once copied, the instance counts as a holder in
the prefix index (``ClusterState.add_replicas``), so Algorithm 1 sees a local hit there and
the worker reads the blocks from its own segment (one memcpy) instead of another host's.

Bounded: the replicas made hold at most ``hot_replication_budget_bytes`` at once (bytes of
replicas the Store later loses are given back), one copy batch is in flight at a time and
plans made meanwhile are dropped (the next access plans again).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from pymooncake.conductor.cluster_view import ClusterState
from pymooncake.conductor.config import ConductorConfig
from pymooncake.conductor.policy import (
    HotBlockConfig,
    InstanceId,
    ReuseWindow,
    plan_replication,
)
from pymooncake.obs import metrics
from pymooncake.obs.logging import init_logger
from pymooncake.rpc import RpcClient, RpcError

logger = init_logger(__name__)

REPLICATIONS = metrics.counter("pymooncake_conductor_hot_replications_total",
                               "hot blocks copied to one more prefill instance's segment")
REPLICATED_BYTES = metrics.counter("pymooncake_conductor_hot_replicated_bytes_total",
                                   "bytes of hot blocks copied (hot-block replication)")
REPLICA_BYTES = metrics.gauge("pymooncake_conductor_hot_replica_bytes",
                              "bytes the replicas made by hot-block replication hold now")
BUDGET_BYTES = metrics.gauge("pymooncake_conductor_hot_replication_budget_bytes",
                             "byte budget of hot-block replication (0 while it is off)")
REPLICATION_FAILURES = metrics.counter("pymooncake_conductor_hot_replication_failures_total",
                                       "hot-block copies the Store refused or failed")


def store_object_key(namespace_digest: str, block_key: str) -> str:
    """The Store object of a KV block, as prefill workers put it
    (``engine.kv_loader.store_key``: namespace-scoped)."""
    return f"kv/{namespace_digest[:16]}/{block_key}"


SEGMENT_SUFFIXES = ("-kv", "-store")
"""How a prefill worker names the Store segment it mounts: its Transfer Engine's name,
``<instance id>-kv`` (``engine.worker.prefill``; ``-store`` before it shared one)."""


def segment_of(instance_id: str, mounted: list[str]) -> str | None:
    """The segment of ``mounted`` that prefill instance ``instance_id`` contributes:
    ``<id>-kv`` or ``<id>-store``, else the only one named ``<id>-…``; None if none is."""
    names = set(mounted)
    for suffix in SEGMENT_SUFFIXES:
        if instance_id + suffix in names:
            return instance_id + suffix
    rest = [n for n in mounted if n.startswith(instance_id + "-")]
    return rest[0] if len(rest) == 1 else None


class HotBlockReplicator:
    """Counts reuse and has the Store copy hot blocks (module docstring)."""

    def __init__(self, config: ConductorConfig, state: ClusterState) -> None:
        assert config.master is not None
        self.config = config
        self.state = state
        self.cfg = HotBlockConfig(config.hot_min_accesses, config.hot_max_replicas)
        self.window = ReuseWindow(config.hot_window_s)
        self.budget_bytes = config.hot_replication_budget_bytes
        self.made: dict[str, dict[str, int]] = {}
        """block key → {instance id: bytes} of the replicas made and not known lost."""
        self.used_bytes = 0
        self.block_bytes = 0
        """Estimated bytes of one block (set with the cluster's namespace)."""
        self.namespace_digest = ""
        self._segments: list[str] = []
        """Segment names the master had mounted when last asked."""
        self.num_replicated = 0
        self._inflight: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        host, port = config.master.rsplit(":", 1)
        self._client = RpcClient(host, int(port), timeout_s=30.0, connect_timeout_s=2.0)
        BUDGET_BYTES.set(self.budget_bytes)

    async def close(self) -> None:
        for t in list(self._tasks):
            t.cancel()
            with contextlib.suppress(BaseException):
                await t
        await self._client.close()

    # -- bookkeeping --------------------------------------------------------------------
    def forget(self, keys: Any = None, instance_id: str | None = None) -> None:
        """Replicas the Store lost (``keys``) or a worker took with it (``instance_id``):
        their bytes go back to the budget."""
        for k in list(self.made) if keys is None else list(keys):
            held = self.made.get(k)
            if held is None:
                continue
            for inst in [i for i in held if instance_id is None or i == instance_id]:
                self.used_bytes -= held.pop(inst)
            if not held:
                del self.made[k]
        REPLICA_BYTES.set(self.used_bytes)

    # -- after a placement ---------------------------------------------------------------
    def on_placement(self, keys: list[str], prefill_instance: str, now_s: float) -> None:
        """Record the request's reuse; start one copy batch when the plan has one."""
        idx = self.state.index
        reused: list[str] = []
        for k in keys:
            if not idx.num_replicas(k):
                break
            reused.append(k)
        self.window.record(reused, now_s)
        if self._inflight is not None and not self._inflight.done():
            return
        bb = max(1, self.block_bytes)
        room = (self.budget_bytes - self.used_bytes) // bb
        if room <= 0 or not reused:
            return
        others = sorted((w for w in self.state.prefill_pool()
                         if w.info.instance_id != prefill_instance),
                        key=lambda w: (len(w.prefills), w.info.instance_id))
        targets = [InstanceId(prefill_instance)] + [InstanceId(w.info.instance_id)
                                                    for w in others]
        plan = plan_replication(reused, idx.holders, targets, self.window.count, self.cfg,
                                int(room))
        if plan is None:
            return
        target, blocks = plan
        task = asyncio.ensure_future(self._copy(str(target), [str(b) for b in blocks]))
        self._inflight = task
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _copy(self, instance_id: str, keys: list[str]) -> None:
        skeys = [store_object_key(self.namespace_digest, k) for k in keys]
        try:
            seg = segment_of(instance_id, self._segments)
            if seg is None:       # a new worker (or the first copy): ask the master
                self._segments = list(await self._client.call("segment_names", {}))
                seg = segment_of(instance_id, self._segments)
            if seg is None:
                raise RpcError("NO_SEGMENT", f"no Store segment of {instance_id} is mounted")
            res = await self._client.call("replicate", {"keys": skeys, "segment": seg})
        except RpcError as e:
            REPLICATION_FAILURES.inc(len(keys))
            logger.warning("hot-block replication to %s failed: %s", instance_id, e)
            return
        done: list[str] = []
        for k, r in zip(keys, res, strict=True):
            if isinstance(r, dict) and "r" in r:
                done.append(k)
                nbytes = int(r["r"])
                if nbytes > 0:
                    self.made.setdefault(k, {})[instance_id] = nbytes
                    self.used_bytes += nbytes
                    self.num_replicated += 1
                    REPLICATIONS.inc()
                    REPLICATED_BYTES.inc(nbytes)
            else:
                REPLICATION_FAILURES.inc()
                logger.info("hot block %s not copied to %s: %s", k, instance_id, r)
        REPLICA_BYTES.set(self.used_bytes)
        if done and not self.state.add_replicas(instance_id, done):
            self.forget(instance_id=instance_id)
