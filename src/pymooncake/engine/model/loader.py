"""Load a Hugging Face model directory: ``config.json`` + ``*.safetensors`` (sharded or not).

Errors are ``ModelLoadError`` naming the directory, file and tensor at fault: a missing
``config.json`` or weight file, an unsupported architecture, a missing tensor or a shape
mismatch. Weights may be bf16, fp16 or fp32 and are cast to the engine's dtype.
"""

from __future__ import annotations

import json
from pathlib import Path

import blake3
import torch
from safetensors import SafetensorError, safe_open

from pymooncake.engine.model.layers import rope_inv_freq
from pymooncake.engine.model.llama import LlamaForCausalLM, ModelConfig


class ModelLoadError(ValueError):
    """A model directory cannot be loaded; the message names the file/tensor and the fix."""


# what reading a safetensors file can raise: SafetensorError (bad header, truncated data),
# OSError (permissions), and a few plain errors from malformed metadata
_READ_ERRORS = (SafetensorError, OSError, ValueError, RuntimeError, KeyError, TypeError)


def _read_error(f: Path, e: BaseException) -> ModelLoadError:
    detail = str(e).strip() or type(e).__name__
    return ModelLoadError(f"{f}: cannot read as safetensors ({detail}); "
                          "the file is corrupt, truncated or not a safetensors file")


def _keys(f: Path) -> list[str]:
    """Tensor names of one safetensors file. Raises ``ModelLoadError`` naming the file."""
    try:
        with safe_open(str(f), framework="pt") as sf:
            return list(sf.keys())  # noqa: SIM118 (safe_open has no __iter__)
    except _READ_ERRORS as e:
        raise _read_error(f, e) from None


def read_model_config(model_dir: str | Path) -> ModelConfig:
    """Parse ``model_dir/config.json``. Raises ``ModelLoadError``."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{path} not found: a model directory needs config.json")
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{path} is not valid JSON: {e}") from None
    except OSError as e:
        raise ModelLoadError(f"{path}: cannot read ({e.strerror or e})") from None
    try:
        return ModelConfig.from_hf_config(raw, source=str(path))
    except ValueError as e:
        raise ModelLoadError(str(e)) from None


def weight_files(model_dir: str | Path) -> dict[str, Path]:
    """Tensor name → safetensors file, from ``model.safetensors.index.json`` or the files.

    Raises ``ModelLoadError`` when there is no safetensors file or the index names a file
    that does not exist.
    """
    d = Path(model_dir)
    index = d / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text()).get("weight_map", {})
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
            raise ModelLoadError(f"{index} is not a JSON object with a weight_map "
                                 f"({e})") from None
        except OSError as e:
            raise ModelLoadError(f"{index}: cannot read ({e.strerror or e})") from None
        if not isinstance(weight_map, dict):
            raise ModelLoadError(f"{index}: weight_map must be an object of tensor → file")
        out = {}
        for name, fname in weight_map.items():
            f = d / fname
            if not f.is_file():
                raise ModelLoadError(f"{index} maps tensor {name!r} to {f}, which does not exist")
            out[name] = f
        return out
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{d} holds no *.safetensors weight file")
    out = {}
    for f in files:
        for name in _keys(f):
            out[name] = f
    return out


def weight_revision(model_dir: str | Path) -> str:
    """BLAKE3 hex digest over the weight files and ``config.json`` (name + content).

    Raises ``ModelLoadError`` naming a file that cannot be read."""
    d = Path(model_dir)
    h = blake3.blake3(b"pymooncake.engine.weights/v1\x00")
    for f in sorted([*d.glob("*.safetensors"), d / "config.json"]):
        if f.is_file():
            name = f.name.encode()
            h.update(len(name).to_bytes(8, "little") + name)
            try:
                h.update(f.read_bytes())
            except OSError as e:
                raise ModelLoadError(f"{f}: cannot read ({e.strerror or e})") from None
    return h.hexdigest()


def _expected_tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    hd, q, kv = cfg.head_dim, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    h, inter = cfg.hidden_size, cfg.intermediate_size
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h),
                                       "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (cfg.vocab_size, h)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        out |= {p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                p + "mlp.down_proj.weight": (h, inter), p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,)}
        if cfg.attention_bias:
            out |= {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                    p + "self_attn.v_proj.bias": (kv,)}
        if cfg.qk_norm:
            out |= {p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)}
    return out


def _fuse(tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """HF tensor names → this model's state dict (q/k/v and gate/up concatenated)."""
    out = dict(tensors)
    for i in range(cfg.num_layers):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        for kind in ("weight", "bias") if cfg.attention_bias else ("weight",):
            out[a + f"qkv_proj.{kind}"] = torch.cat(
                [out.pop(a + f"{x}_proj.{kind}") for x in "qkv"], dim=0)
        out[m + "gate_up_proj.weight"] = torch.cat(
            [out.pop(m + "gate_proj.weight"), out.pop(m + "up_proj.weight")], dim=0)
    if cfg.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out


def _checked(f: Path, name: str, t: torch.Tensor, shape: tuple[int, ...],
             dtype: torch.dtype) -> torch.Tensor:
    if tuple(t.shape) != shape:
        raise ModelLoadError(f"{f}: tensor {name!r} has shape {tuple(t.shape)}, "
                             f"config.json implies {shape}")
    if not t.is_floating_point():
        raise ModelLoadError(f"{f}: tensor {name!r} has dtype {t.dtype}; "
                             "expected bf16/fp16/fp32")
    return t.to(dtype)


def load_state_dict(model_dir: str | Path, cfg: ModelConfig,
                    dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Read, check and fuse the checkpoint tensors. Raises ``ModelLoadError``."""
    where = weight_files(model_dir)
    expected = _expected_tensors(cfg)
    by_file: dict[Path, list[str]] = {}
    for name in expected:
        if name not in where:
            raise ModelLoadError(f"{model_dir}: tensor {name!r} is missing from the "
                                 f"safetensors files ({sorted({p.name for p in where.values()})})")
        by_file.setdefault(where[name], []).append(name)
    tensors: dict[str, torch.Tensor] = {}
    for f, names in by_file.items():
        try:
            with safe_open(str(f), framework="pt") as sf:
                for name in names:
                    tensors[name] = _checked(f, name, sf.get_tensor(name), expected[name], dtype)
        except ModelLoadError:
            raise
        except _READ_ERRORS as e:
            raise _read_error(f, e) from None
    return _fuse(tensors, cfg)


def load_model(model_dir: str | Path, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    """Build a ``LlamaForCausalLM`` from a HF directory, weights cast to ``dtype``."""
    cfg = read_model_config(model_dir)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    state = load_state_dict(model_dir, cfg, dtype)
    model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    # the RoPE buffer was created on the meta device; compute it for real
    model.inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling_dict)
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise ModelLoadError(f"{model_dir}: parameters not loaded: {missing[:5]}")
    return model.eval()
