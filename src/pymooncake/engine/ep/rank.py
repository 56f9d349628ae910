"""An EP rank process (``pymooncake ep rank``): holds some routed experts and computes them.

Control is the project's RPC layer; token rows move over the Transfer Engine. The front
calls (all params msgpack maps):

* ``ep.ping {"owner"}`` -> ``{"incarnation", "held": [[layer, expert], ...], "computed_rows",
  "owner", "owner_age_s"}``: the heartbeat. ``incarnation`` is new for every process, so a
  replaced rank is seen as one. ``owner`` is the token of the front this rank serves (None
  before the first ``ep.hold``) and ``owner_age_s`` how long ago it last heard from it; a
  ping carrying the owner's token refreshes that.
* Ownership: every ``ep.hold`` / ``ep.compute`` carries the front's ``owner`` token. A rank
  refuses (``OWNED``) a token other than its owner's while the owner is live (heard from
  within its ``lease_s``, given with ``ep.hold``), unless the ``ep.hold`` says
  ``take_over``; then the caller becomes the owner and the old front's calls are refused.
  ``ep.release {"owner"}``: the owner gives the rank up (a front closing cleanly), so the
  next front need not wait for the lease.
* ``ep.hold {"metadata", "dtype", "experts": [[layer, expert], ...], "exact"}``: load
  those experts (from the rank's ``--model``); with ``exact`` also drop every other one.
  The first call starts this rank's Transfer Engine on the front's metadata service.
* ``ep.compute {"layer", "groups": [[expert, rows], ...], "segment", "src", "dst"}``:
  READ ``sum(rows)`` rows ``[rows, hidden]`` from the front's ``segment`` at byte address
  ``src``, run each expert on its rows, WRITE the results to ``dst``. ``expires``
  (wall-clock seconds, optional): past it the call is refused and nothing is written — the
  front has timed the call out and may reuse that buffer (a rank that was stopped and
  continues must not overwrite it). Errors: ``EXPERT_NOT_HELD`` (an expert it does not
  hold), ``TRANSFER`` (a failed READ/WRITE), ``EXPIRED``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
import time
import uuid
from typing import Any

import torch

from pymooncake.engine.ep.models import expert_loader, model_config
from pymooncake.engine.kv.kv_tensors import torch_dtype
from pymooncake.engine.model.layers import SwiGLU, use_onednn_weights
from pymooncake.engine.model.moe import run_expert_slices
from pymooncake.obs.logging import init_logger
from pymooncake.rpc import RpcError, RpcServer
from pymooncake.transfer import TransferConfig, TransferEngine, TransferOp, TransferRequest

logger = init_logger(__name__)

EXPERT_NOT_HELD = "EXPERT_NOT_HELD"
TRANSFER = "TRANSFER"
EXPIRED = "EXPIRED"
OWNED = "OWNED"
DEFAULT_LEASE_S = 3.0


class RankService:
    """The state and RPC handlers of one EP rank. ``model`` is a spec for
    ``ep.models.expert_loader`` (``tiny-moe`` or a HF directory)."""

    def __init__(self, model: str, host: str = "127.0.0.1", port: int = 0) -> None:
        self.model = model
        self.cfg = model_config(model)
        self.host = host
        self.server = RpcServer(host, port)
        self.incarnation = uuid.uuid4().hex
        self.experts: dict[tuple[int, int], SwiGLU] = {}
        self._loaders: dict[str, Any] = {}
        self.engine: TransferEngine | None = None
        self._buf: torch.Tensor | None = None
        self._lock = threading.Lock()
        self.computed_rows = 0
        self._metadata = ""
        self._generation = 0
        self.owner: str | None = None
        self._owner_seen = 0.0
        self._lease_s = DEFAULT_LEASE_S
        # one compute thread with one intra-op thread: torch's thread count is per thread,
        # and a fresh executor thread would use every core (on a busy box an OpenMP team
        # whose second thread is descheduled makes each GEMM wait: measured 10x slower)
        self._pool = concurrent.futures.ThreadPoolExecutor(
            1, "ep-rank-compute", initializer=torch.set_num_threads, initargs=(1,))
        for name, fn in (("ep.ping", self.ping), ("ep.hold", self.hold),
                         ("ep.compute", self.compute), ("ep.release", self.release)):
            self.server.register(name, fn)

    # -- handlers --------------------------------------------------------------------
    def ping(self, params: Any = None) -> dict[str, Any]:
        if isinstance(params, dict) and self.owner is not None \
                and params.get("owner") == self.owner:
            self._owner_seen = time.monotonic()
        return {"incarnation": self.incarnation, "pid": os.getpid(),
                "held": sorted([list(k) for k in self.experts]),
                "computed_rows": self.computed_rows, "owner": self.owner,
                "owner_age_s": None if self.owner is None
                else time.monotonic() - self._owner_seen,
                "lease_s": self._lease_s}

    def release(self, params: Any = None) -> dict[str, Any]:
        if isinstance(params, dict) and params.get("owner") == self.owner:
            self.owner = None
        return {"owner": self.owner}

    def _check_owner(self, params: dict[str, Any], claim: bool) -> None:
        """Refuse a caller that is not this rank's front while that front is live;
        ``claim`` (``ep.hold``): an unowned rank, one whose owner went silent past its
        lease, or an explicit ``take_over`` makes the caller the owner."""
        token = params.get("owner")
        token = None if token is None else str(token)
        now = time.monotonic()
        if token == self.owner:
            self._owner_seen = now
            return
        live = self.owner is not None and now - self._owner_seen < self._lease_s
        if claim and (not live or params.get("take_over")):
            if self.owner is not None:
                logger.warning("EP rank: front %s takes over from %s", token, self.owner)
            self.owner, self._owner_seen = token, now
            return
        raise RpcError(OWNED, f"this rank belongs to another live front (owner {self.owner}, "
                              f"heard from {now - self._owner_seen:.1f} s ago); "
                              "take it over explicitly (ep serve --take-over)")

    async def hold(self, params: dict[str, Any]) -> dict[str, Any]:
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._hold, params)

    def _hold(self, params: dict[str, Any]) -> dict[str, Any]:
        dtype = torch_dtype(str(params.get("dtype", "float32")))
        metadata = str(params["metadata"])
        with self._lock:
            self._check_owner(params, claim=True)
            if params.get("lease_s") is not None:
                self._lease_s = float(params["lease_s"])
            if self.engine is not None and self._metadata != metadata:  # a new front
                self.engine.close()
                self.engine, self._buf = None, None
            if self.engine is None:
                self._generation += 1
                name = f"ep-rank-{self.incarnation[:12]}-{self._generation}"
                self.engine = TransferEngine(name, metadata, config=TransferConfig(
                    host=self.host, max_retries=1, connect_timeout_s=1.0, slice_timeout_s=5.0))
                self.engine.start()
                self._metadata = metadata
            want = {(int(li), int(e)) for li, e in params["experts"]}
            loader = self._loaders.get(str(dtype))
            if loader is None:
                loader = self._loaders[str(dtype)] = expert_loader(self.model, dtype)
            for key in sorted(want - set(self.experts)):
                mlp = loader(*key)
                use_onednn_weights(mlp)
                self.experts[key] = mlp
            if params.get("exact"):
                for key in set(self.experts) - want:
                    del self.experts[key]
        return self.ping()

    async def compute(self, params: dict[str, Any]) -> dict[str, Any]:
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._compute,
                                                                params)

    def _staging(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        assert self.engine is not None
        buf = self._buf
        if buf is None or buf.numel() < numel or buf.dtype != dtype:
            if buf is not None:
                self.engine.unregister_memory(buf)
            buf = torch.empty(max(numel, 1 << 16), dtype=dtype)
            self.engine.register_memory(buf)
            self._buf = buf
        return buf

    def _compute(self, params: dict[str, Any]) -> dict[str, Any]:
        t0 = time.perf_counter()
        layer = int(params["layer"])
        groups = [(int(e), int(n)) for e, n in params["groups"]]
        dtype = torch_dtype(str(params.get("dtype", "float32")))
        with self._lock:
            self._check_owner(params, claim=False)
            if self.engine is None:
                raise RpcError(EXPERT_NOT_HELD, "this rank holds no experts yet")
            experts: dict[int, SwiGLU] = {}
            for e, _ in groups:
                mlp = self.experts.get((layer, e))
                if mlp is None:
                    raise RpcError(EXPERT_NOT_HELD, f"layer {layer} expert {e} is not held here")
                experts[e] = mlp
            expires = float(params.get("expires", 0.0))
            if expires and time.time() > expires:  # the front gave up on this call
                raise RpcError(EXPIRED, "the call expired before it ran")
            rows = sum(n for _, n in groups)
            hidden = self.cfg.hidden_size
            numel = rows * hidden
            nbytes = numel * torch.empty(0, dtype=dtype).element_size()
            buf = self._staging(numel, dtype)
            seg = str(params["segment"])
            st = self.engine.batch_transfer_sync([TransferRequest(
                TransferOp.READ, buf.data_ptr(), seg, int(params["src"]), nbytes)])[0]
            if not st.ok:
                raise RpcError(TRANSFER, f"READ from {seg}: {st.code.value} {st.reason}")
            t1 = time.perf_counter()
            x = buf[:numel].view(rows, hidden)
            with torch.inference_mode():
                y = run_expert_slices(experts, x, groups)
            x.copy_(y)
            t2 = time.perf_counter()
            if expires and time.time() > expires:  # never write into a reused buffer
                raise RpcError(EXPIRED, "the call expired while it ran; result dropped")
            st = self.engine.batch_transfer_sync([TransferRequest(
                TransferOp.WRITE, buf.data_ptr(), seg, int(params["dst"]), nbytes)])[0]
            if not st.ok:
                raise RpcError(TRANSFER, f"WRITE to {seg}: {st.code.value} {st.reason}")
            self.computed_rows += rows
        t3 = time.perf_counter()
        return {"rows": rows, "compute_s": t3 - t0, "read_s": t1 - t0, "mlp_s": t2 - t1,
                "write_s": t3 - t2}

    # -- lifecycle -------------------------------------------------------------------
    async def serve(self, ready: Any = None) -> None:
        """Serve until cancelled; ``ready(port)`` is called once bound (binds unless
        ``self.server.start()`` was awaited already)."""
        if getattr(self.server, "_server", None) is None:
            await self.server.start()
        if ready is not None:
            ready(self.server.port)
        try:
            await self.server.serve_forever()
        finally:
            await self.server.stop()
            if self.engine is not None:
                self.engine.close()
