"""Load a Llama-architecture GGUF file (llama.cpp's format) into ``LlamaForCausalLM``.

The header (metadata and tensor infos) is parsed by ``gguf_file.read_gguf_header``, the
project's one GGUF parser (~0.03 s on this file; ``gguf.GGUFReader`` takes ~1.8 s). The
tensor bytes are memory-mapped and dequantized, Q8_0 and Q4_1 in torch (bit-identical to
``gguf.quants.dequantize``, the reference numpy implementation of the ggml block formats,
and faster), F16 and BF16 with ``gguf.quants.dequantize``. Supported tensor types: F32,
F16, BF16, Q8_0 and Q4_1; everything is dequantized at load to the engine dtype (no
quantized matmuls). Metadata keys follow llama.cpp's ``llama.*`` names.

llama.cpp conventions undone at load:

* ``convert_hf_to_gguf.py`` permutes the output rows of ``attn_q`` / ``attn_k`` of every
  head so that the pairs RoPE rotates are adjacent (llama.cpp's interleaved "normal" RoPE).
  This engine, like Hugging Face, rotates the two halves of a head (``rotate_half``), so
  the rows are put back in HF order (``_unpermute_rows``).
* A file without ``output.weight`` ties the LM head to ``token_embd.weight``.

Load time (SmolLM2-135M-Instruct, Q4_1, 94 MiB; this 2-core AMD EPYC, load average ~1,
file in the page cache): ``load_gguf_model`` 0.47-0.55 s (dequantization ~0.3 s, header
~0.03 s); ``Engine.from_model_name("smollm2")`` with the tokenizer and the weight digest
1.1 s; importing torch ~0.9 s more. Memory: 540 MB of float32 weights.

dtype: float32 is the default and the one whose greedy output equals ``transformers``'
float32 greedy output token for token (``tests/engine/test_gguf.py``). bfloat16 is the
fastest here (this CPU has ``avx512_bf16``; one thread): a 661-token prefill 0.78 s vs
1.85 s, a decode step of 6 requests 38 ms vs 67 ms, but its greedy output leaves
float32's on 4 of the test's 8 chat prompts (at generated tokens 4, 5, 17 and 27). float16
has no fast CPU kernels (the same prefill took 91 s). So: float32 when outputs must match
a reference, bfloat16 for throughput.

Errors: every failure is a ``ModelLoadError`` (``loader.py``) with a one-line message
naming the file and what is wrong: not a GGUF file, truncated, an unsupported version,
architecture or tensor type, a missing metadata key or tensor, a shape mismatch.
"""

from __future__ import annotations

import mmap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import blake3
import numpy as np
import torch
from torch.overrides import TorchFunctionMode

from pymooncake.engine.model.gguf_file import (
    GGML_TYPES,
    GGUFError,
    GGUFFile,
    GGUFTensorInfo,
    map_gguf,
    read_gguf_header,
)
from pymooncake.engine.model.llama import LlamaForCausalLM, ModelConfig
from pymooncake.engine.model.loader import ModelLoadError, _expected_tensors

SUPPORTED_ARCHITECTURES = ("llama",)
"""``general.architecture`` values this loader maps (Llama, and Mistral-style files,
which llama.cpp also writes as ``llama``)."""

# GGUF tensor name (per layer: ``blk.N.`` + key) → HF name (``model.layers.N.`` + value)
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
                 "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}


def read_gguf(path: str | Path) -> GGUFFile:
    """Parse a GGUF file's header (metadata + tensor infos; no tensor data is read) with
    ``gguf_file.read_gguf_header``.

    Raises ``ModelLoadError`` naming the file: unreadable, not GGUF (magic), an unsupported
    version or byte order, a header or tensor data past the end of the file (truncated).
    """
    try:
        return read_gguf_header(path)
    except GGUFError as e:
        raise ModelLoadError(str(e)) from None


def _meta(g: GGUFFile, key: str, default: Any = ...) -> Any:
    if key in g.metadata:
        return g.metadata[key]
    if default is ...:
        raise ModelLoadError(f"{g.path}: metadata key {key!r} is missing")
    return default


def _shortest_f32(x: float) -> float:
    """A float32 metadata value as the shortest decimal that rounds to it (``1e-05``, not
    ``9.999999747378752e-06``): the value the converter was given."""
    return float(str(np.float32(x)))


