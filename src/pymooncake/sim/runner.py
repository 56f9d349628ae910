"""Trace replay on a modelled cluster, placing every request with ``conductor.policy``
(Mooncake FAST'25 §4, Algorithm 1; DESIGN.md §8).

Per request: arrival → ``policy.schedule`` on a fresh ``ClusterView`` (BUG-51: never a stale
snapshot) → prefill queue → at start, reuse of the local prefix and, in the global pool, of
the blocks fetched from the holder the policy chose → prefill (ground-truth cost model) →
first token → KV streamed layer by layer to the decode node → continuous batch → finish.
"""

from __future__ import annotations

import dataclasses
import heapq
from dataclasses import dataclass, field
from operator import itemgetter

import numpy as np

from pymooncake.conductor import policy
from pymooncake.conductor.policy import (
    ClusterView,
    CppCostModel,
    DecodeInstanceState,
    HotBlockConfig,
    InstanceId,
    PolicyConfig,
    PrefillEstimator,
    PrefillInstanceState,
    PrefixIndex,
    Rejection,
    RequestInfo,
    shared_prefix_blocks,
    with_pending,
)
from pymooncake.conductor.policy.cpp import cpp_prefill_s
from pymooncake.obs.slo import tbt_s
from pymooncake.sim import events as ev
from pymooncake.sim.cache_model import LruBlockCache
from pymooncake.sim.calibration import CalibratedCostModel, load_calibration
from pymooncake.sim.cluster import DecodeNode, PrefillNode, SimRequest
from pymooncake.sim.config import SimConfig
from pymooncake.sim.cost_model import CostModel, resolve_gpu, resolve_model
from pymooncake.sim.engine_node import EngineNode, StepPolicy
from pymooncake.workload.stats import prefix_blocks_hit
from pymooncake.workload.trace import Trace

HOT_KEY_RANKS = (1, 10, 100, 1000)


@dataclass(slots=True)
class SimResult:
    """What a run produced: the per-request records plus run-wide counters."""

    config: SimConfig
    requests: list[SimRequest]
    cost_model: CostModel | CalibratedCostModel
    num_events: int = 0
    bytes_moved: int = 0
    """KV bytes over the network: cache blocks fetched between nodes + P→D transfers."""
    bytes_cache_fetch: int = 0
    cache_capacity_tokens: int = 0
    """Cache per node in effect (``SimConfig.resolve_cache_tokens``)."""
    hot_key_replicas: list[dict[str, float | int]] = field(default_factory=list)
    """Samples ``{"t_s": ..., "rank_1": replicas, "rank_10": ...}`` (ranks by accesses)."""


def build_cost_model(cfg: SimConfig) -> CostModel | CalibratedCostModel:
    """The ground-truth cost model of ``cfg`` (raises ``CostModelError`` for bad presets,
    ``CalibrationError`` for a bad calibration file)."""
    if cfg.calibration is not None:
        return CalibratedCostModel(load_calibration(cfg.calibration),
                                   chunk_size_tokens=cfg.chunk_size_tokens)
    return CostModel(resolve_model(cfg.model), resolve_gpu(cfg.gpu),
                     network_bandwidth_bytes_per_s=cfg.network_bandwidth_bytes_per_s,
                     chunk_size_tokens=cfg.chunk_size_tokens)


