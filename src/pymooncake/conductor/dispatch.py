"""One request through the live Conductor: placement by ``conductor.policy.schedule`` on a
fresh cluster view, then dispatch to the workers and the tokens relayed back.

Holds ``RequestDispatch``, the part of ``Conductor`` (``conductor.service``) that serves
``generate``: ``place``, the disaggregated run (``prepare_decode`` overlapped with the
prefill, ``SetTarget``, ``start_decode``, the decode worker's pushed tokens), the colocated
run, the per-request bookkeeping on the worker entries and the abort of a request left
unfinished. The steps are listed in ``conductor.service``'s docstring.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator
from typing import Any

from pymooncake.conductor.cluster_view import ClusterState, WorkerEntry
from pymooncake.conductor.config import ConductorConfig
from pymooncake.conductor.policy import (
    PREFILL_POLICIES,
    Estimators,
    Placement,
    PolicyConfig,
    RequestInfo,
    schedule,
    with_cpp,
    with_pending,
)
from pymooncake.conductor.policy import Rejection as PolicyRejection
from pymooncake.conductor.replication import HotBlockReplicator
from pymooncake.conductor.request_stages import (
    HIT_TOKENS,
    LATE_TARGETS,
    OVERLAPPED,
    PLACED,
    REJECT_STATUS,
    REJECTED,
    observe_stages,
    stage_span,
    worker_failed,
)
from pymooncake.conductor.token_streams import TokenRouter
from pymooncake.conductor.worker_loss import WorkerLossWatch
from pymooncake.identity import CacheNamespace, block_keys
from pymooncake.obs.logging import init_logger
from pymooncake.obs.tracing import end_span, set_span_attributes, start_root_span
from pymooncake.rpc import RpcError, from_wire
from pymooncake.rpc.messages import (
    DecodeTask,
    GenerateRequest,
    KVTarget,
    PrefillResult,
    PrefillTask,
    Rejection,
    RequestRejected,
    SetTarget,
    StartDecode,
    TokenEvent,
)

logger = init_logger("pymooncake.conductor.service")


class RequestDispatch:
    """``Conductor.generate`` and what it needs (a mixin of ``Conductor``, whose
    ``__init__`` sets the attributes below and which supplies ``learn_prefill``)."""

    config: ConductorConfig
    state: ClusterState
    estimators: Estimators
    namespace: CacheNamespace | None
    policy_config: PolicyConfig | None
    replicator: HotBlockReplicator | None
    tokens: TokenRouter
    losses: WorkerLossWatch
    in_flight: dict[str, tuple[str, str | None]]
    _seq: itertools.count[int]
    _roots: dict[str, Any]

    def _stage(self, rid: str, name: str, start_s: float, end_s: float) -> None:
        stage_span(rid, name, start_s, end_s, self._roots.get(rid))

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
        ids = [p.instance_id for p in view.prefill]
        match = self.state.index.match(keys, ids, remote=self.config.use_store)
        # a prefix still being computed there counts as held (its request runs first)
        match = with_pending(match, self.state.pending_blocks(keys, ids))
        info = RequestInfo(req.request_id, len(req.prompt_token_ids), tuple(keys),
                           req.sampling.max_tokens, now_s, next(self._seq),
                           sheddable=req.priority > 0)
        return schedule(info, view, match, self.estimators, self.policy_config,
                        with_cpp(PREFILL_POLICIES[self.config.policy]),
                        colocated=self.config.colocated)

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
                REJECT_STATUS.get(decision.reason, 429), decision.reason, msg,
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
            stream = self._run_colocated(req, decision, t0, keys or [])
        else:
            stream = self._run_disaggregated(req, decision, t0, keys or [])
        async for ev in stream:
            yield ev

    def _book(self, req: GenerateRequest, p: Placement, now_s: float, keys: list[str]
              ) -> tuple[WorkerEntry, WorkerEntry | None]:
        pw = self.state.workers[p.prefill_instance]
        pw.prefills[req.request_id] = (now_s, p.predicted_transfer_s + p.predicted_prefill_s)
        pw.prefill_keys[req.request_id] = tuple(keys)
        dw = None
        if p.decode_instance is not None:
            dw = self.state.workers[p.decode_instance]
            finish = (now_s + p.predicted_ttft_s
                      + req.sampling.max_tokens * max(p.predicted_tbt_s, 1e-3))
            dw.decodes[req.request_id] = (len(req.prompt_token_ids) + req.sampling.max_tokens,
                                          finish)
        self.in_flight[req.request_id] = (p.prefill_instance, p.decode_instance)
        return pw, dw

    @staticmethod
    def _prefilled(rid: str, pw: WorkerEntry) -> None:
        """The prefill of ``rid`` on ``pw`` is over (its blocks are in ``pw``'s cache)."""
        pw.prefills.pop(rid, None)
        pw.prefill_keys.pop(rid, None)

    def _unbook(self, rid: str, pw: WorkerEntry, dw: WorkerEntry | None) -> None:
        self._prefilled(rid, pw)
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
        pw, dw = self._book(req, p, t0, keys)
        assert dw is not None and self.namespace is not None
        bs = self.namespace.block_size
        max_tokens = req.sampling.max_tokens
        # every prompt token's KV moves, the partial last block's too: the decode worker's
        # first step then computes only the prefill's first token (a plain decode step)
        num_blocks = -(-len(req.prompt_token_ids) // bs) if max_tokens > 1 else 0
        finished = False
        prepared = False
        stage = "prefill"
        prefill_call: asyncio.Future[Any] | None = None
        self.losses.watch(rid, (p.prefill_instance, p.decode_instance))
        try:
            # The prefill is dispatched first and the decode admission runs while it
            # queues or computes; its KVTarget follows in a SetTarget (PrefillTask docs: a
            # prefill done before then waits for it and ships its blocks from the cache).
            # Only a predicted queue below overlap_admission_min_queue_s puts admission
            # first. A one-token request has no decode side and no target to wait for.
            overlap = (max_tokens > 1
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
                    raw = await self.losses.guard(rid, dw.client.call(
                        "prepare_decode", DecodeTask(
                            rid, req.prompt_token_ids, req.sampling, num_blocks,
                            self.config.tbt_slo_s if self.config.early_rejection else 0.0)))
                except RpcError as e:
                    # the prefill worker was lost meanwhile: this call's outcome is unknown
                    # (a receive buffer may be reserved), the abort below releases it
                    prepared = e.code == "WORKER_LOST"
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
                elif (target is not None and not await self.losses.guard(
                        rid, pw.client.call("set_target", SetTarget(rid, target)))):
                    LATE_TARGETS.inc()
                stage = "prefill"
            assert prefill_call is not None
            res = from_wire(PrefillResult, await self.losses.guard(rid, prefill_call))
            self._prefilled(rid, pw)
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
            await self.losses.guard(rid, dw.client.call(
                "start_decode", StartDecode(rid, res.first_token_id, res.num_sent_blocks,
                                            res.kv_digest)))
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
            raise worker_failed(stage, e) from None
        finally:
            if prefill_call is not None:
                prefill_call.cancel()            # no-op when it is done
                with contextlib.suppress(BaseException):
                    await prefill_call           # (also retrieves an unread failure)
            self.tokens.close(rid)
            self.losses.forget(rid)
            self._unbook(rid, pw, dw)
            if not finished:
                await self._abort(pw, rid)
                if prepared:
                    await self._abort(dw, rid)

    async def _run_colocated(self, req: GenerateRequest, p: Placement, t0: float,
                             keys: list[str]) -> AsyncIterator[TokenEvent]:
        rid = req.request_id
        w, _ = self._book(req, p, t0, keys)
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
                    self._prefilled(rid, w)
                    self._stage(rid, "ttft", req.arrival_time_s or t0, time.monotonic())
                fin = f.finish_reason
                if fin is not None:
                    finished = True
                    self._observe(rid, f.stages)
                    # its ``prefill`` window (mixed decode steps included) teaches the
                    # predictor what a prompt costs here (Conductor.learn_prefill)
                    self.learn_prefill(len(req.prompt_token_ids), cached or 0, f.stages)
                if f.token_ids or fin is not None:
                    yield TokenEvent(rid, f.token_ids, fin, cached_tokens=cached)
        except RpcError as e:
            logger.warning("request %s failed in %s: %s", rid, stage, e)
            raise worker_failed(stage, e) from None
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