def gguf_model_config(g: GGUFFile) -> ModelConfig:
    """``ModelConfig`` from the ``llama.*`` metadata (and the tensor list: tied embeddings
    when there is no ``output.weight``). Raises ``ModelLoadError``."""
    arch = _meta(g, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(f"{g.path}: architecture {arch!r} is not supported; "
                             f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    a = f"{arch}."
    hidden = int(_meta(g, a + "embedding_length"))
    heads = int(_meta(g, a + "attention.head_count"))
    kv_heads = int(_meta(g, a + "attention.head_count_kv", heads))
    head_dim = int(_meta(g, a + "attention.key_length", hidden // max(heads, 1)))
    rope_dim = int(_meta(g, a + "rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ModelLoadError(f"{g.path}: partial RoPE ({a}rope.dimension_count {rope_dim} "
                             f"of head dim {head_dim}) is not supported")
    if "rope_freqs.weight" in g.tensors:
        raise ModelLoadError(f"{g.path}: per-frequency RoPE factors (rope_freqs.weight, "
                             "Llama 3.1 scaling) are not supported")
    scaling: tuple[tuple[str, Any], ...] = ()
    kind = _meta(g, a + "rope.scaling.type", "none")
    if kind == "linear":
        scaling = (("factor", float(_meta(g, a + "rope.scaling.factor"))),
                   ("rope_type", "linear"))
    elif kind != "none":
        raise ModelLoadError(f"{g.path}: {a}rope.scaling.type {kind!r} is not supported")
    emb = g.tensors.get("token_embd.weight")
    tokens = g.metadata.get("tokenizer.ggml.tokens")
    vocab = _meta(g, a + "vocab_size", len(tokens) if tokens else
                  (emb.shape[0] if emb is not None else None))
    if vocab is None:
        raise ModelLoadError(f"{g.path}: no {a}vocab_size, tokenizer.ggml.tokens or "
                             "token_embd.weight to size the vocabulary")
    eos = [g.metadata[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
           if isinstance(g.metadata.get(k), int)]
    try:
        return ModelConfig(
            architecture="LlamaForCausalLM", vocab_size=int(vocab), hidden_size=hidden,
            intermediate_size=int(_meta(g, a + "feed_forward_length")),
            num_layers=int(_meta(g, a + "block_count")), num_heads=heads,
            num_kv_heads=kv_heads, head_dim=head_dim,
            rms_norm_eps=_shortest_f32(_meta(g, a + "attention.layer_norm_rms_epsilon")),
            rope_theta=_shortest_f32(_meta(g, a + "rope.freq_base", 10000.0)),
            rope_scaling=scaling, tie_word_embeddings="output.weight" not in g.tensors,
            bos_token_id=g.metadata.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=tuple(dict.fromkeys(eos)))
    except (ValueError, TypeError) as e:
        raise ModelLoadError(f"{g.path}: {e}") from None


def _unpermute_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation: within each head, GGUF row ``2i`` / ``2i+1``
    hold HF rows ``i`` / ``i + head_dim/2`` (the pair one RoPE rotation mixes). ``w`` is
    ``[n_heads * head_dim, in]``; returns the rows in HF (rotate-half) order."""
    out_features = w.shape[0]
    half = out_features // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _dequantize(g: GGUFFile, buf: mmap.mmap, t: GGUFTensorInfo) -> torch.Tensor:
    """The tensor as a float32 torch tensor of ``t.shape`` (own memory, not the mapping).

    Q8_0 and Q4_1 (the SmolLM2 file's types) are decoded here in torch, ~1.5x faster than
    ``gguf.quants.dequantize`` and bit-identical to it (ggml's ``dequantize_row_q8_0`` /
    ``_q4_1``: per block of 32, ``d * q`` / ``d * q + m`` in float32, a Q4_1 block's low
    nibbles first); F16 and BF16 go through ``gguf.quants.dequantize``."""
    import gguf

    if t.ggml_type not in GGML_TYPES:
        raise ModelLoadError(f"{g.path}: tensor {t.name!r} has type {t.type_name}; supported: "
                             f"{', '.join(v[0] for v in GGML_TYPES.values())}")
    _, block, block_bytes = GGML_TYPES[t.ggml_type]
    row = t.shape[-1] if t.shape else 1
    if row % block:
        raise ModelLoadError(f"{g.path}: tensor {t.name!r} rows of {row} are not a multiple "
                             f"of the {t.type_name} block ({block})")
    raw = np.frombuffer(buf, np.uint8, t.nbytes, t.offset)
    if t.ggml_type == 0:  # F32: copied out of the (read-only) mapping
        return torch.from_numpy(raw.view(np.float32).copy()).reshape(t.shape)
    if t.ggml_type in (3, 8):  # Q4_1, Q8_0
        blocks = torch.from_numpy(raw.copy()).view(-1, block_bytes)
        d = blocks[:, 0:2].contiguous().view(torch.float16).float()
        if t.ggml_type == 8:
            q = blocks[:, 2:].contiguous().view(torch.int8).float()
            return (q * d).reshape(t.shape)
        m = blocks[:, 2:4].contiguous().view(torch.float16).float()
        qs = blocks[:, 4:]
        q = torch.cat([qs & 0xF, qs >> 4], dim=1).float()
        return (q * d + m).reshape(t.shape)
    raw = raw.reshape(*t.shape[:-1], row // block * block_bytes)
    out = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(t.ggml_type))
    return torch.from_numpy(np.asarray(out, dtype=np.float32).reshape(t.shape))


def _hf_tensors(g: GGUFFile, cfg: ModelConfig,
                dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(HF name, tensor in dtype)`` for every weight; a tensor owns its memory (never
    a view of the mapped file) but may be a non-contiguous view (q/k un-permuted)."""
    expected = _expected_tensors(cfg)
    wanted: dict[str, str] = {}
    for gname, hname in _GLOBAL_NAMES.items():
        if hname in expected:
            wanted[hname] = gname
    for i in range(cfg.num_layers):
        for gk, hk in _LAYER_NAMES.items():
            wanted[f"model.layers.{i}.{hk}"] = f"blk.{i}.{gk}"
    missing = [gn for gn in wanted.values() if gn not in g.tensors]
    if missing:
        raise ModelLoadError(f"{g.path}: tensor {missing[0]!r} is missing"
                             + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    try:
        buf = map_gguf(g.path)
    except GGUFError as e:
        raise ModelLoadError(str(e)) from None
    try:
        for hname, gname in wanted.items():
            t = g.tensors[gname]
            if t.shape != expected[hname]:
                raise ModelLoadError(f"{g.path}: tensor {gname!r} has shape {t.shape}, the "
                                     f"metadata implies {expected[hname]}")
            w = _dequantize(g, buf, t)
            if w.dtype != dtype:
                w = w.to(dtype)
            if gname.endswith("attn_q.weight"):
                w = _unpermute_rows(w, cfg.num_heads)
            elif gname.endswith("attn_k.weight"):
                w = _unpermute_rows(w, cfg.num_kv_heads)
            yield hname, w
    finally:
        buf.close()


def gguf_hf_state_dict(g: GGUFFile, cfg: ModelConfig,
                       dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Every weight dequantized to ``dtype`` under Hugging Face names, q/k rows in HF
    order, not fused, contiguous: what a HF ``model.safetensors`` of this model holds (no
    ``lm_head.weight`` when tied). Shapes are checked against ``cfg``.

    Raises ``ModelLoadError`` for a missing tensor, an unsupported type or a wrong shape.
    """
    return {name: w.contiguous() for name, w in _hf_tensors(g, cfg, dtype)}


def _fused_state_dict(g: GGUFFile, cfg: ModelConfig,
                      dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``loader._fuse(gguf_hf_state_dict(...))`` without the intermediate copies: q/k/v and
    gate/up are written straight into their fused tensors."""
    q, kv, inter = (cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim,
                    cfg.intermediate_size)
    rows = {"q_proj": ("qkv_proj", 0, q + 2 * kv), "k_proj": ("qkv_proj", q, q + 2 * kv),
            "v_proj": ("qkv_proj", q + kv, q + 2 * kv), "gate_proj": ("gate_up_proj", 0, 2 * inter),
            "up_proj": ("gate_up_proj", inter, 2 * inter)}
    state: dict[str, torch.Tensor] = {}
    for name, w in _hf_tensors(g, cfg, dtype):
        part = name.rsplit(".", 2)[-2]
        if part not in rows:
            state[name] = w.contiguous()
            continue
        fused, row0, total = rows[part]
        fname = name.replace(part, fused)
        if fname not in state:
            state[fname] = torch.empty(total, w.shape[1], dtype=dtype)
        state[fname][row0:row0 + w.shape[0]].copy_(w)
    return state


class _SkipInit(TorchFunctionMode):
    """Skip ``torch.nn.init`` calls while a model is built: the weights are uninitialised
    (``torch.empty``, pages never touched) until the loaded tensors replace them. Building
    on the meta device instead imports ``torch._dynamo`` on the first ``normal_`` (~0.9 s
    on this CPU) and random init of 134 M parameters takes longer still."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        if getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else (kwargs or {}).get("tensor")
        return func(*args, **(kwargs or {}))


def load_gguf_model(path: str | Path,
                    dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    """Build a ``LlamaForCausalLM`` from a GGUF file, weights dequantized to ``dtype``.

    Raises ``ModelLoadError`` (one line, naming the file and the fault)."""
    g = read_gguf(path)
    cfg = gguf_model_config(g)
    with _SkipInit():
        model = LlamaForCausalLM(cfg)
    state = _fused_state_dict(g, cfg, dtype)
    result = model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    missing = [n for n in result.missing_keys
               if not (cfg.tie_word_embeddings and n == "lm_head.weight")]
    if missing:
        raise ModelLoadError(f"{path}: parameters not loaded: {missing[:5]}")
    return model.eval()


_REVISIONS: dict[tuple[str, int, int], str] = {}


def gguf_weight_revision(path: str | Path) -> str:
    """BLAKE3 hex digest of the file's bytes (streamed in 8 MiB reads), for the cache
    namespace's weight revision (DESIGN.md §3). Cached in-process per (resolved path,
    size, mtime_ns); ~0.1 s for the 94 MiB SmolLM2 file. Raises ``ModelLoadError``."""
    p = Path(path).resolve()
    try:
        st = p.stat()
        key = (str(p), st.st_size, st.st_mtime_ns)
        if key in _REVISIONS:
            return _REVISIONS[key]
        h = blake3.blake3(b"pymooncake.engine.weights.gguf/v1\x00")
        with p.open("rb") as f:
            while chunk := f.read(8 << 20):
                h.update(chunk)
    except OSError as e:
        raise ModelLoadError(f"{p}: cannot read ({e.strerror or e})") from None
    _REVISIONS[key] = h.hexdigest()
    return _REVISIONS[key]
