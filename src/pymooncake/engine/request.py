"""Request: token ids, block keys, ``num_computed_tokens`` → ``num_tokens`` (vLLM v1's model).

A request's tokens are its prompt followed by its output so far. The scheduler moves
``num_computed_tokens`` (tokens whose KV is in the request's blocks) towards ``num_tokens``;
when they meet, the step's logits sample the next token. Block keys are the ``identity``
chain over every full block of those tokens.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import NewType

import blake3

from pymooncake.engine.sampling import SamplingParams
from pymooncake.identity import BlockKey, CacheNamespace, block_keys, encode_block_tokens

RequestId = NewType("RequestId", str)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"
    """EOS, a stop token id or a stop string."""
    LENGTH = "length"
    """``max_tokens`` reached."""
    ABORT = "abort"
    ERROR = "error"
    """Failed cleanly (e.g. its KV load failed and recompute was not possible)."""


class Request:
    """A generation request while it lives in the engine (a mutable state holder)."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 namespace: CacheNamespace,
                 hash_fn: Callable[[bytes], bytes] | None = None) -> None:
        if not prompt_token_ids:
            raise ValueError(f"request {request_id}: prompt_token_ids must not be empty")
        self.request_id = RequestId(request_id)
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.params = params
        self.namespace = namespace
        self.hash_fn = hash_fn
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1
        """Prompt tokens served from cache at first scheduling (-1 until then)."""
        self.num_external_tokens = 0
        """Of the computed tokens, those loaded from an external source in this step."""
        self.allow_external_load = True
        self.max_chunk_tokens: int | None = None
        """This request's prefill chunk per step at most, below the engine's
        ``prefill_chunk_tokens`` (None: that alone). A prefill worker caps a prompt whose
        KV target has not arrived yet, so the target can join between its chunks."""
        self.num_preemptions = 0
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | str | None = None
        self.logprobs: list[float] = []
        self.logits: list = []
        self.generator = None
        if params.seed is not None:
            import torch
            self.generator = torch.Generator().manual_seed(params.seed)
        self._block_keys: list[BlockKey] = []

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    @property
    def block_keys(self) -> list[BlockKey]:
        """Chained keys of every full block of ``all_token_ids`` (computed on demand).

        The first call computes them with ``identity.block_keys``; later full blocks extend
        the chain with ``key_i = BLAKE3-256(key_{i-1} ‖ tokens(block_i))``, the identity
        definition, without rehashing the prefix (tests check both agree).
        """
        bs = self.namespace.block_size
        n_full = self.num_tokens // bs
        have = len(self._block_keys)
        if have < n_full:
            if self.hash_fn is not None or have == 0:
                kw = {} if self.hash_fn is None else {"hash_fn": self.hash_fn}
                self._block_keys = block_keys(self.all_token_ids, self.namespace, **kw)
            else:
                prev = bytes.fromhex(self._block_keys[-1])
                tokens = self.all_token_ids
                for i in range(have, n_full):
                    row = encode_block_tokens(tokens[i * bs:(i + 1) * bs]).tobytes()
                    prev = blake3.blake3(prev + row).digest()
                    self._block_keys.append(BlockKey(prev.hex()))
        return self._block_keys[:n_full]

    @property
    def known_block_keys(self) -> list[BlockKey]:
        """The block keys computed so far (``block_keys`` computes the rest on demand)."""
        return self._block_keys

    def block_token_ids(self, index: int) -> list[int]:
        bs = self.namespace.block_size
        return self.all_token_ids[index * bs:(index + 1) * bs]


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """A finished request's result, as returned by ``Engine.generate`` / ``Engine.step``."""

    request_id: RequestId
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]
    finish_reason: FinishReason
    num_cached_tokens: int
    """Prompt tokens whose KV was reused (local prefix cache or imported) at first
    scheduling; never the whole prompt (BUG-09: at least one token is computed — the
    whole last block when it comes from a cache of full blocks)."""
    logprobs: tuple[float, ...] = ()
    logits: tuple = ()
    """Float32 ``[vocab]`` tensors per sampling step, when ``return_logits`` was set."""
    num_preemptions: int = 0
    text: str | None = None
    prompt_block_keys: tuple[BlockKey, ...] = ()
    """Keys of the prompt's full blocks when the engine computed them while it ran the
    request (``Request.block_keys``, its hash), else ``()``: callers that need them do
    not hash the prompt again."""


def check_stop(req: Request, token: int, eos_token_ids: tuple[int, ...],
               detokenize: Callable[[list[int]], str] | None) -> FinishReason | None:
    """The finish reason after appending ``token``, or ``None`` to continue."""
    p = req.params
    if not p.ignore_eos and token in eos_token_ids:
        req.stop_reason = token
        return FinishReason.STOP
    if token in p.stop_token_ids:
        req.stop_reason = token
        return FinishReason.STOP
    if p.stop and detokenize is not None:
        text = detokenize(req.output_token_ids)
        for s in p.stop:
            if s in text:
                req.stop_reason = s
                return FinishReason.STOP
    if len(req.output_token_ids) >= p.max_tokens:
        return FinishReason.LENGTH
    return None
