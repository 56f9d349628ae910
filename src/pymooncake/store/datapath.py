"""The store client's one door to the Transfer Engine (all bulk bytes go through it).

``DataPath`` wraps ``pymooncake.transfer.TransferEngine``: registering memory, and batches
of READ/WRITE requests between this process's registered memory and other processes'
segments. Results are per request: ``None`` on success, else a short reason; a failure
whose reason is a lost/refused peer is flagged ``peer_down`` so the client can stop trying
that segment (case BUG-34). A move that succeeded against a segment whose owner process is
dead (same host: its pid is gone; the bytes came from or went to a leftover shm mapping)
is reported failed with ``peer_down`` too (``DataPath.owner_dead``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pymooncake.transfer.batch import StatusCode, TransferOp, TransferRequest


@dataclass(frozen=True, slots=True)
class Move:
    """One copy: ``write`` (local → segment) or read (segment → local)."""

    write: bool
    local_addr: int
    segment: str
    target_addr: int
    length: int


@dataclass(frozen=True, slots=True)
class MoveResult:
    ok: bool
    reason: str = ""
    peer_down: bool = False


_MOVED = MoveResult(True)
_READ, _WRITE = TransferOp.READ, TransferOp.WRITE


class DataPath:
    """A started Transfer Engine named ``name`` on ``metadata_url``; or, given ``engine``
    (a started engine the caller owns, e.g. the worker's), that one: ``close`` then only
    unregisters what was registered through this ``DataPath``."""

    def __init__(self, name: str, metadata_url: str, transfer_config: Any = None,
                 engine: Any = None) -> None:
        from pymooncake.metadata import open_metadata
        from pymooncake.transfer import TransferEngine

        self.name = name
        self._mine: set[int] = set()  # addresses registered through this DataPath
        self.owner_dead: Callable[[str], str | None] | None = None
        """Set by the client: after a move to/from another segment succeeded, returns why
        that segment's owner is dead (the move then counts as failed, ``peer_down``) or
        ``None``. Reads and writes of a shm mapping left behind by a dead process succeed
        at the transfer level; this check makes them replica failures (case BUG-34)."""
        self.owner_prefetch: Callable[[list[str]], None] | None = None
        """Set by the client: starts the owner lookups of segments a batch is about to
        touch, so they overlap the transfer instead of following it."""
        self._owns_engine = engine is None
        if engine is not None:
            self.engine = engine
            self._metadata = engine.metadata
        else:
            self._metadata = open_metadata(metadata_url)
            self.engine = TransferEngine(name, self._metadata, config=transfer_config)
            try:
                self.engine.start()
            except BaseException:
                with contextlib.suppress(Exception):
                    self.engine.close()
                raise
        self._may_map_dead = self.may_map_dead_memory  # the engine's config is fixed

    @property
    def may_map_dead_memory(self) -> bool:
        """Whether a move can succeed against a dead process's memory: only through the
        shm transport (a leftover mapping); over tcp a dead peer refuses the connection."""
        cfg = getattr(self.engine, "config", None)
        return "shm" in getattr(cfg, "transports", ("shm",))

    def register(self, buffer: object) -> int:
        """Register ``buffer``; returns its base address."""
        addr = int(self.engine.register_memory(buffer))
        self._mine.add(addr)
        return addr

    def register_at(self, addr: int, length: int) -> int:
        """Register raw memory ``[addr, addr+length)`` owned by the caller."""
        addr = int(self.engine.register_memory_at(addr, length))
        self._mine.add(addr)
        return addr

    def unregister(self, addr: int) -> None:
        self.engine.unregister_memory(addr)
        self._mine.discard(addr)

    def run(self, moves: list[Move]) -> list[MoveResult]:
        if not moves:
            return []
        check = self.owner_dead is not None and self._may_map_dead
        if check and self.owner_prefetch is not None:
            self.owner_prefetch([m.segment for m in moves if m.segment != self.name])
        reqs = [TransferRequest(_WRITE if m.write else _READ, m.local_addr, m.segment,
                                m.target_addr, m.length) for m in moves]
        try:
            statuses = self.engine.batch_transfer_sync(reqs)
        except Exception as e:  # the engine refused the whole batch
            return [MoveResult(False, f"{type(e).__name__}: {e}") for _ in moves]
        out = []
        dead: dict[str, str | None] = {}  # one liveness check per segment and batch
        for mv, st in zip(moves, statuses, strict=True):
            if st.ok:
                if check and mv.segment != self.name:
                    assert self.owner_dead is not None
                    if mv.segment not in dead:
                        dead[mv.segment] = self.owner_dead(mv.segment)
                    why = dead[mv.segment]
                    if why is not None:  # copied to/from a dead process's leftover memory
                        out.append(MoveResult(False, why, True))
                        continue
                out.append(_MOVED)
            else:
                down = st.code in (StatusCode.CONNECTION_ERROR, StatusCode.TIMEOUT,
                                   StatusCode.NOT_FOUND)
                out.append(MoveResult(False, f"{st.code.value}: {st.reason}", down))
        return out

    def lookup_owner(self, segment: str, loop: Any) -> Any:
        """Start looking up ``(pid, host_id)`` of the process that publishes ``segment``
        (its Transfer Engine descriptor) on the asyncio ``loop`` (another thread's); a
        ``concurrent.futures.Future`` of that pair, or of ``None`` when it is not
        published or the lookup fails."""
        import asyncio

        from pymooncake.transfer.segment import SegmentDescriptor, segment_key

        async def one() -> tuple[int, str] | None:
            try:
                kv = await self._metadata.get(segment_key(segment))
                if kv is None:
                    return None
                desc = SegmentDescriptor.decode(kv.value)
                return desc.pid, desc.host_id
            except Exception:  # noqa: BLE001 - unknown owner: no liveness verdict
                return None

        return asyncio.run_coroutine_threadsafe(one(), loop)

    def close(self) -> None:
        if self._owns_engine:
            self.engine.close()
            return
        for addr in list(self._mine):  # a shared engine outlives us: give our memory back
            with contextlib.suppress(Exception):
                self.engine.unregister_memory(addr)
        self._mine.clear()
