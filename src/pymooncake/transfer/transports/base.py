"""What every transport works on: a slice of a request, and the path error it may raise."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pymooncake.transfer.batch import StatusCode, TransferOp


@dataclass(slots=True, eq=False)
class Slice:
    """``length`` bytes between ``local_addr`` and the target's ``target_addr``.

    Mutable work item: ``retries`` counts re-sends after path errors.
    """

    op: TransferOp
    local_addr: int
    target_addr: int
    length: int
    batch_id: int
    request_index: int
    retries: int = 0
    last_error: str = field(default="")
    view: memoryview | None = field(default=None, repr=False)
    """The local range as a view (slice of the registered region's view), when known."""
    owner: Any = field(default=None, repr=False)
    """The request's state in the batch table (``failure`` set once a slice of it failed:
    its slices still queued are then dropped unsent)."""


class PathError(Exception):
    """A path (connection) broke: the first ``len(results)`` slices of the window got
    their replies (``results``); the rest must be retried.
    ``code`` says whether it was a connection error or a timeout. ``refused``: the target
    refused the last slice of ``results`` and closed the session (BUG-64) — the path is
    healthy, the rest of the window is re-sent at once without counting a retry."""

    def __init__(self, message: str, results: list[tuple[StatusCode, str]],
                 code: StatusCode, *, refused: bool = False) -> None:
        super().__init__(message)
        self.results = results
        self.code = code
        self.refused = refused

    @property
    def num_done(self) -> int:
        return len(self.results)
