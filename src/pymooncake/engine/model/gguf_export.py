"""Write a GGUF model as a standard Hugging Face Llama directory.

The directory holds ``model.safetensors`` (float32, HF tensor names, q/k/v and gate/up
separate, q/k rows in HF's rotate-half order, no ``lm_head.weight`` when the embeddings
are tied), ``config.json`` (``LlamaForCausalLM``), ``generation_config.json`` and the
tokenizer files of ``GGUFTokenizer.save_pretrained`` (``tokenizer.json``,
``tokenizer_config.json`` with the chat template, ``special_tokens_map.json``), so that
``transformers`` (``AutoModelForCausalLM`` + ``AutoTokenizer``), vLLM and this engine's
``--model DIR`` load it as it is. The weights are the GGUF's dequantized values: the
exported model computes what the GGUF model computes, not the original unquantized one.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from pymooncake.engine.model import export
from pymooncake.engine.model.gguf import gguf_hf_state_dict, gguf_model_config, read_gguf
from pymooncake.engine.model.llama import ModelConfig

EXPORT_FILES = ("config.json", "generation_config.json", "model.safetensors",
                "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def hf_config(cfg: ModelConfig, max_position_embeddings: int) -> dict[str, Any]:
    """``export.hf_config`` (float32) with the fields a HF Llama checkpoint also states
    (dropout, MLP bias, init range, ``use_cache``) and a single eos id as an int."""
    eos = list(cfg.eos_token_ids)
    return export.hf_config(cfg, "float32", max_position_embeddings) | {
        "attention_dropout": 0.0, "mlp_bias": False, "initializer_range": 0.02,
        "pretraining_tp": 1, "use_cache": True,
        "eos_token_id": eos[0] if len(eos) == 1 else eos,
    }


def export_gguf(path: str | Path, out_dir: str | Path) -> Path:
    """Write the GGUF file ``path`` as a HF directory ``out_dir`` (created; files in it are
    overwritten). Returns ``out_dir``.

    Raises ``ModelLoadError`` when the GGUF cannot be loaded, ``ValueError`` when its
    tokenizer cannot be built, ``OSError`` when ``out_dir`` cannot be written.
    """
    from pymooncake.engine.model.tokenizer import GGUFTokenizer

    g = read_gguf(path)
    cfg = gguf_model_config(g)
    tokenizer = GGUFTokenizer(path)  # before any file is written: fails early
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    ctx = g.metadata.get("llama.context_length")
    config = hf_config(cfg, int(ctx) if isinstance(ctx, int) and ctx > 0 else 8192)
    state = gguf_hf_state_dict(g, cfg, torch.float32)
    weights = d / "model.safetensors"
    save_file(state, str(weights), metadata={"format": "pt"})
    umask = os.umask(0)
    os.umask(umask)
    weights.chmod(0o666 & ~umask)  # safetensors creates it 0600; readable like the others
    (d / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    gen = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"],
           "pad_token_id": tokenizer.special_token_ids.get("pad")}
    (d / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    tokenizer.save_pretrained(d)
    return d
