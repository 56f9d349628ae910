"""Paged-KV inference engine (DESIGN.md §6): Llama-family model, paged KV cache with a local
prefix cache, continuous batching with chunked prefill, per-layer hooks, three roles.

Public API: ``Engine``, ``EngineConfig``, ``SamplingParams``, ``RequestOutput``,
``FinishReason``, ``ExportedBlock``, ``make_namespace``. Exports are resolved lazily, so the
pure cores (``engine.kv.block_pool``, ``engine.kv.kv_cache_manager``, ``engine.scheduler``,
``engine.request``, ``engine.config``) import without torch; ``Engine`` imports torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Engine": "pymooncake.engine.engine",
    "ExportedBlock": "pymooncake.engine.engine",
    "PrefixCacheStats": "pymooncake.engine.engine",
    "make_namespace": "pymooncake.engine.engine",
    "EngineConfig": "pymooncake.engine.config",
    "FinishReason": "pymooncake.engine.request",
    "RequestOutput": "pymooncake.engine.request",
    "SamplingParams": "pymooncake.engine.sampling",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'pymooncake.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
