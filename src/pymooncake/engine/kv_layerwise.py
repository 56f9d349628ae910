"""``LayerwiseKVSender``: the prefill engine's per-layer hook that writes each finished
layer of a step's prompt blocks to their decode worker's receive buffer with a
``kv_sender.KVSender`` (Mooncake FAST'25 §3.1 step 3), leaves writes to a slow decode host
to a watcher thread (issue 17), and takes the digest the decode side verifies."""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from pymooncake.engine.hooks import NullHooks, StepContext
from pymooncake.engine.kv_sender import KVSender, KVTransferError
from pymooncake.engine.kv_writes import KV_WRITE_TIMEOUT_S

if TYPE_CHECKING:
    from pymooncake.engine.kv.kv_tensors import KVTensors
    from pymooncake.engine.worker.stages import StageClock
    from pymooncake.rpc.messages import KVTarget


class LayerwiseKVSender(NullHooks):
    """Per-layer hook of a prefill engine: right after layer ``i`` of a step, WRITE layer
    ``i`` of every prompt block that is full after this step and not sent yet — and, in
    the step that computes the prompt's last token, its partial last block — to the
    request's ``KVTarget``, so layer ``i``'s transfer overlaps layer ``i+1``'s compute
    (Mooncake FAST'25 §3.1 step 3). Blocks reused from the local cache or loaded from the
    Store in this step are sent too (their layer ``i`` is in place by ``after_layer(i)``).

    ``end_step`` waits for the step's writes (the scheduler may free the blocks right
    after); a failed write marks the request failed (``error``), nothing is retried. The
    writes go in one batch per (layer, decode segment), so a dead or unreachable decode
    host fails only its own requests: the wait gives up a batch whose requests were all
    aborted (``KVSender.cancel``) or that is still pending after ``timeout_s``.

    With ``pool`` set (the prefill worker sets it), a batch not done within ``DEFER_S``
    — and at once any batch for a decode segment that already has one outstanding — is
    left to ``KVWrites``' watcher instead: the blocks it reads are pinned (one reference
    each) until it is final, the step loop serves the other requests meanwhile, and the
    request counts as ``writing`` until its outcome is known. ``on_settled`` (watcher
    thread) asks for ``settle()`` on the engine thread, which unpins and returns the
    requests whose last outstanding write just settled (issue 17: a decode host that stops
    answering must not stall the other requests of its prefill worker).
    """

    DEFER_S = 0.2
    """How long a step waits for its writes before it leaves them to the watcher (s)."""

    MIN_BATCH_BYTES = 1 << 20
    """Layers are written in batches of at least this many bytes (the step's last layer
    closes a batch whatever its size). A batch costs about 0.1-0.2 ms of the engine
    thread's CPU to build, route and (on one host) copy; a step of 40 prompt tokens moves
    20 KiB a layer on the tiny model, so one batch per layer was mostly that fixed cost.
    Layers of 1 MiB or more still go one by one as they finish; what a smaller step
    delays is at most this many bytes of transfer past its last layer (Mooncake slices
    at 64 KiB-1 MiB). 0: every layer on its own."""

    def __init__(self, sender: KVSender, timeout_s: float = KV_WRITE_TIMEOUT_S,
                 min_batch_bytes: int = MIN_BATCH_BYTES) -> None:
        if min_batch_bytes < 0:
            raise ValueError(f"min_batch_bytes must be >= 0, got {min_batch_bytes}")
        self.sender = sender
        self.timeout_s = timeout_s
        self.min_batch_bytes = min_batch_bytes
        self._layers: list[int] = []
        """Finished layers of this step not written yet (below ``min_batch_bytes``)."""
        self._layer_nbytes = 0
        """Bytes one layer of this step's writes moves."""
        self._complete = False
        """This step's last layer ran and its writes were submitted."""
        self._ends: set[str] = set()
        """Requests whose prompt's last token is computed in this step."""
        self.digests: dict[str, int] = {}
        """Request id → ``KVSender.digest`` of every block sent, once the last is."""
        self._targets: dict[str, KVTarget] = {}
        self._num_tokens: dict[str, int] = {}
        """Request id → its prompt's length (``add``), when the partial block is shipped."""
        self.sent_blocks: dict[str, int] = {}
        """Request id → leading blocks whose every layer has been written."""
        self.errors: dict[str, str] = {}
        self.busy_s: dict[str, float] = {}
        """Request id → seconds this hook spent building, submitting and waiting for its
        writes (the part of the P→D transfer that did not overlap compute)."""
        self._step: dict[str, tuple[tuple[int, ...], int, int]] = {}
        self._batches: list[tuple[int, tuple[str, ...], str]] = []
        self.clock: StageClock | None = None
        """Where ``p2d_transfer`` windows go (first WRITE submitted → last completed)."""
        self.pool: Any = None
        """The engine's ``BlockPool`` (pins for deferred writes); None: never defers."""
        self.on_settled: Callable[[], None] | None = None
        self._outstanding: dict[str, int] = {}
        """Request id → its deferred batches whose outcome is not known yet."""
        self._slow: dict[str, int] = {}
        """Decode segment → its deferred batches not final yet."""
        self._settled: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()

    def writing(self, request_id: str) -> bool:
        """Writes of the request were deferred and their outcome is not known yet."""
        return self._outstanding.get(request_id, 0) > 0

    def add(self, request_id: str, target: KVTarget, num_tokens: int | None = None) -> None:
        """Ship the request's prompt KV to ``target`` from now on. With the prompt's length
        ``num_tokens``, the step that computes its last token also sends its partial last
        block (when the target has room for it); ``None``: full blocks only."""
        self._targets[request_id] = target
        self.sent_blocks[request_id] = 0
        if num_tokens is not None:
            self._num_tokens[request_id] = num_tokens

    def pop(self, request_id: str) -> tuple[int, str | None, float, int | None]:
        """Forget the request; returns (blocks sent, error or None, busy seconds, digest of
        the sent blocks or None: ``digests``)."""
        self._targets.pop(request_id, None)
        self._num_tokens.pop(request_id, None)
        self._outstanding.pop(request_id, None)
        self.sender.writes.forget(request_id)
        return (self.sent_blocks.pop(request_id, 0), self.errors.pop(request_id, None),
                self.busy_s.pop(request_id, 0.0), self.digests.pop(request_id, None))

    def _charge(self, t0: float) -> None:
        dt = time.monotonic() - t0
        for rid in self._step:
            self.busy_s[rid] = self.busy_s.get(rid, 0.0) + dt

    def start_step(self, ctx: StepContext, kv: KVTensors) -> None:
        self._step = {}
        self._batches = []
        self._layers = []
        self._complete = False
        self._ends = set()
        bs = kv.block_size
        for s in ctx.seqs:
            target = self._targets.get(s.request_id)
            if (target is None or s.request_id in self.errors
                    or self.sender.writes.cancelled(s.request_id)):
                continue
            end = s.num_computed_tokens + s.num_new_tokens
            # the partial last block once the prompt's last token is in it
            last = end >= self._num_tokens.get(s.request_id, end + 1)
            upto = min(-(-end // bs) if last else end // bs, target.num_blocks)
            first = self.sent_blocks[s.request_id]
            if upto > first:
                self._step[s.request_id] = (s.block_ids, first, upto)
                if last:
                    self._ends.add(s.request_id)
        self._layer_nbytes = (sum(full - first for _, first, full in self._step.values())
                              * kv.block_nbytes_per_layer)

    def after_layer(self, layer: int, ctx: StepContext, kv: KVTensors) -> None:
        if not self._step:
            return
        self._layers.append(layer)
        if (layer < kv.num_layers - 1
                and len(self._layers) * self._layer_nbytes < self.min_batch_bytes):
            return      # too few bytes for a batch of their own yet
        t0 = time.monotonic()
        try:
            self._submit_layers()
        finally:
            self._charge(t0)
        self._complete = layer == kv.num_layers - 1

    def _submit_layers(self) -> None:
        """Write the finished layers ``_layers`` of every request of the step: one batch
        per decode segment."""
        layers, self._layers = tuple(self._layers), []
        by_target: dict[str, tuple[list, list[str]]] = {}  # decode segment -> reqs, rids
        writes = self.sender.writes
        for rid, (block_ids, first, full) in self._step.items():
            if rid in self.errors or writes.cancelled(rid):
                continue
            target = self._targets[rid]
            try:
                reqs = self.sender.requests(block_ids[first:full], target, layers,
                                            first_block=first)
            except KVTransferError as e:
                self.errors[rid] = str(e)
                continue
            group = by_target.setdefault(target.segment, ([], []))
            group[0].extend(reqs)
            group[1].append(rid)
        eng = self.sender.engine
        for reqs, rids in by_target.values():
            if not reqs:
                continue
            bid = eng.allocate_batch(len(reqs))
            try:
                eng.submit(bid, reqs)
            except Exception as e:  # noqa: BLE001 - the whole batch was refused
                eng.free_batch(bid)
                for rid in rids:
                    self.errors[rid] = f"KV write refused: {e}"
                continue
            self._batches.append((bid, tuple(rids), reqs[0].target_segment))
            self.sender.bytes_sent += sum(r.length for r in reqs)
            if self.clock is not None:
                t = time.time()
                for rid in rids:
                    self.clock.mark(rid, "p2d_transfer", t, t)

    def end_step(self, ctx: StepContext, kv: KVTensors) -> None:
        t0 = time.monotonic()
        # A step that stopped before its last layer (a failed load, a refused write) sent
        # only some layers: its blocks stay unsent, and the step's re-run (or the
        # request's recompute) writes them whole. What it submitted is still waited for.
        self._layers = []
        deferred = False
        for bid, rids, seg in self._batches:
            blocks = [b for rid in rids
                      for b in self._step[rid][0][self._step[rid][1]:self._step[rid][2]]]
            deferred = self._settle_or_defer(bid, rids, seg, blocks) or deferred
        t_end = time.time()
        for rid, (_, _, full) in self._step.items():
            if self._complete and rid not in self.errors and rid in self.sent_blocks:
                self.sent_blocks[rid] = full
                if rid in self._ends:    # every block is sent: what the decode verifies
                    self.digests[rid] = self.sender.digest(self._step[rid][0][:full])
                if self.clock is not None and self._batches and not deferred:
                    self.clock.mark(rid, "p2d_transfer", t_end, t_end)
        self._charge(t0)
        self._step = {}
        self._batches = []

    def send_blocks(self, request_id: str, block_ids: Sequence[int]) -> None:
        """Engine thread: write every layer of the prompt blocks ``block_ids`` (blocks 0,
        1, … of the prompt) to the request's target (``add``) in one batch — a prefill
        that ended before its ``KVTarget`` came, or one run with layer-wise writes off.
        The same rules as a step's writes: waited for at most ``DEFER_S`` (not at all when
        its decode segment has a slow batch already), then left to the watcher;
        ``writing(request_id)`` tells which, ``pop`` gives the outcome once it is known.
        The engine thread never waits for a decode host that stopped answering."""
        target = self._targets[request_id]
        if not block_ids or request_id in self.errors:
            return
        t0 = time.monotonic()
        try:
            reqs = self.sender.requests(block_ids, target)
        except KVTransferError as e:
            self.errors[request_id] = str(e)
            return
        eng = self.sender.engine
        bid = eng.allocate_batch(len(reqs))
        try:
            eng.submit(bid, reqs)
        except Exception as e:  # noqa: BLE001 - the whole batch was refused
            eng.free_batch(bid)
            self.errors[request_id] = f"KV write refused: {e}"
            return
        self.sender.bytes_sent += sum(r.length for r in reqs)
        if self.clock is not None:
            t = time.time()
            self.clock.mark(request_id, "p2d_transfer", t, t)
        deferred = self._settle_or_defer(bid, (request_id,), target.segment, list(block_ids))
        if self.clock is not None and not deferred:     # done: the window ends now
            t = time.time()
            self.clock.mark(request_id, "p2d_transfer", t, t)
        if request_id not in self.errors:
            self.sent_blocks[request_id] = len(block_ids)
            self.digests[request_id] = self.sender.digest(block_ids)
        self.busy_s[request_id] = self.busy_s.get(request_id, 0.0) + time.monotonic() - t0

    def _settle_or_defer(self, bid: int, rids: tuple[str, ...], seg: str,
                         block_ids: list[int]) -> bool:
        """Engine thread: wait a little for batch ``bid`` (to decode segment ``seg``,
        reading ``block_ids``) and apply its outcome, or leave it to the watcher; True
        when it was left (deferred)."""
        writes = self.sender.writes
        if self.pool is None:
            statuses, why = writes.wait_for(bid, rids, self.timeout_s,
                                            self.errors.__contains__)
        else:
            statuses = writes.poll(bid, 0.0 if self._slow.get(seg) else self.DEFER_S)
            if statuses is None:            # slow or unreachable peer: off this thread
                self._defer(bid, rids, seg, block_ids)
                return True
            why = ""
        self._apply(rids, statuses, why, seg)
        return False

    def _apply(self, rids: tuple[str, ...], statuses: list[Any] | None, why: str,
               seg: str) -> None:
        """Engine thread: a batch's outcome onto its requests (``None``: given up)."""
        if statuses is None:     # aborted, or the decode host does not answer
            for rid in rids:
                if rid in self.sent_blocks:
                    self.errors.setdefault(rid, f"KV write to {seg}: {why}")
            return
        bad = next((st for st in statuses if not st.ok), None)
        if bad is not None:
            for rid in rids:
                if rid in self.sent_blocks:
                    self.errors.setdefault(rid, f"KV write to {seg} failed: "
                                           f"{getattr(bad.code, 'value', bad.code)}: "
                                           f"{bad.reason or bad.state}")

    def _defer(self, bid: int, rids: tuple[str, ...], seg: str, block_ids: list[int]) -> None:
        """Engine thread: pin the blocks ``bid`` reads and leave it to the watcher."""
        blocks = [self.pool.blocks[b] for b in block_ids]
        self.pool.touch(blocks)
        for rid in rids:
            self._outstanding[rid] = self._outstanding.get(rid, 0) + 1
        self._slow[seg] = self._slow.get(seg, 0) + 1

        def outcome(statuses: list[Any] | None, why: str) -> None:   # watcher thread
            self._settled.put(("outcome", rids, statuses, why, seg))
            if self.on_settled is not None:
                self.on_settled()

        def final() -> None:                                          # watcher thread
            self._settled.put(("final", seg, blocks))
            if self.on_settled is not None:
                self.on_settled()
        self.sender.writes.defer(bid, rids, time.monotonic() + self.timeout_s, outcome,
                                 final, self.errors.__contains__)

    def settle(self) -> list[str]:
        """Engine thread: apply what the watcher reported (outcomes onto requests, pins
        of final batches released); the requests whose last deferred write settled."""
        done: list[str] = []
        while True:
            try:
                item = self._settled.get_nowait()
            except queue.Empty:
                return done
            if item[0] == "final":
                _, seg, blocks = item
                self.pool.free_blocks(blocks)
                n = self._slow.get(seg, 0) - 1
                if n > 0:
                    self._slow[seg] = n
                else:
                    self._slow.pop(seg, None)
                continue
            _, rids, statuses, why, seg = item
            self._apply(rids, statuses, why, seg)
            t = time.time()
            for rid in rids:
                n = self._outstanding.get(rid, 0) - 1
                if n > 0:
                    self._outstanding[rid] = n
                elif rid in self._outstanding:
                    del self._outstanding[rid]
                    done.append(rid)
                    if self.clock is not None:
                        self.clock.mark(rid, "p2d_transfer", t, t)
