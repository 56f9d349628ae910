"""Cost model of the simulated cluster: roofline prefill/decode times for a named GPU and model,
and KV transfer times (Mooncake FAST'25 §2.2 Table 1, §5.4.3 Figure 14; PAPER.md §6).

* Prefill of ``n`` tokens with ``p`` reused: ``FLOPs = l·(a·(n²−p²)·d + b·(n−p)·d²)``
  (the paper's Eq. 1 with the prefix subtracted). The attention term (``a``, here the causal
  ``a = 2``) and the linear term (``b = 2·params per layer / d²``) run at their own efficiency
  of the node's peak: ``t = attn / (G·attention_efficiency) + linear / (G·mfu)``.
* Decode step of a batch ``B`` with ``C`` context tokens: ``overhead + max(2·params·B /
  (G·mfu), (weight bytes + C·kv_bytes_per_token) / (HBM bandwidth·hbm_efficiency))``.
* Transfer: ``bytes / bandwidth + overhead``.

The A800 efficiencies are calibrated on LLaMA3-70B against Figure 14a: the prefill term
reproduces the fit ``7.146e-10·(n²−p²) + 1.1622e-4·(n−p)`` s (within 2.5 % of the five
measured points), the decode term gives 26.5 ms/token at 8k and 30.8 ms at 128k context.
Other GPUs reuse these efficiencies with their own published peaks (an assumption).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from pymooncake.conductor.policy import (
    DecodeEstimator,
    Estimators,
    PrefillEstimator,
    TransferEstimator,
)


class CostModelError(ValueError):
    """Unknown preset or an unusable model/GPU description; the message says what to change."""


@dataclass(frozen=True, slots=True)
class GpuPreset:
    """One node of 8 GPUs of a kind (tensor-parallel 8), with published per-GPU peaks."""

    name: str
    peak_bf16_flops: float
    """Dense BF16 FLOP/s of one GPU (vendor datasheet)."""
    hbm_bandwidth_bytes_per_s: float
    """HBM bandwidth of one GPU."""
    hbm_bytes: float
    """HBM capacity of one GPU."""
    num_gpus: int = 8
    mfu: float = 0.4720
    """Efficiency of the linear (GEMM) FLOPs; calibrated on A800 (Figure 14a)."""
    attention_efficiency: float = 0.7349
    """Efficiency of the attention FLOPs (causal, a = 2); calibrated on A800 (Figure 14a)."""
    hbm_efficiency: float = 0.5741
    """Achieved fraction of HBM bandwidth in decode; calibrated on Figure 14a's TBTs."""
    decode_step_overhead_s: float = 0.01114
    """Per-step overhead (launches, TP all-reduce); calibrated on Figure 14a's TBTs."""
    h2d_bandwidth_bytes_per_s: float = 95e9
    """Node DRAM → HBM bandwidth when loading cached KV (Figure 14: 0.421 s for ~40 GB)."""

    @property
    def node_flops(self) -> float:
        return self.peak_bf16_flops * self.num_gpus

    @property
    def node_hbm_bandwidth_bytes_per_s(self) -> float:
        return self.hbm_bandwidth_bytes_per_s * self.num_gpus

    @property
    def node_hbm_bytes(self) -> float:
        return self.hbm_bytes * self.num_gpus


