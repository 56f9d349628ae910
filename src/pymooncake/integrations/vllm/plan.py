"""The vLLM connector's pure parts: configuration, namespace, object keys, load/save plans.

Nothing here imports vLLM or torch, opens a socket or reads a clock, so it is tested
without either (tests/integrations/test_vllm_plan.py); ``connector.py`` is the shell that
vLLM calls.

What goes into the Store (DESIGN.md §3, §5): every *full* block of a prompt, one object
per (block, layer) so a layer is saved as soon as vLLM's attention has written it and
loaded just before vLLM's attention reads it (the paper's layer-wise prefill, §5.1). An
object's key is ``"<block key>.L<layer>"``; its bytes are that block's slice of the
layer's paged KV tensor as vLLM-CPU lays it out (``[kv_heads][K rows | V rows][head_dim]``,
see ``VLLM_CPU_LAYOUT``), so puts and gets copy straight between vLLM's blocks and the
Store's segments, with no staging copy.
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import blake3

from pymooncake.identity import CacheNamespace, encode_block_tokens, kv_layout_descriptor
from pymooncake.transfer.config import DEFAULT_TRANSPORTS, KNOWN_TRANSPORTS

VLLM_CPU_LAYOUT = "vllm_cpu_h_2n_d"
"""Layout name in the namespace: one layer's block is ``[kv_heads][2 * block_size]
[head_dim]`` with the block's K rows first and its V rows after them (vLLM-CPU 0.32's
``CPUAttentionBackend``: ``[num_blocks, kv_heads, block_size, 2 * head_size]`` viewed as
``[num_blocks, kv_heads, 2 * block_size, head_size]``)."""

# torch dtype names (``str(torch.float32)`` without ``torch.``) and vLLM's cache_dtype
# strings, as the namespace's kv_dtype names them.
KV_DTYPES = {"float32": "float32", "float16": "float16", "half": "float16",
             "bfloat16": "bfloat16", "float": "float32", "fp8": "float8_e4m3fn",
             "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


@dataclass(frozen=True, slots=True)
class ConnectorConfig:
    """``kv_connector_extra_config`` of ``--kv-transfer-config`` (see docs/vllm.md)."""

    master: str
    """``host:port`` of ``pymooncake master`` (or an HA set / ``etcd://``)."""
    metadata: str
    """The Transfer Engine's metadata service, e.g. ``http://127.0.0.1:8080/metadata``."""
    tenant_salt: str | None = None
    """Namespace salt: instances with different salts never share blocks."""
    model_id: str | None = None
    """Model name in the namespace; default: vLLM's served model name."""
    weight_revision: str | None = None
    """Weight revision in the namespace; default: BLAKE3 of the model directory's weight
    files (``weight_digest``), required when the model is not a local directory."""
    local_hostname: str = "127.0.0.1"
    """Address this process's Transfer Engine publishes."""
    transports: tuple[str, ...] = DEFAULT_TRANSPORTS
    """Transfer Engine transports (``TransferConfig.transports``; add ``cma`` to reach
    same-host peers' KV caches with one kernel copy)."""
    rpc_timeout_s: float = 5.0
    """Master RPC timeout (s)."""
    load: bool = True
    """Load store hits (False: this instance only fills the Store)."""
    save: bool = True
    """Put computed full blocks (False: this instance only reads the Store)."""
    pd_hold_s: float = 120.0
    """P/D over the Transfer Engine: seconds a prefill instance holds a finished prefill's
    blocks (its lease) for the decode to read them (``pd.HOLD_TIMEOUT_S``)."""

    @classmethod
    def from_extra(cls, extra: Mapping[str, object] | None) -> ConnectorConfig:
        """Parse and check ``kv_connector_extra_config``. Raises ``ValueError`` naming the
        key for a missing ``master``/``metadata``, an unknown key or a wrong type."""
        extra = dict(extra or {})
        known = {f for f in cls.__slots__}  # type: ignore[attr-defined]
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(f"kv_connector_extra_config: unknown key(s) {unknown}; "
                             f"known: {sorted(known)}")
        for req in ("master", "metadata"):
            if req in extra and extra[req] is not None and not isinstance(extra[req], str):
                raise ValueError(f"kv_connector_extra_config.{req} must be a string, e.g. "
                                 f"{_EXAMPLES[req]!r}, got {type(extra[req]).__name__} "
                                 f"{extra[req]!r}")
            if not isinstance(extra.get(req), str) or not str(extra[req]).strip():
                raise ValueError(f"kv_connector_extra_config.{req} is required (a non-empty "
                                 f"string, e.g. {_EXAMPLES[req]!r})")
        for k in ("tenant_salt", "model_id", "weight_revision", "local_hostname"):
            if k in extra and extra[k] is not None and not isinstance(extra[k], str):
                raise ValueError(f"kv_connector_extra_config.{k} must be a string, "
                                 f"got {extra[k]!r}")
        if "transports" in extra:
            t = extra["transports"]
            if isinstance(t, str):
                t = [s.strip() for s in t.split(",") if s.strip()]
            if not isinstance(t, list | tuple) or not t or not all(isinstance(s, str) for s in t):
                raise ValueError("kv_connector_extra_config.transports must be a list of "
                                 f"transport names {KNOWN_TRANSPORTS}, got {extra['transports']!r}")
            extra["transports"] = tuple(t)
        for k in ("rpc_timeout_s", "pd_hold_s"):
            if k not in extra:
                continue
            v = extra[k]
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or not v > 0 \
                    or not math.isfinite(v):
                raise ValueError(f"kv_connector_extra_config.{k} must be a number > 0, "
                                 f"got {v!r}")
            extra[k] = float(v)
        for k in ("load", "save"):
            if k in extra and not isinstance(extra[k], bool):
                raise ValueError(f"kv_connector_extra_config.{k} must be true or false, "
                                 f"got {extra[k]!r}")
        return cls(**extra)  # type: ignore[arg-type]


_EXAMPLES = {"master": "127.0.0.1:50051", "metadata": "http://127.0.0.1:8080/metadata"}


def kv_dtype_name(name: str) -> str:
    """The namespace's kv_dtype for a torch dtype name (``"torch.float32"`` or
    ``"float32"``) or a vLLM ``cache_dtype``. Raises ``ValueError`` for others."""
    key = name.removeprefix("torch.")
    if key not in KV_DTYPES:
        raise ValueError(f"KV cache dtype {name!r} is not supported by the pymooncake "
                         f"connector; supported: {sorted(KV_DTYPES)}")
    return KV_DTYPES[key]


def weight_digest(model_dir: str | Path) -> str:
    """BLAKE3 hex digest of a model directory's weight files (``*.safetensors``, ``*.bin``,
    ``*.pt``, ``*.gguf``; names and contents, sorted by name): the namespace's
    ``weight_revision`` when none is configured. Raises ``FileNotFoundError`` when the
    directory holds no weight file."""
    d = Path(model_dir)
    files = sorted(p for ext in ("*.safetensors", "*.bin", "*.pt", "*.gguf")
                   for p in d.glob(ext) if p.is_file()) if d.is_dir() else []
    if not files:
        raise FileNotFoundError(f"{d}: no weight files (*.safetensors, *.bin, *.pt, *.gguf) "
                                "to fingerprint; set kv_connector_extra_config.weight_revision")
    h = blake3.blake3(b"pymooncake.integrations.vllm.weights/v1\x00")
    for p in files:
        name = p.name.encode()
        h.update(len(name).to_bytes(8, "little") + name + p.stat().st_size.to_bytes(8, "little"))
        h.update_mmap(p)  # blake3 >= 0.3: hashes the file without reading it into memory
    return h.hexdigest()


def vllm_namespace(*, model_id: str, weight_revision: str, tokenizer_fingerprint: str,
                   kv_dtype: str, num_layers: int, num_kv_heads: int, head_dim: int,
                   block_size: int, tp_rank: int = 0, tp_size: int = 1,
                   tenant_salt: str | None = None) -> CacheNamespace:
    """The cache namespace of a vLLM-CPU instance (DESIGN.md §3): two instances share
    blocks only when every field is equal. ``num_kv_heads`` is per tensor-parallel shard.
    Raises ``ValueError`` (from ``CacheNamespace``) for a bad field."""
    layout = kv_layout_descriptor(num_layers, num_kv_heads, head_dim, kv_dtype,
                                  layout=VLLM_CPU_LAYOUT)
    return CacheNamespace(model_id=model_id, weight_revision=weight_revision,
                          tokenizer_fingerprint=tokenizer_fingerprint, kv_dtype=kv_dtype,
                          kv_layout=layout, block_size=block_size, tp_rank=tp_rank,
                          tp_size=tp_size, tenant_salt=tenant_salt)


def request_namespace(ns: CacheNamespace, *, cache_salt: str | None = None,
                      lora: object | None = None, multimodal: object = None
                      ) -> CacheNamespace | None:
    """The namespace of one request's blocks: the instance's ``ns`` plus vLLM's
    per-request ``cache_salt`` (CASES BUG-66: requests with different salts never share a
    block through the Store, as vLLM's own prefix cache keeps them apart); ``None``, the
    request bypasses the Store (no lookup, no save), for a LoRA request or one with
    multimodal inputs: their KV also depends on the adapter or on the image content,
    which the prompt's token ids do not carry."""
    if lora is not None or multimodal:
        return None
    if not cache_salt:
        return ns
    return replace(ns, extra=(*ns.extra, ("vllm_cache_salt", str(cache_salt))))


_LAYER_RE = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")


def layer_index(name: str) -> int:
    """The layer number in a vLLM attention layer name (``model.layers.7.self_attn.attn``
    → 7). Raises ``ValueError`` for a name without one."""
    m = _LAYER_RE.search(name)
    if m is None:
        raise ValueError(f"PymooncakeConnector: no layer number in KV cache name {name!r}")
    return int(m.group(1))


def object_key(block_key: str, layer: int) -> str:
    """Store key of one layer of one block: ``"<block key>.L<layer>"``."""
    return f"{block_key}.L{layer}"


def object_keys(block_keys: Sequence[str], num_layers: int) -> list[str]:
    """Keys of every layer of every block, block-major: ``[b0.L0, b0.L1, ..., b1.L0, ...]``."""
    return [object_key(k, layer) for k in block_keys for layer in range(num_layers)]


_TAIL_TAG = b"pymooncake.integrations.vllm.tail/v1\x00"


def tail_key(token_ids: Sequence[int], full_block_keys: Sequence[str],
             namespace: CacheNamespace) -> str | None:
    """Key of a prompt's partial last block (P/D: the prefill puts it, the decode loads
    it): BLAKE3 of a tag, the last full block's key (the namespace digest when there is
    none) and the partial block's token ids, so like a block key it names the tokens and
    everything before them. ``None`` when the prompt fills its blocks exactly."""
    bs = namespace.block_size
    full = len(token_ids) // bs
    if len(token_ids) % bs == 0:
        return None
    if len(full_block_keys) != full:
        raise ValueError(f"{len(full_block_keys)} block keys for {full} full blocks")
    prev = bytes.fromhex(full_block_keys[-1]) if full else namespace.digest_bytes()
    tail = encode_block_tokens(list(token_ids[full * bs:]))
    return blake3.blake3(_TAIL_TAG + prev + tail.tobytes()).hexdigest()


def loadable_blocks(num_prompt_tokens: int, block_size: int) -> int:
    """Full prompt blocks that may come from the Store: vLLM must still compute at least
    the prompt's last token (its logits give the first output token), so a prompt of
    exactly ``k`` blocks may load ``k - 1`` of them."""
    return max(0, (num_prompt_tokens - 1) // block_size)


def leading_hits(present: Sequence[bool], num_layers: int) -> int:
    """Blocks at the start of a block-major presence list (``object_keys`` order) whose
    every layer is present: the prefix that can be loaded."""
    if num_layers <= 0 or len(present) % num_layers:
        raise ValueError(f"{len(present)} presence flags do not make whole blocks of "
                         f"{num_layers} layers")
    n = 0
    for b in range(len(present) // num_layers):
        if not all(present[b * num_layers:(b + 1) * num_layers]):
            break
        n += 1
    return n


@dataclass(slots=True)
class BlockTransfer:
    """Blocks of one request to move this step: block keys and vLLM block ids, in order."""

    req_id: str
    block_keys: list[str]
    block_ids: list[int]


@dataclass(slots=True)
class _Req:
    keys: list[str]                   # block keys of the prompt's full blocks
    prompt_len: int
    load_keys: list[str]              # keys of the blocks the Store can give, in order
    hit_tokens: int = 0               # tokens the Store can give (from the prompt's start)
    local_blocks: int = 0             # leading blocks vLLM had in its own prefix cache
    saved: int = 0                    # blocks [0, saved) are in the Store or planned
    tail: str | None = None           # P/D prefill: key to put the partial last block under
    load: tuple[int, int] | None = None   # block range to load when next scheduled
    block_ids: list[int] = field(default_factory=list)


class Planner:
    """The scheduler side's bookkeeping, one entry per live request.

    ``lookup`` (from ``get_num_new_matched_tokens``) records the prompt's block keys and
    what the Store can give; ``allocated`` (``update_state_after_alloc``) turns an accepted
    hit into a pending load; ``scheduled`` (``build_connector_meta``, once per scheduled
    request per step) returns what the worker loads before this step's forward and what it
    saves during it: the full prompt blocks that this step completes and that the Store
    does not hold yet (and, for a P/D prefill, the partial last block under its tail key).
    ``finished`` forgets the request.

    A shared-prefix hit is whole blocks (``hits``). A P/D decode hit (``pd_last_key``)
    is every prompt token but the last: the loadable full blocks plus the block holding
    the next-to-last token, under ``pd_last_key`` (the prefill's tail object, or the last
    full block's own key when the prompt fills its blocks exactly; the caller checked
    that the Store holds it).
    """

    def __init__(self, block_size: int,
                 keys_of: Callable[[str, Sequence[int]], list[str]] | None = None) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        self.block_size = block_size
        self.keys_of = keys_of
        """Block keys of a request's token sequence, ``keys_of(req_id, tokens)``
        (``identity.block_keys`` under that request's namespace): with it, blocks of
        generated tokens are saved too (``scheduled(tokens=...)``)."""
        self.reqs: dict[str, _Req] = {}

    def lookup(self, req_id: str, block_keys: Sequence[str], prompt_len: int, hits: int,
               local_tokens: int, *, pd_last_key: str | None = None,
               tail: str | None = None) -> int:
        """Record a lookup; the tokens to load beyond the ``local_tokens`` (block-aligned)
        that vLLM already holds. ``hits``: leading full blocks the Store holds;
        ``pd_last_key``: a P/D decode hit (class docstring; needs every loadable full block
        in ``hits``); ``tail``: this request is a P/D prefill, whose partial last block is
        to be put under this key."""
        bs = self.block_size
        n = loadable_blocks(prompt_len, bs)
        if hits > n or hits > len(block_keys):
            raise ValueError(f"{hits} hits for a {prompt_len}-token prompt of "
                             f"{len(block_keys)} keyed blocks")
        load_keys, hit_tokens = list(block_keys[:hits]), hits * bs
        if pd_last_key is not None and prompt_len > 1:
            full = (prompt_len - 1) // bs
            if hits < full:
                raise ValueError(f"a P/D hit needs all {full} full blocks, the Store has {hits}")
            if (prompt_len - 1) % bs:
                load_keys = list(block_keys[:full]) + [pd_last_key]
            hit_tokens = prompt_len - 1
        r = _Req(list(block_keys), prompt_len, load_keys, hit_tokens=hit_tokens,
                 local_blocks=local_tokens // bs, saved=hits,
                 tail=tail if prompt_len % bs else None)
        self.reqs[req_id] = r
        return max(0, hit_tokens - local_tokens)

    def allocated(self, req_id: str, num_external_tokens: int) -> None:
        """vLLM accepted ``num_external_tokens`` from the Store for ``req_id``."""
        r = self.reqs.get(req_id)
        if r is None or num_external_tokens <= 0:
            if r is not None:
                r.load = None
            return
        start = r.local_blocks
        end_tok = start * self.block_size + num_external_tokens
        if end_tok > r.hit_tokens:
            raise ValueError(f"request {req_id}: vLLM accepted {num_external_tokens} external "
                             f"tokens after {start} local blocks, the Store had "
                             f"{r.hit_tokens} tokens")
        r.load = (start, -(-end_tok // self.block_size))

    def scheduled(self, req_id: str, block_ids: Sequence[int] | None, replace: bool,
                  computed_before: int, num_scheduled: int,
                  tokens: Sequence[int] | None = None
                  ) -> tuple[BlockTransfer | None, BlockTransfer | None]:
        """One scheduled step of ``req_id``: its new block ids (all of them when
        ``replace``), tokens computed before the step (loads included) and tokens the
        step computes; ``tokens``, the request's prompt and output so far, lets the blocks
        of generated tokens be saved as they fill (multi-turn reuse). Returns
        ``(load, save)``, either ``None`` when empty."""
        r = self.reqs.get(req_id)
        if r is None:
            return None, None
        if block_ids is not None:
            r.block_ids = list(block_ids) if replace else r.block_ids + list(block_ids)
        load = None
        if r.load is not None:
            s, e = r.load
            load = BlockTransfer(req_id, r.load_keys[s:e], r.block_ids[s:e])
            r.load = None
        computed = computed_before + num_scheduled
        if tokens is not None and self.keys_of is not None \
                and min(computed, len(tokens)) // self.block_size > len(r.keys):
            r.keys = self.keys_of(req_id, tokens[:min(computed, len(tokens))])
        else:
            computed = min(computed, r.prompt_len)
        done = min(computed // self.block_size, len(r.keys), len(r.block_ids))
        keys, ids = [], []
        if done > r.saved:
            keys, ids = r.keys[r.saved:done], r.block_ids[r.saved:done]
            r.saved = done
        last = r.prompt_len // self.block_size
        if r.tail is not None and computed >= r.prompt_len and last < len(r.block_ids):
            keys, ids = keys + [r.tail], ids + [r.block_ids[last]]
            r.tail = None
        save = BlockTransfer(req_id, keys, ids) if keys else None
        return load, save

    def finished(self, req_id: str) -> None:
        self.reqs.pop(req_id, None)
