"""The EP front service (``pymooncake ep serve``): attention, router and shared expert here,
routed experts on the EP ranks (``dispatch.RemoteExperts``), an RPC API for clients.

RPC methods (msgpack maps):

* ``ep.generate {"prompt_token_ids": [int] | "prompt": str, "max_tokens": int}`` ->
  ``{"token_ids", "text", "finish_reason", "error", "degraded", "missing_experts",
  "elapsed_s"}``. Greedy decoding. ``error`` is None on success; a request whose tokens
  were routed to an expert with no live copy ends with ``finish_reason`` ``"error"`` and
  ``error`` naming the experts — unless the service runs with ``degraded_topk``, in which
  case those tokens use the remaining top-k experts (renormalised) and ``degraded`` is
  True. A request never waits longer than ``request_timeout_s``.
* ``ep.status`` -> ranks (alive, pid), placement, experts without a live copy, re-routed
  rows, re-plans (reason, seconds), requests served / failed / degraded.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from pymooncake.engine.config import EngineConfig
from pymooncake.engine.engine import Engine
from pymooncake.engine.ep.dispatch import EPOptions, RemoteExperts
from pymooncake.engine.ep.models import build_engine
from pymooncake.engine.hooks import StepContext
from pymooncake.engine.sampling import SamplingParams
from pymooncake.obs.logging import init_logger
from pymooncake.rpc import ErrorCode, RpcError, RpcServer

logger = init_logger(__name__)


class _RowMap:
    """A ``LayerHooks`` that remembers which request each token row of a step belongs to."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, int]] = []

    def start_step(self, ctx: StepContext, kv: Any) -> None:
        self.rows = [(s.request_id, s.num_new_tokens) for s in ctx.seqs]

    def before_layer(self, layer: int, ctx: StepContext, kv: Any) -> None:
        pass

    def after_layer(self, layer: int, ctx: StepContext, kv: Any) -> None:
        pass

    def end_step(self, ctx: StepContext, kv: Any) -> None:
        pass

    def requests_of(self, rows: set[int]) -> set[str]:
        out, start = set(), 0
        for rid, n in self.rows:
            if any(start <= r < start + n for r in rows):
                out.add(rid)
            start += n
        return out


@dataclass(slots=True)
class _Pending:
    rid: str
    ids: list[int]
    max_tokens: int
    done: Any  # callable(result dict), thread-safe
    t0: float = field(default_factory=time.monotonic)
    degraded: bool = False


