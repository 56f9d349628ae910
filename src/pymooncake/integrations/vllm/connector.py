"""``PymooncakeConnector``: vLLM's ``KVConnectorBase_V1`` on the pymooncake Store.

Loaded by vLLM (no patch) with ``--kv-transfer-config '{"kv_connector":
"PymooncakeConnector", "kv_connector_module_path": "pymooncake.integrations.vllm",
"kv_role": "kv_both", "kv_connector_extra_config": {"master": ..., "metadata": ...}}'``;
see docs/vllm.md. This is the shared prefix store (issue 18, role (a); Mooncake paper §3.2,
§5.1 "KVCache reuse"): every vLLM instance puts the full blocks it computes into the Store
and loads, before computing a prompt, the longest prefix of its blocks the Store holds.

vLLM calls the two halves in different places:

* **scheduler side** (``get_num_new_matched_tokens``, ``update_state_after_alloc``,
  ``build_connector_meta``, ``request_finished``): block keys of the prompt
  (``pymooncake.identity``, namespace from ``plan.vllm_namespace``), one ``batch_exist``
  RPC to the master for the prefix hit, and ``plan.Planner``'s per-step load/save lists;
* **worker side** (``register_kv_caches``, ``start_load_kv``, ``wait_for_layer_load``,
  ``save_kv_layer``, ``wait_for_save``, ``get_finished``): the paged KV tensors are
  registered with the Transfer Engine once; loads run layer by layer on a loader thread
  (``batch_get_into`` straight into vLLM's blocks) while the forward computes, each
  attention layer waiting only for its own layer; saves are ``batch_put_from`` straight
  from vLLM's blocks, one batch per layer, issued as soon as the layer's attention has
  written its KV and finished by the end of the step (``wait_for_save``).

P/D (role (b)): a request sent to a prefill instance with
``kv_transfer_params={"pymooncake_pd": "prefill"}`` (and ``max_tokens=1``) also puts its
partial last block (``plan.tail_key``), keeps its blocks when it finishes and returns
``{"pymooncake_pd": "decode", "engine": ..., "remote_block_ids": ...}`` in its response's
``kv_transfer_params``. The same prompt sent with those params to a decode instance reads
every block straight from the prefill instance's memory over the Transfer Engine
(``pd.py``; asynchronous in vLLM's sense, reported by ``get_finished``); with only
``pymooncake_pd``/``prompt_tokens`` it loads every prompt token but the last from the
Store. Either way the decode computes one prompt token before decoding.

Store loads are synchronous in vLLM's sense (the hit is loaded within the step that uses
it). A Store that cannot be reached makes every lookup a miss
and every save a logged failure; vLLM keeps serving (the cache is best effort). A load
that fails part-way reports its blocks through ``get_block_ids_with_load_errors`` and
vLLM recomputes them.

This module holds the connector, its state and the scheduler side; the worker side and the
per-step metadata are in ``integrations.vllm.worker_side``.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from pymooncake.identity import CacheNamespace, block_keys
from pymooncake.integrations.vllm.instance import namespace_of, shared_client
from pymooncake.integrations.vllm.pd import (
    DirectLoad,
    Holds,
    direct_load,
    direct_tokens,
    grant_lease,
    pd_mode,
)
from pymooncake.integrations.vllm.plan import (
    ConnectorConfig,
    Planner,
    leading_hits,
    loadable_blocks,
    object_keys,
    request_namespace,
    tail_key,
)
from pymooncake.integrations.vllm.worker_side import (
    ConnectorWorkerSide,
    PymooncakeConnectorMetadata,
)
from pymooncake.obs.logging import init_logger
from pymooncake.store.errors import StoreError

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = init_logger(__name__)

__all__ = ["PymooncakeConnector", "PymooncakeConnectorMetadata"]

class PymooncakeConnector(ConnectorWorkerSide, KVConnectorBase_V1):
    """vLLM KV connector that shares prefix blocks through the pymooncake Store (see the
    module docstring; docs/vllm.md). Raises ``ValueError`` at construction for a bad
    ``kv_connector_extra_config`` or an unsupported configuration, ``StoreError`` when the
    Store cannot be reached at start."""

    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._cfg = ConnectorConfig.from_extra(self._kv_transfer_config.kv_connector_extra_config)
        self._ns = namespace_of(vllm_config, self._cfg)
        mc, pc = vllm_config.model_config, vllm_config.parallel_config
        self._block_size = vllm_config.cache_config.block_size
        self._num_layers = mc.get_num_layers(pc)
        self._client = shared_client(self._cfg)
        self._warned: set[str] = set()
        self._planner = Planner(self._block_size, keys_of=self._keys_of)
        self._requests: dict[str, Request] = {}   # live requests: their tokens as they grow
        self._req_ns: dict[str, CacheNamespace] = {}  # their namespaces (cache_salt folded in)
        self._engine_id = str(self._kv_transfer_config.engine_id)
        self._direct_params: dict[str, dict[str, Any]] = {}
        self._direct_queue: list[DirectLoad] = []
        self._new_holds: list[str] = []
        self._holds = Holds(self._engine_id, hold_s=self._cfg.pd_hold_s)
        self._recvd: set[str] = set()
        self._layouts: dict[str, dict[str, Any]] = {}
        # worker side
        self._layers: dict[str, int] = {}       # layer name → layer index
        self._bases: dict[int, int] = {}        # layer index → address of block 0
        self._block_bytes = 0
        self._loader = self._saver = None
        self._ready: dict[int, threading.Event] = {}
        self._load_fut: Future | None = None
        self._save_futs: list[Future] = []
        self._load_errors: set[int] = set()
        self._errors_lock = threading.Lock()
        self.stats = {"lookups": 0, "hit_blocks": 0, "loaded_blocks": 0, "saved_objects": 0,
                      "load_s": 0.0, "save_wait_s": 0.0}
        logger.info("PymooncakeConnector (%s) on master %s, namespace %s", role.name,
                    self._cfg.master, self._ns.digest()[:16])

    def _keys_of(self, req_id: str, tokens: Any) -> list[str]:
        """Block keys of the known prefix of ``tokens`` under ``req_id``'s namespace (vLLM
        may hold placeholders, < 0, for tokens still being sampled)."""
        ns = self._req_ns.get(req_id)
        if ns is None:
            return []
        toks = list(tokens)
        cut = next((i for i, t in enumerate(toks) if t < 0), len(toks))
        return block_keys(toks[:cut], ns)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped save is a later miss, never an error

    def _warn_once(self, what: str, err: BaseException) -> None:
        if what not in self._warned:
            self._warned.add(what)
            logger.warning("PymooncakeConnector: %s failed (%s); serving without the Store "
                           "for it (logged once)", what, err)

    # == scheduler side ===================================================================

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` (vLLM's own block-aligned hit) whose KV the
        Store holds: the longest run of the prompt's leading full blocks with every layer
        present, never the prompt's last token. A P/D decode request (``kv_transfer_params``
        from a P/D prefill, docs/vllm.md) gets every prompt token but the last when the
        Store holds them all. Loads are synchronous (``False``)."""
        prompt = list(request.prompt_token_ids or [])
        ns = request_namespace(self._ns, cache_salt=getattr(request, "cache_salt", None),
                               lora=getattr(request, "lora_request", None),
                               multimodal=getattr(request, "mm_features", None))
        n = loadable_blocks(len(prompt), self._block_size)
        pd = pd_mode(request.kv_transfer_params, request.request_id)
        params = request.kv_transfer_params or {}
        self._requests[request.request_id] = request
        ext = direct_tokens(params, len(prompt), num_computed_tokens, self._block_size) \
            if pd == "decode" and self._cfg.load else 0
        if ext:  # P/D over the Transfer Engine: read after allocation, asynchronously
            self._direct_params[request.request_id] = params
            if ns is not None:  # its blocks are the Store's too
                self._req_ns[request.request_id] = ns
                self._planner.lookup(request.request_id, block_keys(prompt, ns), len(prompt),
                                     n, num_computed_tokens)
            return ext, True
        if ns is None:  # LoRA or multimodal: not keyed by token ids alone, no Store
            return 0, False
        self._req_ns[request.request_id] = ns
        keys = block_keys(prompt, ns)
        tail = tail_key(prompt, keys, ns) if pd == "prefill" else None
        last = None
        if pd == "decode" and (len(prompt) - 1) % self._block_size:
            last = keys[n] if n < len(keys) else tail_key(prompt, keys, ns)
        hits, last_ok = 0, False
        if self._cfg.load and n + (last is not None) > num_computed_tokens // self._block_size:
            self.stats["lookups"] += 1
            want = keys[:n] + ([last] if last is not None else [])
            try:
                present = self._client.batch_exist(object_keys(want, self._num_layers))
                flags = [p is True for p in present]
                hits = leading_hits(flags[:n * self._num_layers], self._num_layers)
                last_ok = last is not None and all(flags[n * self._num_layers:])
            except (StoreError, OSError) as e:
                self._warn_once("lookup", e)
        self.stats["hit_blocks"] += hits
        pd_hit = pd == "decode" and hits == n and (last is None or last_ok)
        return self._planner.lookup(request.request_id, keys, len(prompt), hits,
                                    num_computed_tokens, tail=tail,
                                    pd_last_key=(last or "") if pd_hit else None), False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        params = self._direct_params.pop(request.request_id, None)
        if params is None:
            self._planner.allocated(request.request_id, num_external_tokens)
            return
        if num_external_tokens > 0:
            self._direct_queue.append(direct_load(
                request.request_id, params, len(request.prompt_token_ids or []),
                num_external_tokens, self._block_size, blocks.get_block_ids()[0]))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = PymooncakeConnectorMetadata()
        so = scheduler_output
        steps: list[tuple[str, Any, bool, int]] = [
            (r.req_id, r.block_ids[0] if r.block_ids else [], True, r.num_computed_tokens)
            for r in so.scheduled_new_reqs]
        cr = so.scheduled_cached_reqs
        for i, rid in enumerate(cr.req_ids):
            nb = cr.new_block_ids[i]
            steps.append((rid, nb[0] if nb else None, rid in cr.resumed_req_ids,
                          cr.num_computed_tokens[i]))
        for rid, ids, replace, computed in steps:
            req = self._requests.get(rid)
            load, save = self._planner.scheduled(
                rid, ids, replace, computed, so.num_scheduled_tokens.get(rid, 0),
                tokens=req.all_token_ids if req is not None else None)
            if load is not None and load.block_ids:
                meta.loads.append(load)
            if save is not None and self._cfg.save:
                meta.saves.append(save)
        meta.direct, self._direct_queue = self._direct_queue, []
        meta.holds, self._new_holds = self._new_holds, []
        return meta

    def request_finished(self, request: Request, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        """Forget the request. A P/D prefill's ``kv_transfer_params`` (returned in its
        response) tell the decode instance to load every prompt token but the last."""
        self._planner.finished(request.request_id)
        self._requests.pop(request.request_id, None)
        self._req_ns.pop(request.request_id, None)
        self._direct_params.pop(request.request_id, None)
        if pd_mode(request.kv_transfer_params, request.request_id) == "prefill":
            params = {"pymooncake_pd": "decode",
                      "prompt_tokens": len(request.prompt_token_ids or [])}
            lease = grant_lease(self._client, self._engine_id, request.request_id,
                                self._cfg.pd_hold_s)
            if lease is None:   # no lease, no hold: the decode loads through the Store
                return False, params
            # keep the blocks until the decode instance has read them (pd.Holds)
            self._new_holds.append(request.request_id)
            return True, {**params, "engine": self._engine_id,
                          "remote_req": request.request_id,
                          "remote_block_ids": list(block_ids), "lease": lease}
        return False, None
