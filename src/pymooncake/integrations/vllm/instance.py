"""What the vLLM connector derives from its process and its vLLM instance: the one Store
client of the process (vLLM may run the scheduler-side and worker-side connectors in one
process) and the instance's cache namespace (DESIGN.md §3)."""

from __future__ import annotations

import atexit
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from pymooncake.identity import CacheNamespace, tokenizer_fingerprint
from pymooncake.integrations.vllm.plan import (
    ConnectorConfig,
    kv_dtype_name,
    vllm_namespace,
    weight_digest,
)
from pymooncake.store.client import StoreClient
from pymooncake.store.errors import StoreError

if TYPE_CHECKING:
    from vllm.config import VllmConfig

_clients: dict[tuple, StoreClient] = {}
_digests: dict[str, str] = {}
_shared_lock = threading.Lock()


def shared_client(cfg: ConnectorConfig) -> StoreClient:
    """This process's Store client for ``cfg`` (started on first use, closed at exit).
    Raises ``StoreError`` (the original code) when the master or the metadata service
    cannot be reached, naming the ``kv_connector_extra_config`` key and its address."""
    from pymooncake.transfer import TransferConfig

    key = (cfg.master, cfg.metadata, cfg.local_hostname, cfg.transports, cfg.rpc_timeout_s)
    with _shared_lock:
        c = _clients.get(key)
        if c is None:
            try:
                c = StoreClient(cfg.master, cfg.metadata, local_hostname=cfg.local_hostname,
                                local_buffer_size=0, rpc_timeout_s=cfg.rpc_timeout_s,
                                transfer_config=TransferConfig(host=cfg.local_hostname,
                                                               transports=cfg.transports)
                                ).start()
            except StoreError as e:
                key, addr = (("metadata", cfg.metadata) if cfg.metadata in str(e)
                             or "metadata" in str(e).lower() else ("master", cfg.master))
                raise StoreError(e.code, f"PymooncakeConnector cannot reach the Store: "
                                 f"kv_connector_extra_config.{key} = {addr!r}: {e.message} "
                                 "(start `pymooncake master`/the metadata service first, "
                                 "or fix the address; docs/vllm.md)") from e
            _clients[key] = c
            atexit.register(c.close)
        return c


def namespace_of(vllm_config: VllmConfig, cfg: ConnectorConfig) -> CacheNamespace:
    """The cache namespace of this vLLM instance (``plan.vllm_namespace``). Raises
    ``ValueError`` for what the connector does not support (tensor or pipeline
    parallelism, an unknown KV dtype) or cannot fingerprint."""
    mc, pc, cc = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
    if pc.tensor_parallel_size != 1 or pc.pipeline_parallel_size != 1:
        raise ValueError("PymooncakeConnector supports tensor_parallel_size=1 and "
                         "pipeline_parallel_size=1 only (the KV of one instance is one shard)")
    revision = cfg.weight_revision
    if revision is None:
        if not Path(mc.model).is_dir():
            raise ValueError(f"model {mc.model!r} is not a local directory: set "
                             "kv_connector_extra_config.weight_revision")
        with _shared_lock:
            revision = _digests.get(mc.model)
            if revision is None:
                revision = _digests[mc.model] = weight_digest(mc.model)
    tok = mc.tokenizer
    tok_fp = (tokenizer_fingerprint(tok) if Path(tok).is_dir() else
              tokenizer_fingerprint(None, chat_template=f"hub:{tok}@{mc.tokenizer_revision}"))
    dtype = cc.cache_dtype if cc.cache_dtype != "auto" else str(mc.dtype)
    return vllm_namespace(
        model_id=cfg.model_id or str(mc.served_model_name or mc.model),
        weight_revision=revision, tokenizer_fingerprint=tok_fp, kv_dtype=kv_dtype_name(dtype),
        num_layers=mc.get_num_layers(pc), num_kv_heads=mc.get_num_kv_heads(pc),
        head_dim=mc.get_head_size(), block_size=cc.block_size, tenant_salt=cfg.tenant_salt)
