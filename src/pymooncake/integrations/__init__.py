"""Adapters that let other engines use pymooncake's parts (DESIGN.md §2, ``integrations``).

``pymooncake.integrations.vllm``: a vLLM ``KVConnectorBase_V1`` on the pymooncake Store.
Nothing below this layer imports it.
"""
