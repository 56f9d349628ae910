"""Continuous batching with chunked prefill and preemption by recompute (vLLM v1 / Orca).

Every step shares one token budget: running requests first (decodes, and the next chunk of
prefills in progress), then waiting requests in arrival order (or shortest first,
``EngineConfig.waiting_order``; ``srpt`` orders running prompts' chunks and waiting prompts
together, fewest tokens left first), each prefill cut to at most ``prefill_chunk_tokens`` and,
under ``EngineConfig.decode_step_s``, to what keeps the step's predicted time within it
while requests decode (``engine.step_time``); under ``EngineConfig.prefill_hold_s`` a step
carries the decodes alone until a prompt has waited that long. A waiting request reuses its cached
prefix (local prefix cache, then an external ``KVLoadSource``); while the source's lookup
or load is in flight (``get_num_matched_tokens`` answers None) it stays waiting and the next
one is admitted instead (vLLM's "waiting for remote KV"); one whose next block a running prompt is
still computing waits for it (``prefix_in_progress``). When blocks run out, the most recently
admitted running request not yet in the step is preempted: its blocks are freed and it goes
back to the head of the queue with ``num_computed_tokens = 0`` (its output so far is kept and
recomputed as prompt), so no request is lost. No torch; the runner executes the ``SchedulerOutput``.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from itertools import chain

from pymooncake.engine.config import EngineConfig
from pymooncake.engine.hooks import KVLoad, KVLoadSource
from pymooncake.engine.kv.kv_cache_manager import KVCacheManager
from pymooncake.engine.request import FinishReason, Request, RequestStatus, check_stop
from pymooncake.engine.step_time import StepPlan, StepTimeModel, attention_pairs


@dataclass(slots=True)
class ScheduledRequest:
    """Tokens ``[request.num_computed_tokens, + num_new_tokens)`` run in this step."""

    request: Request
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """Whether this step reaches the request's last token (and so samples)."""
        return self.request.num_computed_tokens + self.num_new_tokens == self.request.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    loads: list[KVLoad] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    num_waiting_for_kv: int = 0
    """Waiting requests skipped because their external KV is still loading."""

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    """Owns the waiting queue and running list over a ``KVCacheManager``."""

    def __init__(self, config: EngineConfig, kv_manager: KVCacheManager,
                 eos_token_ids: tuple[int, ...] = (),
                 detokenize: Callable[[list[int]], str] | None = None,
                 kv_source: KVLoadSource | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = clock
        """Seconds; only the ``shortest`` waiting order reads it (for aging)."""
        self._enqueued_s: dict[str, float] = {}
        self.kv = kv_manager
        self.eos_token_ids = eos_token_ids
        self.detokenize = detokenize
        self.kv_source = kv_source
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.step_time = StepTimeModel() if config.decode_step_s is not None else None
        """Fitted from the steps the engine reports (``observe_step``), ``decode_step_s`` only."""

    def add_request(self, req: Request) -> None:
        self.waiting.append(req)
        if self.config.waiting_order != "fcfs" or self.config.prefill_hold_s is not None:
            self._enqueued_s[req.request_id] = self.clock()

    def _next_waiting(self, skip: AbstractSet[str] = frozenset()) -> Request:
        """The waiting request to admit next (``EngineConfig.waiting_order``), leaving out
        the ids in ``skip`` (requests waiting for their external KV)."""
        cands = [r for r in self.waiting if r.request_id not in skip] if skip else self.waiting
        if self.config.waiting_order == "fcfs" or len(cands) == 1:
            return cands[0]
        now = self.clock()
        aging = self.config.aging_tokens_per_s
        enq = self._enqueued_s
        return min(cands, key=lambda r: (r.num_tokens - r.num_computed_tokens)
                   - aging * (now - enq.get(r.request_id, now)))

    def observe_step(self, out: SchedulerOutput, seconds: float) -> None:
        """The engine ran ``out`` in ``seconds`` (before ``update_from_output``): one sample
        of the step-time model (``decode_step_s`` only)."""
        if self.step_time is not None:
            self.step_time.observe(out.num_batched_tokens, sum(
                attention_pairs(s.request.num_computed_tokens, s.num_new_tokens)
                for s in out.scheduled), seconds)

    def _hold_prompts(self) -> bool:
        """``prefill_hold_s``: True while no prompt (waiting, or running with more than one
        token to compute) has waited that long since ``add_request``."""
        hold = self.config.prefill_hold_s
        if hold is None:
            return False
        since = self.clock() - hold
        prompts = chain(self.waiting, (r for r in self.running
                                       if r.num_tokens - r.num_computed_tokens > 1))
        return all(self._enqueued_s.get(r.request_id, since) > since for r in prompts)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        out.preempted.append(req)

    def _chunk(self, req: Request, num_tokens: int, budget: int) -> int:
        if self.config.enable_chunked_prefill:
            cap = self.config.prefill_chunk_tokens
            if req.max_chunk_tokens is not None:
                cap = min(cap, req.max_chunk_tokens)
            return min(num_tokens, budget, cap)
        return num_tokens if num_tokens <= budget else 0

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        cap = self.config.decode_step_tokens
        decoding = any(r.num_tokens - r.num_computed_tokens == 1 for r in self.running)
        if cap is not None and cap < budget and decoding:
            budget = cap
        timed = self.step_time is not None and decoding and self.step_time.ready
        if timed:   # the step-time limit replaces the token cap once the model is fitted
            budget = self.config.max_num_batched_tokens
        step = StepPlan(budget, self.step_time if timed else None,
                        self.config.decode_step_s or 0.0)
        if decoding and self._hold_prompts():    # the decodes alone (prefill_hold_s)
            self._schedule_running(out, step, [
                r for r in self.running if r.num_tokens - r.num_computed_tokens == 1])
        elif self.config.waiting_order == "srpt":
            self._schedule_srpt(out, step)
        else:
            self._schedule_running(out, step, list(self.running))
            self._admit_waiting(out, step)
        return out

    def _schedule_running(self, out: SchedulerOutput, step: StepPlan,
                          reqs: list[Request]) -> bool:
        """Schedule ``reqs`` (running requests) into ``out`` while budget lasts; out of
        blocks, preempt the most recently admitted running request not yet in this step.
        Returns False when a request had to preempt itself (stop scheduling)."""
        for req in reqs:
            if step.budget <= 0:
                break
            if req.status != RequestStatus.RUNNING:
                continue    # preempted earlier in this step
            left = req.num_tokens - req.num_computed_tokens
            n = self._chunk(req, left, step.room(left, req.num_computed_tokens))
            if n <= 0:
                continue
            while self.kv.allocate_slots(req, n) is None:
                victim = self._victim(out)
                self._preempt(victim, out)
                if victim is req:
                    return False
            out.scheduled.append(ScheduledRequest(req, n))
            step.add(req.num_computed_tokens, n)
        return True

    def _victim(self, out: SchedulerOutput) -> Request:
        """The most recently admitted running request that this step has not scheduled."""
        taken = {id(s.request) for s in out.scheduled}
        for req in reversed(self.running):
            if id(req) not in taken:
                self.running.remove(req)
                return req
        raise AssertionError("no running request left to preempt")  # the caller is running

    def prefix_in_progress(self, req: Request) -> bool:
        """True when a running prompt has yet to compute the block after ``req``'s cached
        prefix, with the same chained key: ``req`` waits for it to be cached rather than
        compute it twice (vLLM v1 caches a block when it is scheduled; here, once its step
        has run). False without prefix caching."""
        if not self.kv.pool.enable_caching or not self.running:
            return False
        bs = self.config.block_size
        keys = req.block_keys
        m = self.kv.num_cached_prefix_tokens(req) // bs
        if m >= len(keys):
            return False
        key = keys[m]
        for r in self.running:
            if r.num_computed_tokens // bs <= m and r.status == RequestStatus.RUNNING:
                theirs = r.block_keys
                if len(theirs) > m and theirs[m] == key:
                    return True
        return False

    def _admit_waiting(self, out: SchedulerOutput, step: StepPlan) -> None:
        loading: set[str] = set()  # waiting for their external KV: skipped this step
        skip: set[str] = set()     # those and the ones waiting for a prefix in progress
        while (len(self.waiting) > len(skip) and step.budget > 0 and not out.preempted
               and len(self.running) < self.config.max_num_seqs):
            req = self._next_waiting(skip)
            if self.prefix_in_progress(req):
                skip.add(req.request_id)
                continue
            ok = self._admit(req, out, step)
            if ok is None:
                loading.add(req.request_id)
                skip.add(req.request_id)
            elif not ok:
                break
        out.num_waiting_for_kv = len(loading)

    def _admit(self, req: Request, out: SchedulerOutput, step: StepPlan) -> bool | None:
        """``_schedule_waiting`` and, when admitted, move ``req`` to the running list."""
        note_batch = getattr(self.kv_source, "set_running_batch", None)
        if note_batch is not None:
            note_batch(len(out.scheduled))
        ok = self._schedule_waiting(req, step, out)
        if ok:
            if req is self.waiting[0]:
                self.waiting.popleft()
            else:
                self.waiting.remove(req)
            self.running.append(req)
            req.status = RequestStatus.RUNNING
        return ok

    def _schedule_srpt(self, out: SchedulerOutput, step: StepPlan) -> None:
        """``srpt``: decodes first, then every prompt with tokens left to compute — running
        ones (their next chunk) and waiting ones (admission) — fewest tokens left first,
        aged by ``aging_tokens_per_s``. A running prompt that loses the budget to a shorter
        one keeps its blocks and continues in a later step (preemption at chunk granularity,
        shortest-remaining-processing-time)."""
        decodes = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        if not self._schedule_running(out, step, decodes):
            return
        now = self.clock()
        aging = self.config.aging_tokens_per_s
        enq = self._enqueued_s
        cands: list[tuple[float, int, Request, bool]] = []
        for i, r in enumerate(self.running):
            left = r.num_tokens - r.num_computed_tokens
            if left > 1:
                cands.append((left - aging * (now - enq.get(r.request_id, now)), i, r, True))
        for i, r in enumerate(self.waiting, len(self.running)):
            left = r.num_tokens - self.kv.num_cached_prefix_tokens(r)
            cands.append((left - aging * (now - enq.get(r.request_id, now)), i, r, False))
        cands.sort(key=lambda c: (c[0], c[1]))
        loading = 0
        for _, _, req, running in cands:
            if step.budget <= 0 or out.preempted:
                break
            if running:
                if not self._schedule_running(out, step, [req]):
                    break
                continue
            if len(self.running) >= self.config.max_num_seqs or self.prefix_in_progress(req):
                continue
            ok = self._admit(req, out, step)
            if ok is None:
                loading += 1
            elif not ok:
                break
        out.num_waiting_for_kv = loading

    def _schedule_waiting(self, req: Request, step: StepPlan, out: SchedulerOutput
                          ) -> bool | None:
        """Admit ``req`` into ``out``: True, False (no room: stop admitting), or None (its
        external KV is still loading: skip it, admit the next)."""
        bs = self.config.block_size
        queried, hit = self.kv.num_queried_blocks, self.kv.num_hit_blocks
        computed_blocks, num_local = self.kv.get_computed_blocks(req)
        num_ext = 0
        if self.kv_source is not None and req.allow_external_load:
            ext = self.kv_source.get_num_matched_tokens(req, num_local)
            if ext is None:  # asked again next step: count the prefix-cache query once
                self.kv.num_queried_blocks, self.kv.num_hit_blocks = queried, hit
                return None
            num_ext = ext
            end = num_local + num_ext
            # whole blocks, or every token but the last (P→D: the prompt with its partial
            # last block; the token after it, which the prefill sampled, is computed)
            assert end % bs == 0 or end == req.num_tokens - 1, (
                "external matches must be whole blocks or reach the last token")
            if end >= req.num_tokens:   # the full-hit rule (BUG-09): a token is computed
                num_ext = ((req.num_tokens - 1) // bs) * bs - num_local
            num_ext = max(0, num_ext)
        left = req.num_tokens - num_local - num_ext
        n = self._chunk(req, left, step.room(left, num_local + num_ext))
        if n <= 0:
            return False
        new_blocks = self.kv.allocate_slots(req, n, computed_blocks, num_ext)
        if new_blocks is None:
            return False
        req.num_computed_tokens = num_local + num_ext
        req.num_external_tokens = num_ext
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = num_local + num_ext
        if num_ext:
            first = num_local // bs
            targets = new_blocks[:-(-num_ext // bs)]
            for b in targets:  # BUG-10: a load never writes into a computed or shared block
                assert b.ref_cnt == 1 and not b.is_computed, f"load target {b.block_id} in use"
            keys = req.block_keys[first:first + num_ext // bs]   # a partial block has none
            out.loads.append(KVLoad(req.request_id, tuple(b.block_id for b in targets),
                                    tuple(keys), num_local, num_ext))
        out.scheduled.append(ScheduledRequest(req, n))
        step.add(req.num_computed_tokens, n)
        return True

    def update_from_output(self, out: SchedulerOutput,
                           sampled: dict[str, tuple[int, float, object]]) -> list[Request]:
        """Advance requests after a successful step; ``sampled`` maps request id to
        (token, logprob, logits row or None). Returns the requests that finished."""
        finished = []
        for s in out.scheduled:
            req = s.request
            req.num_computed_tokens += s.num_new_tokens
            req.num_external_tokens = 0
            self.kv.cache_blocks(req, req.num_computed_tokens)
            if req.request_id not in sampled:
                continue
            token, logprob, logits = sampled[req.request_id]
            req.output_token_ids.append(token)
            if req.params.logprobs:
                req.logprobs.append(logprob)
            if logits is not None:
                req.logits.append(logits)
            reason = check_stop(req, token, self.eos_token_ids, self.detokenize)
            if reason is None and self.config.role == "prefill":
                reason = FinishReason.LENGTH
            if reason is not None:
                self.finish(req, reason)
                finished.append(req)
        return finished

    def finish(self, req: Request, reason: FinishReason) -> None:
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        self.kv.free(req)
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self._enqueued_s.pop(req.request_id, None)

    def abort_step(self, out: SchedulerOutput, failed_ids: set[str],
                   recompute: bool) -> list[Request]:
        """Undo a step whose KV load failed. Requests that loaded KV in it are reset to
        recompute (the failed ones without external loads), or failed when ``recompute``
        is False. Others keep their state and rerun the same tokens next step (their KV
        writes are idempotent). Returns the requests failed here."""
        failed = []
        loaded = {ld.request_id for ld in out.loads}
        for s in out.scheduled:
            req = s.request
            if req.request_id not in loaded:
                continue
            req.num_external_tokens = 0
            if req.request_id in failed_ids and not recompute:
                self.finish(req, FinishReason.ERROR)
                failed.append(req)
                continue
            self.running.remove(req)
            self.kv.free(req)
            req.num_computed_tokens = 0
            req.num_cached_tokens = -1
            req.status = RequestStatus.WAITING
            if req.request_id in failed_ids:
                req.allow_external_load = False
            self.waiting.appendleft(req)
        return failed
