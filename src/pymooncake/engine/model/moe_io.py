"""The MoE model's weights: the seeded ``tiny-moe``, and HF checkpoints (safetensors).

``tiny-moe`` is a Qwen2-MoE-layout model with seeded random weights (2 layers, 8 experts,
top-2 with renormalisation, a shared expert, hidden 128, vocab 259 with the byte
tokenizer): every machine builds the same bits with no download, like ``tiny.py``.

Checkpoints use Hugging Face's on-disk names (one tensor per expert projection):
Qwen2-MoE ``model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight`` with
``mlp.gate`` / ``mlp.shared_expert`` / ``mlp.shared_expert_gate``; Mixtral
``model.layers.{i}.block_sparse_moe.experts.{e}.w{1,3,2}.weight`` and
``block_sparse_moe.gate``. Our fused ``qkv_proj`` / ``gate_up_proj`` are concatenations.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from pymooncake.engine.model.layers import SwiGLU
from pymooncake.engine.model.loader import ModelLoadError, weight_files
from pymooncake.engine.model.moe import MOE_ARCHITECTURES, MoEConfig, MoEForCausalLM
from pymooncake.engine.model.tiny import seed_weights, tiny_weight_revision
from pymooncake.engine.model.tokenizer import ByteTokenizer

TINY_MOE = "tiny-moe"
TINY_MOE_SEED = 0


def tiny_moe_config() -> MoEConfig:
    """The ``tiny-moe`` shape."""
    return MoEConfig(architecture="Qwen2MoeForCausalLM", vocab_size=ByteTokenizer.VOCAB_SIZE,
                     hidden_size=128, intermediate_size=256, moe_intermediate_size=96,
                     num_experts=8, top_k=2, num_layers=2, num_heads=4, num_kv_heads=2,
                     head_dim=32, norm_topk_prob=True, shared_expert_intermediate_size=192,
                     rms_norm_eps=1e-6, rope_theta=10000.0, attention_bias=True,
                     bos_token_id=ByteTokenizer.BOS, eos_token_ids=(ByteTokenizer.EOS,))


moe_weight_revision = tiny_weight_revision
"""The weight revision of a seeded MoE: BLAKE3 of (seed, config fields)."""


def build_tiny_moe(cfg: MoEConfig | None = None, seed: int = TINY_MOE_SEED,
                   dtype: torch.dtype = torch.float32) -> MoEForCausalLM:
    """A ``MoEForCausalLM`` with seeded weights (deterministic across machines); the router
    gets spread but decisive logits, the rest ``tiny.seed_weights``' rules."""
    model = MoEForCausalLM(cfg or tiny_moe_config())

    def router(name: str, p: torch.Tensor, gen: torch.Generator) -> bool:
        if not name.endswith("mlp.gate.weight"):
            return False
        p.copy_(2.0 / math.sqrt(p.shape[1]) * torch.randn(p.shape, generator=gen))
        return True

    seed_weights(model, seed, router)
    return model.to(dtype).eval()


def _expert_names(cfg: MoEConfig, i: int, e: int) -> tuple[list[str], str]:
    """HF names of expert ``e`` of layer ``i``: (gate + up sources, down)."""
    if MOE_ARCHITECTURES[cfg.architecture] == "mixtral":
        p = f"model.layers.{i}.block_sparse_moe.experts.{e}."
        return [p + "w1.weight", p + "w3.weight"], p + "w2.weight"
    p = f"model.layers.{i}.mlp.experts.{e}."
    return [p + "gate_proj.weight", p + "up_proj.weight"], p + "down_proj.weight"


def hf_sources(cfg: MoEConfig, name: str) -> list[str]:
    """The HF tensor names whose dim-0 concatenation is our parameter ``name``."""
    parts = name.split(".")
    if not name.startswith("model.layers."):
        return [name]
    i, rest = int(parts[2]), ".".join(parts[3:])
    pre = f"model.layers.{i}."
    mixtral = MOE_ARCHITECTURES[cfg.architecture] == "mixtral"
    if rest.startswith("self_attn.qkv_proj."):
        kind = parts[-1]
        return [f"{pre}self_attn.{p}_proj.{kind}" for p in ("q", "k", "v")]
    if rest.startswith("mlp.experts."):
        e = int(parts[5])
        gate_up, down = _expert_names(cfg, i, e)
        return gate_up if parts[6] == "gate_up_proj" else [down]
    if rest == "mlp.gate.weight":
        return [pre + ("block_sparse_moe.gate.weight" if mixtral else "mlp.gate.weight")]
    if rest.endswith("gate_up_proj.weight"):  # shared expert or dense MLP
        base = pre + rest[:-len("gate_up_proj.weight")]
        return [base + "gate_proj.weight", base + "up_proj.weight"]
    return [pre + rest]


