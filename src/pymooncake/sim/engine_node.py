"""A colocated node simulated step by step like the engine's scheduler (``ours-1w``).

The analytic colocated node (``sim.cluster``) runs one prefill at a time in arrival order
with decode steps between its chunks. ``EngineNode`` instead replays, step by step, what
``engine/scheduler.py`` decides (the simulator never imports it; DESIGN.md §2):

* every step has a token budget (``step_budget_tokens``, the engine's
  ``max_num_batched_tokens``), at most ``decode_step_tokens`` while any running request
  decodes (``EngineConfig.decode_step_tokens``, Sarathi-Serve's stall-free batching);
* running requests first, in admission order: a decode takes 1 token, a prefill in progress
  its next chunk of at most ``min(left, budget, chunk_tokens)``; once the budget is spent the
  rest of the running list waits for the next step;
* then waiting requests while budget is left and fewer than ``max_seqs`` run, in arrival
  order (``fcfs``) or fewest tokens first (``shortest``: prompt tokens minus
  ``aging_tokens_per_s`` x seconds waited; ties to the earlier arrival); with ``srpt``,
  after the decodes, running prompts' next chunks and waiting prompts go together, fewest
  tokens left first (a waiting prompt's net of its cached prefix), aged the same way;
* with ``decode_step_s``, while a request decodes, each prefill chunk is the longest that
  keeps the step's time (below) within it, the first chunk of a step at least
  ``MIN_TIMED_CHUNK`` tokens (the engine predicts with its fitted model; here the
  calibrated cost is both the truth and the prediction); with ``prefill_hold_s``, while a
  request decodes, a step carries the decodes alone until a prompt (waiting, or running
  with more than one token left) has waited that long since it arrived; an admitted request
  first reuses the whole blocks of its prefix held in the node's cache (at least its last
  prompt token is computed); admission stops while its prompt does not fit in the KV space
  the running requests leave (the engine would admit and preempt later);
* a request samples a token when a step reaches its last token: its first token at the end
  of its last prefill chunk, then one per step; it finishes with its ``output_length``-th;
* a step's time, with a calibration's ``step`` cost (``calibrate-cpu --mixed-chunks``):
  ``a + b·tokens + c·pairs + e·sequences + g·decode context + h·chunk prefix`` of the
  step's whole composition (``sim.step_cost.StepCost.composition_s``: its decodes, each
  attending its computed tokens + 1, and its chunks, ``k`` tokens after ``c`` computed),
  fitted from timed engine steps of that kind; without one (older files), per prefill
  chunk of ``k`` tokens after ``c`` computed
  ``q·((c+k)² − c²) + l·k``, plus the prefill overhead ``o`` in a request's first chunk;
  its ``B`` decodes (``C``: their context tokens) add ``decode.step_s(B, C)`` to a step
  without a chunk, and ``d + l·B + a·C`` to a step with one (one forward pass over all the
  rows: the weights are read once, a decode row costs what a prompt row does, plus its
  attention, ``a`` the decode fit's attention term, plus ``d`` the decode fit's fixed part
  per step: the work a step with decodes has whatever its size. Measured on the engine,
  ``bench mixed-step``: a 2,400-token prompt beside 3 decodes 2.73 s in 256-token steps
  and 2.44 s in 512-token ones on 2 threads; this rule gives 2.77 and 2.57 s, without
  ``d`` 2.45 and 2.41 s; docs/sim.md). Without a step cost, a request alone costs exactly
  the calibrated ``prefill_s(n, p)`` and then ``step_s(1, ·)`` per token;
* the blocks a step completes enter the node's cache at the step's end (the engine caches
  each full block once computed); a waiting request whose next uncached block a running
  prompt is still computing is not admitted until it is cached (the engine's
  ``Scheduler.prefix_in_progress``).
Left out: preemption (a running request always gets its KV; admission stops instead) and,
without a step cost, any cost of mixing a chunk into a decode step beyond the sum above.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain

from pymooncake.conductor.policy import DecodeEstimator, PrefillEstimator
from pymooncake.sim.cache_model import LruBlockCache
from pymooncake.sim.cluster import SimRequest
from pymooncake.sim.step_cost import StepCost
from pymooncake.workload.stats import prefix_blocks_hit

WAITING_ORDERS = ("fcfs", "shortest", "srpt")
MIN_TIMED_CHUNK = 16
"""``engine.step_time.MIN_TIMED_CHUNK`` (not imported: the simulator stands apart)."""


@dataclass(frozen=True, slots=True)
class StepPolicy:
    """The engine's step sizes and waiting order (``EngineConfig``'s names)."""

    step_budget_tokens: int = 512
    decode_step_tokens: int | None = None
    chunk_tokens: int = 512
    max_seqs: int = 64
    waiting_order: str = "fcfs"
    aging_tokens_per_s: float = 2000.0
    decode_step_s: float | None = None
    prefill_hold_s: float | None = None

    def __post_init__(self) -> None:
        if min(self.step_budget_tokens, self.chunk_tokens, self.max_seqs) < 1:
            raise ValueError("step budget, chunk tokens and max seqs must be >= 1")
        if self.decode_step_tokens is not None and self.decode_step_tokens < 1:
            raise ValueError(f"decode_step_tokens must be >= 1 or None, got "
                             f"{self.decode_step_tokens}")
        if self.decode_step_s is not None and not self.decode_step_s > 0:
            raise ValueError(f"decode_step_s must be > 0 or None, got {self.decode_step_s}")
        if self.prefill_hold_s is not None and not self.prefill_hold_s > 0:
            raise ValueError(f"prefill_hold_s must be > 0 or None, got {self.prefill_hold_s}")
        if self.waiting_order not in WAITING_ORDERS:
            raise ValueError(f"waiting order must be one of {WAITING_ORDERS}, got "
                             f"{self.waiting_order!r}")


@dataclass(slots=True)
class Running:
    """A request on the node: ``num_tokens`` to have computed (prompt + sampled tokens but
    the last), ``computed`` done; ``outputs`` sampled so far and when."""

    req: SimRequest
    num_tokens: int
    computed: int = 0
    outputs: int = 0
    token_times: list[float] = field(default_factory=list)

    @property
    def decoding(self) -> bool:
        return self.outputs > 0


def step_budget(policy: StepPolicy, running: list[Running]) -> int:
    """The step's token budget: capped while any running request decodes."""
    cap = policy.decode_step_tokens
    if cap is not None and cap < policy.step_budget_tokens and any(
            r.num_tokens - r.computed == 1 for r in running):
        return cap
    return policy.step_budget_tokens


