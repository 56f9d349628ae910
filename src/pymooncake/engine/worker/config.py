"""A worker process's configuration (``WorkerConfig``, validated) and its KV sizing from the
model's bytes per token (``worker_sizing``), without loading the weights."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MAX_DECODE_STEP_INTERVAL_S = 10.0
"""Largest ``WorkerConfig.decode_step_interval_s`` accepted (s)."""


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """One worker process (flags of ``pymooncake prefill`` / ``pymooncake decode``)."""

    instance_id: str
    role: str
    """``prefill``, ``decode`` or ``colocated``."""
    conductor: str
    """``host:port`` of the Conductor's worker RPC endpoint."""
    metadata_url: str = "http://127.0.0.1:8080/metadata"
    """Transfer Engine metadata service (segments are published there)."""
    master: str | None = None
    """``host:port`` of the Store master (prefill workers; None = no global Store)."""
    host: str = "127.0.0.1"
    """This worker's address on the cluster's network: its RPC server, its Transfer Engine
    segment(s) and its Store client bind to it and publish it, so it must be one the other
    hosts can reach (not 0.0.0.0)."""
    port: int = 0
    """RPC port (0 = any free port)."""
    model: str = "tiny"
    num_kv_blocks: int | None = None
    """Paged KV cache blocks; None = from ``kv_memory_bytes``, else
    ``engine.config.DEFAULT_KV_CAPACITY_TOKENS`` tokens (``engine.config.size_kv``)."""
    kv_memory_bytes: int | None = None
    """Memory budget of the paged KV cache (bytes); used when ``num_kv_blocks`` is None."""
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None
    """Token budget of one engine step (decodes + prefill chunks). None: a colocated worker
    takes one prefill chunk per step (``EngineConfig.prefill_chunk_tokens``, 512), so a
    running decode batch waits for at most one chunk's compute between its tokens (with
    SmolLM2 on one core, 2048 prompt tokens in one step made every TBT ~6 s); prefill and
    decode roles keep ``EngineConfig``'s 2048 (a prefill worker computes one prompt at a
    time, a decode worker has no prompts). With ``prefill_batch`` 1, a prefill worker's chunk
    of one prompt is this budget too (not ``EngineConfig.prefill_chunk_tokens``): a prompt up
    to the budget is one step, with the fixed cost of one step (while its KV target is still
    on its way, its chunks are ``prefill.TARGET_WAIT_CHUNK_TOKENS``)."""
    max_model_len: int = 8192
    enable_prefix_caching: bool = True
    dtype: str = "float32"
    decode_step_tokens: int | None = None
    """``EngineConfig.decode_step_tokens``: a colocated worker's step budget while requests
    decode (None: ``max_num_batched_tokens`` always)."""
    decode_step_s: float | None = None
    """``EngineConfig.decode_step_s``: a colocated worker's predicted step time at most while
    requests decode (None: off)."""
    prefill_hold_s: float | None = None
    """``EngineConfig.prefill_hold_s``: while requests decode, a colocated worker's steps
    carry the decodes alone until a prompt has waited this long (None: off)."""
    decode_step_interval_s: float = 0.0
    """Decode role: while requests decode, start a step at most this often (s); a request
    whose KV arrives meanwhile joins the next step. 0 = off (each step starts as soon as
    the previous one is done). Why: with few requests decoding at once, every step streams
    all the weights for one or two tokens; holding steps to an interval that stays well
    inside the TBT objective lets more requests share each pass: the most effective
    throughput that still meets the latency SLOs, the Mooncake paper's goal (abstract).
    The cost is TBT: steps start at least this far apart, so tokens come about this
    interval or more apart (docs/benchmarks.md, "Issue 16, session 32"). ``serve`` and
    ``bench serving`` refuse an interval at or above their TBT SLO; the worker's admission
    counts it as the least TBT it can give (``DecodeWorker._prepare``)."""
    num_threads: int = 1
    """torch intra-op threads of the engine (``EngineConfig.num_threads``): 1 = one core per
    worker; a worker alone on several cores uses one per core."""
    global_segment_size_bytes: int | None = None
    """DRAM a prefill worker contributes to the Store; None = sized from the model's KV
    bytes per token (twice the paged cache)."""
    recv_buffer_bytes: int | None = None
    """Receive arena of a decode worker (P→D KV lands here); None = sized from the model's
    KV bytes per token (one ``max_model_len`` prompt or half the cache, whichever is
    larger, at most the cache)."""
    recv_wait_timeout_s: float = 20.0
    """Decode: how long a request queued for receive space waits *without any space being
    freed* before ``NO_RECV_SPACE``. While earlier requests keep freeing space the queue is
    moving and the wait goes on: with decode admission overlapped with the prefill queue,
    a burst's requests hold receive space from admission until their KV is in the paged
    cache, so the head of the queue can wait as long as the prefill queue is deep."""
    recv_wait_max: int = 256
    """Decode: requests queued for receive space at most."""
    load_report_interval_s: float = 0.1
    """How often the worker looks at its load and KV events (s): KV events and a changed
    load go to the Conductor at the next look."""
    load_heartbeat_s: float = 0.5
    """An unchanged load is sent again this often (s): the worker's heartbeat, well inside
    the Conductor's ``worker_timeout_s`` (3 s). An idle worker thus sends 2 reports a
    second instead of 10 (each one a round trip that wakes the worker's and the
    Conductor's event loops)."""
    register_timeout_s: float = 60.0
    """Exit (``WorkerFatal``) when the Conductor was not reachable this long after start."""
    layerwise_kv: bool = True
    """Prefill: write each layer's KV to the decode worker right after the layer's compute
    (overlapped); False = all layers in one batch after the prefill."""
    prefill_batch: int = 1
    """Prefill role: prompts computed together at most. 1 = one at a time in arrival order,
    the FCFS queue the Conductor's Algorithm 1 predicts (queue time = sum of the predicted
    prefill times ahead); larger values batch prompts (processor sharing: everyone in the
    batch finishes late, which raises the mean TTFT on compute-bound hardware)."""

    prefill_order: str = "shortest"
    """Prefill and colocated roles: which queued prompt is admitted next, ``shortest``
    (fewest tokens first, aged), ``fcfs``, or ``srpt`` (fewest tokens left first among
    waiting and running prompts) (``EngineConfig.waiting_order``)."""
    aging_tokens_per_s: float | None = None
    """``EngineConfig.aging_tokens_per_s`` (None: its default)."""
    startup_profile_tokens: int = 2048
    """Prefill and colocated roles: before registering, time prompts of up to this many
    tokens on the engine (``worker.profile.startup_profile``, ~3 s for SmolLM2-135M on two
    cores) and send the samples with ``WorkerInfo`` so the Conductor fits its prefill
    predictor for this machine at once; 0 = off."""

    def __post_init__(self) -> None:
        if self.role not in ("prefill", "decode", "colocated"):
            raise ValueError(f"role must be prefill, decode or colocated, got {self.role!r}")
        if not self.instance_id or "/" in self.instance_id:
            raise ValueError(f"instance_id must be non-empty without '/', got "
                             f"{self.instance_id!r}")
        if ":" not in self.conductor:
            raise ValueError(f"conductor must be host:port, got {self.conductor!r}")
        if self.load_report_interval_s <= 0:
            raise ValueError("load_report_interval_s must be > 0")
        if not self.load_heartbeat_s >= self.load_report_interval_s:
            raise ValueError(f"load_heartbeat_s ({self.load_heartbeat_s}) must be >= "
                             f"load_report_interval_s ({self.load_report_interval_s})")
        if not self.register_timeout_s > 0:
            raise ValueError(f"--register-timeout must be > 0 seconds, got "
                             f"{self.register_timeout_s}")
        if not self.recv_wait_timeout_s > 0 or self.recv_wait_max < 0:
            raise ValueError(f"recv_wait_timeout_s must be > 0 and recv_wait_max >= 0, got "
                             f"{self.recv_wait_timeout_s}, {self.recv_wait_max}")
        for name in ("num_kv_blocks", "kv_memory_bytes", "global_segment_size_bytes",
                     "recv_buffer_bytes"):
            v = getattr(self, name)
            if v is not None and v <= 0:
                raise ValueError(f"{name} must be > 0 (or unset: sized from the model), "
                                 f"got {v}")
        if not isinstance(self.startup_profile_tokens, int) or self.startup_profile_tokens < 0:
            raise ValueError(f"--startup-profile-tokens must be >= 0, got "
                             f"{self.startup_profile_tokens}")
        if self.prefill_batch < 1:
            raise ValueError(f"prefill_batch must be >= 1, got {self.prefill_batch}")
        if self.decode_step_tokens is not None and self.decode_step_tokens < 1:
            raise ValueError(f"--decode-step-tokens must be >= 1, got {self.decode_step_tokens}")
        if not 0 <= self.decode_step_interval_s <= MAX_DECODE_STEP_INTERVAL_S:
            raise ValueError(f"--decode-step-interval-s must be in "
                             f"[0, {MAX_DECODE_STEP_INTERVAL_S:g}] seconds, got "
                             f"{self.decode_step_interval_s}")
        if self.decode_step_interval_s and self.role != "decode":
            raise ValueError(f"--decode-step-interval-s applies to decode workers only, not to a "
                             f"{self.role} worker")
        if not isinstance(self.num_threads, int) or self.num_threads < 1:
            raise ValueError(f"--threads must be >= 1, got {self.num_threads}")


