"""Messages that cross two top-level packages (api ↔ conductor ↔ engine workers).

Every one is a ``rpc.codec.Message`` (a frozen ``msgspec.Struct``): in-process it is passed
as it is; on the wire it is a map of its fields, decoded by the server straight from the
frame with every field's type checked (a prompt's token ids, a step's token frames: one
compiled pass, not a Python loop per item) and ``__post_init__`` run. A copy with other
field values is ``msgspec.structs.replace(msg, field=value)``.
"""

from __future__ import annotations

from pymooncake.rpc.codec import Message


class SamplingOptions(Message):
    """How one request samples and when it stops (OpenAI request fields, validated)."""

    max_tokens: int
    """Generated tokens at most (≥ 1); finish reason ``length`` when reached."""
    temperature: float = 1.0
    """0 = greedy; OpenAI's default is 1."""
    top_p: float = 1.0
    top_k: int = 0
    """0 = off (an extension, as in vLLM)."""
    seed: int | None = None
    stop: tuple[str, ...] = ()
    """Stop strings; the matched string is not part of the output (OpenAI semantics)."""
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")


class GenerateRequest(Message):
    """One request as the front door hands it to the Conductor: token ids, not text."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingOptions
    priority: int = 0
    """Lower is more important (vLLM's convention); > 0 is sheddable under overload."""
    arrival_time_s: float = 0.0
    """Monotonic arrival time at the front door (s), for TTFT and queue timeouts."""
    tokenize_s: float = 0.0
    """Seconds the front door spent on the chat template and tokenizer."""


class TokenEvent(Message):
    """New tokens of one request, streamed back to the front door.

    ``cached_tokens`` is the number of prompt tokens whose KV the *prefill* side reused
    from a cache (CASES BUG-56: KV moved from a prefill to a decode instance is not a
    hit); it is set on the first event and on the last.
    """

    request_id: str
    token_ids: tuple[int, ...]
    finish_reason: str | None = None
    """``None`` while running; then ``"stop"``, ``"length"`` or ``"abort"``."""
    cached_tokens: int | None = None
    logprobs: tuple[float, ...] | None = None


class Rejection(Message):
    """Why a request was refused, and when to retry (HTTP 429 or 503 + Retry-After)."""

    status: int
    """429 = too many requests now (queue full, SLO unreachable); 503 = queue timeout or
    no instance able to serve; 400 = a worker refused the request itself (no retry)."""
    code: str
    """``queue_full``, ``queue_timeout``, ``slo_ttft``, ``slo_tbt``, ``no_instance``…"""
    message: str
    retry_after_s: float = 1.0

    def __post_init__(self) -> None:
        if self.status not in (400, 429, 503):
            raise ValueError(f"a rejection is HTTP 400, 429 or 503, got {self.status}")


class RequestRejected(Exception):
    """Raised by a backend's ``generate`` when the request is refused (early rejection)."""

    def __init__(self, rejection: Rejection) -> None:
        super().__init__(f"{rejection.code}: {rejection.message}")
        self.rejection = rejection


# -- conductor ↔ engine workers (disaggregated serving, DESIGN.md §1 and §7) ----------------


class WorkerInfo(Message):
    """A worker announcing itself to the Conductor (``register_worker``)."""

    instance_id: str
    role: str
    """``prefill``, ``decode`` or ``colocated``."""
    host: str
    rpc_port: int
    namespace_json: str
    """The engine's ``identity.CacheNamespace`` fields as JSON: the Conductor computes the
    same block keys from them (DESIGN.md §3)."""
    block_size: int
    kv_capacity_tokens: int
    max_batch_size: int
    pid: int = 0
    prefill_order: str = "fcfs"
    """Order its queued prompts run in: ``fcfs`` or ``shortest`` (job first)."""
    max_model_len: int = 0
    """Prompt + output tokens one request may have on it (0 = not stated)."""
    cpp_json: str = ""
    """A chunked-pipeline (CPP) prefill group (docs/cpp.md): its cost model as JSON
    (``conductor.policy.cpp_placement.cpp_model_to_wire``); empty for a single worker."""
    prefill_profile_json: str = ""
    """Prefill times it measured at start as JSON ``[[prompt tokens, reused tokens,
    seconds], ...]`` (``engine.worker.profile.startup_profile``); empty when it measured
    none. The Conductor fits its ``PrefillEstimator`` to them (``Conductor.learn_profile``)."""


class WorkerLoad(Message):
    """A worker's periodic load report (also its heartbeat)."""

    instance_id: str
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_kv_blocks: int
    num_prefill_tokens_total: int = 0
    """Prompt tokens this worker has computed (not reused) since it started."""
    cpp_state_json: str = ""
    """A CPP prefill instance's group health as JSON (``engine.cpp.health.StageWatch.state``:
    ``healthy``, ``reason``, ``stages``); empty for a single worker. While ``healthy`` is
    false the Conductor places on the instance as on a single worker (docs/cpp.md)."""


class KVEvents(Message):
    """KV events of one holder: block keys (hex) it now holds / no longer holds."""

    holder: str
    """A prefill instance id, or ``"store"`` for the global Mooncake Store."""
    stored: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()


class KVTarget(Message):
    """Where a prefill worker writes a request's prompt KV: a decode worker's receive
    buffer (Transfer Engine segment ``segment`` at ``addr``) of ``num_blocks`` blocks of
    ``block_nbytes`` bytes each — one per started ``block_size`` prompt tokens, the last
    one partial when the prompt does not fill it — laid out ``[layer, K/V, kv_head,
    num_blocks, block_size, head_dim]`` (the engine's head-major paged layout)."""

    segment: str
    addr: int
    num_blocks: int
    block_nbytes: int


class DecodeTask(Message):
    """Ask a decode worker to admit a request: it reserves and registers a receive buffer
    for ``num_kv_blocks`` prompt blocks (``prepare_decode``: ``ceil(prompt / block_size)``,
    the partial last block included), then decodes after the prefill (``start_decode``).
    ``num_kv_blocks = 0`` is a colocated request (no KV moves)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingOptions
    num_kv_blocks: int = 0
    tbt_slo_s: float = 0.0
    """The TBT objective (s) the worker re-checks against its own measured step times
    (0 = no TBT check): DESIGN.md §1 step 4, "local admission re-checked"."""


class StartDecode(Message):
    """The prompt KV has arrived (KV-ready notice): decode from ``first_token_id`` (the
    token the prefill worker sampled), ``None`` for a colocated request."""

    request_id: str
    first_token_id: int | None = None
    num_ready_blocks: int = 0
    """Leading prompt blocks written into the receive buffer (<= the reserved count); the
    last one may be the prompt's partial last block. The decode worker computes the
    prompt tokens they do not cover."""
    kv_digest: int | None = None
    """``PrefillResult.kv_digest``: the decode worker checks the receive buffer against it
    before decoding from it (a mismatch recomputes the prompt); None: not checked."""


class PrefillTask(Message):
    """Prefill ``prompt_token_ids`` and ship the prompt KV to ``target``."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingOptions
    target: KVTarget | None = None
    use_store: bool = True
    """Load missing prefix blocks from (and put new ones into) the global Store; off for
    the local-cache-only policies (no cross-instance reuse)."""
    target_follows: bool = False
    """The decode side's ``KVTarget`` comes later in a ``SetTarget`` (the Conductor asks the
    decode worker for it while this prefill waits in the queue, so the decode admission is
    off the TTFT path). Layers computed before it arrives are sent with the next layer
    written; a prefill that ends before it arrives waits for it (at most 30 s, then fails
    ``KV_TARGET_MISSING``) with its blocks pinned, and then writes them all in one batch,
    the partial last block included: the decode worker computes only the first token's
    KV (and recomputes whatever was not sent)."""
    store_hint_blocks: int = -1
    """Leading prompt blocks the Conductor's index says the Store holds (-1 = unknown).
    0 lets the worker skip the Store lookup (a metadata round trip on its engine thread);
    the index can lag a put by one load report, which only costs that reuse."""


class SetTarget(Message):
    """The receive buffer of a prefill started with ``target_follows``."""

    request_id: str
    target: KVTarget


class PrefillResult(Message):
    """What a prefill returns: the first token and the *prefill side's* prefix hit."""

    request_id: str
    first_token_id: int
    cached_tokens: int
    """Prompt tokens reused from the local cache or the Store (CASES BUG-56)."""
    num_sent_blocks: int = 0
    """Leading prompt blocks written to the ``KVTarget`` (the last one may be partial):
    the ``StartDecode.num_ready_blocks`` of the decode worker."""
    prefill_s: float = 0.0
    transfer_s: float = 0.0
    finish_reason: str | None = None
    """``"stop"`` when the first token already ends the request (EOS)."""
    stages: tuple[tuple[str, float, float], ...] = ()
    """``(stage, start, end)`` windows the prefill worker measured (unix seconds):
    ``queue``, ``store_lookup``, ``cache_load``, ``prefill``, ``p2d_transfer``."""
    kv_digest: int | None = None
    """XXH3-64 (unsigned) of the ``num_sent_blocks`` blocks as they lie in the receive
    buffer (``KVSender.digest``), taken from the prefill's paged cache; None when not
    known (nothing sent, or the last block went before the prompt's end was known)."""


class TokenFrame(Message):
    """New tokens of one request, pushed by the decode (or colocated) worker to the
    Conductor. Frames of one request are numbered ``seq`` = 0, 1, 2… in the order the
    worker sent them (all on its one connection to the Conductor): a missing number means
    frames were lost, and the Conductor fails the request instead of serving a hole."""

    request_id: str
    seq: int
    token_ids: tuple[int, ...] = ()
    finish_reason: str | None = None
    """Set on the request's last frame: ``"stop"``, ``"length"`` or ``"abort"``."""
    error: str | None = None
    """The request failed on the worker (the last frame then)."""
    cached_tokens: int | None = None
    """Colocated: prompt tokens this worker's own prefix cache supplied (first frame on)."""
    stages: tuple[tuple[str, float, float], ...] = ()
    """On the last frame: ``(stage, start, end)`` windows the worker measured (unix s)."""


class TokenFrames(Message):
    """One engine step's token frames of one worker (one-way ``tokens`` notice)."""

    instance_id: str
    frames: tuple[TokenFrame, ...]
