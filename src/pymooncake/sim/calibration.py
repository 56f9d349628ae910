"""A measured CPU calibration of the simulator's costs (issue 15, build item 5; docs/sim.md,
"CPU calibration").

``pymooncake sim calibrate-cpu`` (the harness lives in ``pymooncake.bench.calibrate``: the
simulator never imports the engine) times the real engine on one pinned core and writes one
JSON file; ``sim run/sweep --calibration FILE`` replays traces with those costs in place of a
GPU preset's roofline. A "node" of the simulated cluster is then one core running one engine.

File format (``"format": "pymooncake.sim.calibration"``, ``"version": 1``), seconds and
tokens throughout::

    {"format": "pymooncake.sim.calibration", "version": 1,
     "label": "draft, measured under load",          # free text, shown by sim run
     "model": {"name": "smollm2", "num_layers": 30, "kv_bytes_per_token": 46080,
               "dtype": "float32"},
     "prefill": {"quadratic_s": ..., "linear_s": ..., "overhead_s": ...},
                 # t(n, p) = q·(n² − p²) + l·(n − p) + o   (conductor.policy.PrefillEstimator)
     "decode": {"overhead_s": ..., "weight_s": ..., "per_sequence_s": ...,
                "per_context_token_s": ..., "attention_per_context_token_s": ...},
                 # step(B, C) = o + max(s·B, w + m·C) + a·C   (DecodeEstimator)
     "transfer": {"kv_bytes_per_token": 46080, "bandwidth_bytes_per_s": ...,
                  "overhead_s": ..., "bandwidth_source": "measured copy" | "flag"},
     "node": {"kv_capacity_tokens": 16384, "engine_block_size": 16,
              "prefill_chunk_tokens": 512, "cores": 1, "threads": 1},
     "step": {"overhead_s": ..., "per_token_s": ..., "per_pair_s": ...,
              "per_sequence_s": ..., "per_decode_context_token_s": ...,
              "per_prefix_token_s": ...},                                     # optional
                 # one engine step = a + b·tokens + c·pairs + e·sequences
                 #   + g·decode context + h·chunk prefix                      (StepCost)
     "samples": {"prefill": [[n, p, s], ...], "decode": [[B, C, s], ...],
                 "step": [[B, D, k, p, s], ...]},                             # optional
     "fit": {"prefill_rel_rms": ..., "decode_rel_rms": ..., "step_rel_rms": ...},  # optional
     "provenance": {...}}   # optional: machine, CPU, versions, commit, engine paths, load

Required: ``format``, ``version``, ``model.num_layers``, ``model.kv_bytes_per_token``, every
number of ``prefill``, ``decode`` (``per_context_token_s`` and
``attention_per_context_token_s`` default to 0) and ``transfer``, and
``node.kv_capacity_tokens``. ``load_calibration`` names the first bad field.

``step`` (written by ``calibrate-cpu --mixed-chunks``; absent from older files, which load
and behave as before): the cost of one whole engine step of any composition, fitted from
timed steps of ``B`` decodes (attention pairs ``D`` in all) beside one prefill chunk of ``k``
tokens after ``p`` computed ones (``samples.step``; ``k = 0``: decode-only, ``B = 0``:
prefill alone). ``tokens`` = ``B + k``, ``pairs`` = ``D + attention_pairs(p, k)``,
``sequences`` = ``B + (k > 0)``, ``decode context`` = ``D``, ``chunk prefix`` = ``p``
(``step_features``). The simulator's engine-stepped node (``sim.engine_node``, ``ours-1w``)
then charges every step with it; every other node keeps the ``prefill`` and ``decode``
fits. The last three coefficients default to 0.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pymooncake.conductor.policy import (
    DecodeEstimator,
    Estimators,
    PrefillEstimator,
    TransferEstimator,
)
from pymooncake.sim.step_cost import (  # noqa: F401  (re-exported: the file's ``step``)
    DEFAULT_STEP_TERMS,
    STEP_TERMS,
    StepCost,
    attention_pairs,
    fit_step_cost,
    step_features,
    step_rel_errors,
)

FORMAT = "pymooncake.sim.calibration"
VERSION = 1


class CalibrationError(ValueError):
    """A calibration file that cannot be used; the message is ``FILE: field: what``."""


@dataclass(frozen=True, slots=True)
class CalibratedModel:
    """What the simulator needs of the model when costs come from a calibration."""

    name: str
    num_layers: int
    kv_bytes_per_token: int
    dtype: str = "float32"


@dataclass(frozen=True, slots=True)
class Calibration:
    """A parsed calibration file (see the module docstring)."""

    model: CalibratedModel
    prefill: PrefillEstimator
    decode: DecodeEstimator
    transfer: TransferEstimator
    kv_capacity_tokens: int
    label: str = ""
    node: dict[str, Any] = field(default_factory=dict)
    samples: dict[str, Any] = field(default_factory=dict)
    fit: dict[str, Any] = field(default_factory=dict)
    provenance: dict[str, Any] = field(default_factory=dict)
    transfer_source: str = "flag"
    step: StepCost | None = None
    """The fitted cost of a whole engine step (the file's optional ``step``), None in files
    written before it or without ``--mixed-chunks``."""

    def to_json(self) -> dict[str, Any]:
        """The file's document (``parse_calibration(c.to_json()) == c``)."""
        p, d, t = self.prefill, self.decode, self.transfer
        step = {} if self.step is None else {"step": self.step.to_json()}
        return {
            "format": FORMAT, "version": VERSION, "label": self.label,
            "model": {"name": self.model.name, "num_layers": self.model.num_layers,
                      "kv_bytes_per_token": self.model.kv_bytes_per_token,
                      "dtype": self.model.dtype},
            "prefill": {"quadratic_s": p.quadratic_s, "linear_s": p.linear_s,
                        "overhead_s": p.overhead_s},
            "decode": {"overhead_s": d.overhead_s, "weight_s": d.weight_s,
                       "per_sequence_s": d.per_sequence_s,
                       "per_context_token_s": d.per_context_token_s,
                       "attention_per_context_token_s": d.attention_per_context_token_s},
            "transfer": {"kv_bytes_per_token": t.kv_bytes_per_token,
                         "bandwidth_bytes_per_s": t.bandwidth_bytes_per_s,
                         "overhead_s": t.overhead_s, "bandwidth_source": self.transfer_source},
            "node": {**self.node, "kv_capacity_tokens": self.kv_capacity_tokens}, **step,
            "samples": self.samples, "fit": self.fit, "provenance": self.provenance}


def _num(doc: dict[str, Any], sect: str, key: str, where: str, *, lo: float = 0.0,
         strict: bool = False, default: float | None = None) -> float:
    if key not in doc:
        if default is not None:
            return default
        raise CalibrationError(f"{where}: {sect}.{key}: missing")
    v = doc[key]
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise CalibrationError(f"{where}: {sect}.{key}: must be a finite number, got {v!r}")
    if v < lo or (strict and v == lo):
        raise CalibrationError(f"{where}: {sect}.{key}: must be {'>' if strict else '>='} "
                               f"{lo:g}, got {v!r}")
    return float(v)


def _int(doc: dict[str, Any], sect: str, key: str, where: str) -> int:
    v = doc.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise CalibrationError(f"{where}: {sect}.{key}: must be an int >= 1, got {v!r}")
    return v


def _section(doc: dict[str, Any], name: str, where: str) -> dict[str, Any]:
    s = doc.get(name)
    if not isinstance(s, dict):
        raise CalibrationError(f"{where}: {name}: missing or not an object")
    return s


def parse_calibration(doc: Any, where: str = "calibration") -> Calibration:
    """A ``Calibration`` from a decoded JSON document; ``CalibrationError`` names the bad
    field (``where`` prefixes the message, e.g. the file name)."""
    if not isinstance(doc, dict):
        raise CalibrationError(f"{where}: not a JSON object")
    if doc.get("format") != FORMAT:
        raise CalibrationError(f"{where}: format: expected {FORMAT!r}, got "
                               f"{doc.get('format')!r} (write one with "
                               "`pymooncake sim calibrate-cpu`)")
    if doc.get("version") != VERSION:
        raise CalibrationError(f"{where}: version: this pymooncake reads version {VERSION}, "
                               f"got {doc.get('version')!r}")
    m = _section(doc, "model", where)
    model = CalibratedModel(str(m.get("name", "model")), _int(m, "model", "num_layers", where),
                            _int(m, "model", "kv_bytes_per_token", where),
                            str(m.get("dtype", "float32")))
    p = _section(doc, "prefill", where)
    pre = PrefillEstimator(_num(p, "prefill", "quadratic_s", where),
                           _num(p, "prefill", "linear_s", where, strict=True),
                           _num(p, "prefill", "overhead_s", where))
    d = _section(doc, "decode", where)
    dec = DecodeEstimator(
        overhead_s=_num(d, "decode", "overhead_s", where),
        weight_s=_num(d, "decode", "weight_s", where),
        per_context_token_s=_num(d, "decode", "per_context_token_s", where, default=0.0),
        per_sequence_s=_num(d, "decode", "per_sequence_s", where),
        attention_per_context_token_s=_num(d, "decode", "attention_per_context_token_s",
                                           where, default=0.0))
    if dec.step_s(1, 1) <= 0:
        raise CalibrationError(f"{where}: decode: a step of batch 1 takes no time; the "
                               "coefficients are all 0")
    t = _section(doc, "transfer", where)
    kvb = _int(t, "transfer", "kv_bytes_per_token", where)
    if kvb != model.kv_bytes_per_token:
        raise CalibrationError(f"{where}: transfer.kv_bytes_per_token ({kvb}) != "
                               f"model.kv_bytes_per_token ({model.kv_bytes_per_token})")
    tr = TransferEstimator(kvb, _num(t, "transfer", "bandwidth_bytes_per_s", where, strict=True),
                           _num(t, "transfer", "overhead_s", where))
    node = _section(doc, "node", where)
    cap = _int(node, "node", "kv_capacity_tokens", where)
    step = None
    if "step" in doc:
        st = _section(doc, "step", where)
        step = StepCost(_num(st, "step", "overhead_s", where),
                        _num(st, "step", "per_token_s", where, strict=True),
                        _num(st, "step", "per_pair_s", where),
                        *(_num(st, "step", key, where, default=0.0) for key in (
                            "per_sequence_s", "per_decode_context_token_s",
                            "per_prefix_token_s")))
    extras = {}
    for k in ("samples", "fit", "provenance"):
        v = doc.get(k, {})
        if not isinstance(v, dict):
            raise CalibrationError(f"{where}: {k}: must be an object, got {type(v).__name__}")
        extras[k] = v
    return Calibration(model, pre, dec, tr, cap, label=str(doc.get("label", "")),
                       node=dict(node), transfer_source=str(t.get("bandwidth_source", "flag")),
                       step=step, **extras)


def load_calibration(path: str | Path) -> Calibration:
    """Read and validate a calibration file; ``CalibrationError`` says what is wrong."""
    p = Path(path)
    try:
        doc = json.loads(p.read_text())
    except FileNotFoundError:
        raise CalibrationError(f"{p}: no such calibration file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise CalibrationError(f"{p}: cannot read ({e})") from None
    except ValueError as e:
        raise CalibrationError(f"{p}: not JSON ({e})") from None
    return parse_calibration(doc, str(p))


@dataclass(frozen=True, slots=True)
class CalibratedCostModel:
    """The simulator's cost model from a ``Calibration``: one node = one core.

    * prefill: the fitted ``PrefillEstimator`` (at least the last prompt token is computed,
      as on the engine); a local prefix is in the same DRAM, so there is no load time;
    * decode step: the fitted ``DecodeEstimator``;
    * transfer (P→D KV, remote prefix blocks): ``bytes / bandwidth + overhead``.
    The policy's estimators are exactly these (the Conductor predicts with the truth).
    """

    calibration: Calibration
    chunk_size_tokens: int = 512
    chunk_overhead_s: float = 0.0

    @property
    def model(self) -> CalibratedModel:
        return self.calibration.model

    @property
    def kv_capacity_tokens(self) -> int:
        return self.calibration.kv_capacity_tokens

    def prefill_compute_s(self, num_tokens: int, num_prefix_tokens: int = 0) -> float:
        p = min(max(num_prefix_tokens, 0), num_tokens - 1)
        return (self.calibration.prefill.prefill_s(num_tokens, p)
                + self.num_chunks(num_tokens - p) * self.chunk_overhead_s)

    def prefill_s(self, num_tokens: int, num_prefix_tokens: int = 0) -> float:
        return self.prefill_compute_s(num_tokens, num_prefix_tokens)

    def num_chunks(self, num_new_tokens: int) -> int:
        return max(1, math.ceil(num_new_tokens / self.chunk_size_tokens))

    def kv_bytes(self, num_tokens: int) -> int:
        return num_tokens * self.model.kv_bytes_per_token

    def transfer_s(self, num_tokens: int) -> float:
        return self.calibration.transfer.transfer_s(num_tokens)

    def decode_step_s(self, batch_size: int, num_context_tokens: int) -> float:
        return self.calibration.decode.step_s(batch_size, num_context_tokens)

    def estimators(self) -> Estimators:
        c = self.calibration
        return Estimators(prefill=c.prefill, transfer=c.transfer, decode=c.decode)