GPU_PRESETS: dict[str, GpuPreset] = {
    # NVIDIA datasheets: dense BF16 tensor FLOP/s, HBM bandwidth, HBM size (SXM parts).
    "A800": GpuPreset("A800", 312e12, 2.039e12, 80e9),
    "H800": GpuPreset("H800", 989e12, 3.35e12, 80e9),
    "H100": GpuPreset("H100", 989e12, 3.35e12, 80e9),
    "H200": GpuPreset("H200", 989e12, 4.8e12, 141e9),
}


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """The shape of a decoder-only transformer, enough for FLOPs and KV bytes."""

    name: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    dtype_bytes: int = 2
    attention_flops_coeff: float = 2.0
    """``a`` of Eq. 1 (2 = causal QKᵀ and PV; the paper's non-causal count is 4)."""

    def __post_init__(self) -> None:
        for f in ("num_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
                  "intermediate_size", "vocab_size", "dtype_bytes"):
            v = getattr(self, f)
            if not isinstance(v, int) or v < 1:
                raise CostModelError(f"model {self.name!r}: {f} must be a positive int, got {v!r}")
        if self.hidden_size % self.num_attention_heads:
            raise CostModelError(f"model {self.name!r}: hidden_size must be divisible by "
                                 "num_attention_heads")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def kv_bytes_per_token(self) -> int:
        """``2 (K,V) · layers · kv_heads · head_dim · dtype bytes`` (327,680 for LLaMA3-70B)."""
        return (2 * self.num_layers * self.num_key_value_heads * self.head_dim
                * self.dtype_bytes)

    @property
    def params_per_layer(self) -> int:
        d = self.hidden_size
        kv = self.num_key_value_heads * self.head_dim
        return 2 * d * d + 2 * d * kv + 3 * d * self.intermediate_size

    @property
    def num_params(self) -> int:
        """Layers' weights + input and output embeddings (norms neglected)."""
        return self.num_layers * self.params_per_layer + 2 * self.vocab_size * self.hidden_size

    @property
    def linear_flops_coeff(self) -> float:
        """``b`` of Eq. 1: 2·params per layer / d² (25.5 for LLaMA3-70B; the paper rounds 22)."""
        return 2 * self.params_per_layer / (self.hidden_size ** 2)

    @property
    def weight_bytes(self) -> int:
        return self.num_params * self.dtype_bytes


MODEL_PRESETS: dict[str, ModelSpec] = {
    "llama3-70b": ModelSpec("llama3-70b", 80, 8192, 64, 8, 28672, 128256),
    "llama2-70b": ModelSpec("llama2-70b", 80, 8192, 64, 8, 28672, 32000),
}

_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1, "int8": 1}