def pick_waiting(policy: StepPolicy, waiting: list[SimRequest], now_s: float) -> int:
    """Index in ``waiting`` (arrival order) of the request admitted next."""
    if policy.waiting_order == "fcfs" or len(waiting) == 1:
        return 0
    aging = policy.aging_tokens_per_s
    return min(range(len(waiting)), key=lambda i: (
        waiting[i].input_length - aging * (now_s - waiting[i].arrival_s), i))


def chunk_s(pre: PrefillEstimator, computed: int, k: int, first: bool) -> float:
    """Time of a prefill chunk of ``k`` tokens after ``computed`` (``first``: + overhead)."""
    c, n = computed, computed + k
    return pre.quadratic_s * (n * n - c * c) + pre.linear_s * k + (pre.overhead_s if first
                                                                    else 0.0)


def decode_rows_s(pre: PrefillEstimator, dec: DecodeEstimator, batch: int, context: int,
                  *, mixed: bool) -> float:
    """What ``batch`` decodes (``context`` tokens in all) add to a step: a decode step of
    their own, or, riding in a step that computes a prefill chunk (one forward pass: the
    weights are read once for all its rows), the decode step's fixed part, a prompt token's
    linear cost each and their attention over their context."""
    if not mixed:
        return dec.step_s(batch, context)
    return dec.overhead_s + pre.linear_s * batch + dec.attention_per_context_token_s * context


