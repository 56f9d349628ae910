"""Asynchronous, layer-wise reads of prefix KV blocks from the Mooncake Store.

``StoreFetcher`` runs every Store round trip of a prefix load on its own thread, never on
the engine thread (issue 16 item 3; vLLM's external-KV contract, LMCache's layer-wise
retrieval): the lookup (one replica plan of the request's next blocks: the leading run
the Store holds is what loads), then the blocks' layers in groups — layer ``0`` first,
then groups of growing size (``layer_groups``), cut at checksum-chunk boundaries
(``chunk_groups``) — each group one round of ranged reads (``StoreClient.open_reads``) of
the whole chunks after the previous group's, straight into registered staging slots and
verified there (``kv_pacing``: with a load share below 1, in smaller rounds paced while
a batch steps). The engine computes layer ``l`` as soon as ``l``'s group has landed
(``BlockFetch.wait_layer``), so the later groups' reads overlap the earlier layers'
compute (Mooncake FAST'25 §3.1 step 1: "load ... layer by layer").

A Store without ranged reads gets every layer in one group (``batch_get_into``); blocks
beyond the free staging slots are read whole as ``bytes`` with the first group.
Every read window (and each wait of the engine for a group) is kept on the ``BlockFetch``
(``timeline``) and exported as a span (``prefill.store_lookup``, ``prefill.store_read``
per layer group, ``prefill.store_load_wait``), so the share of the load that compute hid
can be computed (``hidden_fraction``); the prefill worker also reports the whole read
window as its ``store_load`` stage (spans ``serving.store_load`` next to
``serving.prefill`` at the Conductor).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from pymooncake.engine.kv_pacing import LoadPacer
from pymooncake.obs.logging import init_logger
from pymooncake.obs.tracing import record_span
from pymooncake.store.checksum import CHUNK

if TYPE_CHECKING:
    from pymooncake.engine.kv.kv_tensors import KVTensors

logger = init_logger(__name__)

SLICE_BLOCKS = 8
"""Blocks per round of ranged reads between two pacing points (``kv_pacing``)."""


def layer_groups(num_layers: int, max_group: int = 8) -> list[tuple[int, int]]:
    """Layer ranges ``[a, b)`` read in one round each: ``[0, 1)``, then doubling sizes up
    to ``max_group`` layers (the first group is what compute waits for; the rest hide
    behind it). ``layer_groups(30) == [(0,1),(1,3),(3,7),(7,15),(15,23),(23,30)]``."""
    if num_layers <= 0:
        raise ValueError(f"num_layers={num_layers}: must be > 0")
    out, a, size = [], 0, 1
    while a < num_layers:
        b = min(num_layers, a + size)
        out.append((a, b))
        a, size = b, min(2 * size, max_group)
    return out


def chunk_groups(groups: list[tuple[int, int]], layer_nbytes: int, block_nbytes: int,
                 chunk: int = CHUNK) -> list[tuple[int, int, int]]:
    """``groups`` as ``(a, b, end)``: each group reads the block object's bytes from the
    previous group's ``end`` to ``end`` — whole checksum chunks (``chunk``; the last one
    up to the object's end), verified in place in the staging slot, no byte read twice.
    A group whose layers the previous group's chunks already cover is merged into it
    (the tiny model's 32 KiB block is one chunk: one group)."""
    out: list[tuple[int, int, int]] = []
    for a, b in groups:
        need = b * layer_nbytes
        if out and need <= out[-1][2]:
            out[-1] = (out[-1][0], b, out[-1][2])
            continue
        out.append((a, b, min(block_nbytes, -(-need // chunk) * chunk)))
    return out


class BlockFetch:
    """One request's load: state shared by the fetch thread and the engine thread.

    ``num_blocks`` is None until the lookup is done, then the blocks the Store holds (it
    only shrinks when group 0 finds a block unreadable: the leading run that arrived
    intact). Once group 0 has landed the blocks are ``views`` (``[layers, 2, kv_heads, 1,
    block_size, head_dim]`` each, a staging slot's view or a private tensor), of which
    layer group ``g`` holds data once ``landed > g``.
    """

    def __init__(self, request_id: str, first_block: int, skeys: list[str],
                 groups: list[tuple[int, int, int]], cond: threading.Condition) -> None:
        self.request_id = request_id
        self.first_block = first_block
        self.skeys = skeys
        self.groups = [(a, b) for a, b, _ in groups]
        self.ends = [e for _, _, e in groups]
        """Byte of each block object up to which group ``g``'s reads go (``chunk_groups``)."""
        self.num_blocks: int | None = None
        self.views: list[torch.Tensor] = []
        self.slots: list[int] = []
        self.landed = 0
        self.error: str | None = None
        self.done = False
        """The fetch thread is finished with it (all landed, failed, or cancelled)."""
        self.cancelled = False
        self.cpu_s = 0.0
        """CPU seconds the fetch thread spent on this load (lookup and reads)."""
        self.timeline: list[tuple[str, float, float]] = []
        """``(kind, start_unix_s, end_unix_s)``: ``lookup``, ``read``, ``wait``."""
        self._cond = cond

    @property
    def all_landed(self) -> bool:
        return self.num_blocks is not None and self.landed >= len(self.groups)

    def group_of(self, layer: int) -> int:
        return next(g for g, (a, b) in enumerate(self.groups) if a <= layer < b)

    def wait_layer(self, layer: int, timeout_s: float) -> str | None:
        """Block until ``layer``'s group has landed; the error (or timeout) text, or None.
        A wait that blocks is recorded (``wait``) as load time compute did not hide."""
        g = self.group_of(layer)
        with self._cond:
            if self.landed > g:
                return None
            t0 = time.time()
            self._cond.wait_for(lambda: self.landed > g or self.error is not None,
                                timeout_s)
            t1 = time.time()
            self.timeline.append(("wait", t0, t1))
        record_span("prefill.store_load_wait", t0, t1, request_id=self.request_id,
                    layer=layer)
        if self.landed > g:
            return None
        return self.error or f"layer {layer} not loaded within {timeout_s:.0f} s"

    def read_window(self) -> tuple[float, float] | None:
        reads = [w for w in self.timeline if w[0] == "read"]
        return (reads[0][1], reads[-1][2]) if reads else None


def hidden_fraction(fetch: BlockFetch, compute: tuple[float, float]) -> float:
    """Share of the Store read time (first read start → last read end) that overlapped the
    request's compute window ``compute = (start, end)`` (unix s) without the engine
    waiting for it: ``(|reads ∩ compute| − waits) / |reads|``; 1.0 = fully hidden."""
    w = fetch.read_window()
    if w is None or w[1] <= w[0]:
        return 0.0
    overlap = max(0.0, min(w[1], compute[1]) - max(w[0], compute[0]))
    waits = sum(t1 - t0 for k, t0, t1 in fetch.timeline if k == "wait")
    return max(0.0, overlap - waits) / (w[1] - w[0])


class StoreFetcher:
    """The fetch thread (see module docstring). ``take_slots(n)``/``give_slots`` hand out
    registered staging slots; ``slot_addr(slot)`` is a slot's address, ``slot_view`` its
    block tensor; ``on_done(fetch)`` runs on the fetch thread when one is finished."""

    def __init__(self, store: Any, kv: KVTensors, take_slots: Callable[[int], list[int]],
                 give_slots: Callable[[list[int]], None], slot_addr: Callable[[int], int],
                 slot_view: Callable[[int], torch.Tensor],
                 on_lookup: Callable[[str, float, float], None] | None = None,
                 pacer: LoadPacer | None = None, slice_blocks: int = SLICE_BLOCKS) -> None:
        if slice_blocks < 1:
            raise ValueError(f"slice_blocks={slice_blocks}: must be >= 1")
        self.store = store
        self.pacer = pacer or LoadPacer(1.0)
        self.slice_blocks = slice_blocks
        self.kv = kv
        self._take, self._give = take_slots, give_slots
        self._addr, self._view = slot_addr, slot_view
        self._on_lookup = on_lookup
        self.cond = threading.Condition()
        self._jobs: queue.Queue[BlockFetch | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._ranged = hasattr(store, "open_reads")
        self._all = [(0, kv.num_layers, kv.block_nbytes)]
        self._groups = (chunk_groups(layer_groups(kv.num_layers), kv.block_nbytes_per_layer,
                                     kv.block_nbytes) if self._ranged else self._all)
        self.groups = [(a, b) for a, b, _ in self._groups]
        """Layer groups of a layer-wise load, each one round of reads."""

    def submit(self, request_id: str, first_block: int, skeys: list[str],
               layerwise: bool = True) -> BlockFetch:
        """Queue the load of ``skeys`` (Store keys of the request's blocks from
        ``first_block`` on); ``layerwise=False`` reads every layer in one round (fewer
        transfer requests, when compute will not start before the whole load anyway)."""
        groups = self._groups if layerwise else self._all
        f = BlockFetch(request_id, first_block, skeys, groups, self.cond)
        if self._thread is None:
            self._thread = threading.Thread(target=self._main, daemon=True,
                                            name="store-kv-fetch")
            self._thread.start()
        self._jobs.put(f)
        return f

    def cancel(self, f: BlockFetch) -> None:
        """Drop ``f``: its slots go back now if the thread is done with it, else when the
        thread next looks at it (it never writes a slot after that)."""
        with self.cond:
            f.cancelled = True
            if not f.done:
                return
            slots, f.slots = f.slots, []
        self._give(slots)

    def close(self) -> None:
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join(5.0)

    # -- fetch thread ---------------------------------------------------------------------
    def _main(self) -> None:
        while True:
            f = self._jobs.get()
            if f is None:
                return
            try:
                self._fetch(f)
            except Exception as e:  # noqa: BLE001 - the Store being down only costs reuse
                logger.warning("store load for %s failed: %s", f.request_id, e)
                with self.cond:
                    f.error = f"store load failed: {e}"
            with self.cond:
                f.done = True
                give = f.slots if f.cancelled else []
                if f.cancelled:
                    f.slots = []
                self.cond.notify_all()
            if give:
                self._give(give)

    def _fetch(self, f: BlockFetch) -> None:
        if f.cancelled:
            return
        t0, c0 = time.time(), time.thread_time()
        if self._ranged:  # one master round trip: the plan says which blocks it holds
            reader = self.store.open_reads(f.skeys)
            n = next((i for i, s in enumerate(reader.sizes)
                      if not isinstance(s, int) or s != self.kv.block_nbytes),
                     len(reader.sizes))
        else:
            reader = None
            exists = self.store.batch_exist(f.skeys)
            n = next((i for i, x in enumerate(exists) if x is not True), len(exists))
        t1 = time.time()
        self.pacer.after_slice(time.thread_time() - c0)
        f.timeline.append(("lookup", t0, t1))
        if self._on_lookup is not None:
            self._on_lookup(f.request_id, t0, t1)
        record_span("prefill.store_lookup", t0, t1, request_id=f.request_id, num_blocks=n)
        slots = self._take(n) if n else []
        with self.cond:  # planned: a layer-wise load may join a step from here on
            f.slots = slots
            f.num_blocks = n if not f.cancelled else 0
            self.cond.notify_all()
        views = [self._view(s) for s in slots]
        if n == 0 or f.cancelled:
            self._publish(f, 0, views)
            return
        for g, (a, b) in enumerate(f.groups):
            if f.cancelled:
                return
            r0 = time.time()
            if g == 0:
                views = self._first_group(f, reader, slots, views, n, f.ends[0])
                n, slots = len(views), f.slots  # the run that arrived intact
                if n == 0:
                    self._publish(f, 0, [])
                    return
            else:
                err = self._read_group(reader, slots, f.ends[g - 1], f.ends[g], a, b)
                if err is not None:
                    raise RuntimeError(err)
            r1 = time.time()
            f.timeline.append(("read", r0, r1))
            record_span("prefill.store_read", r0, r1, request_id=f.request_id,
                        first_layer=a, end_layer=b, num_blocks=n)
            with self.cond:
                if g == 0:
                    f.num_blocks, f.views = n, views
                f.landed = g + 1
                self.cond.notify_all()
        if reader is not None:  # every round checked its leases after its copies
            reader.close()
        f.cpu_s = time.thread_time() - c0

    def _publish(self, f: BlockFetch, n: int, views: list[torch.Tensor]) -> None:
        with self.cond:
            f.num_blocks, f.views, f.landed = n, views, len(f.groups)
            self.cond.notify_all()

    def _first_group(self, f: BlockFetch, reader: Any, slots: list[int],
                     views: list[torch.Tensor], n: int, end: int) -> list[torch.Tensor]:
        """Group 0 (bytes ``[0, end)`` of each block) into the slots, and the blocks beyond
        them whole as ``bytes``; the leading run that arrived intact."""
        nb = self.kv.block_nbytes
        have = len(slots)
        if slots and reader is not None:
            bad = self._sliced_read(reader, slots, 0, end, stop_at_error=True)
            have = bad[0][0] if bad else have
        elif slots:
            res = self.store.batch_get_into(f.skeys[:len(slots)],
                                            [self._addr(s) for s in slots], [nb] * len(slots))
            have = next((i for i, r in enumerate(res) if r != nb), have)
        out = views[:have]
        if have == len(slots) and n > len(slots):
            for v in self.store.batch_get(f.skeys[len(slots):n]):
                if not isinstance(v, bytes | bytearray) or len(v) != nb:
                    break
                t = torch.frombuffer(bytearray(v), dtype=torch.uint8).view(self.kv.dtype)
                out.append(t.view(self.kv.num_layers, 2, self.kv.num_kv_heads, 1,
                                  self.kv.block_size, self.kv.head_dim))
        if have < len(slots):  # slots past a failed block hold nothing: back now
            with self.cond:
                give, f.slots = f.slots[have:], f.slots[:have]
            self._give(give)
        return out

    def _read_group(self, reader: Any, slots: list[int], start: int, end: int, a: int,
                    b: int) -> str | None:
        """Bytes ``[start, end)`` of each block (whole chunks: verified in place) into its
        slot, for layers ``[a, b)``; the first failure's text, or None."""
        bad = self._sliced_read(reader, slots, start, end)
        return f"layers [{a}, {b}) of block {bad[0][0]}: {bad[0][1]}" if bad else None

    def _sliced_read(self, reader: Any, slots: list[int], start: int, end: int,
                     stop_at_error: bool = False) -> list[tuple[int, Any]]:
        """Bytes ``[start, end)`` of each block into its slot, ``slice_blocks`` blocks per
        round of reads with a pacing point after each while the pacer is active (otherwise
        the rest in one round: fewer transfer batches); the ``(block, error)`` failures
        (the first only, and no later rounds, with ``stop_at_error``)."""
        bad: list[tuple[int, Any]] = []
        j = 0
        while j < len(slots):  # the rest in one round whenever no decode batch is paced for
            k = self.slice_blocks if self.pacer.active() else len(slots) - j
            c0 = time.thread_time()
            errs = reader.read([(i, start, end - start, self._addr(s) + start)
                                for i, s in enumerate(slots[j:j + k], j)])
            bad += [(j + i, e) for i, e in enumerate(errs) if e is not None]
            self.pacer.after_slice(time.thread_time() - c0)
            if bad and stop_at_error:
                return bad[:1]
            j += k
        return bad
