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
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import time
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

from pymooncake.conductor.cluster_view import ClusterState, WorkerEntry
from pymooncake.conductor.config import ConductorConfig
from pymooncake.conductor.policy import (
    PREFILL_POLICIES,
    DecodeEstimator,
    Estimators,
    Placement,
    PolicyConfig,
    PrefillEstimator,
    RequestInfo,
    TransferEstimator,
    fit_prefill_estimator,
    schedule,
)
from pymooncake.conductor.policy import Rejection as PolicyRejection
from pymooncake.conductor.replication import HotBlockReplicator
from pymooncake.conductor.token_streams import TokenRouter
from pymooncake.identity import CacheNamespace, block_keys
from pymooncake.obs import metrics
from pymooncake.obs.logging import init_logger
from pymooncake.obs.tracing import end_span, record_span, set_span_attributes, start_root_span
from pymooncake.rpc import RpcClient, RpcError, RpcServer, from_wire
from pymooncake.rpc.messages import (
    DecodeTask,
    GenerateRequest,
    KVEvents,
    KVTarget,
    PrefillResult,
    PrefillTask,
    Rejection,
    RequestRejected,
    SetTarget,
    StartDecode,
    TokenEvent,
    TokenFrames,
    WorkerInfo,
    WorkerLoad,
)

logger = init_logger(__name__)

PLACED = metrics.counter("pymooncake_conductor_placements_total",
                         "requests placed, by prefill instance", ["prefill_instance"])
REJECTED = metrics.counter("pymooncake_conductor_rejections_total",
                           "requests refused by the Conductor, by reason", ["reason"])
FAILED = metrics.counter("pymooncake_conductor_failed_requests_total",
                         "placed requests that failed (worker lost, transfer failed)", ["stage"])
HIT_TOKENS = metrics.counter("pymooncake_conductor_prefix_hit_tokens_total",
                             "prompt tokens the prefill side reused (local cache or Store)")
OVERLAPPED = metrics.counter("pymooncake_conductor_overlapped_admissions_total",
                             "P/D requests whose decode admission ran while their prefill "
                             "queued or computed (KVTarget sent with SetTarget)")
LATE_TARGETS = metrics.counter("pymooncake_conductor_late_targets_total",
                               "overlapped requests whose SetTarget found no prefill waiting "
                               "for it (aborted meanwhile)")
ORPHAN_ABORTS = metrics.counter("pymooncake_conductor_orphan_aborts_total",
                                "requests aborted on their worker because it pushed tokens "
                                "nobody here waits for (client gone, request failed)")
STAGE_S = metrics.histogram("pymooncake_conductor_stage_seconds",
                            "time per request stage (s): the Conductor's own (tokenize, "
                            "schedule, prepare_decode, prefill_rpc, ttft, decode_stream) and "
                            "the windows workers measured (queue, store_lookup, cache_load, "
                            "prefill, p2d_transfer, decode_queue, decode_load, decode, "
                            "generate)", ["stage"])


def observe_stages(request_id: str, windows: Any, parent: Any = None) -> None:
    """Histogram + OpenTelemetry span for each ``(stage, start, end)`` window (unix s) a
    worker measured; malformed windows are skipped (a worker's report is not trusted)."""
    for w in windows or ():
        try:
            name, start, end = str(w[0]), float(w[1]), float(w[2])
        except (TypeError, ValueError, IndexError):
            continue
        if not end >= start:
            continue
        STAGE_S.labels(name).observe(end - start)
        record_span(f"serving.{name}", start, end, parent, request_id=request_id)


def _stage(request_id: str, name: str, start_s: float, end_s: float, parent: Any = None
           ) -> None:
    """A stage the Conductor timed itself (monotonic ``start_s``/``end_s``)."""
    STAGE_S.labels(name).observe(end_s - start_s)
    wall = time.time() - time.monotonic()
    record_span(f"serving.{name}", start_s + wall, end_s + wall, parent,
                request_id=request_id)

_REJECT_STATUS = {"saturated": 429, "ttft_slo": 429, "tbt_slo": 429, "decode_full": 503,
                  "no_instance": 503}


def estimators_from(cfg: ConductorConfig, prefill: PrefillEstimator | None = None
                    ) -> Estimators:
    """The policy's predictors from the config (``prefill`` from a measured profile)."""
    pre = prefill or PrefillEstimator(cfg.prefill_quadratic_s, cfg.prefill_linear_s,
                                      cfg.prefill_overhead_s)
    return Estimators(prefill=pre,
                      transfer=TransferEstimator(cfg.kv_bytes_per_token,
                                                 cfg.transfer_bandwidth_bytes_per_s, 0.001),
                      decode=DecodeEstimator(overhead_s=cfg.decode_step_s * 0.5,
                                             weight_s=cfg.decode_step_s * 0.5,
                                             per_context_token_s=1e-8, per_sequence_s=1e-3))


