"""Which same-host peers the ``cma`` transport reaches (``transports.cma``): one probed
:class:`~pymooncake.transfer.transports.cma.CmaPeer` per segment name, and the life of
its pidfd (until the process exits, the segment is withdrawn or re-published, or the
engine closes)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from pymooncake.obs.logging import init_logger
from pymooncake.transfer.transports.cma import CmaPeer, supported

logger = init_logger(__name__)


def _drop(p: CmaPeer | str) -> None:
    """Close ``p``'s pidfd when it is a peer (a remembered refusal holds none)."""
    if isinstance(p, CmaPeer):
        p.close()


class CmaPeers:
    """Which peers ``cma`` reaches: each segment's peer probed once per descriptor
    (:meth:`CmaPeer.open`), holding a pidfd until its process exits, the segment is
    re-published by another process or withdrawn, or :meth:`close`."""

    MAX_PEERS = 256
    """Live peers held at once (one pidfd each); beyond, new peers are refused cma."""
    RETRY_S = 5.0
    """A refusal is remembered this long, then the peer is probed again."""

    def __init__(self, stale: Callable[[str], None]) -> None:
        self._stale = stale
        self._lock = threading.Lock()
        self._peers: dict[str, tuple[tuple[int, int, str], CmaPeer | str, float]] = {}
        self._closed = False

    def peer(self, segment: str, pid: int, anchor_addr: int, token_hex: str
             ) -> CmaPeer | str:
        """The peer, or why ``cma`` cannot reach it (remembered for this descriptor, and
        logged once as a warning). ``segment`` is the name the request used."""
        key = (pid, anchor_addr, token_hex)
        with self._lock:
            got = self._peers.get(segment)
        if got is not None and got[0] == key and (
                isinstance(got[1], CmaPeer) or time.monotonic() - got[2] < self.RETRY_S):
            return got[1]
        out: CmaPeer | str
        if not supported():
            out = "process_vm_writev/readv or pidfds are not available"
        else:
            peer = CmaPeer(segment, pid, anchor_addr, bytes.fromhex(token_hex), self._stale)
            peer.on_exit = self._forget
            out = peer.open() or peer
        with self._lock:
            old = self._peers.pop(segment, None)
            if old is not None and old[0] == key and isinstance(old[1], CmaPeer):
                self._peers[segment] = old  # another thread probed it meanwhile
                _drop(out)
                return old[1]
            if old is not None:
                _drop(old[1])  # the segment's previous process, or a refusal
            self._sweep_locked()
            if self._closed:
                out = self._refuse(out, "the engine is closed")
            elif isinstance(out, CmaPeer) and len(self._peers) >= self.MAX_PEERS:
                out = self._refuse(out, f"{self.MAX_PEERS} cma peers held already")
            if not self._closed:
                self._peers[segment] = (key, out, time.monotonic())
        if isinstance(out, str):
            logger.warning("cma to segment %r refused: %s", segment, out)
        return out

    @staticmethod
    def _refuse(out: CmaPeer | str, why: str) -> str:
        _drop(out)
        return why

    def _sweep_locked(self) -> None:
        """Forget peers whose process has exited (their pidfds closed); run at every new
        probe, so a departed peer's pidfd is held at most until the next one."""
        for segment, (_, p, _t) in list(self._peers.items()):
            if isinstance(p, CmaPeer) and not p.alive():
                _drop(p)
                del self._peers[segment]

    def forget(self, segment: str) -> None:
        """``segment`` is no longer published: close its peer's pidfd."""
        with self._lock:
            got = self._peers.pop(segment, None)
        if got is not None:
            _drop(got[1])

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for _, p, _t in self._peers.values():
                _drop(p)
            self._peers.clear()

    def _forget(self, peer: CmaPeer) -> None:
        """Drop an exited peer and close its pidfd (a new probe of the same descriptor
        is then refused: the process is gone)."""
        with self._lock:
            got = self._peers.get(peer.segment)
            if got is not None and got[1] is peer:
                self._peers[peer.segment] = (got[0], f"segment {peer.segment!r}: pid "
                                                     f"{peer.pid} has exited",
                                             time.monotonic())
                peer.close()
