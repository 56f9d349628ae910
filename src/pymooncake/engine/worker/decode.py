"""Decode worker (``pymooncake decode``): engine in decode (or colocated) role + KV receiver.

``prepare_decode(DecodeTask)`` re-checks admission locally (free KV blocks, batch size) and
reserves a receive buffer registered with the Transfer Engine; the prefill worker writes the
prompt's blocks there, the partial last one included (also a parked prefill's, whose
blocks stay pinned until its target comes); ``start_decode(StartDecode)`` (the KV-ready notice) adds
the request — prompt plus the prefill's first token — whose arrived blocks the engine loads
into its paged cache layer by layer (``kv_receiver.KVReceiver``) before joining the
continuous batch. With the whole prompt's KV here, its first step computes only the first
token (a plain decode step); prompt tokens that did not arrive are computed with it. After
each engine step the new tokens are pushed to the Conductor: one one-way ``tokens`` notice
(``TokenFrames``) per step, one numbered ``TokenFrame`` per request in it, sent in order on
the worker's one connection to the Conductor. Colocated role: no receive buffer, the
engine computes the prompt itself. Mooncake FAST'25 §3.1 step 4.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass
from typing import Any

from pymooncake.engine.kv_receiver import KVReceiver
from pymooncake.engine.worker.base import PREFILL_TOKENS, EngineWorker, to_sampling_params
from pymooncake.engine.worker.stages import StageClock
from pymooncake.engine.worker.tbt_model import StepTimeModel
from pymooncake.obs.logging import init_logger
from pymooncake.rpc import RpcError
from pymooncake.rpc.messages import DecodeTask, KVTarget, StartDecode, TokenFrame, TokenFrames

logger = init_logger(__name__)


@dataclass(slots=True)
class _Stream:
    task: DecodeTask
    started: bool = False
    first_token_id: int | None = None
    need_blocks: int = 0
    """KV blocks admission set aside for it until it starts."""
    seq: int = 0
    """Number of its next ``TokenFrame``."""


class DecodeWorker(EngineWorker):
    """See module docstring."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.receiver: KVReceiver | None = None
        self.transfer: Any = None
        self._streams: dict[str, _Stream] = {}
        self._sent: dict[str, int] = {}
        """Engine thread: output tokens already posted, per running request."""
        self._recv_waiters: deque[tuple[str, int, asyncio.Future[KVTarget]]] = deque()
        self._recv_releases = 0
        """Receive buffers released so far (the receive queue's progress)."""
        """Requests queued for receive space (event loop), in arrival order."""
        self._outbox: list[TokenFrame] = []
        """Token frames not sent yet (event loop): they wait for ``_send_frames``, which
        connects; with the connection open ``_push`` sends a step's frames at once."""
        self._sender: asyncio.Task[None] | None = None
        self.step_times = StepTimeModel()
        """Measured step time vs batch size (engine thread adds; admission reads)."""
        self.clock = (StageClock("decode", "decode_queue") if config.role == "decode"
                      else StageClock("generate", "queue", prompt_stage="prefill"))

    def start_resources(self) -> None:
        from pymooncake.transfer import TransferConfig, TransferEngine
        c = self.config
        self.engine = self.build_engine(c.role)
        self.engine.runner.hooks.insert(0, self.clock)
        if c.role == "decode":
            self.transfer = TransferEngine(f"{c.instance_id}-kv", c.metadata_url,
                                           config=TransferConfig(host=c.host)).start()
            self.receiver = KVReceiver(self.transfer, self.engine.kv,
                                       self.sizing.recv_buffer_bytes)
            self.receiver.clock = self.clock
            self.receiver.on_release = lambda: self.post(self._on_recv_release)
            self.engine.scheduler.kv_source = self.receiver
            self.engine.runner.hooks.append(self.receiver)

    def close_resources(self) -> None:
        if self.transfer is not None:
            try:
                self.transfer.close()
            except Exception:  # noqa: BLE001
                logger.exception("close failed")

    def register_methods(self) -> None:
        self.server.register("prepare_decode", self._prepare, DecodeTask)
        self.server.register("start_decode", self._start, StartDecode)
        self.server.register("abort", self._abort)

    # -- RPC handlers (event loop) -------------------------------------------------------
    async def _prepare(self, task: DecodeTask) -> KVTarget | None:
        rid = task.request_id
        if rid in self._streams:
            raise RpcError("DUPLICATE", f"request {rid} is already admitted here")
        need = -(-(len(task.prompt_token_ids) + task.sampling.max_tokens)
                 // self.config.block_size)

        # Admission runs here on the event loop, not on the engine thread: waiting for the
        # current decode step would put a whole step on the request's TTFT path. The engine's
        # counters are read without its lock (a step may change them meanwhile); requests
        # admitted but not started yet are counted from ``_streams``, so two admissions
        # cannot both take the last free blocks or batch slots.
        e = self.engine
        pending = [st.need_blocks for st in self._streams.values() if not st.started]
        free = e.pool.num_free_blocks - sum(pending)
        if need > free:
            raise RpcError("NO_KV_SPACE", f"{need} KV blocks needed, {max(free, 0)} free")
        busy = len(e.scheduler.running) + len(e.scheduler.waiting) + len(pending)
        if busy >= e.config.max_num_seqs:
            raise RpcError("BATCH_FULL", f"{e.config.max_num_seqs} requests admitted")
        if task.tbt_slo_s > 0:
            measured = (self.step_times.predict_s(busy + 1)
                        if len(self.step_times) >= 8 else None) or 0.0
            paced = self.config.decode_step_interval_s   # a paced worker's least TBT
            if max(measured, paced) > task.tbt_slo_s:
                why = (f"predicted TBT {measured:.4f} s at batch {busy + 1} (measured here)"
                       if measured >= paced else
                       f"decode steps paced {paced:.4f} s apart (--decode-step-interval-s)")
                raise RpcError("TBT_SLO", f"{why} exceeds the SLO {task.tbt_slo_s} s")
        st = self._streams[rid] = _Stream(task, need_blocks=need)
        if not task.num_kv_blocks or self.receiver is None:
            return None
        try:
            return await self._reserve(rid, task.num_kv_blocks)
        except BaseException:
            if self._streams.get(rid) is st:
                del self._streams[rid]
            raise

    async def _reserve(self, rid: str, num_blocks: int) -> KVTarget:
        """A receive buffer for ``num_blocks`` blocks. When the arena has no room now the
        request queues (FIFO, at most ``recv_wait_max`` requests) for the space that earlier
        requests free once their KV is in the paged cache. ``NO_RECV_SPACE`` when it can
        never fit, the queue is full, or no space at all was freed for
        ``recv_wait_timeout_s`` (a stalled queue; a moving one is waited for)."""
        r = self.receiver
        assert r is not None and self.loop is not None
        c = self.config
        if not r.fits(num_blocks):
            raise RpcError("NO_RECV_SPACE", (
                f"the prompt's KV ({num_blocks} blocks x {r.block_nbytes} bytes = "
                f"{num_blocks * r.block_nbytes} bytes) is larger than this decode worker's "
                f"whole receive buffer ({r.capacity_bytes} bytes, recv_buffer_bytes): it can "
                f"never be received here; give the decode worker a larger receive buffer"))
        if not self._recv_waiters:
            target = r.reserve(rid, num_blocks)
            if target is not None:
                return target
        if len(self._recv_waiters) >= c.recv_wait_max:
            raise RpcError("NO_RECV_SPACE", f"receive buffer full and {c.recv_wait_max} "
                           f"requests already queued for it")
        fut: asyncio.Future[KVTarget] = self.loop.create_future()
        self._recv_waiters.append((rid, num_blocks, fut))
        try:
            while True:
                seen = self._recv_releases
                try:
                    return await asyncio.wait_for(asyncio.shield(fut), c.recv_wait_timeout_s)
                except TimeoutError:
                    if self._recv_releases == seen:   # nothing freed the whole time
                        raise RpcError("NO_RECV_SPACE", (
                            f"receive buffer full and no space freed for "
                            f"{c.recv_wait_timeout_s:.0f} s ({r.free_bytes} of "
                            f"{r.capacity_bytes} bytes free, {num_blocks * r.block_nbytes} "
                            f"needed)")) from None
        except BaseException:
            if fut.done() and not fut.cancelled():
                r.release(rid)   # granted, but the caller is gone
            else:
                fut.cancel()     # _admit_recv_waiters skips it
            raise
        finally:
            self._admit_recv_waiters()

    def _on_recv_release(self) -> None:
        """Event loop: a receive buffer was released; count it and admit the waiters."""
        self._recv_releases += 1
        self._admit_recv_waiters()

    def _admit_recv_waiters(self) -> None:
        """Event loop: hand freed receive space to the queued requests, in arrival order
        (the head blocks the rest: a long prompt is not overtaken until it starves)."""
        r = self.receiver
        while self._recv_waiters and r is not None:
            rid, n, fut = self._recv_waiters[0]
            if fut.done():          # timed out or cancelled
                self._recv_waiters.popleft()
                continue
            target = r.reserve(rid, n)
            if target is None:
                return
            self._recv_waiters.popleft()
            fut.set_result(target)

    async def _start(self, msg: StartDecode) -> bool:
        st = self._streams.get(msg.request_id)
        if st is None:
            raise RpcError("UNKNOWN_REQUEST", f"request {msg.request_id} was not prepared")
        task = st.task
        prompt = list(task.prompt_token_ids)
        max_tokens = task.sampling.max_tokens
        if msg.first_token_id is not None:
            prompt.append(msg.first_token_id)
            max_tokens -= 1
            st.first_token_id = msg.first_token_id
        if max_tokens < 1:
            self._finish_stream(msg.request_id, "length")
            return True
        params = to_sampling_params(task.sampling, max_tokens)
        self.clock.arrive(msg.request_id)

        def add() -> None:
            if (self.receiver is not None and msg.first_token_id is not None
                    and msg.num_ready_blocks > 0):
                self.receiver.mark_ready(msg.request_id, msg.num_ready_blocks,
                                         len(task.prompt_token_ids), msg.kv_digest)
            self.engine.add_request(prompt, params, msg.request_id)
            self._sent[msg.request_id] = 0

        try:
            await self.on_engine(add)
        except ValueError as e:
            self._release(msg.request_id)
            raise RpcError("INVALID_REQUEST", str(e)) from None
        st.started = True
        return True

    async def _abort(self, request_id: Any) -> bool:
        rid = str(request_id)
        self._streams.pop(rid, None)
        for w_rid, _, fut in self._recv_waiters:
            if w_rid == rid and not fut.done():
                fut.set_exception(RpcError("ABORTED", f"request {rid} aborted while queued "
                                           f"for receive space"))
        await self.on_engine(lambda: self._abort_engine(rid))
        return True

    def _abort_engine(self, rid: str) -> None:
        self.clock.forget(rid)
        self.engine.abort(rid)
        self._sent.pop(rid, None)
        if self.receiver is not None:
            self.receiver.release(rid)

    def _release(self, rid: str) -> None:
        self._streams.pop(rid, None)
        if self.receiver is not None:
            self.receiver.release(rid)

    def _finish_stream(self, rid: str, reason: str) -> None:
        self._push([(rid, [], reason, None, ())])

    def _push(self, updates: list[tuple[str, list[int], str | None, int | None,
                                        tuple[tuple[str, float, float], ...]]],
              error: str | None = None) -> None:
        """Event loop: frame ``updates`` (request id, new tokens, finish reason, cached
        tokens, stages) for the requests still streaming and send them to the Conductor,
        in this loop turn when its connection is open (``RpcClient.notify_now``), else
        through ``_send_frames``; a request's last frame (finished, or ``error``) ends its
        stream here."""
        for rid, toks, reason, cached, stages in updates:
            st = self._streams.get(rid)
            if st is None:       # aborted meanwhile
                continue
            err = error
            if reason == "error":
                reason, err = "abort", "generation failed (KV load)"
            self._outbox.append(TokenFrame(
                rid, st.seq, tuple(toks), reason, err,
                cached if st.first_token_id is None else None, stages))
            st.seq += 1
            if reason is not None or err is not None:
                del self._streams[rid]
        if self._outbox and (self._sender is None or self._sender.done()):
            # the connection is open (the usual case): the frames leave now, in this loop
            # turn; otherwise a sender task connects and sends them (and any that follow
            # meanwhile, queued behind it so that their order holds)
            c = self._conductor
            frames = self._outbox
            try:
                sent = c is not None and c.notify_now("tokens", TokenFrames(
                    self.config.instance_id, tuple(frames)))
            except ValueError as e:   # over MAX_FRAME_BYTES: the frames are dropped, as
                sent = True           # a lost connection drops them (logged here)
                logger.warning("token frames of %d requests not sent: %s",
                               len({f.request_id for f in frames}), e)
            if sent:
                self._outbox = []
                return
            self._sender = asyncio.ensure_future(self._send_frames())

    async def _send_frames(self) -> None:
        """Send the outbox, oldest first, one ``tokens`` notice at a time: the frames of a
        request leave in order on the one connection. Frames the connection loses show
        up at the Conductor as a sequence gap (or its stream fails with the link)."""
        c = self._conductor
        assert c is not None
        while self._outbox:
            frames, self._outbox = self._outbox, []
            try:
                await c.notify("tokens", TokenFrames(self.config.instance_id, tuple(frames)))
            except (RpcError, ValueError) as e:   # ValueError: over MAX_FRAME_BYTES
                logger.warning("token frames of %d requests not sent: %s",
                               len({f.request_id for f in frames}), e)

    # -- engine thread --------------------------------------------------------------------
    def on_step_timed(self, batch_size: int, seconds: float) -> None:
        self.step_times.add(batch_size, seconds)

    def after_step(self, outputs: list[Any]) -> None:
        updates: list[tuple[str, list[int], str | None, int | None,
                            tuple[tuple[str, float, float], ...]]] = []
        finished = {o.request_id: o for o in outputs}
        for rid, n in list(self._sent.items()):
            out = finished.get(rid)
            if out is not None:
                toks = list(out.output_token_ids)
                reason = out.finish_reason.value
                cached = out.num_cached_tokens
                del self._sent[rid]
                if self.receiver is not None:
                    self.receiver.release(rid)
                if self.config.role == "colocated":
                    computed = len(out.prompt_token_ids) - cached
                    self.num_prefill_tokens_total += computed
                    PREFILL_TOKENS.inc(computed)
            else:
                req = self.engine.requests.get(rid)
                if req is None:
                    continue
                toks = req.output_token_ids
                reason = None
                cached = req.num_cached_tokens if req.num_cached_tokens >= 0 else None
            if len(toks) > n or reason is not None:
                self._sent[rid] = len(toks) if reason is None else 0
                if reason is not None:
                    self._sent.pop(rid, None)
                stages = self.clock.pop(rid) if reason is not None else ()
                updates.append((rid, list(toks[n:]), reason, cached, stages))
        if updates:
            self.post(lambda: self._push(updates))

    def on_failed(self, request_id: str, reason: str) -> None:
        self.clock.forget(request_id)
        self._sent.pop(request_id, None)
        if self.receiver is not None:
            self.receiver.release(request_id)

        self.post(lambda: self._push([(request_id, [], None, None, ())], error=reason))
