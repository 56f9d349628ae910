"""The worker side of ``PymooncakeConnector`` (``integrations.vllm.connector``): what vLLM
calls in its model runner around each forward.

Holds ``PymooncakeConnectorMetadata`` (one step's loads, saves, P/D reads and holds, built by
the scheduler side) and ``ConnectorWorkerSide``, the mixin with ``register_kv_caches`` (the
paged KV tensors registered with the Transfer Engine once), ``start_load_kv`` /
``wait_for_layer_load`` (layer-by-layer loads on a loader thread), ``save_kv_layer`` /
``wait_for_save`` (one ``batch_put_from`` per layer), the P/D direct reads and
``get_finished`` / ``get_block_ids_with_load_errors`` / ``shutdown``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from pymooncake.identity import CacheNamespace
from pymooncake.integrations.vllm.pd import (
    DirectLoad,
    Holds,
    publish_layout,
    read_blocks,
)
from pymooncake.integrations.vllm.plan import (
    BlockTransfer,
    ConnectorConfig,
    layer_index,
    object_key,
)
from pymooncake.obs.logging import init_logger
from pymooncake.store.errors import ErrorCode, StoreError

if TYPE_CHECKING:
    from vllm.forward_context import ForwardContext

logger = init_logger("pymooncake.integrations.vllm.connector")


@dataclass
class PymooncakeConnectorMetadata(KVConnectorMetadata):
    """One step's work for the worker: blocks to load before the forward, blocks to save
    during it (block keys and vLLM block ids)."""

    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)
    direct: list[DirectLoad] = field(default_factory=list)   # P/D reads from a prefill
    holds: list[str] = field(default_factory=list)           # P/D prefills keeping blocks


class ConnectorWorkerSide:
    """The worker-side methods of ``PymooncakeConnector`` (a mixin; the connector's
    ``__init__`` sets the attributes below and supplies ``_warn_once``;
    ``KVConnectorBase_V1`` supplies ``_get_connector_metadata``)."""

    _cfg: ConnectorConfig
    _ns: CacheNamespace
    _client: Any
    _num_layers: int
    _block_size: int
    _engine_id: str
    _holds: Holds
    _recvd: set[str]
    _layouts: dict[str, dict[str, Any]]
    _layers: dict[str, int]
    _bases: dict[int, int]
    _block_bytes: int
    _loader: ThreadPoolExecutor | None
    _saver: ThreadPoolExecutor | None
    _ready: dict[int, threading.Event]
    _load_fut: Future | None
    _save_futs: list[Future]
    _load_errors: set[int]
    _errors_lock: threading.Lock
    stats: dict[str, Any]

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Check vLLM-CPU's paged layout (one tensor per layer, ``[num_blocks, kv_heads,
        block_size, 2 * head_dim]``, each block contiguous) and register the tensors'
        memory with the Transfer Engine for zero-copy puts and gets. Raises
        ``ValueError`` for another layout."""
        ns = self._ns
        heads = int(ns.kv_layout.split("kv_heads=")[1].split(";")[0])
        head_dim = int(ns.kv_layout.split("head_dim=")[1].split(";")[0])
        storages: dict[int, int] = {}
        for name, t in kv_caches.items():
            idx = layer_index(name)
            want = (heads, self._block_size, 2 * head_dim)
            if t.dim() != 4 or tuple(t.shape[1:]) != want or not t[0].is_contiguous():
                raise ValueError(f"PymooncakeConnector: KV cache {name} has shape "
                                 f"{tuple(t.shape)} strides {t.stride()}; expected vLLM-CPU's "
                                 f"[num_blocks, {want[0]}, {want[1]}, {want[2]}] with "
                                 "contiguous blocks")
            block_bytes = t[0].numel() * t.element_size()
            if t.stride(0) * t.element_size() != block_bytes:
                raise ValueError(f"PymooncakeConnector: KV cache {name}: blocks are not "
                                 f"adjacent (stride {t.stride(0)} elements)")
            if self._block_bytes and block_bytes != self._block_bytes:
                raise ValueError(f"PymooncakeConnector: KV cache {name}: {block_bytes} bytes "
                                 f"per block, other layers have {self._block_bytes}")
            self._block_bytes = block_bytes
            self._layers[name] = idx
            self._bases[idx] = t.data_ptr()
            st = t.untyped_storage()
            storages[st.data_ptr()] = st.nbytes()
        if sorted(self._bases) != list(range(self._num_layers)):
            raise ValueError(f"PymooncakeConnector: KV caches for layers {sorted(self._bases)},"
                             f" expected 0..{self._num_layers - 1}")
        for addr, size in storages.items():
            self._client.register_memory(addr, size)
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="pmc-load")
        self._saver = ThreadPoolExecutor(1, thread_name_prefix="pmc-save")
        publish_layout(self._client, self._engine_id,
                       [self._bases[i] for i in range(self._num_layers)], self._block_bytes,
                       self._ns.digest())
        logger.info("PymooncakeConnector: %d layers, %d bytes per layer-block, %d KV "
                    "region(s) registered", len(self._bases), self._block_bytes, len(storages))

    def _addrs(self, layer: int, transfers: Iterable[BlockTransfer]) -> tuple[list, list]:
        base, bb = self._bases[layer], self._block_bytes
        keys, addrs = [], []
        for tr in transfers:
            for k, b in zip(tr.block_keys, tr.block_ids, strict=True):
                keys.append(object_key(k, layer))
                addrs.append(base + b * bb)
        return keys, addrs

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, PymooncakeConnectorMetadata)
        if meta.holds:
            self._holds.add(meta.holds)
        if meta.direct and self._loader is not None:
            self._loader.submit(self._read_direct, list(meta.direct))
        if not meta.loads or self._loader is None:
            return
        self._ready = {i: threading.Event() for i in range(self._num_layers)}
        self._load_fut = self._loader.submit(self._load_layers, list(meta.loads), self._ready)

    def _load_layers(self, loads: list[BlockTransfer], ready: dict[int, threading.Event]
                     ) -> None:
        t0 = time.perf_counter()
        failed: set[int] = set()
        try:
            for layer in range(self._num_layers):
                keys, addrs = self._addrs(layer, loads)
                try:
                    res = self._client.batch_get_into(keys, addrs, [self._block_bytes] * len(keys))
                except (StoreError, OSError) as e:
                    self._warn_once("load", e)
                    res = [e] * len(keys)
                ids = [b for tr in loads for b in tr.block_ids]
                failed.update(b for b, r in zip(ids, res, strict=True)
                              if r != self._block_bytes)
                ready[layer].set()
        finally:
            for ev in ready.values():
                ev.set()
            with self._errors_lock:
                self._load_errors |= failed
            self.stats["loaded_blocks"] += sum(len(tr.block_ids) for tr in loads) - len(failed)
            self.stats["load_s"] += time.perf_counter() - t0

    def wait_for_layer_load(self, layer_name: str) -> None:
        ev = self._ready.get(self._layers.get(layer_name, -1))
        if ev is not None:
            ev.wait()

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, PymooncakeConnectorMetadata)
        if not meta.saves or self._saver is None or layer_name not in self._layers:
            return
        keys, addrs = self._addrs(self._layers[layer_name], meta.saves)
        self._save_futs.append(self._saver.submit(
            self._client.batch_put_from, keys, addrs, [self._block_bytes] * len(keys)))

    def wait_for_save(self) -> None:
        """Finish this step's puts (and any load the forward did not wait for): the blocks
        may be reused once the step is over."""
        t0 = time.perf_counter()
        if self._load_fut is not None:
            self._load_fut.result()
            self._load_fut = None
            self._ready = {}
        futs, self._save_futs = self._save_futs, []
        for f in futs:
            try:
                res = f.result()
            except (StoreError, OSError) as e:
                self._warn_once("save", e)
                continue
            for r in res:
                if r is None:
                    self.stats["saved_objects"] += 1
                elif r.code != ErrorCode.OBJECT_ALREADY_EXISTS:  # another instance was first
                    self._warn_once(f"save ({r.code.name})", r)
        self.stats["save_wait_s"] += time.perf_counter() - t0

    def _read_direct(self, loads: list[DirectLoad]) -> None:
        t0 = time.perf_counter()
        done, failed = read_blocks(self._client, loads,
                                   [self._bases[i] for i in range(self._num_layers)],
                                   self._block_bytes, self._ns.digest(), self._layouts)
        with self._errors_lock:
            self._load_errors |= failed
            self._recvd |= done
        self.stats["loaded_blocks"] += sum(len(ld.block_ids) for ld in loads) - len(failed)
        self.stats["load_s"] += time.perf_counter() - t0

    def get_finished(self, finished_req_ids: set[str]
                     ) -> tuple[set[str] | None, set[str] | None]:
        """P/D: prefill requests whose blocks the decode has read (or whose hold timed
        out, lease removed first; the two are logged apart) as finished sending, decode
        requests whose blocks arrived as finished receiving. Store loads and saves complete
        within their step."""
        read, timed_out = self._holds.released(self._client)
        if read:
            logger.info("P/D: %d prefill request(s) read by their decode: blocks handed "
                        "back: %s", len(read), sorted(read))
        if timed_out:
            logger.warning("P/D: %d prefill request(s) timed out (no decode read them in "
                           "%.0f s): lease removed, blocks handed back: %s", len(timed_out),
                           self._cfg.pd_hold_s, sorted(timed_out))
        sending = read | timed_out
        with self._errors_lock:
            recving, self._recvd = self._recvd, set()
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._errors_lock:
            out, self._load_errors = self._load_errors, set()
        return out

    def shutdown(self) -> None:
        for ex in (self._loader, self._saver):
            if ex is not None:
                ex.shutdown(wait=True)
        logger.info("PymooncakeConnector stats: %s", self.stats)
