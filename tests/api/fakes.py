"""Test doubles for the API layer: a byte-level codec and a scripted backend."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from pymooncake.rpc.messages import GenerateRequest, Rejection, RequestRejected, TokenEvent


class ByteCodec:
    """Ids 0..255 are UTF-8 bytes; 256 = BOS, 257 = EOS. Chat: ``<|role|>\\ncontent\\n``."""

    eos_token_ids = (257,)

    def encode(self, text: str) -> list[int]:
        return [256, *text.encode()]

    def decode(self, token_ids: list[int]) -> str:
        return bytes(t for t in token_ids if t < 256).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        text = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages)
        return self.encode(text + "<|assistant|>\n")


class ScriptedBackend:
    """Replies with the bytes of ``reply`` (cycled up to max_tokens), one token per event.

    ``cached_tokens`` is reported as the number of prompt tokens seen before by an earlier
    request with the same first ``block_size``-aligned prefix (a toy prefix cache with
    block size 16, leaving at least one token to compute), like the prefill side would.
    """

    def __init__(self, reply: str = "hello world", hold_s: float = 0.0,
                 block_size: int = 16, eos_after: int | None = None) -> None:
        self.reply = reply.encode()
        self.hold_s = hold_s
        self.block_size = block_size
        self.eos_after = eos_after
        self.seen: set[tuple[int, ...]] = set()
        self.requests: list[GenerateRequest] = []
        self.reject_with: Rejection | None = None
        self.cancelled = 0

    def _cached(self, ids: tuple[int, ...]) -> int:
        bs = self.block_size
        hit = 0
        for n in range(bs, len(ids) + 1, bs):
            if ids[:n] in self.seen:
                hit = n
        for n in range(bs, len(ids) + 1, bs):
            self.seen.add(ids[:n])
        return min(hit, ((len(ids) - 1) // bs) * bs)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenEvent]:
        self.requests.append(request)
        if self.reject_with is not None:
            raise RequestRejected(self.reject_with)
        cached = self._cached(request.prompt_token_ids)
        try:
            if self.hold_s:
                await asyncio.sleep(self.hold_s)
            n = request.sampling.max_tokens
            for i in range(n):
                if self.eos_after is not None and i == self.eos_after:
                    yield TokenEvent(request.request_id, (257,), "stop", cached)
                    return
                tok = self.reply[i % len(self.reply)]
                last = i == n - 1
                yield TokenEvent(request.request_id, (tok,), "length" if last else None,
                                 cached if i == 0 or last else None)
                await asyncio.sleep(0)
        except GeneratorExit:
            self.cancelled += 1
            raise
