"""Continuous batching with chunked prefill and preemption by recompute (vLLM v1 / Orca).

Every step shares one token budget: running requests first (decodes, and the next chunk of
prefills in progress), then waiting requests in arrival order (or shortest first,
``EngineConfig.waiting_order``), each prefill cut to at most ``prefill_chunk_tokens``. A
waiting request first reuses its cached prefix (local prefix cache, then an external
``KVLoadSource``); while the source's lookup or load is in flight
(``get_num_matched_tokens`` answers None) the request stays waiting and the next one is
admitted instead (vLLM's "waiting for remote KV"). When blocks run out, the most recently admitted
running request is preempted: its blocks are freed and it goes back to the head of the
queue with ``num_computed_tokens = 0`` (its output so far is kept and recomputed as prompt),
so no request is lost. No torch; the runner executes the ``SchedulerOutput``.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

from pymooncake.engine.config import EngineConfig
from pymooncake.engine.hooks import KVLoad, KVLoadSource
from pymooncake.engine.kv.kv_cache_manager import KVCacheManager
from pymooncake.engine.request import FinishReason, Request, RequestStatus, check_stop


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

    def add_request(self, req: Request) -> None:
        self.waiting.append(req)
        if self.config.waiting_order == "shortest":
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

    def _chunk(self, num_tokens: int, budget: int) -> int:
        if self.config.enable_chunked_prefill:
            return min(num_tokens, budget, self.config.prefill_chunk_tokens)
        return num_tokens if num_tokens <= budget else 0

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        cap = self.config.decode_step_tokens
        if cap is not None and cap < budget and any(
                r.num_tokens - r.num_computed_tokens == 1 for r in self.running):
            budget = cap
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = self._chunk(req.num_tokens - req.num_computed_tokens, budget)
            if n <= 0:
                i += 1
                continue
            while self.kv.allocate_slots(req, n) is None:
                victim = self.running.pop()
                self._preempt(victim, out)
                if victim is req:
                    break
            if req.status == RequestStatus.PREEMPTED:
                break
            out.scheduled.append(ScheduledRequest(req, n))
            budget -= n
            i += 1
        loading: set[str] = set()  # waiting for their external KV: skipped this step
        note_batch = getattr(self.kv_source, "set_running_batch", None)
        while (len(self.waiting) > len(loading) and budget > 0 and not out.preempted
               and len(self.running) < self.config.max_num_seqs):
            req = self._next_waiting(loading)
            if note_batch is not None:
                note_batch(len(out.scheduled))
            ok = self._schedule_waiting(req, budget, out)
            if ok is None:
                loading.add(req.request_id)
                continue
            if not ok:
                break
            if req is self.waiting[0]:
                self.waiting.popleft()
            else:
                self.waiting.remove(req)
            self._enqueued_s.pop(req.request_id, None)
            self.running.append(req)
            req.status = RequestStatus.RUNNING
            budget -= out.scheduled[-1].num_new_tokens
        out.num_waiting_for_kv = len(loading)
        return out

    def _schedule_waiting(self, req: Request, budget: int, out: SchedulerOutput
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
            assert num_ext % bs == 0, "external matches must be whole blocks"
            # at least one token is computed (the full-hit rule, BUG-09): whole blocks only
            max_ext = ((req.num_tokens - 1) // bs) * bs - num_local
            num_ext = max(0, min(num_ext, max_ext))
        n = self._chunk(req.num_tokens - num_local - num_ext, budget)
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
            targets = new_blocks[:num_ext // bs]
            for b in targets:  # BUG-10: a load never writes into a computed or shared block
                assert b.ref_cnt == 1 and not b.is_computed, f"load target {b.block_id} in use"
            keys = req.block_keys[first:first + len(targets)]
            out.loads.append(KVLoad(req.request_id, tuple(b.block_id for b in targets),
                                    tuple(keys), num_local, num_ext))
        out.scheduled.append(ScheduledRequest(req, n))
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