class Simulator:
    """One run of ``trace`` under ``cfg``; call ``run()`` once."""

    def __init__(self, trace: Trace, cfg: SimConfig,
                 cost_model: CostModel | CalibratedCostModel | None = None) -> None:
        if trace.block_size != cfg.block_size:
            raise ValueError(f"trace block size {trace.block_size} != config block size "
                             f"{cfg.block_size}")
        self.cfg = cfg
        self.cm = cost_model or build_cost_model(cfg)
        self.est = self.cm.estimators()
        self.policy_est = self.est if cfg.policy_prefill is None else dataclasses.replace(
            self.est, prefill=PrefillEstimator(*cfg.policy_prefill))   # the Conductor's view
        self.pcfg = PolicyConfig(ttft_slo_s=cfg.ttft_slo_s, tbt_slo_s=cfg.tbt_slo_s,
                                 kvcache_balancing_threshold=cfg.kvcache_balancing_threshold,
                                 early_rejection=cfg.early_rejection,
                                 block_size_tokens=cfg.block_size, seed=cfg.seed)
        self.hot_cfg = HotBlockConfig(min_accesses=cfg.hot_block_min_accesses)
        # The very functions the live Conductor imports (checked by a test).
        self.schedule = policy.schedule
        self.prefill_policy = policy.PREFILL_POLICIES[cfg.scheduler]
        if cfg.cpp_groups:      # long prompts to a CPP group where it pays (docs/cpp.md)
            self.prefill_policy = policy.with_cpp(self.prefill_policy)
        self.blocks_to_replicate = policy.blocks_to_replicate
        self.index = PrefixIndex()
        self.colocated = cfg.scenario == "colocated"
        hbm_kv = self.cm.kv_capacity_tokens
        cap = cfg.resolve_cache_tokens(hbm_kv)
        self.cache_tokens = cap
        self.prefill_nodes = [
            PrefillNode(f"p{i}", LruBlockCache(f"p{i}", cap, cfg.block_size, self.index))
            for i in range(cfg.num_prefill)]
        cpp = CppCostModel(cfg.cpp_stages, cfg.cpp_chunk_tokens, self.est.prefill,
                           cfg.cpp_hop_s, 0.0, cfg.cpp_min_tokens, edge_tokens=0)
        self.prefill_nodes += [
            PrefillNode(f"cpp{i}", LruBlockCache(f"cpp{i}", cap, cfg.block_size, self.index),
                        cpp=cpp) for i in range(cfg.cpp_groups)]
        self.prefill_ids = tuple(InstanceId(p.name) for p in self.prefill_nodes)
        self.by_name = {p.name: p for p in self.prefill_nodes}
        # A colocated prefix cache is HBM: the running requests get what it leaves.
        kv_cap = hbm_kv - cap if self.colocated else hbm_kv
        if self.colocated:
            self.decode_nodes = [DecodeNode(p.name, self.est.decode, cfg.max_batch_size, kv_cap)
                                 for p in self.prefill_nodes]
        else:
            self.decode_nodes = [DecodeNode(f"d{i}", self.est.decode, cfg.max_batch_size, kv_cap)
                                 for i in range(cfg.num_decode)]
        self.decode_by_name = {d.name: d for d in self.decode_nodes}
        self.engine_nodes: dict[str, EngineNode] = {}
        if self.colocated and cfg.step_budget_tokens is not None:
            pol = StepPolicy(cfg.step_budget_tokens, cfg.decode_step_tokens,
                             cfg.chunk_size_tokens, cfg.max_batch_size, cfg.waiting_order,
                             cfg.aging_tokens_per_s, cfg.decode_step_s, cfg.prefill_hold_s)
            step = (self.cm.calibration.step if isinstance(self.cm, CalibratedCostModel)
                    else None)
            self.engine_nodes = {p.name: EngineNode(p.name, p.cache, pol, self.est.prefill,
                                                    self.est.decode, hbm_kv, cfg.block_size,
                                                    step)
                                 for p in self.prefill_nodes}
        self.in_flight: dict[str, dict[int, tuple[float, float]]] = {
            n: {} for n in self.engine_nodes}
        """Engine nodes: (dispatch time, predicted prefill) of each request placed there
        until its first token, as the live Conductor keeps them (``cluster_view``)."""
        self.prefilling: dict[str, dict[int, tuple[int, ...]]] = {
            n: {} for n in self.prefill_ids}
        """Per prefill node, the block keys of each request placed there until its prefill
        ends: a prefix still being computed counts as held there, as the live Conductor
        counts it (``ClusterState.pending_blocks``, ``policy.with_pending``)."""
        self.access: dict[int, int] = {}
        self.q = ev.EventQueue()
        self.requests = [
            SimRequest(index=i, arrival_s=r.timestamp_ms / 1000.0, input_length=r.input_length,
                       output_length=max(1, cfg.output_length or r.output_length),
                       hash_ids=r.hash_ids, request_id=f"r{i}")
            for i, r in enumerate(trace.requests)]
        self.result = SimResult(config=cfg, requests=self.requests, cost_model=self.cm,
                                cache_capacity_tokens=cap)

    # --- views ------------------------------------------------------------------------
    def _view(self, now: float) -> ClusterView:
        pre = tuple(self._engine_state(now, p.name) if p.name in self.engine_nodes else
                    PrefillInstanceState(InstanceId(p.name), p.predicted_busy_until_s,
                                         p.queued_predicted_s, p.num_in_flight, cpp=p.cpp)
                    for p in self.prefill_nodes)
        if self.colocated:
            return ClusterView(now, pre, ())
        dec = tuple(DecodeInstanceState(InstanceId(d.name), d.B, d.C, d.kv_capacity_tokens,
                                        d.max_batch_size, d.predicted_finish_s(),
                                        d.num_incoming, d.incoming_ctx)
                    for d in self.decode_nodes)
        return ClusterView(now, pre, dec)

    def _engine_state(self, now: float, name: str) -> PrefillInstanceState:
        """An engine node as the live Conductor sees a colocated worker: the earliest
        placed request running since its dispatch, the others queued (``cluster_view``)."""
        items = sorted(self.in_flight[name].values())
        busy, queued = now, ()
        if items:
            busy = max(now, items[0][0] + items[0][1])
            queued = tuple(p for _, p in items[1:])
        return PrefillInstanceState(InstanceId(name), busy, sum(queued), len(items), None,
                                    queued, self.cfg.waiting_order in ("shortest", "srpt"))

    def _on_engine_step(self, now: float, node: EngineNode) -> None:
        first, done = node.finish(now)
        for r in first:
            self.in_flight[node.name].pop(r.index, None)
            self.prefilling[node.name].pop(r.index, None)
        for x in done:
            x.req.tbt_s = tbt_s(np.diff(x.token_times).tolist())
            self._finished(x.req)
        d = node.plan(now)
        if d is not None:
            self.q.push(now + d, ev.ENGINE_STEP, node)

    # --- run --------------------------------------------------------------------------
    def run(self) -> SimResult:
        q = self.q
        for r in self.requests:
            q.push(r.arrival_s, ev.ARRIVAL, r)
        if self.cfg.sample_interval_s > 0 and self.requests:
            q.push(self.requests[0].arrival_s, ev.SAMPLE, None)
        handlers = {ev.ARRIVAL: self._on_arrival, ev.PREFILL_DONE: self._on_prefill_done,
                    ev.KV_ARRIVE: self._on_kv_arrive, ev.DECODE_WAKE: self._on_decode_wake,
                    ev.SAMPLE: self._on_sample, ev.ENGINE_STEP: self._on_engine_step}
        self._pending = len(self.requests)
        while q:
            t, kind, payload = q.pop()
            handlers[kind](t, payload)
        self.result.num_events = q.num_popped
        return self.result

    def _on_arrival(self, now: float, r: SimRequest) -> None:
        keys = r.hash_ids
        acc = self.access
        for k in keys:
            acc[k] = acc.get(k, 0) + 1
        info = RequestInfo(r.request_id, r.input_length, keys, r.output_length, now,
                           sequence_number=r.index)
        match = self.index.match(keys, self.prefill_ids, remote=self.cfg.remote_reuse)
        match = with_pending(match, tuple(shared_prefix_blocks(keys, self.prefilling[i].values())
                                          for i in self.prefill_ids))
        view = self._view(now)
        out = self.schedule(info, view, match, self.policy_est, self.pcfg, self.prefill_policy,
                            colocated=self.colocated)
        if isinstance(out, Rejection):
            r.rejected = out.reason
            self._finished(r)
            return
        node = self.by_name[out.prefill_instance]
        r.prefill_node = node.name
        self.prefilling[node.name][r.index] = tuple(keys)
        r.decode_node = node.name if self.colocated else str(out.decode_instance)
        r.predicted_prefill_s = out.predicted_prefill_s + out.predicted_transfer_s
        r.planned_transfer_source = out.transfer_source
        r.predicted_tbt_s = out.predicted_tbt_s
        r.planned_prefix_blocks = out.prefix_blocks
        eng = self.engine_nodes.get(node.name)
        if eng is not None:
            self.in_flight[node.name][r.index] = (now, r.predicted_prefill_s)
            eng.add(r)
            if not eng.busy:
                eng.busy = True
                self.q.push(now, ev.ENGINE_STEP, eng)
            return
        if not self.colocated:
            d = self.decode_by_name[r.decode_node]
            d.num_incoming += 1
            d.incoming_ctx += r.input_length
        node.queue.append(r)
        node.queued_predicted_s += r.predicted_prefill_s
        if node.running is None:
            self._start_prefill(now, node)

    def _start_prefill(self, now: float, node: PrefillNode) -> None:
        r = node.queue.popleft()
        node.queued_predicted_s = (node.queued_predicted_s - r.predicted_prefill_s
                                   if node.queue else 0.0)
        node.running = r
        node.predicted_busy_until_s = now + r.predicted_prefill_s
        cm, bs, n = self.cm, self.cfg.block_size, r.input_length
        keys = r.hash_ids
        local = prefix_blocks_hit(keys, node.cache) if node.cpp is None else 0
        prefix = local
        fetched: tuple[int, ...] = ()
        src = r.planned_transfer_source
        if src is not None and src in self.by_name and node.cpp is None:
            # Reuse what the chosen holder still has (it may have evicted since scheduling).
            avail = min(prefix_blocks_hit(keys, self.by_name[src].cache), r.planned_prefix_blocks)
            if avail > local:
                fetched = keys[local:avail]
                prefix = avail
        prefix_tokens = min(prefix * bs, n)
        fetch_tokens = prefix_tokens - min(local * bs, n)
        t_fetch = cm.transfer_s(fetch_tokens)
        gpu_s = (cm.prefill_s(n, prefix_tokens) if node.cpp is None   # a group: from token 0
                 else cpp_prefill_s(node.cpp, n, 0))
        r.hit_tokens = prefix_tokens
        r.remote_hit_tokens = fetch_tokens
        r.prefill_gpu_s = gpu_s
        r.prefill_start_s = now
        if fetch_tokens:
            b = cm.kv_bytes(fetch_tokens)
            r.transfer_bytes += b
            self.result.bytes_cache_fetch += b
            self.result.bytes_moved += b
        # Cache updates happen when the prefill ENDS (causality): reused blocks refreshed,
        # fetched hot blocks replicated, new blocks kept. Until then no request — queued on
        # this node or placed on another — can reuse blocks this prefill is computing.
        if fetched:
            keep = set(self.blocks_to_replicate(fetched, self.access.__getitem__,
                                                self.index.num_replicas, self.hot_cfg))
            r.cache_keys = (keys[:local] + tuple(k for k in fetched if k in keep)
                            + keys[prefix:])
        else:
            r.cache_keys = keys
        duration = t_fetch + gpu_s
        if self.colocated:
            d = self.decode_by_name[node.name]
            done: list[SimRequest] = []
            d.sync_to(now, done)
            start = d.epoch_s
            if self.cfg.chunked_prefill and d.B > 0:
                k = cm.num_chunks(n - prefix_tokens)
                for _ in range(k):
                    d.stall(duration / k)
                    d._advance(1, done)
            else:
                d.stall(duration)
            end = max(d.epoch_s, start + duration)
            d.epoch_s = end
            self._after_decode_change(d, done)
        else:
            end = now + duration
        node.busy_s += end - now
        self.q.push(end, ev.PREFILL_DONE, node)

    def _on_prefill_done(self, now: float, node: PrefillNode) -> None:
        r = node.running
        assert r is not None, "prefill done on an idle node"
        node.running = None
        r.first_token_s = now
        self.prefilling[node.name].pop(r.index, None)
        # KV events at prefill end: the blocks this prefill made become reusable now.
        node.cache.touch(r.cache_keys)
        r.cache_keys = ()
        if r.output_length <= 1:
            r.finish_s = now
            if not self.colocated:
                d = self.decode_by_name[r.decode_node]
                d.num_incoming -= 1
                d.incoming_ctx -= r.input_length
            self._finished(r)
        elif self.colocated:
            r.kv_arrive_s = now
            self._kv_arrive(now, r)
        else:
            # KV streams layer by layer during the prefill; the last layer's share is the tail.
            cm = self.cm
            pd_s = cm.transfer_s(r.input_length)
            arrive = max(now, r.prefill_start_s + pd_s) + pd_s / cm.model.num_layers
            b = cm.kv_bytes(r.input_length)
            r.transfer_bytes += b
            self.result.bytes_moved += b
            self.q.push(arrive, ev.KV_ARRIVE, r)
        if node.queue:
            self._start_prefill(now, node)

    def _on_kv_arrive(self, now: float, r: SimRequest) -> None:
        d = self.decode_by_name[r.decode_node]
        d.num_incoming -= 1
        d.incoming_ctx -= r.input_length
        r.kv_arrive_s = now
        self._kv_arrive(now, r)

    def _kv_arrive(self, now: float, r: SimRequest) -> None:
        d = self.decode_by_name[r.decode_node]
        done: list[SimRequest] = []
        d.sync_to(now, done)
        if not d.waiting and d.can_admit(r):
            d.join(r)
        else:
            d.waiting.append(r)
        self._after_decode_change(d, done)

    def _on_decode_wake(self, now: float, payload: tuple[DecodeNode, int]) -> None:
        d, version = payload
        if version != d.version:
            return
        done: list[SimRequest] = []
        d.on_wake(done)
        self._after_decode_change(d, done)

    def _after_decode_change(self, d: DecodeNode, done: list[SimRequest]) -> None:
        while d.waiting and d.can_admit(d.waiting[0]):
            d.join(d.waiting.popleft())
        for r in done:
            r.tbt_s = _tbt(d.token_intervals(r))
            self._finished(r)
        d.version += 1
        t = d.next_finish_s()
        if t is not None:
            self.q.push(max(t, self.q.now_s), ev.DECODE_WAKE, (d, d.version))

    def _finished(self, r: SimRequest) -> None:
        self._pending -= 1
        if r.prefill_node in self.prefilling:
            self.prefilling[r.prefill_node].pop(r.index, None)

    def _on_sample(self, now: float, _: object) -> None:
        acc = self.access
        if acc:
            top = heapq.nlargest(max(HOT_KEY_RANKS), acc.items(), key=itemgetter(1))
            row: dict[str, float | int] = {"t_s": now}
            for rank in HOT_KEY_RANKS:
                if rank <= len(top):
                    row[f"rank_{rank}"] = self.index.num_replicas(top[rank - 1][0])
            self.result.hot_key_replicas.append(row)
        if self._pending > 0:
            self.q.push(now + self.cfg.sample_interval_s, ev.SAMPLE, None)


def _tbt(intervals: np.ndarray) -> float | None:
    return tbt_s(intervals.tolist())


def simulate(trace: Trace, cfg: SimConfig,
             cost_model: CostModel | CalibratedCostModel | None = None) -> SimResult:
    """Replay ``trace`` on the cluster of ``cfg``; deterministic for a given config and seed.

    Raises ``CostModelError`` (unknown model/GPU) or ``ValueError`` (bad config) before any
    event runs.
    """
    return Simulator(trace, cfg, cost_model).run()