def _worker_failed(stage: str, err: BaseException) -> RequestRejected:
    if isinstance(err, RpcError) and err.code == "INVALID_REQUEST":
        # the worker refused the request itself (e.g. token ids outside its vocabulary)
        return RequestRejected(Rejection(400, "invalid_request", f"{stage}: {err.message}"))
    FAILED.labels(stage).inc()
    return RequestRejected(Rejection(503, "worker_failed",
                                     f"{stage} failed: {err}", retry_after_s=1.0))


class Conductor:
    """Hosts the worker-facing RPC endpoint and serves ``generate`` (module docstring)."""

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
        self._roots: dict[str, Any] = {}
        """request id → its ``serving.request`` span (OpenTelemetry; None while off)."""
        self.tokens = TokenRouter()
        """The token streams of the requests being decoded (fed by ``tokens`` notices)."""
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
                self.tokens.fail_instance(w.info.instance_id, (
                    f"no load report for {self.config.worker_timeout_s} s"))
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
                                ld.num_prefill_tokens_total if ld else None})
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
        try:
            est = fit_prefill_estimator(list(self._profile), with_overhead=True)
        except ValueError:
            return
        if est.quadratic_s < 0 or est.linear_s <= 0 or est.overhead_s < 0:
            try:  # overhead or curvature not supported by these samples: the simpler fit
                est = fit_prefill_estimator(list(self._profile))
            except ValueError:
                return
            if est.quadratic_s < 0 or est.linear_s <= 0:
                return
        self.estimators = dataclasses.replace(self.estimators, prefill=est)
        self.num_profile_fits += 1

    # -- one request ----------------------------------------------------------------------
    def _stage(self, rid: str, name: str, start_s: float, end_s: float) -> None:
        _stage(rid, name, start_s, end_s, self._roots.get(rid))

    def _observe(self, rid: str, windows: Any) -> None:
        observe_stages(rid, windows, self._roots.get(rid))

    def block_keys_of(self, req: GenerateRequest) -> list[str]:
        """The prompt's block keys in the cluster's cache namespace."""
        assert self.namespace is not None
        return [str(k) for k in block_keys(list(req.prompt_token_ids), self.namespace)]

    def place(self, req: GenerateRequest, now_s: float, keys: list[str] | None = None
              ) -> Placement | PolicyRejection:
        """The policy's decision for ``req`` on the cluster as it is at ``now_s``
        (``keys``: its ``block_keys_of``, when already computed)."""
        view = self.state.view(now_s)
        if not view.prefill or (not self.config.colocated and not view.decode):
            return PolicyRejection("no_instance", 1.0)
        assert self.namespace is not None and self.policy_config is not None
        keys = self.block_keys_of(req) if keys is None else keys
        match = self.state.index.match(keys, [p.instance_id for p in view.prefill],
                                       remote=self.config.use_store)
        info = RequestInfo(req.request_id, len(req.prompt_token_ids), tuple(keys),
                           req.sampling.max_tokens, now_s, next(self._seq),
                           sheddable=req.priority > 0)
        return schedule(info, view, match, self.estimators, self.policy_config,
                        PREFILL_POLICIES[self.config.policy], colocated=self.config.colocated)

    async def generate(self, req: GenerateRequest) -> AsyncIterator[TokenEvent]:
        """Place, dispatch and stream one request; every stage is recorded under one
        ``serving.request`` span (one trace per request when tracing is on)."""
        t0 = time.monotonic()
        arrival = req.arrival_time_s or t0
        root = start_root_span("serving.request", time.time() - (t0 - arrival) - req.tokenize_s,
                               request_id=req.request_id,
                               prompt_tokens=len(req.prompt_token_ids),
                               max_tokens=req.sampling.max_tokens)
        self._roots[req.request_id] = root      # None while tracing is off
        try:
            async for ev in self._generate(req, t0):
                yield ev
        finally:
            self._roots.pop(req.request_id, None)
            end_span(root)

    async def _generate(self, req: GenerateRequest, t0: float) -> AsyncIterator[TokenEvent]:
        if req.tokenize_s > 0:
            self._stage(req.request_id, "tokenize", t0 - req.tokenize_s, t0)
        keys = self.block_keys_of(req) if self.namespace is not None else None
        decision = self.place(req, t0, keys)
        self._stage(req.request_id, "schedule", t0, time.monotonic())
        if isinstance(decision, PolicyRejection):
            REJECTED.labels(decision.reason).inc()
            msg = (f"request refused ({decision.reason}): predicted TTFT "
                   f"{decision.predicted_ttft_s:.3f} s, TBT {decision.predicted_tbt_s:.3f} s "
                   f"against SLOs {self.config.ttft_slo_s} s / {self.config.tbt_slo_s} s")
            if decision.reason == "decode_full":
                msg = ("request refused (decode_full): no decode instance has a free batch "
                       "slot and KV room for it now")
            elif decision.reason == "no_instance":
                msg = "request refused (no_instance): no worker of a needed role is registered"
            raise RequestRejected(Rejection(
                _REJECT_STATUS.get(decision.reason, 429), decision.reason, msg,
                retry_after_s=decision.retry_after_s))
        PLACED.labels(decision.prefill_instance).inc()
        if self.replicator is not None and keys:
            self.replicator.on_placement(keys, decision.prefill_instance, t0)
        set_span_attributes(self._roots.get(req.request_id),
                            prefill_instance=decision.prefill_instance,
                            decode_instance=decision.decode_instance,
                            prefix_blocks=decision.prefix_blocks,
                            predicted_queue_s=decision.predicted_queue_s,
                            predicted_prefill_s=decision.predicted_prefill_s,
                            predicted_ttft_s=decision.predicted_ttft_s)
        if self.config.colocated:
            stream = self._run_colocated(req, decision, t0)
        else:
            stream = self._run_disaggregated(req, decision, t0, keys or [])
        async for ev in stream:
            yield ev

    def _book(self, req: GenerateRequest, p: Placement, now_s: float
              ) -> tuple[WorkerEntry, WorkerEntry | None]:
        pw = self.state.workers[p.prefill_instance]
        pw.prefills[req.request_id] = (now_s, p.predicted_transfer_s + p.predicted_prefill_s)
        dw = None
        if p.decode_instance is not None:
            dw = self.state.workers[p.decode_instance]
            finish = (now_s + p.predicted_ttft_s
                      + req.sampling.max_tokens * max(p.predicted_tbt_s, 1e-3))
            dw.decodes[req.request_id] = (len(req.prompt_token_ids) + req.sampling.max_tokens,
                                          finish)
        self.in_flight[req.request_id] = (p.prefill_instance, p.decode_instance)
        return pw, dw

    def _unbook(self, rid: str, pw: WorkerEntry, dw: WorkerEntry | None) -> None:
        pw.prefills.pop(rid, None)
        if dw is not None:
            dw.decodes.pop(rid, None)
        self.in_flight.pop(rid, None)

    def _store_hint(self, keys: list[str]) -> int:
        """Leading prompt blocks the Store holds, per the Store's KV events."""
        held = self.state.store_keys
        return next((i for i, k in enumerate(keys) if k not in held), len(keys))

    async def _run_disaggregated(self, req: GenerateRequest, p: Placement, t0: float,
                                 keys: list[str]) -> AsyncIterator[TokenEvent]:
        rid = req.request_id
        pw, dw = self._book(req, p, t0)
        assert dw is not None and self.namespace is not None
        bs = self.namespace.block_size
        max_tokens = req.sampling.max_tokens
        num_blocks = len(req.prompt_token_ids) // bs if max_tokens > 1 else 0
        finished = False
        prepared = False
        stage = "prefill"
        prefill_call: asyncio.Future[Any] | None = None
        try:
            # The prefill is dispatched first and the decode admission runs while it
            # queues or computes; its KVTarget follows in a SetTarget (PrefillTask docs: a
            # prefill done before then waits for it and ships its blocks from the cache).
            # Only a predicted queue below overlap_admission_min_queue_s puts admission
            # first. With no full block to ship there is no target to wait for.
            overlap = (max_tokens > 1 and num_blocks > 0
                       and p.predicted_queue_s >= self.config.overlap_admission_min_queue_s)
            t1 = time.monotonic()
            hint = self._store_hint(keys) if self.config.use_store else -1

            def dispatch(target: KVTarget | None) -> asyncio.Future[Any]:
                return asyncio.ensure_future(pw.client.call("prefill", PrefillTask(
                    rid, req.prompt_token_ids, req.sampling, target, self.config.use_store,
                    target_follows=overlap, store_hint_blocks=hint)))

            if overlap or num_blocks == 0:
                prefill_call = dispatch(None)
            if overlap:
                OVERLAPPED.inc()
            if max_tokens > 1:
                stage = "prepare_decode"
                try:
                    raw = await dw.client.call("prepare_decode", DecodeTask(
                        rid, req.prompt_token_ids, req.sampling, num_blocks,
                        self.config.tbt_slo_s if self.config.early_rejection else 0.0))
                except RpcError as e:
                    if e.code == "TBT_SLO":
                        REJECTED.labels("tbt_slo").inc()
                        raise RequestRejected(Rejection(
                            429, "tbt_slo", f"decode instance {dw.info.instance_id}: {e}",
                            1.0)) from None
                    if e.code in ("NO_KV_SPACE", "BATCH_FULL", "NO_RECV_SPACE"):
                        REJECTED.labels("decode_full").inc()
                        raise RequestRejected(Rejection(
                            503, "decode_full", f"decode instance {dw.info.instance_id} "
                            f"cannot admit the request: {e}", 1.0)) from None
                    raise
                prepared = True
                self._stage(rid, "prepare_decode", t1, time.monotonic())
                target = from_wire(KVTarget, raw) if raw is not None else None
                if prefill_call is None:
                    prefill_call = dispatch(target)
                elif (target is not None
                      and not await pw.client.call("set_target", SetTarget(rid, target))):
                    LATE_TARGETS.inc()
                stage = "prefill"
            assert prefill_call is not None
            res = from_wire(PrefillResult, await prefill_call)
            pw.prefills.pop(rid, None)
            t_first = time.monotonic()
            self._stage(rid, "prefill_rpc", t1, t_first)
            self._stage(rid, "ttft", req.arrival_time_s or t0, t_first)
            self._observe(rid, res.stages)
            self.learn_prefill(len(req.prompt_token_ids), res.cached_tokens, res.stages)
            HIT_TOKENS.inc(res.cached_tokens)
            done = max_tokens <= 1 or res.finish_reason == "stop"
            reason = (res.finish_reason or "length") if done else None
            if done:
                finished = True
            yield TokenEvent(rid, (res.first_token_id,), reason, cached_tokens=res.cached_tokens)
            if done:
                return
            stage = "decode"
            stream = self.tokens.open(rid, dw.info.instance_id)   # before it can push
            await dw.client.call("start_decode", StartDecode(rid, res.first_token_id,
                                                             res.num_sent_blocks))
            t2 = time.monotonic()
            # no span around a yield: the consumer may resume us in another context
            async for f in stream.frames():
                fin = f.finish_reason
                if fin is not None:
                    finished = True
                    self._stage(rid, "decode_stream", t2, time.monotonic())
                    self._observe(rid, f.stages)
                if f.token_ids or fin is not None:
                    yield TokenEvent(rid, f.token_ids, fin,
                                     cached_tokens=res.cached_tokens if fin else None)
        except RpcError as e:
            logger.warning("request %s failed in %s: %s", rid, stage, e)
            raise _worker_failed(stage, e) from None
        finally:
            if prefill_call is not None:
                prefill_call.cancel()            # no-op when it is done
                with contextlib.suppress(BaseException):
                    await prefill_call           # (also retrieves an unread failure)
            self.tokens.close(rid)
            self._unbook(rid, pw, dw)
            if not finished:
                await self._abort(pw, rid)
                if prepared:
                    await self._abort(dw, rid)

    async def _run_colocated(self, req: GenerateRequest, p: Placement, t0: float
                             ) -> AsyncIterator[TokenEvent]:
        rid = req.request_id
        w, _ = self._book(req, p, t0)
        finished = False
        stage = "prepare"
        try:
            await w.client.call("prepare_decode", DecodeTask(rid, req.prompt_token_ids,
                                                             req.sampling, 0))
            stream = self.tokens.open(rid, w.info.instance_id)    # before it can push
            await w.client.call("start_decode", StartDecode(rid, None))
            stage = "generate"
            cached = None
            async for f in stream.frames():
                if f.cached_tokens is not None and cached is None:
                    cached = f.cached_tokens
                    HIT_TOKENS.inc(cached)
                if f.token_ids and rid in w.prefills:
                    w.prefills.pop(rid, None)
                    self._stage(rid, "ttft", req.arrival_time_s or t0, time.monotonic())
                fin = f.finish_reason
                if fin is not None:
                    finished = True
                    self._observe(rid, f.stages)
                if f.token_ids or fin is not None:
                    yield TokenEvent(rid, f.token_ids, fin, cached_tokens=cached)
        except RpcError as e:
            logger.warning("request %s failed in %s: %s", rid, stage, e)
            raise _worker_failed(stage, e) from None
        finally:
            self.tokens.close(rid)
            self._unbook(rid, w, None)
            if not finished:
                await self._abort(w, rid)

    async def _abort(self, w: WorkerEntry, rid: str) -> None:
        if w.client is None or w.info.instance_id not in self.state.workers:
            return
        with contextlib.suppress(Exception):
            await asyncio.wait_for(w.client.call("abort", rid, timeout_s=2.0), 2.5)
