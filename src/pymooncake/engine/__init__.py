"""Paged-KV inference engine (DESIGN.md §6): Llama-family model, paged KV cache with a local
prefix cache, continuous batching with chunked prefill, per-layer hooks, three roles.

Public API: ``Engine``, ``EngineConfig``, ``SamplingParams``, ``RequestOutput``,
``ExportedBlock``. Importing this package imports torch.
"""

from pymooncake.engine.config import EngineConfig
from pymooncake.engine.engine import Engine, ExportedBlock, PrefixCacheStats, make_namespace
from pymooncake.engine.request import FinishReason, RequestOutput
from pymooncake.engine.sampling import SamplingParams

__all__ = ["Engine", "EngineConfig", "ExportedBlock", "FinishReason", "PrefixCacheStats",
           "RequestOutput", "SamplingParams", "make_namespace"]
