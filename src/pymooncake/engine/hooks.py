"""Per-layer hooks and the external KV source: how KV is loaded and shipped layer by layer.

The runner calls, for every step: ``start_step`` (begin async loads of this step's
``KVLoad`` s), then for each layer ``i`` ``before_layer(i)`` — which must **block until layer
i's loaded KV is in place** (CASES BUG-39: a no-op wait lets attention read KV that has not
arrived) or raise ``KVLoadError`` — the layer's compute, ``after_layer(i)`` (the layer's new
K/V are in the cache: ship them), and ``end_step`` (always, also after a failure: it must
finish or cancel outstanding writes, since the blocks may be freed right after). A
``KVLoad`` only ever targets fresh blocks of the loading request (``ref_cnt == 1``, not
computed: CASES BUG-10).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from pymooncake.identity import BlockKey

if TYPE_CHECKING:
    from pymooncake.engine.kv.kv_tensors import KVTensors
    from pymooncake.engine.request import Request


class KVLoadError(RuntimeError):
    """A layer's KV load failed or timed out; ``request_ids`` name the requests hit."""

    def __init__(self, message: str, request_ids: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.request_ids = request_ids


@dataclass(frozen=True, slots=True)
class KVLoad:
    """Load tokens ``[first_token, first_token + num_tokens)`` of a request into its fresh
    blocks ``block_ids`` (``first_token`` is a block boundary). ``block_keys`` are the keys
    of the whole blocks among them; a last block the tokens fill only in part (P→D: the
    prompt's tail, ``num_tokens % block_size`` tokens) has none, since only full blocks
    get keys (DESIGN.md §3), so it is the one block id without a key."""

    request_id: str
    block_ids: tuple[int, ...]
    block_keys: tuple[BlockKey, ...]
    first_token: int
    num_tokens: int


@dataclass(frozen=True, slots=True)
class ScheduledSeq:
    """One request in a step: tokens ``[num_computed_tokens, + num_new_tokens)`` computed."""

    request_id: str
    block_ids: tuple[int, ...]
    num_computed_tokens: int
    num_new_tokens: int


@dataclass(frozen=True, slots=True)
class StepContext:
    """What the hooks see of one step."""

    step_id: int
    seqs: tuple[ScheduledSeq, ...]
    loads: tuple[KVLoad, ...]


class LayerHooks(Protocol):
    """Called by the runner around every layer of every step (see module docstring)."""

    def start_step(self, ctx: StepContext, kv: KVTensors) -> None: ...
    def before_layer(self, layer: int, ctx: StepContext, kv: KVTensors) -> None: ...
    def after_layer(self, layer: int, ctx: StepContext, kv: KVTensors) -> None: ...
    def end_step(self, ctx: StepContext, kv: KVTensors) -> None: ...


class KVLoadSource(LayerHooks, Protocol):
    """An external KV tier (store, remote prefill) that can fill a request's prefix."""

    def get_num_matched_tokens(self, req: Request, num_local_computed_tokens: int
                               ) -> int | None:
        """Tokens after ``num_local_computed_tokens`` it can load: a multiple of the block
        size, or every token of the request but its last (a source that holds the
        partial last block too: the P→D receive buffer); None while its lookup or load is
        still in flight (the request then waits and is asked again next step). The
        scheduler keeps at least one token to compute (BUG-09)."""
        ...


class NullHooks:
    """Hooks that do nothing (base class for partial implementations)."""

    def start_step(self, ctx: StepContext, kv: KVTensors) -> None:
        return None

    def before_layer(self, layer: int, ctx: StepContext, kv: KVTensors) -> None:
        return None

    def after_layer(self, layer: int, ctx: StepContext, kv: KVTensors) -> None:
        return None

    def end_step(self, ctx: StepContext, kv: KVTensors) -> None:
        return None


class BlockTables(NullHooks):
    """Engine hook (a prefill worker's one-batch shipping): each request's block ids as of
    its latest step, so the prompt's partial last block — never in the prefix cache, which
    keys full blocks only — can be shipped right after the step that ended the request."""

    def __init__(self) -> None:
        self.tables: dict[str, tuple[int, ...]] = {}

    def start_step(self, ctx: StepContext, kv: KVTensors) -> None:
        for s in ctx.seqs:
            self.tables[s.request_id] = s.block_ids

    def pop(self, request_id: str) -> tuple[int, ...]:
        return self.tables.pop(request_id, ())
