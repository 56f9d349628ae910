"""The front's expert backend: dispatch token rows to EP ranks and combine their results.

For one MoE layer (``run``), rows sorted by expert are split over the live copies of each
expert (``placement.assign_rows``), packed rank by rank into the front's registered send
buffer, and every rank is asked (``ep.compute``, all in parallel) to READ its rows over the
Transfer Engine, compute them and WRITE the outputs back into the front's receive buffer.
A rank whose call fails (connection lost, timeout, transfer error) is marked dead at once
and its rows are re-dispatched to the surviving copies of their experts in the same layer
call, so a request in flight is unaffected when every expert it needs still has a copy.
Rows whose expert has no live copy come back marked ``missing`` (``ExpertBackend``).

Failure detection also runs in the background: ``ep.ping`` every ``heartbeat_s``; a rank
not answering for ``deadline_s`` is dead. A dead rank's experts are re-planned over the
survivors (``replan_on_failure``: they load the lost experts from the checkpoint), and a
rank that answers again with a new incarnation (a replacement) rejoins and the placement
is re-balanced over all live ranks with the routed-token counts seen so far (EPLB).

This module holds the options, ``RemoteExperts``' lifecycle, RPC plumbing and data path;
liveness and re-planning are ``engine.ep.membership.RankMembership``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import torch

from pymooncake.engine.ep import placement as pl
from pymooncake.engine.ep.membership import RankMembership
from pymooncake.metadata.http import MetadataHttpServer
from pymooncake.obs.logging import init_logger
from pymooncake.rpc import RpcClient, RpcError
from pymooncake.transfer import TransferConfig, TransferEngine

logger = init_logger(__name__)


EXPIRY_MARGIN_S = 0.25
"""A rank refuses to READ or WRITE for a call this long before the front's timeout of it
(same-host clocks; across hosts keep clock skew well below it)."""


@dataclass(slots=True)
class EPOptions:
    """Knobs of the front's EP backend (seconds, counts)."""

    slots_per_rank: int = 4
    """Expert copies each rank holds per MoE layer (>= num_experts / ranks; the rest are
    redundant copies of the most-routed experts)."""
    heartbeat_s: float = 0.2
    deadline_s: float = 1.0
    """A rank with no heartbeat answer for this long is dead."""
    call_timeout_s: float = 2.0
    """Longest one ``ep.compute`` may take before its rank counts as dead."""
    replan_on_failure: bool = True
    """Re-place a dead rank's experts on the survivors (loaded from the checkpoint)."""
    max_rows: int = 4096
    """Rows (tokens x top-k) one layer call may carry: sizes the registered buffers."""
    take_over: bool = False
    """Claim ranks that still belong to another live front (ranks refuse it otherwise)."""

    @property
    def lease_s(self) -> float:
        """How long a rank keeps this front as its owner without hearing from it."""
        return max(3.0, 3 * self.deadline_s)


@dataclass(slots=True)
class RankState:
    rank: int
    host: str
    port: int
    client: RpcClient | None = None
    alive: bool = False
    incarnation: str = ""
    last_ok: float = 0.0
    pid: int = 0
    died_at: float | None = None
    joining: bool = False


@dataclass(slots=True)
class EPEvents:
    """What happened, with ``time.monotonic()`` stamps (for status and benchmarks)."""

    deaths: list[tuple[int, float]] = field(default_factory=list)
    replans: list[tuple[str, float, float]] = field(default_factory=list)
    """(reason, started, finished)."""
    rerouted_rows: int = 0