def save_hf_checkpoint(model: MoEForCausalLM, out_dir: str | Path) -> Path:
    """Write ``model`` as a HF model directory (``config.json`` + ``model.safetensors``,
    per-expert tensors, float32). Returns the directory."""
    cfg = model.config
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for name, p in model.state_dict().items():
        if name == "inv_freq":
            continue
        srcs = hf_sources(cfg, name)
        sizes = _split_sizes(cfg, name, p.shape[0], len(srcs))
        for src, part in zip(srcs, torch.split(p.detach().float(), sizes), strict=True):
            tensors[src] = part.contiguous().clone()
    save_file(tensors, str(d / "model.safetensors"))
    mixtral = MOE_ARCHITECTURES[cfg.architecture] == "mixtral"
    raw = {"architectures": [cfg.architecture], "vocab_size": cfg.vocab_size,
           "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
           "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
           "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
           "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
           "num_experts_per_tok": cfg.top_k, "tie_word_embeddings": cfg.tie_word_embeddings,
           "bos_token_id": cfg.bos_token_id, "eos_token_id": list(cfg.eos_token_ids),
           "torch_dtype": "float32", "hidden_act": "silu", "max_position_embeddings": 4096}
    if mixtral:
        raw.update(model_type="mixtral", num_local_experts=cfg.num_experts)
    else:
        dense = [i for i in range(cfg.num_layers) if not cfg.is_moe_layer(i)]
        raw.update(model_type="qwen2_moe", num_experts=cfg.num_experts,
                   moe_intermediate_size=cfg.moe_intermediate_size,
                   shared_expert_intermediate_size=cfg.shared_expert_intermediate_size,
                   norm_topk_prob=cfg.norm_topk_prob, decoder_sparse_step=1,
                   mlp_only_layers=dense, qkv_bias=cfg.attention_bias)
    (d / "config.json").write_text(json.dumps(raw, indent=1))
    return d


def _split_sizes(cfg: MoEConfig, name: str, rows: int, n: int) -> list[int]:
    if n == 3:  # q, k, v
        q = cfg.num_heads * cfg.head_dim
        kv = cfg.num_kv_heads * cfg.head_dim
        return [q, kv, kv]
    return [rows // n] * n


def read_moe_config(model_dir: str | Path) -> MoEConfig:
    """``MoEConfig`` of ``model_dir/config.json``. Raises ``ModelLoadError``."""
    path = Path(model_dir) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{path}: cannot read a JSON config ({e})") from None
    try:
        return MoEConfig.from_hf_config(raw, source=str(path))
    except ValueError as e:
        raise ModelLoadError(str(e)) from None


class _Reader:
    def __init__(self, model_dir: str | Path) -> None:
        self.files = weight_files(model_dir)
        self.dir = Path(model_dir)

    def cat(self, names: list[str], dtype: torch.dtype) -> torch.Tensor:
        parts = []
        for n in names:
            f = self.files.get(n)
            if f is None:
                raise ModelLoadError(f"{self.dir}: tensor {n!r} is missing from the checkpoint")
            with safe_open(str(f), framework="pt") as sf:
                parts.append(sf.get_tensor(n).to(dtype))
        return torch.cat(parts, 0) if len(parts) > 1 else parts[0]


def load_moe_model(model_dir: str | Path, dtype: torch.dtype = torch.float32,
                   load_experts: bool = True) -> MoEForCausalLM:
    """Load a Qwen2-MoE / Mixtral HF directory. ``load_experts=False`` leaves the routed
    experts uninitialised (a front process whose experts live on EP ranks). Raises
    ``ModelLoadError`` naming a missing tensor or a shape mismatch."""
    cfg = read_moe_config(model_dir)
    model = MoEForCausalLM(cfg)
    reader = _Reader(model_dir)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not load_experts and ".mlp.experts." in name:
                continue
            t = reader.cat(hf_sources(cfg, name), dtype)
            if t.shape != p.shape:
                raise ModelLoadError(f"{model_dir}: {name} has shape {tuple(t.shape)}, "
                                     f"expected {tuple(p.shape)}")
            p.copy_(t)
    return model.to(dtype).eval()


def load_expert(model_dir: str | Path, cfg: MoEConfig, layer: int, expert: int,
                dtype: torch.dtype = torch.float32) -> SwiGLU:
    """One routed expert of a HF directory as a ``SwiGLU`` (an EP rank's weights).
    Raises ``ModelLoadError`` when its tensors are missing."""
    reader = _Reader(model_dir)
    gate_up, down = _expert_names(cfg, layer, expert)
    mlp = SwiGLU(cfg.hidden_size, cfg.moe_intermediate_size)
    with torch.no_grad():
        mlp.gate_up_proj.weight.copy_(reader.cat(gate_up, dtype))
        mlp.down_proj.weight.copy_(reader.cat([down], dtype))
    return mlp.to(dtype).eval()
