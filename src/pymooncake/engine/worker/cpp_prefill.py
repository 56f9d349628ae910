"""CPP prefill instance (``pymooncake prefill --cpp-stages N``): a chunked-pipeline prefill
group as one prefill instance of the live cluster (FAST'25 §5.1, docs/cpp.md).

The process is a ``PrefillWorker`` (its RPC methods, Transfer Engine, Store client, KV
sender, prefix cache and load reports) that also owns a ``CppGroup`` of N stage processes.
For a ``PrefillTask``:

1. the prompt goes through the pipeline (``CppGroup.prefill``: chunks flow through the
   stages, each holding a contiguous slice of the layers), one prompt at a time (the FCFS
   queue the Conductor predicts);
2. the stages' KV is read back (``CppGroup.export_kv``) and its full blocks imported into
   this process's paged cache (``Engine.import_blocks``): they become prefix-cache hits;
3. the task then takes the single worker's path unchanged: the engine computes only the
   tail after the last full block (at least one token, CASES BUG-09) and samples the first
   token with the request's own sampling; ``_finish`` ships the prompt's blocks to the
   decode worker (``KVSender``, one batch; ``SetTarget`` as usual) and puts the blocks the
   group computed into the Store.

KV is exported after the pipeline finishes, not streamed per layer while the stages write
it (docs/cpp.md, "Not done yet"). A prompt whose uncached part (after this process's own
prefix cache) is shorter than ``min_prompt_tokens`` skips the pipeline: this process's
engine is a whole single worker. The instance registers its cost model
(``WorkerInfo.cpp_json``) so that the Conductor's ``policy.cpp_placement`` sends it only
the prompts where CPP pays. Its windows: ``cpp_queue``, ``cpp_prefill`` (pipeline),
``cpp_kv_import`` and ``cpp_tail`` (the local tail) instead of ``queue``/``prefill``, so the
Conductor's online single-worker profile does not learn from them.

When a stage fails (docs/cpp.md "When a stage fails"): ``engine.cpp.health.StageWatch``
checks every second that each stage is alive and answers a ping within 2 s (stalled: two
missed in a row). While a stage
fails, long prompts skip the pipeline and are computed by this process's engine; a prompt
already in the pipeline is abandoned as soon as the watch (or the pipeline itself) reports
the failure and is computed here from the start, with one warning naming the group's stage
(index, address, pid). The load reports carry the watch's state
(``WorkerLoad.cpp_state_json``): the Conductor then places on this instance as on a single
worker and shows the state in ``/health``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import time
from dataclasses import dataclass
from typing import Any

import msgspec

from pymooncake.engine.worker.prefill import PrefillWorker, Stages
from pymooncake.obs import metrics
from pymooncake.obs.logging import init_logger
from pymooncake.rpc import RpcError
from pymooncake.rpc.messages import (
    KVTarget,
    PrefillResult,
    PrefillTask,
    SetTarget,
    WorkerInfo,
    WorkerLoad,
)

logger = init_logger(__name__)

CPP_PREFILLS = metrics.counter("pymooncake_worker_cpp_prefills_total",
                               "prompts prefilled through this instance's CPP pipeline")
CPP_FALLBACKS = metrics.counter("pymooncake_worker_cpp_fallbacks_total",
                                "long prompts computed by this CPP instance's own engine "
                                "because a stage of its group failed")


class _GroupFailed(Exception):
    """The pipeline cannot finish a prompt (the message names the stage)."""


@dataclass(frozen=True, slots=True)
class CppWorkerConfig:
    """The group of a CPP prefill instance (flags ``--cpp-*`` of ``pymooncake prefill``)."""

    num_stages: int
    """Stage processes (>= 2; at most the model's layers)."""
    min_prompt_tokens: int
    """Uncached prompt tokens from which the pipeline is used: the measured break-even
    (``conductor.policy.cpp.CPP_BREAK_EVEN_TOKENS`` unless ``--cpp-min-tokens``)."""
    chunk_tokens: int = 512
    edge_tokens: int = 128
    hop_s: float = 0.003
    """One chunk's hidden states to the next stage (s; ``bench cpp``, docs/benchmarks.md)."""
    overhead_s: float = 0.002
    """Dispatch to stage 0 and the first token back (s)."""
    cores: tuple[int, ...] | None = None
    """One core per stage (``CppGroup``); None: not pinned."""
    watch_interval_s: float = 1.0
    """Seconds between two health checks of the stages (``StageWatch``)."""
    watch_deadline_s: float = 2.0
    """Seconds a stage has to answer a ping; two missed in a row: stalled."""

    def __post_init__(self) -> None:
        if self.num_stages < 2:
            raise ValueError(f"--cpp-stages must be >= 2 (a pipeline), got {self.num_stages}")
        for flag, value, low in (("--cpp-chunk-tokens", self.chunk_tokens, 1),
                                 ("--cpp-edge-tokens", self.edge_tokens, 0),
                                 ("--cpp-min-tokens", self.min_prompt_tokens, 0)):
            if value < low:
                raise ValueError(f"{flag} must be >= {low}, got {value}")
        if self.cores is not None and len(self.cores) != self.num_stages:
            raise ValueError(f"--cpp-cores names {len(self.cores)} cores for "
                             f"{self.num_stages} stages")

    def cost_model_wire(self) -> dict[str, Any]:
        """``conductor.policy.cpp_placement.cpp_model_to_wire``'s dict (the Conductor's
        ``CppCostModel`` fields; the engine does not import the Conductor)."""
        return {"num_stages": self.num_stages, "chunk_tokens": self.chunk_tokens,
                "edge_tokens": self.edge_tokens, "hop_s": self.hop_s,
                "overhead_s": self.overhead_s, "min_prompt_tokens": self.min_prompt_tokens}


@dataclass(frozen=True, slots=True)
class _CppRun:
    cached_tokens: int
    """Prompt tokens this process's prefix cache held before the pipeline ran."""
    start_s: float
    """``time.monotonic`` at arrival (the prefill time reported covers the pipeline)."""
    windows: Stages


class CppPrefillWorker(PrefillWorker):
    """See module docstring. ``config.layerwise_kv`` is off: the KV is sent in one batch
    from the prefix cache (the tail's layer-wise writes would miss the imported blocks)."""

    def __init__(self, config: Any, cpp: CppWorkerConfig) -> None:
        super().__init__(dataclasses.replace(config, layerwise_kv=False, prefill_order="fcfs",
                                             startup_profile_tokens=0))
        self.cpp = cpp
        self.group: Any = None
        self.watch: Any = None
        """``engine.cpp.health.StageWatch`` of ``group`` (started with it)."""
        self._runs: dict[str, _CppRun] = {}
        self._before_engine: dict[str, KVTarget | None] = {}
        """Requests not yet handed to the engine (pipeline running) → their ``KVTarget``
        once a ``SetTarget`` brought it."""
        self._pipeline = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="cpp")
        """One prompt at a time through the group, in arrival order."""

    def start_resources(self) -> None:
        from pymooncake.engine.cpp.group import CppGroup
        super().start_resources()
        c, g = self.config, self.cpp
        self.group = CppGroup(c.model, g.num_stages, g.cores,
                              num_blocks=-(-c.max_model_len // c.block_size) + 2,
                              block_size=c.block_size, chunk_tokens=g.chunk_tokens,
                              edge_tokens=g.edge_tokens, dtype=c.dtype)
        self.group.start()      # CppError (a RuntimeError) when a stage cannot start
        from pymooncake.engine.cpp.health import StageWatch
        self.watch = StageWatch(self.group, g.watch_interval_s, g.watch_deadline_s).start()
        logger.info("CPP instance %s: %d stages, layers %s", c.instance_id, g.num_stages,
                    self.group.ranges)

    def close_resources(self) -> None:
        self._pipeline.shutdown(wait=False, cancel_futures=True)
        if self.watch is not None:
            self.watch.close()
        if self.group is not None:
            self.group.close()
        super().close_resources()

    def worker_info(self) -> WorkerInfo:
        return msgspec.structs.replace(super().worker_info(),
                                       cpp_json=json.dumps(self.cpp.cost_model_wire()))

    def load(self) -> WorkerLoad:
        """The single worker's load report with the group's health (``StageWatch.state``)."""
        ld = super().load()
        if self.watch is None:
            return ld
        return msgspec.structs.replace(ld, cpp_state_json=json.dumps(self.watch.state()))

    def _group_ok(self) -> bool:
        return self.watch is None or self.watch.healthy

    # -- one prompt ---------------------------------------------------------------------
    def _local_prefix_tokens(self, ids: list[int]) -> int:  # engine thread
        from pymooncake.identity import block_keys
        e = self.engine
        bs = e.config.block_size
        n = 0
        for i, k in enumerate(block_keys(ids, e.namespace)):
            if e.pool.get_cached_block(k, tuple(ids[i * bs:(i + 1) * bs])) is None:
                break
            n += 1
        return n * bs

    def _run_pipeline(self, rid: str, ids: list[int]) -> tuple[list[Any], float, float]:
        """Pipeline thread: prefill ``ids`` through the group, read its KV back; (exported
        blocks, pipeline start, pipeline end) in unix s. Raises ``RpcError``."""
        from pymooncake.engine.cpp.group import CppError, exported_blocks
        t0 = time.time()
        try:
            self.group.prefill(ids, rid)
            t1 = time.time()
            kv = self.group.export_kv(rid)
        except CppError as e:
            raise RpcError("PREFILL_FAILED", str(e)) from None
        finally:
            try:
                self.group.release(rid)
            except Exception as e:  # noqa: BLE001 - a stage that failed is reported above
                logger.warning("CPP release %s: %s", rid, e)
        return exported_blocks(kv, ids, self.engine.namespace), t0, t1

    async def _prefill(self, task: PrefillTask) -> PrefillResult:
        rid = task.request_id
        if rid in self._runs or rid in self._before_engine:
            raise RpcError("DUPLICATE", f"request {rid} is already prefilling")
        self._before_engine[rid] = None
        try:
            arrived, start = time.time(), time.monotonic()
            ids = list(task.prompt_token_ids)
            cached = await self.on_engine(lambda: self._local_prefix_tokens(ids))
            run = None
            if len(ids) - cached >= max(self.cpp.min_prompt_tokens, 1):
                if not self._group_ok():
                    CPP_FALLBACKS.inc()
                    logger.info("CPP %s: %d-token prompt %s computed here (group "
                                "unhealthy: %s)", self.config.instance_id, len(ids), rid,
                                self.watch.reason)
                else:
                    try:
                        run = await self._through_pipeline(rid, ids, cached, arrived, start)
                    except _GroupFailed as e:
                        CPP_FALLBACKS.inc()
                        logger.warning("CPP %s: prompt %s left the pipeline and is computed "
                                       "here: %s", self.config.instance_id, rid, e)
        except BaseException:
            self._before_engine.pop(rid, None)
            raise
        target = self._before_engine.pop(rid)
        if target is not None:      # its SetTarget came while the pipeline ran
            task = msgspec.structs.replace(task, target=target)
        if run is None:             # short: this process's engine is a single worker
            return await super()._prefill(task)
        self._runs[rid] = run
        try:        # (super queues the request on the engine thread before it awaits)
            return await super()._prefill(task)
        finally:
            self._runs.pop(rid, None)

    async def _through_pipeline(self, rid: str, ids: list[int], cached: int,
                                arrived: float, start: float) -> _CppRun:
        loop = asyncio.get_running_loop()
        fut = loop.run_in_executor(self._pipeline, self._run_pipeline, rid, ids)
        while True:     # abandon the pipeline as soon as the watch reports a failed stage
            done, _ = await asyncio.wait({fut}, timeout=0.2)
            if done:
                break
            if not self._group_ok():
                fut.add_done_callback(lambda f: f.cancelled() or f.exception())
                raise _GroupFailed(self.watch.reason)
        try:
            blocks, t0, t1 = fut.result()
        except RpcError as e:
            raise _GroupFailed(e.message) from None
        imported = await self.on_engine(lambda: self.engine.import_blocks(blocks))
        if imported < len(blocks) - cached // self.config.block_size:
            logger.warning("CPP %s: %d of %d blocks fit the paged cache; the rest is "
                           "recomputed here", rid, imported, len(blocks))
        CPP_PREFILLS.inc()
        return _CppRun(cached, start, (("cpp_queue", arrived, t0), ("cpp_prefill", t0, t1),
                                       ("cpp_kv_import", t1, time.time())))

    async def _set_target(self, msg: SetTarget) -> bool:
        """A ``SetTarget`` that comes while the prompt is still in the pipeline (not yet
        on the engine) is kept and handed to the engine with the request."""
        if msg.request_id in self._before_engine:
            if self._before_engine[msg.request_id] is not None:
                return False
            self._before_engine[msg.request_id] = msg.target
            return True
        return await super()._set_target(msg)

    def _finish(self, p: Any, out: Any, layerwise: Any, stages: Stages = ()) -> PrefillResult:
        """Engine thread: the single worker's ``_finish`` with the group's work counted as
        this prefill's: computed tokens and Store puts from the blocks cached before the
        pipeline ran, the prefill time from arrival, the pipeline's windows."""
        run = self._runs.get(p.task.request_id)
        if run is None:
            return super()._finish(p, out, layerwise, stages)
        p.start_s = run.start_s
        # the group read nothing from the Store: its hint proves no eviction here
        p.task = msgspec.structs.replace(p.task, store_hint_blocks=0)
        out = dataclasses.replace(out, num_cached_tokens=min(run.cached_tokens,
                                                             out.num_cached_tokens))
        tail = tuple(("cpp_tail" if n == "prefill" else n, a, b)
                     for n, a, b in stages if n != "queue")
        return super()._finish(p, out, layerwise, run.windows + tail)
