"""Write a model as a Hugging Face directory (``config.json`` + ``model.safetensors``).

Used to hand the embedded ``tiny`` model to ``transformers`` (benchmark baseline) and to
exercise ``--model DIR`` without a download.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from pymooncake.engine.model.llama import LlamaForCausalLM, ModelConfig


def hf_state_dict(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """This model's weights under Hugging Face names (q/k/v and gate/up split again)."""
    cfg = model.config
    q, kv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, \
        cfg.intermediate_size
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        t = t.detach().contiguous()
        if ".qkv_proj." in name:
            for part, chunk in zip("qkv", t.split([q, kv, kv], dim=0), strict=True):
                out[name.replace("qkv_proj", f"{part}_proj")] = chunk.contiguous()
        elif ".gate_up_proj." in name:
            gate, up = t.split([inter, inter], dim=0)
            out[name.replace("gate_up_proj", "gate_proj")] = gate.contiguous()
            out[name.replace("gate_up_proj", "up_proj")] = up.contiguous()
        elif name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        else:
            out[name] = t
    return out


def hf_config(cfg: ModelConfig, torch_dtype: str,
              max_position_embeddings: int = 8192) -> dict[str, Any]:
    """A Hugging Face ``config.json`` document for ``cfg`` (weights in ``torch_dtype``,
    e.g. ``"float32"``)."""
    model_type = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                  "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}[cfg.architecture]
    hf: dict[str, Any] = {
        "architectures": [cfg.architecture], "model_type": model_type,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta, "attention_bias": cfg.attention_bias,
        "tie_word_embeddings": cfg.tie_word_embeddings, "hidden_act": "silu",
        "max_position_embeddings": max_position_embeddings, "bos_token_id": cfg.bos_token_id,
        "eos_token_id": list(cfg.eos_token_ids) if cfg.eos_token_ids else None,
        "torch_dtype": torch_dtype,
    }
    if cfg.rope_scaling:
        hf["rope_scaling"] = dict(cfg.rope_scaling)
    return hf


def save_hf_dir(model: LlamaForCausalLM, directory: str | Path) -> Path:
    """Write ``config.json`` and ``model.safetensors`` into ``directory`` (created)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    (d / "config.json").write_text(json.dumps(hf_config(model.config, dtype), indent=2))
    save_file(hf_state_dict(model), str(d / "model.safetensors"))
    return d
