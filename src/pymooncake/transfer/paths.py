"""TCP paths to peers: per-peer slice queues, one thread and pooled connection per path.

Each peer gets a :class:`PeerChannel` with ``num_paths`` paths. A path's thread takes a
fair share of the peer's queue as a window, sends it over its pooled connection
(``transports/tcp.py``) and reports each slice's outcome. On a link error the unfinished
slices go back to the front of the queue with their retry count raised, so another path
takes them (BUG-36); see ``engine.py`` for the rules this implements.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from pymooncake.obs.logging import init_logger
from pymooncake.transfer import metrics as m
from pymooncake.transfer.batch import StatusCode
from pymooncake.transfer.config import TransferConfig
from pymooncake.transfer.endpoint_pool import EndpointPool
from pymooncake.transfer.lanes import Lane, PeerChannel
from pymooncake.transfer.segment import SegmentDescriptor
from pymooncake.transfer.topology import Topology, device_ipv4
from pymooncake.transfer.transports import tcp
from pymooncake.transfer.transports.base import PathError, Slice

logger = init_logger(__name__)

FinishSlices = Callable[[Sequence[tuple[Slice, StatusCode, str]]], None]
Resolve = Callable[[str], SegmentDescriptor | None]


class TcpPaths:
    """The tcp paths of one engine to all its peers.

    ``finish_slices([(slice, code, message), ...])`` receives every slice outcome once (OK,
    refused, or failed after its retries), a window at a time; ``refresh(name)`` re-reads
    a peer's descriptor after a failed connect (a peer restarted on another port).
    """

    def __init__(self, config: TransferConfig, topology: Topology,
                 finish_slices: FinishSlices, refresh: Resolve) -> None:
        self.config = config
        self.topology = topology
        self._finish_slices = finish_slices
        self._refresh = refresh
        self._lock = threading.Lock()
        self._channels: dict[str, PeerChannel] = {}
        self._closed = False
        self.pool: EndpointPool[tuple[str, int], Any] = EndpointPool(
            config.max_endpoints, _close_connection)

    def enqueue(self, desc: SegmentDescriptor, slices: list[Slice]) -> None:
        ch = self._channel(desc)
        with ch.cond:
            ch.queue.extend(slices)
            ch.cond.notify_all()

    def run_inline(self, desc: SegmentDescriptor, slices: list[Slice]) -> None:
        """Queue ``slices`` and run windows of them in the calling thread on an idle path.

        The caller blocks anyway (a sync transfer), so it does the I/O itself instead of
        handing it to a path thread and waiting to be woken: no thread hop for small
        transfers. Its path takes a fair share of the queue per window, like a path thread;
        when the queue holds more than one share the other paths' threads are woken to
        take theirs in parallel. The caller stops when the queue is empty or its path went
        down; whatever is left (retries included) is for the path threads.
        """
        ch = self._channel(desc)
        with ch.cond:
            ch.queue.extend(slices)
            now = time.monotonic()
            lane = None
            if not self._closed:
                for x in ch.lanes:
                    if not x.busy and x.down_until <= now:
                        lane = x
                        break
            if lane is None:
                ch.cond.notify_all()
                return
            lane.busy = True
            if len(ch.queue) > -(-len(ch.queue) // len(ch.lanes)):
                ch.cond.notify_all()  # more than our share: let the other paths help
            window = self._take_window(ch)
            host, port = ch.host, ch.port
        try:
            while window:
                self._run_window(ch, lane, window, host, port)
                with ch.cond:
                    if self._closed or lane.down_until > time.monotonic():
                        break
                    window = self._take_window(ch)
                    host, port = ch.host, ch.port
        finally:
            with ch.cond:
                lane.busy = False
                if ch.queue:
                    ch.cond.notify_all()

    def update_address(self, name: str, host: str, port: int) -> None:
        with self._lock:
            ch = self._channels.get(name)
        if ch is not None:
            with ch.cond:
                ch.host, ch.port = host, port

    def close(self) -> None:
        """Stop every path thread and close the pool.

        Connections are shut down first, so a path blocked in a window (an unresponsive
        peer) fails it at once instead of after ``slice_timeout_s``.
        """
        self._closed = True
        with self._lock:
            channels = list(self._channels.values())
        for ch in channels:
            with ch.cond:
                ch.cond.notify_all()
        self.pool.close_all()  # in-use connections too: wakes blocked sends/receives
        for ch in channels:
            for lane in ch.lanes:
                if lane.thread is not None:
                    lane.thread.join(timeout=2 * self.config.slice_timeout_s)

    def _channel(self, desc: SegmentDescriptor) -> PeerChannel:
        ch = self._channels.get(desc.name)  # the common case, without the lock
        if ch is not None:
            return ch
        with self._lock:
            ch = self._channels.get(desc.name)
            if ch is not None:
                return ch
            location = "cpu:0"
            loopback = desc.host.startswith("127.") or desc.host in ("localhost", "::1")
            lanes = [Lane(k, "lo" if loopback else self.topology.path_device(location, k),
                           key=(desc.name, k))
                     for k in range(self.config.num_paths)]
            ch = self._channels[desc.name] = PeerChannel(desc.name, desc.host, desc.tcp_port,
                                                          lanes)
            for lane in lanes:
                lane.thread = threading.Thread(target=self._lane_loop, args=(ch, lane),
                                               daemon=True,
                                               name=f"transfer-path-{desc.name}-{lane.index}")
                lane.thread.start()
            return ch

    def _take_window(self, ch: PeerChannel) -> list[Slice]:
        """Pop the next window off the queue (``ch.cond`` is held); ``[]`` when empty.

        A fair share of the queue, so that every path gets slices. A window holds one
        kind of op: the target's READ payloads flowing back while we still push WRITE
        payloads could fill both socket buffers (deadlock).
        """
        queue = ch.queue
        if not queue:
            return []
        cfg = self.config
        if len(queue) == 1:
            return [queue.popleft()]
        share = -(-len(queue) // len(ch.lanes))
        max_slices = min(cfg.window_slices, share)
        op = queue[0].op
        window: list[Slice] = []
        nbytes = 0
        while (queue and len(window) < max_slices and queue[0].op is op
               and nbytes + queue[0].length <= cfg.window_bytes):
            s = queue.popleft()
            window.append(s)
            nbytes += s.length
        if not window:  # a single slice larger than the window
            window.append(queue.popleft())
        return window

    def _lane_loop(self, ch: PeerChannel, lane: Lane) -> None:
        while not self._closed:
            with ch.cond:
                if not ch.queue or lane.busy:
                    ch.cond.wait(timeout=1.0)
                    continue
                wait_s = lane.down_until - time.monotonic()
                if wait_s > 0:
                    ch.cond.wait(timeout=wait_s)
                    continue
                window = self._take_window(ch)
                host, port = ch.host, ch.port
                lane.busy = True
            try:
                self._run_window(ch, lane, window, host, port)
            finally:
                with ch.cond:
                    lane.busy = False

    def run_one(self, desc: SegmentDescriptor, s: Slice) -> tuple[StatusCode, str] | None:
        """The lone slice of a sync request, run now in the calling thread on an idle path
        while nothing is queued for the peer: no batch, queue or wake-up. Its outcome
        ``(code, message)``, or ``None``: no idle path, or the link broke and it may be
        tried again (``s.retries`` counts it) — the caller then submits it as usual."""
        ch = self._channel(desc)
        with ch.cond:
            if ch.queue or self._closed:
                return None
            now = time.monotonic()
            lane = next((x for x in ch.lanes if not x.busy and x.down_until <= now), None)
            if lane is None:
                return None
            lane.busy = True
            host, port = ch.host, ch.port
        try:
            return self._run_one(ch, lane, s, host, port)
        finally:
            lane.busy = False  # a window queued meanwhile found us busy: wake its path
            if ch.queue:
                with ch.cond:
                    ch.cond.notify_all()

    def _run_one(self, ch: PeerChannel, lane: Lane, s: Slice, host: str, port: int
                 ) -> tuple[StatusCode, str] | None:
        """``run_one`` on ``lane``: the path-error rules of ``_run_window``, for one slice."""
        cfg = self.config
        try:
            conn, reused = self._connect(ch, lane, host, port)
        except OSError as e:
            self._refresh_address(ch)
            return self._one_failed(ch, lane, s, StatusCode.CONNECTION_ERROR,
                                    f"connect to {ch.name} at {host}:{port} failed: {e!r}", True)
        seq = lane.seq
        lane.seq += 1
        t0 = time.monotonic()
        try:
            ((code, msg),) = tcp.run_window(conn, (s,), cfg.checksum, seq, cfg.reply_poll_s)
        except PathError as e:
            self.pool.discard(lane.key, conn)
            if reused:
                m.reconnects_total.labels(lane.label).inc()
            return self._one_failed(ch, lane, s, e.code, f"path {lane.label} to {ch.name}: {e}",
                                    not reused)
        now = time.monotonic()
        if conn.closed_by_peer:
            self.pool.discard(lane.key, conn)
        else:
            conn.idle_since = now
            self.pool.release(lane.key, conn)
        lane.latency_metric.observe(now - t0)
        if code is StatusCode.OK:
            lane.bytes_metric.inc(s.length)
            lane.slices_metric.inc()
        elif code is StatusCode.INVALID_ARGUMENT:
            msg = f"refused by target: {msg}"
        return code, msg

    def _one_failed(self, ch: PeerChannel, lane: Lane, s: Slice, code: StatusCode,
                    reason: str, mark_down: bool) -> tuple[StatusCode, str] | None:
        s.retries += 1
        s.last_error = reason
        if mark_down:
            with ch.cond:
                lane.down_until = time.monotonic() + self.config.path_retry_interval_s
        if s.retries > self.config.max_retries:
            return code, f"{reason} (after {s.retries} tries)"
        lane.retries_metric.inc()
        return None

    def _connect(self, ch: PeerChannel, lane: Lane, host: str, port: int
                 ) -> tuple[Any, bool]:
        """``lane``'s pooled connection (opened when there is none; a stale one reopened,
        BUG-36) and whether it was reused; ``OSError`` when the connect fails."""
        cfg = self.config

        def opener() -> Any:
            source_ip = None if lane.device == "lo" else device_ipv4(lane.device)
            return tcp.open_connection(host, port, cfg.connect_timeout_s, cfg.slice_timeout_s,
                                       source_ip)

        conn, reused = self.pool.acquire(lane.key, opener)
        if reused and tcp.is_stale(conn):  # closed by the peer while idle (BUG-36)
            logger.info("path %s to %s: pooled connection is stale; reopening",
                        lane.label, ch.name)
            self.pool.discard(lane.key, conn)
            m.reconnects_total.labels(lane.label).inc()
            conn, reused = self.pool.acquire(lane.key, opener)
        return conn, reused

    def _run_window(self, ch: PeerChannel, lane: Lane, window: list[Slice], host: str,
                    port: int) -> None:
        cfg = self.config
        key = lane.key
        if any(s.owner is not None and s.owner.failure is not None for s in window):
            # Another slice of their request failed: the request fails once these end, so
            # they end here, unsent, instead of moving bytes nobody will use.
            dropped = [(s, StatusCode.INTERNAL, "dropped: another slice of its request "
                        "failed") for s in window
                       if s.owner is not None and s.owner.failure is not None]
            window = [s for s in window if s.owner is None or s.owner.failure is None]
            self._finish_slices(dropped)
            if not window:
                return

        try:
            conn, reused = self._connect(ch, lane, host, port)
        except OSError as e:
            self._path_failed(ch, lane, window, [], StatusCode.CONNECTION_ERROR,
                              f"connect to {ch.name} at {host}:{port} failed: {e!r}",
                              mark_down=True)
            self._refresh_address(ch)
            return
        seq = lane.seq
        lane.seq += len(window)
        t0 = time.monotonic()
        try:
            results = tcp.run_window(conn, window, cfg.checksum, seq, cfg.reply_poll_s)
        except PathError as e:
            self.pool.discard(key, conn)
            if e.refused:  # the target refused a slice and hung up: the rest goes again
                self._path_failed(ch, lane, window, e.results, e.code, str(e),
                                  mark_down=False, count_retry=False)
                return
            # A reused connection may have died just now (peer restart): retry at once on
            # a fresh one; a fresh connection that fails marks the path down.
            if reused:
                m.reconnects_total.labels(lane.label).inc()
            self._path_failed(ch, lane, window, e.results, e.code,
                              f"path {lane.label} to {ch.name}: {e}", mark_down=not reused)
            return
        now = time.monotonic()
        if conn.closed_by_peer:
            self.pool.discard(key, conn)
        else:
            conn.idle_since = now
            self.pool.release(key, conn)
        lane.latency_metric.observe(now - t0)
        self._account(window, results, lane)

    def _account(self, window: Sequence[Slice], results: Sequence[tuple[StatusCode, str]],
                 lane: Lane) -> None:
        if len(window) == 1 and results and results[0][0] is StatusCode.OK:  # fast path
            lane.bytes_metric.inc(window[0].length)
            lane.slices_metric.inc()
            self._finish_slices([(window[0], StatusCode.OK, "")])
            return
        outcomes: list[tuple[Slice, StatusCode, str]] = []
        nbytes = num_ok = 0
        for s, (code, msg) in zip(window, results, strict=False):
            if code is StatusCode.OK:
                nbytes += s.length
                num_ok += 1
            elif code is StatusCode.INVALID_ARGUMENT:
                msg = f"refused by target: {msg}"
            outcomes.append((s, code, msg))
        if num_ok:
            lane.bytes_metric.inc(nbytes)
            lane.slices_metric.inc(num_ok)
        if outcomes:
            self._finish_slices(outcomes)

    def _path_failed(self, ch: PeerChannel, lane: Lane, window: list[Slice],
                     results: list[tuple[StatusCode, str]], code: StatusCode, reason: str,
                     mark_down: bool, count_retry: bool = True) -> None:
        self._account(window[:len(results)], results, lane)
        retry: list[Slice] = []
        failed: list[tuple[Slice, StatusCode, str]] = []
        for s in window[len(results):]:
            if not count_retry:
                retry.append(s)
                continue
            s.retries += 1
            s.last_error = reason
            if s.retries > self.config.max_retries:
                failed.append((s, code, f"{reason} (after {s.retries} tries)"))
            else:
                retry.append(s)
        if retry:
            lane.retries_metric.inc(len(retry))
        if failed:
            self._finish_slices(failed)
        with ch.cond:
            if mark_down:
                lane.down_until = time.monotonic() + self.config.path_retry_interval_s
            ch.queue.extendleft(reversed(retry))
            ch.cond.notify_all()

    def _refresh_address(self, ch: PeerChannel) -> None:
        try:
            desc = self._refresh(ch.name)
        except Exception:  # noqa: BLE001 - metadata down: keep the old address
            return
        if desc is not None:
            with ch.cond:
                ch.host, ch.port = desc.host, desc.tcp_port


def _close_connection(conn: Any) -> None:
    conn.close()
