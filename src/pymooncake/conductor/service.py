"""The live Conductor: cluster view from worker reports and KV events, the policy's placement
and early rejection, dispatch to prefill and decode workers over RPC, tokens relayed back.

``Conductor.generate`` is the front door's backend (``api.server.Backend``). One decision per
request, on a fresh ``ClusterView`` (CASES BUG-51), with ``conductor.policy.schedule`` —
the same function the simulator calls (DESIGN.md §2, §7; Mooncake FAST'25 Algorithm 1):

1. placement (prefill instance, decode instance) or a ``Rejection`` → HTTP 429 + Retry-After;
2. ``prepare_decode`` on the decode worker: local admission + a receive buffer;
3. ``prefill`` on the prefill worker: reuse (local cache, Store), compute, ship the KV;
   the first token streams back with the *prefill side's* prefix hit (CASES BUG-56);
4. ``start_decode`` (KV ready); the decode worker then pushes the tokens (``tokens``
   notices, ``TokenFrames``) and ``TokenRouter`` hands them to the request's stream.

A worker that fails mid-request (connection lost, or it left the cluster view when its
reports stopped) fails its requests with a 503 ``worker_failed``; the others serve on.

Modules: this one (lifecycle, worker RPC handlers, health), ``conductor.dispatch`` (one
request: placement, dispatch, token relay), ``conductor.request_stages`` (metrics, stage
timings, estimators from the config, failure → ``Rejection``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import time
from collections import deque
from typing import Any

from pymooncake.conductor.cluster_view import ClusterState, WorkerEntry, cpp_model_of
from pymooncake.conductor.config import ConductorConfig
from pymooncake.conductor.dispatch import RequestDispatch
from pymooncake.conductor.policy import (
    PolicyConfig,
    PrefillEstimator,
    fit_prefill_estimator,
)
from pymooncake.conductor.policy.estimators import LINEAR_FLOOR_S
from pymooncake.conductor.replication import HotBlockReplicator
from pymooncake.conductor.request_stages import (
    ORPHAN_ABORTS,
    estimators_from,
    observe_stages,
    profile_samples,
)
from pymooncake.conductor.token_streams import TokenRouter
from pymooncake.conductor.worker_loss import WorkerLossWatch
from pymooncake.identity import CacheNamespace
from pymooncake.obs.logging import init_logger
from pymooncake.rpc import RpcClient, RpcError, RpcServer
from pymooncake.rpc.messages import (
    KVEvents,
    TokenFrames,
    WorkerInfo,
    WorkerLoad,
)

logger = init_logger(__name__)

__all__ = ["Conductor", "estimators_from", "observe_stages"]


class Conductor(RequestDispatch):
    """Hosts the worker-facing RPC endpoint and serves ``generate`` (module docstring).

    This module holds its lifecycle, the worker messages (register, load reports, KV events,
    pushed tokens) and its health view; one request's placement and dispatch are
    ``conductor.dispatch.RequestDispatch``, its metrics and stage timings
    ``conductor.request_stages``."""

    def __init__(self, config: ConductorConfig | None = None, host: str = "127.0.0.1",
                 port: int = 0, prefill_estimator: PrefillEstimator | None = None) -> None:
        self.config = config or ConductorConfig()
        self.state = ClusterState(self.config)
        self.server = RpcServer(host, port)
        self.estimators = estimators_from(self.config, prefill_estimator)
        self.namespace: CacheNamespace | None = None
        self.policy_config: PolicyConfig | None = None
        self._seq = itertools.count()
        self._tasks: list[asyncio.Task[Any]] = []
        self.in_flight: dict[str, tuple[str, str | None]] = {}
        """request id → (prefill instance, decode instance) while it runs."""
        self._profile: deque[tuple[int, int, float]] = deque(
            maxlen=self.config.online_profile_window)
        self._profile_new = 0
        self.num_profile_fits = 0
        self._explicit_estimator = prefill_estimator is not None
        self._profiled: set[str] = set()
        """Workers whose start-up profile was taken (a re-registration adds none)."""
        self._roots: dict[str, Any] = {}
        """request id → its ``serving.request`` span (OpenTelemetry; None while off)."""
        self.tokens = TokenRouter()
        """The token streams of the requests being decoded (fed by ``tokens`` notices)."""
        self.losses = WorkerLossWatch()
        """P/D requests failed at once when their prefill or decode worker is lost."""
        self._aborting: dict[str, asyncio.Task[None]] = {}
        """Orphaned requests (nobody waits for their tokens) whose abort is under way."""
        c = self.config
        self.replicator = (HotBlockReplicator(c, self.state) if c.hot_replication and c.master
                           and c.use_store and not c.colocated else None)
        """Hot-block replication (``conductor.replication``); None while off."""

    # -- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        self.server.register("register_worker", self._register, WorkerInfo)
        self.server.register("worker_load", self._load, WorkerLoad)
        self.server.register("kv_events", self._kv_events, KVEvents)
        self.server.register("tokens", self._on_tokens, TokenFrames)
        await self.server.start()
        self._tasks.append(asyncio.ensure_future(self._expire_loop()))
        if self.config.store_master is not None:  # HA Store: follow its leader (BUG-58)
            from pymooncake.conductor.store_leader import follow_store_leader

            self._tasks.append(asyncio.ensure_future(follow_store_leader(
                self.config.store_master, self._store_leader_changed)))

    def _store_leader_changed(self) -> None:
        n = self.state.reset_store_view()
        logger.warning("the Store's master leader changed: dropped %d store-tier entries; "
                       "the KV events that follow rebuild them", n)

    @property
    def port(self) -> int:
        return self.server.port

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(BaseException):
                await t
        for w in list(self.state.workers.values()):
            if w.client is not None:
                await w.client.close()
        if self.replicator is not None:
            await self.replicator.close()
        await self.server.stop()

    async def _expire_loop(self) -> None:
        while True:
            await asyncio.sleep(0.25)
            for w in self.state.expire(time.monotonic()):
                logger.warning("worker %s left (no load report for %.1f s)",
                               w.info.instance_id, self.config.worker_timeout_s)
                why = f"no load report for {self.config.worker_timeout_s} s"
                self.tokens.fail_instance(w.info.instance_id, why)
                self.losses.lost(w.info.instance_id, why)
                if self.replicator is not None:
                    self.replicator.forget(instance_id=w.info.instance_id)
                if w.client is not None:
                    await w.client.close()

    # -- worker messages ------------------------------------------------------------------
    async def _register(self, info: WorkerInfo) -> bool:
        limit = self.config.context_length
        if limit and 0 < info.max_model_len < limit:
            raise RpcError("CONTEXT_TOO_SMALL",
                           f"worker {info.instance_id} takes at most {info.max_model_len} "
                           f"tokens per request (--max-model-len), the front door admits "
                           f"{limit} (--context-length): start the worker with "
                           f"--max-model-len >= {limit} or the Conductor with "
                           f"--context-length <= {info.max_model_len}")
        try:
            cpp_model_of(info)      # a CPP group's cost model (conductor.cluster_view)
            profile = profile_samples(info.prefill_profile_json)
        except ValueError as e:
            raise RpcError("INVALID_ARGUMENT", f"worker {info.instance_id}: {e}") from None
        d = json.loads(info.namespace_json)
        d["extra"] = tuple(tuple(x) for x in d.get("extra") or ())
        ns = CacheNamespace(**d)
        if self.namespace is None:
            self.namespace = ns
            self.policy_config = PolicyConfig(
                ttft_slo_s=self.config.ttft_slo_s, tbt_slo_s=self.config.tbt_slo_s,
                kvcache_balancing_threshold=self.config.kvcache_balancing_threshold,
                early_rejection=self.config.early_rejection,
                block_size_tokens=ns.block_size, seed=self.config.seed)
            if self.replicator is not None:
                self.replicator.namespace_digest = ns.digest()
                self.replicator.block_bytes = self.config.kv_bytes_per_token * ns.block_size
        elif ns.digest() != self.namespace.digest():
            mine, theirs = dataclasses.asdict(self.namespace), dataclasses.asdict(ns)
            diff = ", ".join(f"{k} {theirs[k]!r} (cluster: {mine[k]!r})" for k in mine
                             if mine[k] != theirs.get(k))
            raise RpcError("NAMESPACE_MISMATCH",
                           f"worker {info.instance_id} serves cache namespace "
                           f"{ns.digest()[:16]}…, the cluster {self.namespace.digest()[:16]}…"
                           f" ({diff}): start every worker with the same --model, dtype and "
                           "block size")
        old = self.state.workers.get(info.instance_id)
        if old is not None:
            # the same process registering again (its reports timed out) still decodes
            # its requests and pushes their tokens; a restarted one lost them
            if (old.info.host, old.info.rpc_port, old.info.pid) != (info.host, info.rpc_port,
                                                                    info.pid):
                self.tokens.fail_instance(info.instance_id, "it was restarted")
            if old.client is not None:
                old.client.on_disconnect = None
                await old.client.close()
        entry = self.state.register(info, time.monotonic())
        entry.client = RpcClient(info.host, info.rpc_port, timeout_s=self.config.rpc_timeout_s,
                                 connect_timeout_s=2.0)
        # a worker that dies closes this connection at once: its pushed tokens stop without
        # a word, so its streams fail now rather than when its load reports are missed
        entry.client.on_disconnect = lambda reason: self._connection_lost(entry, reason)
        logger.info("worker %s (%s) registered at %s:%d", info.instance_id, info.role,
                    info.host, info.rpc_port)
        if profile and info.instance_id not in self._profiled:
            self._profiled.add(info.instance_id)
            self.learn_profile(profile)
        return True

    def _load(self, load: WorkerLoad) -> bool:
        return self.state.report(load, time.monotonic())

    def _kv_events(self, ev: KVEvents) -> None:
        self.state.kv_events(ev)
        if self.replicator is not None and ev.removed and ev.holder == "store":
            self.replicator.forget(ev.removed)    # the Store lost them: bytes given back

    def _connection_lost(self, entry: WorkerEntry, reason: str) -> None:
        if self.state.workers.get(entry.info.instance_id) is entry:
            self.tokens.fail_instance(entry.info.instance_id, reason)
            self.losses.lost(entry.info.instance_id, reason)

    def _on_tokens(self, msg: TokenFrames) -> None:
        """A worker's pushed token frames (one-way); the requests nobody here waits for
        any more (client gone) are aborted on the worker, so none decodes for nobody."""
        orphans = self.tokens.deliver(msg)
        w = self.state.workers.get(msg.instance_id)
        for rid in orphans:
            if w is None or rid in self._aborting:
                continue
            ORPHAN_ABORTS.inc()
            task = self._aborting[rid] = asyncio.ensure_future(self._abort(w, rid))
            task.add_done_callback(lambda _t, rid=rid: self._aborting.pop(rid, None))

    # -- health ---------------------------------------------------------------------------
    def waiting_for(self) -> list[str]:
        """What the Conductor still needs before it can serve a request (empty: ready): a
        registered prefill and decode worker, or one colocated worker. Workers register
        once their model is loaded."""
        roles = {w.info.role for w in self.state.workers.values()}
        need = ("colocated",) if self.config.colocated else ("prefill", "decode")
        return [f"a {r} worker to register" for r in need if r not in roles]

    def health(self) -> dict[str, Any]:
        workers = []
        for w in self.state.workers.values():
            ld = w.load
            workers.append({"instance_id": w.info.instance_id, "role": w.info.role,
                            "pid": w.info.pid, "rpc_port": w.info.rpc_port,
                            "num_free_blocks": ld.num_free_blocks if ld else None,
                            "num_kv_blocks": ld.num_kv_blocks if ld else None,
                            "num_running": ld.num_running if ld else None,
                            "num_prefill_tokens_total":
                                ld.num_prefill_tokens_total if ld else None,
                            "cpp": w.cpp_state})
        pre = self.estimators.prefill
        return {"policy": self.config.policy, "colocated": self.config.colocated,
                "prefill_estimator": {"quadratic_s": pre.quadratic_s,
                                      "linear_s": pre.linear_s, "overhead_s": pre.overhead_s,
                                      "num_online_fits": self.num_profile_fits},
                "workers": sorted(workers, key=lambda x: x["instance_id"]),
                "requests": {k: list(v) for k, v in self.in_flight.items()},
                "num_indexed_blocks": len(self.state.index),
                "num_store_blocks": len(self.state.store_keys),
                "hot_replication": None if self.replicator is None else {
                    "replicated_blocks": self.replicator.num_replicated,
                    "replica_bytes": self.replicator.used_bytes,
                    "budget_bytes": self.replicator.budget_bytes,
                    "replicas": {w.info.instance_id: len(w.replica_keys)
                                 for w in self.state.workers.values() if w.replica_keys}}}

    def learn_prefill(self, num_tokens: int, num_prefix_tokens: int, windows: Any) -> None:
        """Add one measured prefill (its ``prefill`` compute window) to the online profile
        and refit ``PrefillEstimator`` every ``online_profile_every`` samples. A fit that
        would predict a negative time for some prompt is not taken."""
        if not self.config.online_profile or num_prefix_tokens >= num_tokens:
            return
        w = next((w for w in windows if w[0] == "prefill"), None)
        if w is None or not w[2] > w[1]:
            return
        self._profile.append((num_tokens, num_prefix_tokens, float(w[2] - w[1])))
        self._profile_new += 1
        if self._profile_new < self.config.online_profile_every or len(self._profile) < 8:
            return
        self._profile_new = 0
        self._refit()

    def learn_profile(self, samples: list[tuple[int, int, float]]) -> None:
        """Add a worker's start-up profile (``WorkerInfo.prefill_profile_json``) to the
        online profile and, unless the Conductor was given an estimator (``--profile``),
        fit ``PrefillEstimator`` to it now: TTFT predictions (placement, early rejection)
        are then this machine's from the first request on."""
        if not self.config.online_profile:
            return
        self._profile.extend(samples)
        if not self._explicit_estimator:
            self._refit()

    def _refit(self) -> None:
        """Fit ``PrefillEstimator`` to the profile; when noisy samples (a small model's
        millisecond prefills on a loaded machine) give a negative term, the best fit with
        every term >= 0 instead. A fit that grows with neither n nor n² is not taken."""
        samples = list(self._profile)
        try:
            est = fit_prefill_estimator(samples, with_overhead=True)
            if est.quadratic_s < 0 or est.linear_s <= 0 or est.overhead_s < 0:
                est = fit_prefill_estimator(samples, with_overhead=True, nonnegative=True)
        except ValueError:
            return
        if est.quadratic_s <= 0 and est.linear_s <= LINEAR_FLOOR_S:
            return
        self.estimators = dataclasses.replace(self.estimators, prefill=est)
        self.num_profile_fits += 1