class EngineNode:
    """One colocated node stepped like the engine (see the module docstring)."""

    def __init__(self, name: str, cache: LruBlockCache, policy: StepPolicy,
                 prefill: PrefillEstimator, decode: DecodeEstimator, kv_capacity_tokens: int,
                 block_size: int, step: StepCost | None = None) -> None:
        """``step``: a calibration's fitted cost of a whole engine step; given, every step
        (decode-only, mixed, prefill alone) costs ``step.composition_s`` of what it
        computes, else the rule of the module docstring (``prefill`` and ``decode``)."""
        self.name = name
        self.step = step
        self.cache = cache
        self.policy = policy
        self.pre = prefill
        self.dec = decode
        self.kv_capacity_tokens = kv_capacity_tokens
        self.block_size = block_size
        self.waiting: list[SimRequest] = []
        self.running: list[Running] = []
        self.planned: list[tuple[Running, int]] = []
        self.busy = False
        """A step (or a wake-up) is scheduled; arrivals then wait for it."""
        self.busy_s = 0.0

    def add(self, r: SimRequest) -> None:
        self.waiting.append(r)

    def _kv_used(self) -> int:
        return sum(x.num_tokens for x in self.running)

    def plan(self, now_s: float) -> float | None:
        """Choose the next step (as ``Scheduler.schedule``); its duration, None when idle."""
        pol = self.policy
        budget = step_budget(pol, self.running)
        limit = None
        if pol.decode_step_s is not None and any(
                x.num_tokens - x.computed == 1 for x in self.running):
            budget, limit = pol.step_budget_tokens, pol.decode_step_s
        planned: list[tuple[Running, int]] = []
        self._kv_free = self.kv_capacity_tokens - self._kv_used()
        if self._hold_prompts(now_s):    # the decodes alone (``prefill_hold_s``)
            planned = [(x, 1) for x in self.running if x.num_tokens - x.computed == 1]
        elif pol.waiting_order == "srpt":
            self._plan_srpt(now_s, planned, budget, limit)
        else:
            for x in self.running:
                if budget <= 0:
                    break
                k = self._room(planned, x, min(x.num_tokens - x.computed, budget,
                                               pol.chunk_tokens), limit)
                if k > 0:
                    planned.append((x, k))
                    budget -= k
            skip: set[int] = set()
            while budget > 0 and len(self.running) < pol.max_seqs:
                cands = [r for r in self.waiting if r.index not in skip]
                if not cands:
                    break
                r = cands[pick_waiting(pol, cands, now_s)]
                if self._prefix_in_progress(r):
                    skip.add(r.index)
                    continue
                k = self._admit(self.waiting.index(r), now_s, planned, budget, limit)
                if k <= 0:
                    break
                budget -= k
        self.planned = planned
        if not planned:
            self.busy = False
            return None
        self.busy = True
        for x, k in planned:
            if not x.decoding:
                x.req.prefill_gpu_s += self._chunk_cost_s(x, k)
        t = self._step_s(planned)
        self.busy_s += t
        return t

    def _hold_prompts(self, now_s: float) -> bool:
        """``Scheduler._hold_prompts``: a request decodes and no prompt (waiting, or running
        with more than one token left) has waited ``prefill_hold_s`` since it arrived."""
        hold = self.policy.prefill_hold_s
        if hold is None or not any(x.num_tokens - x.computed == 1 for x in self.running):
            return False
        since = now_s - hold
        prompts = chain(self.waiting, (x.req for x in self.running
                                       if x.num_tokens - x.computed > 1))
        return all(r.arrival_s > since for r in prompts)

    def _prefix_in_progress(self, r: SimRequest) -> bool:
        """A running prompt has yet to compute the block after ``r``'s cached prefix, with
        the same key: ``r`` waits for it (``Scheduler.prefix_in_progress``)."""
        m = prefix_blocks_hit(r.hash_ids, self.cache)
        if m >= len(r.hash_ids):
            return False
        key, bs = r.hash_ids[m], self.block_size
        return any(x.computed // bs <= m and len(x.req.hash_ids) > m
                   and x.req.hash_ids[m] == key for x in self.running)

    def _hit(self, r: SimRequest) -> int:
        bs = self.block_size
        return min(prefix_blocks_hit(r.hash_ids, self.cache), (r.input_length - 1) // bs) * bs

    def _admit(self, i: int, now_s: float, planned: list[tuple[Running, int]], budget: int,
               limit: float | None) -> int:
        """Admit ``waiting[i]`` with its first chunk into ``planned``: the chunk's tokens, 0
        when it does not fit (KV space, or no time left in the step): stop admitting."""
        r = self.waiting[i]
        n = r.input_length
        if n > self._kv_free and self.running:
            return 0
        hit = self._hit(r)
        x = Running(r, n, computed=hit)
        r.hit_tokens = hit
        k = self._room(planned, x, min(n - hit, budget, self.policy.chunk_tokens), limit)
        if k <= 0:
            return 0
        del self.waiting[i]
        r.prefill_start_s = now_s
        self.running.append(x)
        planned.append((x, k))
        self._kv_free -= n
        return k

    def _plan_srpt(self, now_s: float, planned: list[tuple[Running, int]], budget: int,
                   limit: float | None) -> None:
        pol = self.policy
        for x in self.running:
            if x.num_tokens - x.computed == 1 and budget > 0:
                planned.append((x, 1))
                budget -= 1
        aging = pol.aging_tokens_per_s
        cands: list[tuple[float, int, Running | SimRequest]] = [
            (x.num_tokens - x.computed - aging * (now_s - x.req.arrival_s), i, x)
            for i, x in enumerate(self.running) if x.num_tokens - x.computed > 1]
        cands += [(r.input_length - self._hit(r) - aging * (now_s - r.arrival_s),
                   len(self.running) + i, r) for i, r in enumerate(self.waiting)]
        cands.sort(key=lambda c: (c[0], c[1]))
        for _, _, c in cands:
            if budget <= 0:
                break
            if isinstance(c, Running):
                k = self._room(planned, c, min(c.num_tokens - c.computed, budget,
                                               pol.chunk_tokens), limit)
                if k > 0:
                    planned.append((c, k))
                    budget -= k
                continue
            if len(self.running) >= pol.max_seqs or self._prefix_in_progress(c):
                continue
            k = self._admit(self.waiting.index(c), now_s, planned, budget, limit)
            if k <= 0:
                break
            budget -= k

    def _room(self, planned: list[tuple[Running, int]], x: Running, k_max: int,
              limit: float | None) -> int:
        """The largest chunk ``<= k_max`` for ``x`` that keeps the step within ``limit``
        (the step's first chunk at least ``MIN_TIMED_CHUNK``); ``k_max`` without a limit."""
        if limit is None or k_max <= 1:
            return k_max
        lo, hi = 0, k_max
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._step_s([*planned, (x, mid)]) <= limit:
                lo = mid
            else:
                hi = mid - 1
        if not any(not y.decoding for y, _ in planned):
            lo = max(lo, min(k_max, MIN_TIMED_CHUNK))
        return lo

    def _chunk_cost_s(self, x: Running, k: int) -> float:
        """A prefill chunk's share of its step (the request's ``prefill_gpu_s``): with a
        step cost, what the chunk adds to the step (its tokens, pairs and sequence)."""
        if self.step is None:
            return chunk_s(self.pre, x.computed, k, x.computed == x.req.hit_tokens)
        return self.step.chunk_s(x.computed, k)

    def _step_s(self, planned: list[tuple[Running, int]]) -> float:
        """A planned step's time (module docstring; ``StepCost`` when the node has one)."""
        if self.step is not None:
            return self.step.composition_s(
                [x.computed + 1 for x, _ in planned if x.decoding],
                [(x.computed, k) for x, k in planned if not x.decoding])
        t = sum(chunk_s(self.pre, x.computed, k, x.computed == x.req.hit_tokens)
                for x, k in planned if not x.decoding)
        dec = [x for x, _ in planned if x.decoding]
        if dec:
            t += decode_rows_s(self.pre, self.dec, len(dec), sum(x.num_tokens for x in dec),
                               mixed=t > 0)
        return t

    def finish(self, now_s: float) -> tuple[list[SimRequest], list[Running]]:
        """End the planned step at ``now_s``: the requests whose first token came, and the
        finished ones (their ``token_times`` give the TBT)."""
        first, done = [], []
        bs = self.block_size
        for x, k in self.planned:
            x.computed += k
            self.cache.touch(x.req.hash_ids[:min(x.computed, x.req.input_length) // bs])
            if x.computed < x.num_tokens:
                continue
            x.outputs += 1
            x.token_times.append(now_s)
            if x.outputs == 1:
                x.req.first_token_s = x.req.kv_arrive_s = now_s
                first.append(x.req)
            if x.outputs >= x.req.output_length:
                x.req.finish_s = now_s
                self.running.remove(x)
                done.append(x)
            else:
                x.num_tokens += 1
        self.planned = []
        return first, done
