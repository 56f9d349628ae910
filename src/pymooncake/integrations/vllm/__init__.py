"""vLLM KV connector on the pymooncake Store (issue 18; docs/vllm.md).

vLLM loads ``PymooncakeConnector`` from this module through ``--kv-transfer-config``'s
``kv_connector_module_path``. It is imported lazily so that ``plan`` (the pure parts) is
usable without vLLM installed; asking for the connector without vLLM raises
``ImportError`` naming the install command.
"""

from __future__ import annotations

from typing import Any

__all__ = ["PymooncakeConnector", "PymooncakeConnectorMetadata"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        try:
            from pymooncake.integrations.vllm import connector
        except ImportError as e:
            if e.name and e.name.split(".")[0] in ("vllm", "torch"):
                raise ImportError(f"pymooncake.integrations.vllm.{name} needs vLLM in this "
                                  f"interpreter ({e}); see docs/vllm.md") from e
            raise
        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
