"""Prefill worker (``pymooncake prefill``): engine in prefill role + Store client + KV sender.

For a ``PrefillTask``: reuse the prompt's prefix blocks (the engine's local prefix cache
first, then the global Store through ``kv_loader.StoreKVLoader``), compute the rest in
chunks, sample the first token, write the prompt's blocks — its partial last block
included — into the decode worker's receive buffer (``kv_sender.KVSender``, Transfer
Engine WRITEs straight from the paged KV memory) and put the new full blocks into the
Store. Mooncake FAST'25 §3.1, DESIGN.md §1.

The P→D write is layer-wise by default (``kv_layerwise.LayerwiseKVSender``: layer ``i`` of
the step's new full blocks, and of the partial last block in the prompt's last step, is
submitted right after layer ``i``'s compute, the step waits for its writes at its end);
``WorkerConfig.layerwise_kv=False`` ships all layers in one batch right after the prefill
instead, as does a ``target_follows`` prefill that ended before its ``KVTarget`` came
(parked: its blocks, the partial last one included, stay pinned until then, so the decode
worker computes one token, not the prompt's tail). Either way a write not done within
``LayerwiseKVSender.DEFER_S`` leaves the engine thread (issue 17): the request is
answered once it settles, and a decode host that stops answering never holds up the
other requests of this worker.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from pymooncake.engine.hooks import BlockTables
from pymooncake.engine.kv_layerwise import LayerwiseKVSender
from pymooncake.engine.kv_loader import StoreKVLoader
from pymooncake.engine.kv_sender import KVSender
from pymooncake.engine.worker.base import PREFILL_TOKENS, EngineWorker, to_sampling_params
from pymooncake.engine.worker.config import staging_blocks
from pymooncake.engine.worker.poster import set_exception_if_pending, set_result_if_pending
from pymooncake.engine.worker.stages import StageClock
from pymooncake.engine.worker.store_puts import StorePuts, stale_store_blocks
from pymooncake.obs.logging import init_logger
from pymooncake.rpc import RpcError
from pymooncake.rpc.messages import KVTarget, PrefillResult, PrefillTask, SetTarget

logger = init_logger(__name__)

Stages = tuple[tuple[str, float, float], ...]
"""``(stage, start_unix_s, end_unix_s)`` windows (worker.stages.StageClock)."""
PARKED_MAX_S = 30.0
"""Longest a finished ``target_follows`` prefill waits for its ``SetTarget`` before it
fails (the Conductor sends one or aborts the request; this bounds a lost message)."""
TARGET_WAIT_CHUNK_TOKENS = 512
"""Chunk (tokens; ``Request.max_chunk_tokens``) of a ``target_follows`` prompt until its
``KVTarget`` comes (a decode admission round trip, ~3 ms): its later layers are then
written as computed, not parked and shipped after; then chunks of the step budget."""


@dataclass(slots=True)
class _Pending:
    task: PrefillTask
    future: asyncio.Future[PrefillResult]
    start_s: float = field(default_factory=time.monotonic)
    target: KVTarget | None = None


class PrefillWorker(EngineWorker):
    """See module docstring."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.store: Any = None
        self.loader: StoreKVLoader | None = None
        self.sender: KVSender | None = None
        self.layerwise: LayerwiseKVSender | None = None
        """The per-layer write hook (None with ``layerwise_kv`` off)."""
        self.shipper: LayerwiseKVSender | None = None
        """Writes a finished prompt's blocks in one batch (``_ship``); ``layerwise`` itself
        when that is on (one set of deferred writes, one ``settle``)."""
        self.transfer: Any = None
        self._pending: dict[str, _Pending] = {}
        self._parked: dict[str, tuple[float, _Pending, Any, Stages, tuple[int, ...]]] = {}
        """Engine thread: finished ``target_follows`` prefills whose ``KVTarget`` has not come
        yet (monotonic park time, request, engine output, stage windows, the prompt's block
        ids, pinned in the engine's ``BlockPool`` until shipped or dropped: ``_unpark``)."""
        self._writing: dict[str, tuple[Any, Stages | None]] = {}
        """Engine thread: finished prefills whose deferred KV writes have not settled yet
        (request id → engine output and, for a prompt shipped in one batch, its stage
        windows); answered by ``_settle_writes``."""
        self._puts: StorePuts | None = None
        self.clock = StageClock("prefill", "queue")
        self._tables = BlockTables()
        """Block ids of the running requests: the prompt's partial last block of a one-batch
        ship (``_ship``), and the blocks a parked prefill pins."""

    def start_resources(self) -> None:
        from pymooncake.transfer import TransferConfig, TransferEngine
        c = self.config
        self.engine = self.build_engine("prefill")
        self.engine.runner.hooks.insert(0, self.clock)
        # one Transfer Engine per process (issue 16): P->D sends and the Store client's
        # data path share it, and with it one segment table, one endpoint pool, one loop
        self.transfer = TransferEngine(f"{c.instance_id}-kv", c.metadata_url,
                                       config=TransferConfig(host=c.host)).start()
        if c.master:
            from pymooncake.store.client import StoreClient
            self.store = StoreClient(c.master, c.metadata_url, local_hostname=c.host,
                                     global_segment_size=self.sizing.global_segment_size_bytes,
                                     transfer_engine=self.transfer).start()
            self.loader = StoreKVLoader(self.store, self.engine.kv,
                                        self.engine.namespace.digest(),
                                        staging_blocks=staging_blocks(
                                            c.block_size, self.engine.kv.block_nbytes))
            self.loader.clock = self.clock
            self.engine.scheduler.kv_source = self.loader
            self.engine.runner.hooks.append(self.loader)
            self._puts = StorePuts(self.loader, self.engine.has_unfinished, self._stop.is_set,
                                   self.add_store_keys, f"store-put-{c.instance_id}")
        self.sender = KVSender(self.transfer, self.engine.kv)
        self.shipper = LayerwiseKVSender(self.sender)
        self.shipper.clock = self.clock
        # writes to a slow or unreachable decode host leave the step loop (issue 17)
        self.shipper.pool = self.engine.pool
        self.shipper.on_settled = lambda: self._cmds.put(self._settle_writes)
        if c.layerwise_kv:
            self.layerwise = self.shipper
            self.engine.runner.hooks.append(self.layerwise)
        # _ship (and a parked prefill) need the id of the prompt's partial last block
        self.engine.runner.hooks.append(self._tables)

    def close_resources(self) -> None:
        if self.sender is not None:
            self.sender.writes.close()
        if self._puts is not None:
            self._puts.close()
        if self.loader is not None:  # its fetch thread reads through the Store client
            self.loader.close()
        for closer in (self.store, self.transfer):  # the Store client's segment first
            if closer is not None:
                try:
                    closer.close()
                except Exception:  # noqa: BLE001 - best effort at shutdown
                    logger.exception("close failed")

    def register_methods(self) -> None:
        self.server.register("prefill", self._prefill, PrefillTask)
        self.server.register("set_target", self._set_target, SetTarget)
        self.server.register("abort", self._abort)

    async def _prefill(self, task: PrefillTask) -> PrefillResult:
        fut: asyncio.Future[PrefillResult] = asyncio.get_running_loop().create_future()
        params = to_sampling_params(task.sampling, 1)
        self.clock.arrive(task.request_id)

        def add() -> None:
            if task.request_id in self._pending or task.request_id in self._parked:
                # (a parked one waits for its SetTarget with its blocks pinned: taking the
                # id again would orphan those pins)
                raise RpcError("DUPLICATE", f"request {task.request_id} is already prefilling")
            if self.loader is not None and not task.use_store:
                self.loader.disable(task.request_id)
            elif self.loader is not None:   # a hint of 0 blocks skips the lookup as well
                self.loader.hint(task.request_id, task.store_hint_blocks)
            if self.layerwise is not None and task.target is not None:
                self.layerwise.add(task.request_id, task.target, len(task.prompt_token_ids))
            try:
                self.engine.add_request(task.prompt_token_ids, params, task.request_id)
            except ValueError as e:
                self._forget(task.request_id)
                raise RpcError("INVALID_REQUEST", str(e)) from None
            if task.target_follows and task.target is None and self.layerwise is not None:
                req = self.engine.requests[task.request_id]     # (lifted by _set_target)
                req.max_chunk_tokens = TARGET_WAIT_CHUNK_TOKENS
            self._pending[task.request_id] = _Pending(task, fut, target=task.target)

        await self.on_engine(add)
        try:
            return await fut
        except asyncio.CancelledError:
            if self.sender is not None:   # a KV write in flight must not hold the step
                self.sender.cancel(task.request_id)
            self.on_engine(lambda: self._drop(task.request_id))
            raise

    async def _set_target(self, msg: SetTarget) -> bool:
        """The late ``KVTarget`` of a ``target_follows`` prefill: applied to the layers still
        to come, or — when the prefill is already done (parked) — its pinned blocks are
        written now and the prefill RPC answers. False when the request is no longer here
        (aborted) or already has a target."""
        def apply() -> bool:
            parked = self._parked.get(msg.request_id)
            if parked is not None:      # the prefill is done: ship its pinned blocks now
                _, p, out, stages, table = parked
                p.target = msg.target
                try:
                    self._ship(p, out, stages, table)
                finally:                # a write left to the watcher holds its own pins
                    self._unpark(msg.request_id)
                return True
            p = self._pending.get(msg.request_id)
            if p is None or p.target is not None:
                return False
            p.target = msg.target
            if self.layerwise is not None:
                self.layerwise.add(msg.request_id, msg.target, len(p.task.prompt_token_ids))
            if (req := self.engine.requests.get(msg.request_id)) is not None:
                req.max_chunk_tokens = None     # the rest in the step budget's chunks
            return True
        return await self.on_engine(apply)

    def _forget(self, request_id: str) -> tuple[int, str | None, float, int | None]:
        self.clock.forget(request_id)
        self._tables.pop(request_id)
        if self.sender is not None:
            self.sender.writes.forget(request_id)
        if self.loader is not None:
            self.loader.forget(request_id)
        if self.shipper is not None:
            return self.shipper.pop(request_id)
        return 0, None, 0.0, None

    def _unpark(self, request_id: str) -> Any:
        """Engine thread: take ``request_id`` off the parked prefills and release the pins
        on its blocks; its ``_parked`` entry, or None."""
        parked = self._parked.pop(request_id, None)
        if parked is not None and parked[4]:
            pool = self.engine.pool     # tail first: its last blocks are evicted first
            pool.free_blocks([pool.blocks[b] for b in reversed(parked[4])])
        return parked

    def _drop(self, request_id: str) -> None:
        self._pending.pop(request_id, None)
        self._unpark(request_id)
        self._writing.pop(request_id, None)
        self.engine.abort(request_id)
        self._forget(request_id)

    async def _abort(self, request_id: Any) -> bool:
        # first, from this thread: the engine thread may be waiting for the request's KV
        # write to a decode host that is gone (issue 17: the step loop moves on at once)
        if self.sender is not None:
            self.sender.cancel(str(request_id))
        await self.on_engine(lambda: self._drop(str(request_id)))
        return True

    def on_idle(self) -> None:
        if self._puts is not None:      # a put deferred while prompts computed goes now
            self._puts.idle()
        if self._parked:    # no step to expire them after: an idle turn does (1 s at most)
            self._expire_parked()

    def on_failed(self, request_id: str, reason: str) -> None:
        self._forget(request_id)
        p = self._pending.pop(request_id, None)
        if p is not None:
            err = RpcError("PREFILL_FAILED", reason)
            self.post(lambda: set_exception_if_pending(p.future, err))

    def _settle_writes(self) -> None:
        """Engine thread: deferred KV writes settled; answer the prefills done meanwhile."""
        if self.shipper is None:
            return
        done = []
        for rid in self.shipper.settle():
            out, stages = self._writing.pop(rid, (None, None))
            if out is None:
                continue
            if stages is None:
                done.append(out)
            else:
                self._shipped(out, stages)
        if done:
            self.after_step(done)

    def after_step(self, outputs: list[Any]) -> None:
        for out in outputs:
            if (self.layerwise is not None and self.layerwise.writing(out.request_id)
                    and out.request_id in self._pending):
                self._writing[out.request_id] = (out, None)  # answered once they settle
                continue
            p = self._pending.pop(out.request_id, None)
            stages = self.clock.pop(out.request_id)
            table = self._tables.pop(out.request_id)
            layerwise = self._forget(out.request_id)
            if p is None:
                continue
            table = table[:-(-len(p.task.prompt_token_ids) // self.engine.config.block_size)]
            if p.task.target_follows and p.target is None and self.sender is not None:
                # Done before its KVTarget came: its blocks (freed by the step that ended
                # it; nothing allocates before the next step) are pinned and shipped in one
                # batch when the SetTarget arrives (_set_target), the partial last one too.
                self.engine.pool.touch([self.engine.pool.blocks[b] for b in table])
                self._parked[out.request_id] = (time.monotonic(), p, out, stages, table)
                continue
            if p.target is not None and self.layerwise is None:
                self._ship(p, out, stages, table)   # layer-wise writes off: one batch now
                continue
            self._resolve(p, out, layerwise, stages)
        if self._parked:
            self._expire_parked()

    def _ship(self, p: _Pending, out: Any, stages: Stages, table: tuple[int, ...]) -> None:
        """Engine thread: write the finished prompt's blocks ``table`` (its block ids, the
        partial last one included: freed by the step that just ended it but not reused —
        ``send_blocks`` pins those of a write it leaves to the watcher — or pinned since,
        when parked) to ``p.target`` in one batch (``LayerwiseKVSender.send_blocks``); the
        prefill RPC is answered at once when the write is done within ``DEFER_S``, else
        once it settles (``_settle_writes``) — never by waiting for a decode host (issue
        17)."""
        assert self.shipper is not None and p.target is not None
        rid = p.task.request_id
        self._pending[rid] = p          # (aborts find it here meanwhile)
        self.shipper.add(rid, p.target)
        self.shipper.send_blocks(rid, list(table[:p.target.num_blocks]))
        if self.shipper.writing(rid):
            self._writing[rid] = (out, stages)
        else:
            self._shipped(out, stages)

    def _shipped(self, out: Any, stages: Stages) -> None:
        """Engine thread: the one-batch write of ``_ship`` settled: answer the prefill."""
        rid = out.request_id
        p = self._pending.pop(rid, None)
        write_windows = self.clock.pop(rid)     # its p2d_transfer window
        outcome = self._forget(rid)
        if p is not None:
            self._resolve(p, out, outcome, (*stages, *write_windows))

    def _resolve(self, p: _Pending, out: Any,
                 layerwise: tuple[int, str | None, float, int | None],
                 stages: Stages) -> None:
        """Engine thread: finish ``p`` and hand the result (or error) to its RPC."""
        try:
            result = self._finish(p, out, layerwise, stages)
        except Exception as e:  # noqa: BLE001 - the one request fails, the worker serves on
            logger.warning("prefill %s: %s", out.request_id, e)
            err = e if isinstance(e, RpcError) else RpcError("KV_TRANSFER_FAILED", str(e))
            self.post(lambda p=p, err=err: set_exception_if_pending(p.future, err))
        else:
            self.post(lambda p=p, r=result: set_result_if_pending(p.future, r))

    def _expire_parked(self) -> None:
        now = time.monotonic()
        for rid, (t, p, *_) in list(self._parked.items()):
            if now - t > PARKED_MAX_S:
                self._unpark(rid)
                err = RpcError("KV_TARGET_MISSING",
                               f"no KVTarget for {rid} within {PARKED_MAX_S:.0f} s")
                self.post(lambda p=p, err=err: set_exception_if_pending(p.future, err))

    def _cached_blocks(self, prompt: list[int], keys: list[Any]) -> list[int]:
        """Engine thread: block ids of the prompt's leading full blocks in the prefix cache
        (``keys``: the prompt's block keys)."""
        e = self.engine
        bs = e.config.block_size
        block_ids = []
        for i, k in enumerate(keys):
            b = e.pool.get_cached_block(k, tuple(prompt[i * bs:(i + 1) * bs]))
            if b is None:
                break
            block_ids.append(b.block_id)
        return block_ids

    def _finish(self, p: _Pending, out: Any,
                layerwise: tuple[int, str | None, float, int | None],
                stages: Stages = ()) -> PrefillResult:
        """Engine thread: the prefill's result, once its KV writes are over (``layerwise``:
        blocks written, error or None, seconds spent on them — layer by layer during the
        prefill, or in one batch by ``_ship``); puts new blocks into the Store."""
        from pymooncake.engine.request import FinishReason
        prefill_s = time.monotonic() - p.start_s
        if out.finish_reason not in (FinishReason.LENGTH, FinishReason.STOP):
            raise RpcError("PREFILL_FAILED", f"prefill ended with {out.finish_reason.value}")
        prompt = list(p.task.prompt_token_ids)
        cached = out.num_cached_tokens
        computed = len(prompt) - cached
        self.num_prefill_tokens_total += computed
        PREFILL_TOKENS.inc(computed)
        e = self.engine
        bs = e.config.block_size
        from pymooncake.identity import block_keys
        # the engine's keys when it hashed the prompt (default hash: the Store's keys)
        keys = (list(out.prompt_block_keys) if out.prompt_block_keys and e.hash_fn is None
                else block_keys(prompt, e.namespace))
        block_ids = self._cached_blocks(prompt, keys)
        sent = 0
        transfer_s = 0.0
        digest = None
        if p.target is not None:
            sent, err, transfer_s, digest = layerwise
            if err is not None:
                raise RpcError("KV_TRANSFER_FAILED", err)
        if self.loader is not None and p.task.use_store:
            lo, hi = stale_store_blocks(p.task.store_hint_blocks, cached, len(prompt), bs)
            if hi > lo:
                self.drop_store_keys([str(k) for k in keys[lo:hi]])
        if self.loader is not None and p.task.use_store and block_ids:
            new_from = cached // bs
            if new_from < len(block_ids):
                put_keys = [str(k) for k in keys[new_from:len(block_ids)]]
                # copied once, into the loader's registered staging slots; the put thread
                # writes them from there (batch_put_from: no bytes in between)
                data = self.loader.stage_for_put(block_ids[new_from:])
                assert self._puts is not None
                self._puts.put(put_keys, data)
        first = out.output_token_ids[0]
        finish = "stop" if out.finish_reason == FinishReason.STOP else None
        return PrefillResult(p.task.request_id, first, cached, sent, prefill_s, transfer_s,
                             finish, stages, digest if sent else None)

