"""pymooncake: Mooncake's KVCache-centric disaggregated LLM serving, in Python.

Packages, in the order a request travels (DESIGN.md §1–§2):
``api`` → ``conductor`` (``conductor.policy``) → ``engine`` (prefill worker) →
``store`` → ``transfer`` → ``engine`` (decode worker); underneath: ``identity``,
``rpc``, ``metadata``, ``obs``; beside: ``workload`` and ``sim``.
"""

__version__ = "0.1.0"
