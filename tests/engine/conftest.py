"""Fixtures of the engine tests: the tiny engine (seeded, CPU) and prompt factories."""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")

from pymooncake.engine import Engine, EngineConfig  # noqa: E402


def make_engine(**overrides: object) -> Engine:
    """A fresh ``tiny`` engine (fp32 unless ``dtype`` is overridden)."""
    return Engine.from_model_name("tiny", EngineConfig(**overrides))  # type: ignore[arg-type]


@pytest.fixture
def tiny_engine() -> Engine:
    return make_engine()


def random_prompts(n: int, lo: int, hi: int, seed: int = 0, vocab: int = 256) -> list[list[int]]:
    """``n`` prompts of random lengths in ``[lo, hi]`` of random byte ids, each starting
    with BOS (256)."""
    rng = random.Random(seed)
    return [[256] + [rng.randrange(vocab) for _ in range(rng.randint(lo, hi) - 1)]
            for _ in range(n)]
