"""The store client's one door to the Transfer Engine (all bulk bytes go through it).

``DataPath`` wraps ``pymooncake.transfer.TransferEngine``: registering memory, and batches
of READ/WRITE requests between this process's registered memory and other processes'
segments. Results are per request: ``None`` on success, else a short reason; a failure
whose reason is a lost/refused peer is flagged ``peer_down`` so the client can stop trying
that segment (case BUG-34).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any


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


class DataPath:
    """A started Transfer Engine named ``name`` on ``metadata_url``."""

    def __init__(self, name: str, metadata_url: str, transfer_config: Any = None) -> None:
        from pymooncake.metadata import open_metadata
        from pymooncake.transfer import TransferEngine

        self.name = name
        self._metadata = open_metadata(metadata_url)
        self.engine = TransferEngine(name, self._metadata, config=transfer_config)
        try:
            self.engine.start()
        except BaseException:
            with contextlib.suppress(Exception):
                self.engine.close()
            raise

    def register(self, buffer: object) -> int:
        """Register ``buffer``; returns its base address."""
        return int(self.engine.register_memory(buffer))

    def register_at(self, addr: int, length: int) -> int:
        """Register raw memory ``[addr, addr+length)`` owned by the caller."""
        return int(self.engine.register_memory_at(addr, length))

    def unregister(self, addr: int) -> None:
        self.engine.unregister_memory(addr)

    def run(self, moves: list[Move]) -> list[MoveResult]:
        if not moves:
            return []
        from pymooncake.transfer import TransferOp, TransferRequest
        from pymooncake.transfer.batch import StatusCode

        reqs = [TransferRequest(TransferOp.WRITE if m.write else TransferOp.READ, m.local_addr,
                                m.segment, m.target_addr, m.length) for m in moves]
        try:
            statuses = self.engine.batch_transfer_sync(reqs)
        except Exception as e:  # the engine refused the whole batch
            return [MoveResult(False, f"{type(e).__name__}: {e}") for _ in moves]
        out = []
        for st in statuses:
            if st.ok:
                out.append(MoveResult(True))
            else:
                down = st.code in (StatusCode.CONNECTION_ERROR, StatusCode.TIMEOUT,
                                   StatusCode.NOT_FOUND)
                out.append(MoveResult(False, f"{st.code.value}: {st.reason}", down))
        return out

    def close(self) -> None:
        self.engine.close()