def engine_config(c: WorkerConfig, role: str) -> Any:
    """The ``EngineConfig`` of a ``role`` worker with config ``c``: its KV blocks (given,
    else from ``kv_memory_bytes``, else ``DEFAULT_KV_CAPACITY_TOKENS``), batch and step
    budget (``max_num_batched_tokens``: see there), policies and dtype."""
    from pymooncake.engine.config import DEFAULT_KV_CAPACITY_TOKENS, EngineConfig
    max_seqs = min(c.max_num_seqs, c.prefill_batch) if role == "prefill" else c.max_num_seqs
    blocks = c.num_kv_blocks
    if blocks is None:
        if c.kv_memory_bytes is not None:
            blocks = max(1, c.kv_memory_bytes // (model_kv_bytes_per_token(
                c.model, c.dtype) * c.block_size))
        else:
            blocks = -(-max(DEFAULT_KV_CAPACITY_TOKENS, c.max_model_len) // c.block_size)
    budget = c.max_num_batched_tokens
    if budget is None and role == "colocated":
        budget = EngineConfig().prefill_chunk_tokens
    # a prefill worker of one prompt at a time (prefill_batch 1) has no decodes to protect
    # and no other prompt to let in between chunks: a chunk shorter than its step budget
    # only adds steps, each with its fixed cost (the per-layer hooks, a new oneDNN shape
    # for the tail). With prefill_batch > 1 the prompts share steps in 512-token chunks.
    chunk = ({"prefill_chunk_tokens": budget or EngineConfig().max_num_batched_tokens}
             if role == "prefill" and c.prefill_batch == 1 else {})
    return EngineConfig(block_size=c.block_size, num_kv_blocks=blocks,
                        max_num_seqs=max_seqs, max_model_len=c.max_model_len,
                        waiting_order=c.prefill_order if role != "decode" else "fcfs",
                        decode_step_tokens=c.decode_step_tokens,
                        decode_step_s=c.decode_step_s, prefill_hold_s=c.prefill_hold_s,
                        **({} if c.aging_tokens_per_s is None
                           else {"aging_tokens_per_s": c.aging_tokens_per_s}),
                        enable_prefix_caching=c.enable_prefix_caching, role=role,
                        dtype=c.dtype, num_threads=c.num_threads,
                        **({} if budget is None else {"max_num_batched_tokens": budget}),
                        **chunk)


STAGING_MIN_TOKENS = 2048
STAGING_MAX_TOKENS = 8192
STAGING_BYTES = 32 << 20


def staging_blocks(block_size: int, block_nbytes: int) -> int:
    """Block slots of a prefill worker's Store staging buffer: ``STAGING_MIN_TOKENS`` of
    KV (a 2k-token prefix is read from the Store layer group by layer group; at least 64
    blocks), more up to ``STAGING_MAX_TOKENS`` while they fit in ``STAGING_BYTES``, for the
    puts of a burst of prompts (they take at most half; the rest are copied twice: issue
    16). Tiny model: 512 blocks, 16 MiB; SmolLM2-135M: 128 blocks."""
    lo = max(64, -(-STAGING_MIN_TOKENS // block_size))
    hi = -(-STAGING_MAX_TOKENS // block_size)
    return max(lo, min(hi, STAGING_BYTES // block_nbytes))


def worker_sizing(c: WorkerConfig, kv_bytes_per_token: int, num_kv_blocks: int) -> Any:
    """The worker's ``KVSizing`` for a model of ``kv_bytes_per_token`` (pure)."""
    from pymooncake.engine.config import size_kv
    return size_kv(kv_bytes_per_token, c.block_size, c.max_model_len,
                   num_kv_blocks=num_kv_blocks, recv_buffer_bytes=c.recv_buffer_bytes,
                   global_segment_size_bytes=c.global_segment_size_bytes)


def model_kv_bytes_per_token(model: str, dtype: str) -> int:
    """KV bytes per token of ``model`` (a ``--model`` spec) in ``dtype``, read from its
    configuration without loading the weights."""
    from pymooncake.engine.config import kv_bytes_per_token
    from pymooncake.engine.model.registry import resolve_model
    src = resolve_model(model)
    if src.kind == "tiny":
        from pymooncake.engine.model.tiny import tiny_config
        mc = tiny_config()
    elif src.kind == "hf":
        from pymooncake.engine.model.loader import read_model_config
        mc = read_model_config(src.path)  # type: ignore[arg-type]
    else:
        from pymooncake.engine.model.gguf import gguf_model_config, read_gguf
        mc = gguf_model_config(read_gguf(src.path))  # type: ignore[arg-type]
    elem = {"float32": 4, "float64": 8}.get(dtype, 2)
    return kv_bytes_per_token(mc.num_layers, mc.num_kv_heads, mc.head_dim, elem)