class EPService:
    """Engine + EP backend + RPC server. ``ranks`` empty: experts run in this process
    (the single-process reference). Raises ``ModelLoadError`` / ``RuntimeError`` (a rank
    not answering) from ``start``."""

    def __init__(self, model: str, ranks: list[tuple[str, int]], *,
                 options: EPOptions | None = None, engine_config: EngineConfig | None = None,
                 degraded_topk: bool = False, request_timeout_s: float = 60.0,
                 metadata: str | None = None) -> None:
        self.model_spec = model
        self.rank_addrs = ranks
        self.options = options or EPOptions()
        self.engine_config = engine_config or EngineConfig(num_kv_blocks=512, max_model_len=2048,
                                                           max_num_batched_tokens=512)
        self.degraded_topk = degraded_topk
        self.request_timeout_s = request_timeout_s
        self.metadata = metadata
        self.rowmap = _RowMap()
        self.engine: Engine | None = None
        self.backend: RemoteExperts | None = None
        self._queue: queue.Queue[_Pending | None] = queue.Queue()
        self._pending: dict[str, _Pending] = {}
        self._ids = itertools.count(1)
        self.counters = {"ok": 0, "error": 0, "degraded": 0}
        self._thread: threading.Thread | None = None

    def start(self) -> EPService:
        self.engine = build_engine(self.model_spec, self.engine_config,  # experts on ranks
                                   with_experts=not self.rank_addrs, hooks=[self.rowmap])
        model: Any = self.engine.model
        if self.rank_addrs:
            cfg = model.config
            rows = self.engine_config.max_num_batched_tokens * cfg.top_k
            self.options.max_rows = max(self.options.max_rows, rows)
            moe_layers = [b.layer_idx for b in model.moe_blocks()]
            self.backend = RemoteExperts(self.rank_addrs, moe_layers, cfg.num_experts,
                                         cfg.hidden_size, next(model.parameters()).dtype,
                                         self.options, self.metadata).start()
            model.set_expert_backend(self.backend)
        self._thread = threading.Thread(target=self._loop, name="ep-engine", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._queue.put(None)
        if self._thread is not None:
            self._thread.join(10)
        if self.backend is not None:
            self.backend.close()

    # -- the engine thread -----------------------------------------------------------
    def submit(self, ids: list[int], max_tokens: int, done: Any) -> None:
        """Queue a greedy request; ``done(result)`` is called from the engine thread."""
        self._queue.put(_Pending(f"ep-{next(self._ids)}", ids, max_tokens, done))

    def _finish(self, p: _Pending, tokens: list[int], reason: str,
                error: str | None) -> None:
        self._pending.pop(p.rid, None)
        eng = self.engine
        text = eng.tokenizer.decode(tokens) if eng and eng.tokenizer and not error else None
        self.counters["error" if error else "ok"] += 1
        self.counters["degraded"] += int(p.degraded)
        p.done({"token_ids": tokens, "text": text, "finish_reason": reason, "error": error,
                "degraded": p.degraded,
                "missing_experts": [list(x) for x in self.backend.missing()]
                if self.backend else [], "elapsed_s": time.monotonic() - p.t0})

    def _loop(self) -> None:
        eng = self.engine
        assert eng is not None
        model: Any = eng.model
        if self.engine_config.num_threads:  # torch's intra-op thread count is per thread
            torch.set_num_threads(self.engine_config.num_threads)
        while True:
            block = not eng.has_unfinished()
            try:
                while True:
                    p = self._queue.get(block, 0.05)
                    if p is None:
                        return
                    try:
                        eng.add_request(p.ids, SamplingParams(max_tokens=p.max_tokens,
                                                              temperature=0.0), p.rid)
                        self._pending[p.rid] = p
                    except ValueError as e:
                        self._finish(p, [], "error", str(e))
                    block = False
            except queue.Empty:
                pass
            now = time.monotonic()
            for p in list(self._pending.values()):
                if now - p.t0 > self.request_timeout_s:
                    eng.abort(p.rid)
                    self._finish(p, [], "error", f"timed out after {self.request_timeout_s} s")
            if not eng.has_unfinished():
                continue
            try:
                outs = eng.step()
            except Exception as e:  # noqa: BLE001 (fail the requests, keep serving)
                logger.exception("EP step failed")
                for p in list(self._pending.values()):
                    eng.abort(p.rid)
                    self._finish(p, [], "error", f"step failed: {e}")
                continue
            hit = self.rowmap.requests_of(model.degraded_rows())
            for rid in hit:
                p = self._pending.get(rid)
                if p is None:
                    continue
                if self.degraded_topk:
                    p.degraded = True
                    continue
                eng.abort(rid)
                missing = ", ".join(f"layer {a} expert {b}" for a, b in
                                    (self.backend.missing() if self.backend else []))
                self._finish(p, [], "error",
                             f"experts without a live replica: {missing or 'unknown'}")
            for o in outs:
                p = self._pending.get(o.request_id)
                if p is not None:
                    self._finish(p, list(o.output_token_ids), o.finish_reason.value, None)

    # -- RPC -------------------------------------------------------------------------
    def status(self, params: Any = None) -> dict[str, Any]:
        out: dict[str, Any] = {"model": self.model_spec, "counters": dict(self.counters),
                               "degraded_topk": self.degraded_topk}
        if self.backend is not None:
            out.update(self.backend.status())
        return out

    async def generate(self, params: dict[str, Any]) -> dict[str, Any]:
        if not isinstance(params, dict):
            raise RpcError(ErrorCode.INVALID_ARGUMENT, "params must be a map")
        ids = params.get("prompt_token_ids")
        if ids is None:
            text = params.get("prompt")
            tok = self.engine.tokenizer if self.engine else None
            if not isinstance(text, str) or tok is None:
                raise RpcError(ErrorCode.INVALID_ARGUMENT,
                               "need prompt_token_ids (list of int) or prompt (str)")
            ids = tok.encode(text)
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids):
            raise RpcError(ErrorCode.INVALID_ARGUMENT, "prompt_token_ids: non-empty ints")
        vocab = getattr(getattr(self.engine, "model", None), "config", None)
        vocab = getattr(vocab, "vocab_size", None)
        bad = [t for t in ids if t < 0 or (vocab is not None and t >= vocab)]
        if bad:
            raise RpcError(ErrorCode.INVALID_ARGUMENT,
                           f"prompt token ids out of the vocabulary [0, {vocab}): "
                           f"{', '.join(map(str, bad[:5]))}")
        max_tokens = params.get("max_tokens", 16)
        if not isinstance(max_tokens, int) or max_tokens <= 0:
            raise RpcError(ErrorCode.INVALID_ARGUMENT, "max_tokens must be a positive int")
        limit = self.engine_config.max_model_len
        if len(ids) + max_tokens > limit:
            raise RpcError(ErrorCode.INVALID_ARGUMENT,
                           f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds "
                           f"the model length limit ({limit})")
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[dict[str, Any]] = loop.create_future()

        def done(result: dict[str, Any]) -> None:
            loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(result))
        self.submit(ids, max_tokens, done)
        return await fut

    async def listen(self, host: str, port: int) -> RpcServer:
        """Bind the RPC API's port (``OSError`` if taken); ``serve(server=...)`` serves it.
        Call before ``start`` so a taken port fails before any rank is touched."""
        server = RpcServer(host, port)
        server.register("ep.generate", self.generate)
        server.register("ep.status", self.status)
        await server.start()
        return server

    async def serve(self, host: str = "127.0.0.1", port: int = 0, ready: Any = None,
                    server: RpcServer | None = None) -> None:
        """Serve the RPC API until cancelled; ``ready(port)`` once bound."""
        if server is None:
            server = await self.listen(host, port)
        if ready is not None:
            ready(server.port)
        try:
            await server.serve_forever()
        finally:
            await server.stop()
