"""What every engine worker process shares: the engine thread, the RPC server, and the
registration, load reports and KV events it sends to the Conductor.

The ``Engine`` is not thread-safe, so one thread owns it: it runs queued commands (closures
from the RPC handlers) and ``engine.step()`` in a loop. The asyncio side awaits commands
through ``on_engine``. After each step the subclass's ``after_step`` sees the finished
outputs (still on the engine thread). DESIGN.md §2: the worker is the I/O shell, the engine
and its scheduler the pure-ish core.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any, TypeVar

from pymooncake.engine.worker.config import (  # noqa: F401 (re-exported)
    WorkerConfig,
    engine_config,
    model_kv_bytes_per_token,
    worker_sizing,
)
from pymooncake.engine.worker.kv_events import KVEventLog
from pymooncake.engine.worker.poster import (
    LoopPoster,
    set_exception_if_pending,
    set_result_if_pending,
)
from pymooncake.obs import metrics
from pymooncake.obs.logging import init_logger
from pymooncake.rpc import RpcClient, RpcError, RpcServer
from pymooncake.rpc.messages import KVEvents, SamplingOptions, WorkerInfo, WorkerLoad

logger = init_logger(__name__)
T = TypeVar("T")

PREFILL_TOKENS = metrics.counter("pymooncake_worker_prefill_tokens_total",
                                 "prompt tokens computed (not reused) by this worker")


class WorkerFatal(RuntimeError):
    """The worker cannot serve in this cluster (refused by the Conductor, or never reached
    it); the process exits with this message."""


_RETRYABLE = ("TIMEOUT", "CONNECTION", "INTERNAL")
"""RpcError codes of a Conductor that is down or slow (retried); any other code is its
answer, and a refusal is fatal."""
IDLE_WAIT_S = 1.0
"""Longest an idle engine thread sleeps on its command queue (s): every command (RPC
handlers' ``on_engine``, settled writes, the stop) wakes it at once; this is a safety net,
not a poll (it was a 20 ms poll: 50 wake-ups a second per idle worker)."""
SLOW_SHUTDOWN_S = 2.0
"""A shutdown longer than this (s) is logged with its phases."""


def to_sampling_params(s: SamplingOptions, max_tokens: int | None = None) -> Any:
    """The engine's ``SamplingParams`` for a request's ``SamplingOptions``."""
    from pymooncake.engine.sampling import SamplingParams
    return SamplingParams(max_tokens=max_tokens if max_tokens is not None else s.max_tokens,
                          temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                          seed=s.seed, stop_token_ids=tuple(s.stop_token_ids), stop=tuple(s.stop),
                          ignore_eos=s.ignore_eos, logprobs=s.logprobs)


class EngineWorker:
    """Base of the prefill and decode workers (see module docstring)."""

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.engine: Any = None
        self.server = RpcServer(config.host, config.port)
        self.loop: asyncio.AbstractEventLoop | None = None
        self._cmds: queue.Queue[Callable[[], None]] = queue.Queue()
        self._poster: LoopPoster | None = None  # post(), from serve() on
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._step_began = float("-inf")
        """``time.perf_counter()`` when the last engine step began (decode pacing)."""
        self.kv_events = KVEventLog()
        self.num_prefill_tokens_total = 0
        self._conductor: RpcClient | None = None
        self._registered = False
        self._on_registered: Callable[[], None] | None = None
        """Called once, after the first registration the Conductor accepted (``serve``)."""
        self._warned_s = -1e9
        self.sizing: Any = None
        """``engine.config.KVSizing`` of this worker (set by ``build_engine``)."""
        self.prefill_profile: list[tuple[int, int, float]] = []
        """``(prompt tokens, reused tokens, seconds)`` timed at start (``build_engine``)."""

    # -- engine ---------------------------------------------------------------------------
    def build_engine(self, role: str, hooks: tuple = (), kv_source: Any = None) -> Any:
        from pymooncake.engine import Engine
        c = self.config
        cfg = engine_config(c, role)
        engine = Engine.from_model_name(c.model, cfg, hooks=hooks, kv_source=kv_source)
        self.sizing = worker_sizing(c, engine.kv.block_nbytes // c.block_size,
                                    cfg.num_kv_blocks)
        logger.info("%s %s: %s", role, c.instance_id, self.sizing.describe(role))
        if role != "decode" and c.startup_profile_tokens:
            self.prefill_profile = self._startup_profile(engine)
        return engine

    def _startup_profile(self, engine: Any) -> list[tuple[int, int, float]]:
        """``worker.profile.startup_profile`` of ``engine``; a failure is logged and gives
        no samples (the Conductor then keeps its defaults): it never stops the worker."""
        from pymooncake.engine.worker.profile import startup_profile
        t0 = time.perf_counter()
        try:
            samples = startup_profile(engine, self.config.startup_profile_tokens)
        except Exception:  # noqa: BLE001 - a profile is an optimisation, serving is not
            logger.exception("startup prefill profile failed; the Conductor keeps its "
                             "prefill estimator")
            return []
        logger.info("startup prefill profile in %.1f s: %s", time.perf_counter() - t0,
                    ", ".join(f"{n} tok {s:.3f} s" for n, _, s in samples))
        return samples

    def _engine_thread(self, started: asyncio.Future[None], go: threading.Event) -> None:
        """Build the engine (``start_resources``) and then run it, both on this one thread.

        Every torch op of the engine runs here, so the process keeps a single OpenMP thread
        pool. A pool left by ops on another thread (the model load in an executor thread,
        as before) made libgomp count more OpenMP threads than CPUs and throttle its
        spin-wait: the workers then slept between parallel regions and every region woke
        them, ~300 wake-ups per step (a 3-request decode step of SmolLM2 on 2 threads
        took 65 ms instead of 53; measured in one process, the engine run on a thread
        other than the one that built it, against the same thread)."""
        assert self.loop is not None
        loop = self.loop
        try:
            from pymooncake.engine.malloc_tuning import tune_malloc
            tune_malloc()  # before the engine's first allocations (the model, the KV cache)
            self.start_resources()
        except BaseException as e:  # noqa: BLE001 - raised by serve()
            loop.call_soon_threadsafe(set_exception_if_pending, started, e)
            return
        loop.call_soon_threadsafe(set_result_if_pending, started, None)
        go.wait()
        if not self._stop.is_set():
            self._engine_main()

    def _engine_main(self) -> None:
        while not self._stop.is_set():
            busy = self.engine.has_unfinished()
            if not busy:
                self.on_idle()
            try:
                cmd = self._cmds.get(timeout=0 if busy else IDLE_WAIT_S)
            except queue.Empty:
                cmd = None
            while cmd is not None:
                cmd()
                try:
                    cmd = self._cmds.get_nowait()
                except queue.Empty:
                    cmd = None
            if busy and self.config.decode_step_interval_s:
                self._hold_step(self._step_began + self.config.decode_step_interval_s)
                if self._stop.is_set():
                    break
            if self.engine.has_unfinished():
                batch = len(self.engine.scheduler.running)
                t0 = self._step_began = time.perf_counter()
                try:
                    outs = self.engine.step()
                    self.on_step_timed(batch, time.perf_counter() - t0)
                except Exception:  # noqa: BLE001 - keep serving; fail what was running
                    logger.exception("engine step failed")
                    outs = []
                    for rid in list(self.engine.requests):
                        self.engine.abort(rid)
                        self.on_failed(rid, "engine step failed")
                self.after_step(outs)
            self._collect_kv_events()

    def _hold_step(self, until: float) -> None:
        """Decode pacing (``WorkerConfig.decode_step_interval_s``): wait until ``until``
        (``time.perf_counter()`` seconds) before the next step, running commands as they
        come, so a request that arrives meanwhile joins that step. Returns early on stop
        and once a command left the engine with nothing to run (the idle path then takes
        over, and the next request's first step is not held)."""
        while not self._stop.is_set() and self.engine.has_unfinished():
            wait = until - time.perf_counter()
            if wait <= 0:
                return
            try:
                cmd = self._cmds.get(timeout=wait)
            except queue.Empty:
                continue
            cmd()

    def on_engine(self, fn: Callable[[], T]) -> asyncio.Future[T]:
        """Run ``fn`` on the engine thread; the future has its result or exception."""
        assert self.loop is not None
        loop = self.loop
        fut: asyncio.Future[T] = loop.create_future()

        def run() -> None:
            try:   # through post: in order with the posts around it
                r = fn()
            except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine
                self.post(functools.partial(set_exception_if_pending, fut, e))
            else:
                self.post(functools.partial(set_result_if_pending, fut, r))

        self._cmds.put(run)
        return fut

    def post(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the event loop (from the engine thread), in order; posts made
        before the loop gets to them share one wake-up (``LoopPoster``)."""
        if self._poster is None:  # serve() makes it; a caller that set .loop itself
            assert self.loop is not None
            self._poster = LoopPoster(self.loop)
        self._poster.post(fn)

    def after_step(self, outputs: list[Any]) -> None:  # engine thread
        raise NotImplementedError

    def on_step_timed(self, batch_size: int, seconds: float) -> None:  # engine thread
        """One step took ``seconds`` with ``batch_size`` requests running before it."""
        return None

    def on_failed(self, request_id: str, reason: str) -> None:  # engine thread
        return None

    def on_idle(self) -> None:  # engine thread
        """The engine has nothing to compute (called on every idle turn of its loop)."""
        return None

    def _collect_kv_events(self) -> None:
        events = self.engine.pool.take_events()
        if events and self.config.role == "prefill":
            self.kv_events.add_engine(events)

    def add_store_keys(self, keys: list[str]) -> None:
        self.kv_events.add_store(keys)

    def drop_store_keys(self, keys: list[str]) -> None:
        """Keys found missing from the Store (evicted): reported as ``store`` removals."""
        self.kv_events.drop_store(keys)

    # -- conductor link -------------------------------------------------------------------
    def worker_info(self) -> WorkerInfo:
        ns = asdict(self.engine.namespace)
        return WorkerInfo(instance_id=self.config.instance_id, role=self.config.role,
                          host=self.config.host, rpc_port=self.server.port,
                          namespace_json=json.dumps(ns), block_size=self.config.block_size,
                          kv_capacity_tokens=self.engine.config.kv_capacity_tokens,
                          max_batch_size=self.engine.config.max_num_seqs, pid=os.getpid(),
                          prefill_order=self.engine.config.waiting_order,
                          max_model_len=self.engine.config.max_model_len,
                          prefill_profile_json=json.dumps(self.prefill_profile)
                          if self.prefill_profile else "")

    def load(self) -> WorkerLoad:
        e = self.engine
        return WorkerLoad(self.config.instance_id, len(e.scheduler.running),
                          len(e.scheduler.waiting), e.pool.num_free_blocks,
                          e.config.num_kv_blocks, self.num_prefill_tokens_total)

    async def _report_loop(self) -> None:
        """Register, then every ``load_report_interval_s`` send the KV events and a changed
        load (an unchanged one every ``load_heartbeat_s``, as the heartbeat).
        Raises ``WorkerFatal`` when the Conductor refuses the worker (e.g. a different cache
        namespace) or was not reachable for ``register_timeout_s`` since the start."""
        host, port = self.config.conductor.rsplit(":", 1)
        self._conductor = RpcClient(host, int(port), timeout_s=5.0, connect_timeout_s=2.0)
        c = self._conductor
        info = self.worker_info()
        started = time.monotonic()
        ever_registered = False
        sent: tuple[WorkerLoad | None, float] = (None, 0.0)  # the last load sent, when
        while True:
            try:
                if not self._registered:
                    await self._register(c, info, started, ever_registered)
                    if not ever_registered and self._on_registered is not None:
                        self._on_registered()
                    self._registered = ever_registered = True
                    sent = (None, 0.0)
                stored, removed, sstored, sremoved = self.kv_events.take()
                if stored or removed:
                    await c.notify("kv_events", KVEvents(self.config.instance_id,
                                                         tuple(stored), tuple(removed)))
                if sstored or sremoved:
                    await c.notify("kv_events", KVEvents("store", tuple(sstored),
                                                         tuple(sremoved)))
                load, now = self.load(), time.monotonic()
                if load != sent[0] or now - sent[1] >= self.config.load_heartbeat_s:
                    sent = (load, now)
                    if not await c.call("worker_load", load):
                        self._registered = False  # the Conductor forgot it: register
            except RpcError as e:
                if self._registered:
                    logger.warning("conductor unreachable: %s", e)
                self._registered = False
            await asyncio.sleep(self.config.load_report_interval_s)

    async def _register(self, c: RpcClient, info: WorkerInfo, started_s: float,
                        ever_registered: bool) -> None:
        """One registration attempt; a (re)registered worker then reports its whole prefix
        cache again. Raises ``RpcError`` to be retried, ``WorkerFatal`` for a refusal or
        when a first registration has not succeeded within ``register_timeout_s``."""
        try:
            await c.call("register_worker", info)
        except RpcError as e:
            if e.code not in _RETRYABLE:
                raise WorkerFatal(f"the Conductor at {self.config.conductor} refused this "
                                  f"worker: {e.message}") from None
            waited = time.monotonic() - started_s
            if not ever_registered and waited > self.config.register_timeout_s:
                raise WorkerFatal(f"the Conductor at {self.config.conductor} was not "
                                  f"reachable for {waited:.0f} s: {e.message}") from None
            if time.monotonic() - self._warned_s > 10.0:
                self._warned_s = time.monotonic()
                logger.warning("conductor %s unreachable (%s); retrying",
                               self.config.conductor, e.message)
            raise
        keys = await self.on_engine(lambda: list(self.engine.pool.cached_keys()))
        if self.config.role == "prefill":
            self.kv_events.resend_stored(keys)

    def register_methods(self) -> None:
        raise NotImplementedError

    def start_resources(self) -> None:
        """Build the engine and data-path resources (called before serving)."""
        raise NotImplementedError

    def close_resources(self) -> None:
        return None

    async def serve(self, ready: Callable[[dict[str, Any]], None] | None = None) -> None:
        """Start everything, serve until cancelled; ``ready`` gets the readiness event once
        the Conductor has accepted the worker's registration. Raises ``WorkerFatal`` when
        the worker cannot join the cluster."""
        self.loop = asyncio.get_running_loop()
        self._poster = LoopPoster(self.loop)
        started: asyncio.Future[None] = self.loop.create_future()
        go = threading.Event()
        self._thread = threading.Thread(target=self._engine_thread, args=(started, go),
                                        daemon=True, name=f"engine-{self.config.instance_id}")
        self._thread.start()
        try:
            await started
            self.register_methods()
            self.server.register("ping", lambda _p: "pong")
            await self.server.start()
        except BaseException:
            self._stop.set()
            go.set()
            raise
        go.set()
        if ready is not None:   # once the Conductor has accepted it, not before (a refused
            # worker must not look ready to a script watching for the line)
            self._on_registered = lambda: ready({
                "event": "ready", "instance_id": self.config.instance_id,
                "role": self.config.role, "rpc_port": self.server.port, "pid": os.getpid(),
                "kv_sizing": self.sizing.describe(self.config.role)})
        reporter = asyncio.ensure_future(self._report_loop())
        try:
            await reporter          # runs until cancelled; raises WorkerFatal
        finally:
            await self._shut_down(reporter)

    async def _shut_down(self, reporter: asyncio.Future[None]) -> None:
        """Stop reporting, serving and the engine thread, then free the resources; a
        shutdown slower than ``SLOW_SHUTDOWN_S`` is logged with each phase's seconds."""
        t = [time.monotonic()]
        reporter.cancel()
        with contextlib.suppress(BaseException):
            await reporter
        self._stop.set()
        self._cmds.put(lambda: None)    # wakes an idle engine thread to see the stop
        if self._conductor is not None:
            await self._conductor.close()
        await self.server.stop()
        t.append(time.monotonic())
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 5.0)
        t.append(time.monotonic())
        self.close_resources()
        t.append(time.monotonic())
        if t[-1] - t[0] > SLOW_SHUTDOWN_S:
            logger.warning("%s: shutdown took %.1f s (RPC %.1f, engine thread %.1f, "
                           "resources %.1f)", self.config.instance_id, t[3] - t[0],
                           t[1] - t[0], t[2] - t[1], t[3] - t[2])
