"""The tcp paths' state: one ``PeerChannel`` per peer (its slice queue and lock) holding
one ``Lane`` per path (its connection's pool key, sequence number, health and metrics).
``paths.TcpPaths`` runs them."""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from pymooncake.transfer import metrics as m
from pymooncake.transfer.transports.base import Slice


@dataclass(slots=True, eq=False)
class Lane:
    """One tcp path to a peer."""

    index: int
    device: str
    down_until: float = 0.0
    seq: int = 0
    busy: bool = False
    """A window is running on this path (by its thread or inline by a caller)."""
    thread: threading.Thread | None = None
    bytes_metric: Any = None
    slices_metric: Any = None
    retries_metric: Any = None
    latency_metric: Any = None
    key: tuple[str, int] = ("", 0)
    """The pool key of this path's connection: (peer name, path index)."""

    def __post_init__(self) -> None:
        self.latency_metric = m.window_latency_seconds.labels("tcp", self.label)
        self.bytes_metric = m.bytes_total.labels("tcp", self.label)
        self.slices_metric = m.slices_total.labels("tcp", self.label)
        self.retries_metric = m.retries_total.labels("tcp", self.label)

    @property
    def label(self) -> str:
        return f"{self.device}#{self.index}"


@dataclass(slots=True, eq=False)
class PeerChannel:
    """A peer: where it listens, its paths, the queue of slices they take windows from."""

    name: str
    host: str
    port: int
    lanes: list[Lane]
    queue: deque[Slice] = field(default_factory=deque)
    cond: threading.Condition = field(default_factory=threading.Condition)