class RemoteExperts(RankMembership):
    """An ``ExpertBackend`` over EP rank processes.

    ``ranks``: ``(host, port)`` of each rank's RPC server; ``num_layers`` MoE layers (their
    decoder indices in ``moe_layers``) of ``num_experts`` experts of width ``hidden``.
    ``start`` raises ``RuntimeError`` when a rank cannot be reached.
    """

    def __init__(self, ranks: list[tuple[str, int]], moe_layers: list[int], num_experts: int,
                 hidden: int, dtype: torch.dtype = torch.float32,
                 options: EPOptions | None = None, metadata: str | None = None) -> None:
        self.opts = options or EPOptions()
        self.moe_layers = list(moe_layers)
        self.layer_index = {li: i for i, li in enumerate(self.moe_layers)}
        self.num_experts, self.hidden, self.dtype = num_experts, hidden, dtype
        self.ranks = [RankState(i, h, p) for i, (h, p) in enumerate(ranks)]
        self.placement: pl.Placement = []
        self.loads = [[0.0] * num_experts for _ in self.moe_layers]
        self.events = EPEvents()
        self._lock = threading.Lock()  # placement, alive flags, the buffers
        self._meta_server = None if metadata else MetadataHttpServer().start()
        self.metadata = metadata or self._meta_server.url  # type: ignore[union-attr]
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="ep-front",
                                        daemon=True)
        self._replan = threading.Event()
        self._replan_reason = ""
        self._closed = threading.Event()
        self.engine: TransferEngine | None = None
        self.owner = uuid.uuid4().hex
        """This front's token: ranks serve only it (``rank.OWNED`` otherwise)."""

    # -- lifecycle -------------------------------------------------------------------
    def start(self) -> RemoteExperts:
        try:
            return self._start()
        except BaseException:
            self.close()
            raise

    def _start(self) -> RemoteExperts:
        self._thread.start()
        self.engine = TransferEngine(f"ep-front-{os.getpid()}-{id(self) & 0xffff:x}",
                                     self.metadata, config=TransferConfig(max_retries=1))
        self.engine.start()
        nbytes = self.opts.max_rows * self.hidden * torch.empty(0, dtype=self.dtype).element_size()
        self._send_shm = self.engine.allocate_shared(nbytes)
        self._recv_shm = self.engine.allocate_shared(nbytes)
        self._send = torch.frombuffer(self._send_shm.view(), dtype=self.dtype)
        self._recv = torch.frombuffer(self._recv_shm.view(), dtype=self.dtype)
        for r in self.ranks:
            try:
                pong = self._call(r, "ep.ping", {"owner": self.owner}, self.opts.deadline_s * 5,
                                  mark=False)
            except RpcError as e:
                raise RuntimeError(f"EP rank {r.rank} at {r.host}:{r.port} is not answering "
                                   f"({e.message})") from None
            if not isinstance(pong, dict) or "incarnation" not in pong:
                raise RuntimeError(f"{r.host}:{r.port} (rank {r.rank}) is not an EP rank")
            age = pong.get("owner_age_s")
            if (pong.get("owner") not in (None, self.owner) and age is not None
                    and age < float(pong.get("lease_s") or 3.0) and not self.opts.take_over):
                raise RuntimeError(f"EP rank {r.rank} at {r.host}:{r.port} belongs to another "
                                   f"live front (heard from it {age:.1f} s ago); stop that "
                                   "front or pass --take-over")
            r.alive, r.last_ok = True, time.monotonic()
            r.incarnation, r.pid = str(pong["incarnation"]), int(pong.get("pid", 0))
        self._rebalance("start")
        threading.Thread(target=self._replanner, name="ep-replan", daemon=True).start()
        async def start_beats() -> asyncio.Task[None]:
            return asyncio.get_running_loop().create_task(self._heartbeats())
        self._hb = asyncio.run_coroutine_threadsafe(start_beats(), self._loop).result(5)
        return self

    def close(self) -> None:
        self._closed.set()
        self._replan.set()

        async def _close() -> None:
            hb = getattr(self, "_hb", None)
            if hb is not None:
                hb.cancel()
                await asyncio.gather(hb, return_exceptions=True)
            for r in self.ranks:
                if r.client is not None:
                    with contextlib.suppress(Exception):  # best effort: the lease ends anyway
                        await r.client.call("ep.release", {"owner": self.owner}, 1.0)
                    await r.client.close()
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(_close(), self._loop).result(5)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)
            self._loop.close()
        if self.engine is not None:
            self.engine.close()
        if self._meta_server is not None:
            self._meta_server.stop()

    # -- RPC plumbing ----------------------------------------------------------------
    async def _acall(self, r: RankState, method: str, params: Any, timeout_s: float) -> Any:
        if r.client is None:
            r.client = RpcClient(r.host, r.port, timeout_s=timeout_s,
                                 connect_timeout_s=min(timeout_s, 1.0))
        return await r.client.call(method, params, timeout_s)

    def _call(self, r: RankState, method: str, params: Any, timeout_s: float,
              mark: bool = True) -> Any:
        fut = asyncio.run_coroutine_threadsafe(self._acall(r, method, params, timeout_s),
                                               self._loop)
        try:
            return fut.result(timeout_s + 1.0)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise RpcError("TIMEOUT", f"{method} to rank {r.rank}: no answer") from None
        except RpcError:
            if mark:
                self._mark_dead(r, f"{method} failed")
            raise

    # -- the data path ---------------------------------------------------------------
    def run(self, layer: int, x_sorted: torch.Tensor,
            counts: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``ExpertBackend.run`` over the ranks (see the module docstring)."""
        n = x_sorted.shape[0]
        if n > self.opts.max_rows:
            raise ValueError(f"{n} rows exceed EPOptions.max_rows ({self.opts.max_rows})")
        li = self.layer_index[layer]
        y = torch.zeros_like(x_sorted)
        missing = torch.zeros(n, dtype=torch.bool)
        with self._lock:
            for e, c in enumerate(counts):
                self.loads[li][e] += c
            layer_plan = self.placement[li]
            todo, lost = pl.assign_rows(layer_plan, counts, self.alive_ranks())
        starts = [0]
        for c in counts:
            starts.append(starts[-1] + c)
        for e in lost:
            missing[starts[e]:starts[e + 1]] = True
        for _ in range(2 * len(self.ranks) + 2):
            if not todo:
                break
            failed = self._dispatch(layer, x_sorted, y, todo)
            with self._lock:
                alive = self.alive_ranks()
                layer_plan = self.placement[li]
            todo, again = {}, []
            for groups in failed.values():
                for e, off, m in groups:
                    live = [r for r in layer_plan.get(e, ()) if r in alive]
                    if not live:
                        again.append((off, m))
                        continue
                    self.events.rerouted_rows += m
                    sub, _ = pl.assign_rows({e: tuple(live)}, [0] * e + [m], alive)
                    for r, gs in sub.items():
                        todo.setdefault(r, []).extend((ee, off + o, mm) for ee, o, mm in gs)
            for off, m in again:
                missing[off:off + m] = True
        for groups in todo.values():  # still failing after every retry
            for _, off, m in groups:
                missing[off:off + m] = True
        return y, (missing if bool(missing.any()) else None)

    def _dispatch(self, layer: int, x: torch.Tensor, y: torch.Tensor,
                  todo: dict[int, list[tuple[int, int, int]]],
                  ) -> dict[int, list[tuple[int, int, int]]]:
        """Pack, call every rank in parallel, unpack; returns the groups of failed ranks."""
        hidden, esize = self.hidden, x.element_size()
        calls, spans = [], []
        base = 0
        for r, groups in todo.items():
            idx = torch.cat([torch.arange(off, off + m) for _, off, m in groups])
            rows = idx.numel()
            self._send[base * hidden:(base + rows) * hidden].view(rows, hidden).copy_(x[idx])
            addr = base * hidden * esize
            params = {"layer": layer, "groups": [[e, m] for e, _, m in groups],
                      "segment": self.engine.name,  # type: ignore[union-attr]
                      "src": self._send_shm.addr + addr, "dst": self._recv_shm.addr + addr,
                      "dtype": str(self.dtype).removeprefix("torch."), "owner": self.owner,
                      "expires": time.time() + self.opts.call_timeout_s - EXPIRY_MARGIN_S}
            calls.append((self.ranks[r], params))
            spans.append((r, idx, base, rows))
            base += rows

        async def all_calls() -> list[Any]:
            return await asyncio.gather(*(self._acall(rs, "ep.compute", p,
                                                      self.opts.call_timeout_s)
                                          for rs, p in calls), return_exceptions=True)
        results = asyncio.run_coroutine_threadsafe(all_calls(), self._loop).result(
            self.opts.call_timeout_s + 5.0)
        failed = {}
        for (r, idx, start, rows), res in zip(spans, results, strict=True):
            if isinstance(res, BaseException):
                code = getattr(res, "code", type(res).__name__)
                if code != "EXPERT_NOT_HELD":
                    self._mark_dead(self.ranks[r], f"ep.compute: {res}")
                failed[r] = todo[r]
                continue
            y[idx] = self._recv[start * hidden:(start + rows) * hidden].view(rows, hidden)
        return failed

    def status(self) -> dict[str, Any]:
        """Ranks, placement and events as plain data."""
        with self._lock:
            return {"ranks": [{"rank": r.rank, "addr": f"{r.host}:{r.port}", "alive": r.alive,
                               "pid": r.pid} for r in self.ranks],
                    "placement": [{str(e): list(rs) for e, rs in lay.items()}
                                  for lay in self.placement],
                    "missing": [list(p) for p in self._to_decoder(
                        pl.missing_experts(self.placement, self.alive_ranks()))],
                    "rerouted_rows": self.events.rerouted_rows,
                    "replans": [[why, b - a] for why, a, b in self.events.replans]}