def model_from_hf_config(path: str | Path) -> ModelSpec:
    """A ``ModelSpec`` from a Hugging Face ``config.json`` (file or directory holding one).

    Raises ``CostModelError`` when the file is missing, not JSON, or lacks a needed field.
    """
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        cfg = json.loads(p.read_text())
    except FileNotFoundError:
        raise CostModelError(f"{p}: no such config.json") from None
    except (OSError, ValueError) as e:
        raise CostModelError(f"{p}: cannot read a JSON config ({e})") from None
    try:
        heads = cfg["num_attention_heads"]
        dtype = str(cfg.get("torch_dtype", "bfloat16"))
        if dtype not in _DTYPE_BYTES:
            raise CostModelError(f"{p}: unknown torch_dtype {dtype!r}; known: "
                                 f"{sorted(_DTYPE_BYTES)}")
        return ModelSpec(
            name=str(cfg.get("_name_or_path") or p.parent.name or "hf-model"),
            num_layers=cfg["num_hidden_layers"], hidden_size=cfg["hidden_size"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads", heads),
            intermediate_size=cfg["intermediate_size"], vocab_size=cfg["vocab_size"],
            dtype_bytes=_DTYPE_BYTES[dtype])
    except KeyError as e:
        raise CostModelError(f"{p}: config.json lacks {e.args[0]!r}") from None


def resolve_model(name: str) -> ModelSpec:
    """A preset name (case-insensitive: LLaMA3-70B, LLaMA2-70B) or a path to a config.json."""
    key = name.lower()
    if key in MODEL_PRESETS:
        return MODEL_PRESETS[key]
    if name.endswith(".json") or Path(name).is_dir():
        return model_from_hf_config(name)
    raise CostModelError(f"unknown model {name!r}; use one of {sorted(MODEL_PRESETS)} or a "
                         "path to a Hugging Face config.json")


def resolve_gpu(name: str) -> GpuPreset:
    """A GPU preset by name (case-insensitive: A800, H800, H100, H200)."""
    g = GPU_PRESETS.get(name.upper())
    if g is None:
        raise CostModelError(f"unknown GPU {name!r}; use one of {sorted(GPU_PRESETS)}")
    return g


@dataclass(frozen=True, slots=True)
class CostModel:
    """Ground-truth times of the simulated cluster (seconds, bytes, tokens)."""

    model: ModelSpec
    gpu: GpuPreset
    network_bandwidth_bytes_per_s: float = 87e9
    """Inter-node KV bandwidth (Transfer Engine on 4×200 Gbps, Figure 12)."""
    transfer_overhead_s: float = 0.001
    """Fixed cost per batch transfer."""
    chunk_size_tokens: int = 4096
    """Chunked prefill: uncached tokens above this are prefilled in chunks of this size."""
    chunk_overhead_s: float = 0.0
    """Extra time per prefill chunk."""
    hbm_utilization: float = 0.9
    """Share of HBM usable for weights + KV on a decode node."""

    def __post_init__(self) -> None:
        if not math.isfinite(self.network_bandwidth_bytes_per_s) \
                or self.network_bandwidth_bytes_per_s <= 0:
            raise CostModelError("network bandwidth must be a finite number > 0 bytes/s, "
                                 f"got {self.network_bandwidth_bytes_per_s}")
        if self.chunk_size_tokens < 1:
            raise CostModelError(f"chunk_size_tokens must be >= 1, got {self.chunk_size_tokens}")
        if self.kv_capacity_tokens < 1:
            raise CostModelError(f"model {self.model.name} does not fit on one {self.gpu.name} "
                                 "node's HBM; pick a bigger GPU or a smaller model")

    # --- prefill -----------------------------------------------------------------------
    @property
    def prefill_quadratic_s(self) -> float:
        m, g = self.model, self.gpu
        return (m.num_layers * m.attention_flops_coeff * m.hidden_size
                / (g.node_flops * g.attention_efficiency))

    @property
    def prefill_linear_s(self) -> float:
        m, g = self.model, self.gpu
        return m.num_layers * m.linear_flops_coeff * m.hidden_size ** 2 / (g.node_flops * g.mfu)

    def prefill_flops(self, num_tokens: int, num_prefix_tokens: int = 0) -> float:
        """Eq. 1 with the prefix subtracted, with this model's ``a`` and ``b``."""
        m = self.model
        n, p = num_tokens, min(num_prefix_tokens, num_tokens)
        return m.num_layers * (m.attention_flops_coeff * (n * n - p * p) * m.hidden_size
                               + m.linear_flops_coeff * (n - p) * m.hidden_size ** 2)

    def prefill_compute_s(self, num_tokens: int, num_prefix_tokens: int = 0) -> float:
        """GPU time to prefill ``num_tokens`` with ``num_prefix_tokens`` reused.

        At least the last prompt token is computed (its logits give the first output token),
        so a full hit still costs one token. Chunks telescope (``Σ (n_i² − n_{i-1}²) = n² − p²``),
        so chunking adds only ``chunk_overhead_s`` per chunk.
        """
        p = min(max(num_prefix_tokens, 0), num_tokens - 1)
        new = num_tokens - p
        t = self.prefill_quadratic_s * (num_tokens ** 2 - p * p) + self.prefill_linear_s * new
        return t + self.num_chunks(new) * self.chunk_overhead_s

    def num_chunks(self, num_new_tokens: int) -> int:
        return max(1, math.ceil(num_new_tokens / self.chunk_size_tokens))

    def cache_load_s(self, num_tokens: int) -> float:
        """DRAM → HBM load of ``num_tokens`` tokens of KV (layer-wise, Figure 14)."""
        return num_tokens * self.model.kv_bytes_per_token / self.gpu.h2d_bandwidth_bytes_per_s

    def prefill_s(self, num_tokens: int, num_prefix_tokens: int = 0) -> float:
        """Prefill wall time: compute overlapped layer by layer with loading the reused KV.

        ``max(compute, load) + load / layers`` (the first layer's load cannot overlap).
        """
        comp = self.prefill_compute_s(num_tokens, num_prefix_tokens)
        if num_prefix_tokens <= 0:
            return comp
        load = self.cache_load_s(min(num_prefix_tokens, num_tokens))
        return max(comp, load) + load / self.model.num_layers

    # --- transfer ----------------------------------------------------------------------
    def kv_bytes(self, num_tokens: int) -> int:
        return num_tokens * self.model.kv_bytes_per_token

    def transfer_s(self, num_tokens: int) -> float:
        """Moving ``num_tokens`` tokens of KV between nodes: bytes / bandwidth + overhead."""
        if num_tokens <= 0:
            return 0.0
        return self.kv_bytes(num_tokens) / self.network_bandwidth_bytes_per_s \
            + self.transfer_overhead_s

    # --- decode ------------------------------------------------------------------------
    @property
    def decode_mem_base_s(self) -> float:
        """Step memory time for the weights alone."""
        return self.model.weight_bytes / self._hbm_effective

    @property
    def decode_mem_per_token_s(self) -> float:
        """Step memory time added per context token in the batch."""
        return self.model.kv_bytes_per_token / self._hbm_effective

    @property
    def decode_compute_per_seq_s(self) -> float:
        """Step compute time added per sequence in the batch (2·params FLOPs)."""
        return 2 * self.model.num_params / (self.gpu.node_flops * self.gpu.mfu)

    @property
    def _hbm_effective(self) -> float:
        return self.gpu.node_hbm_bandwidth_bytes_per_s * self.gpu.hbm_efficiency

    def decode_step_s(self, batch_size: int, num_context_tokens: int) -> float:
        """One continuous-batching step (every running request gets one token)."""
        if batch_size <= 0:
            return 0.0
        mem = self.decode_mem_base_s + self.decode_mem_per_token_s * num_context_tokens
        return self.gpu.decode_step_overhead_s + max(
            self.decode_compute_per_seq_s * batch_size, mem)

    @property
    def kv_capacity_tokens(self) -> int:
        """KV tokens a decode node's HBM holds beside the weights."""
        free = self.gpu.node_hbm_bytes * self.hbm_utilization - self.model.weight_bytes
        return int(free // self.model.kv_bytes_per_token)

    def estimators(self) -> Estimators:
        """The policy's predictors, fitted exactly to this cost model (no-prefix form)."""
        return Estimators(
            prefill=PrefillEstimator(self.prefill_quadratic_s, self.prefill_linear_s, 0.0),
            transfer=TransferEstimator(self.model.kv_bytes_per_token,
                                       self.network_bandwidth_bytes_per_s,
                                       self.transfer_overhead_s),
            decode=DecodeEstimator(self.gpu.decode_step_overhead_s, self.decode_mem_base_s,
                                   self.decode_mem_per_token_s, self.decode_compute_per_seq_s))


# Figure 14a (8×A800, LLaMA3-70B, no prefix cache): prompt tokens → prefill s, decode 128 s.
FIGURE14_PREFILL_S: dict[int, float] = {8192: 1.002, 16384: 2.055, 32768: 4.478,
                                        65536: 10.587, 131072: 27.514}
FIGURE14_DECODE128_S: dict[int, float] = {8192: 3.395, 16384: 3.433, 32768: 3.521,
                                          65536: 3.659, 131072: 3.940}


def calibration_table(cm: CostModel) -> list[dict[str, float]]:
    """Model vs Figure 14a per prompt length: prefill and 128-token decode (batch 1)."""
    rows = []
    for n, paper in FIGURE14_PREFILL_S.items():
        pre = cm.prefill_s(n, 0)
        dec = sum(cm.decode_step_s(1, n + k) for k in range(128))
        rows.append({"prompt_tokens": n, "prefill_model_s": pre, "prefill_paper_s": paper,
                     "prefill_error": pre / paper - 1.0, "decode128_model_s": dec,
                     "decode128_paper_s": FIGURE14_DECODE128_S[n],
                     "decode128_error": dec / FIGURE14_DECODE128_S[n] - 1.0})
    return rows
