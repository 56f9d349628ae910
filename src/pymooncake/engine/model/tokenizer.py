"""Tokenizers the engine's offline CLI uses: byte-level (tiny model) or a HF directory's.

Identity is over token ids (DESIGN.md §3); ``fingerprint`` is what goes into the cache
namespace (``identity.tokenizer_fingerprint`` of the files and chat template).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Protocol

from pymooncake.identity import tokenizer_fingerprint


class Tokenizer(Protocol):
    """Text ↔ token ids, plus the chat template."""

    fingerprint: str
    eos_token_ids: tuple[int, ...]

    def encode(self, text: str) -> list[int]: ...
    def decode(self, token_ids: list[int]) -> str: ...
    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]: ...


BYTE_CHAT_TEMPLATE = "<|{role}|>\n{content}\n"
"""Byte-level chat template: each message as ``<|role|>\\n content \\n``, then
``<|assistant|>\\n`` opens the reply."""


class ByteTokenizer:
    """Ids 0..255 are bytes (UTF-8), then ``BOS=256``, ``EOS=257``, ``PAD=258``."""

    BOS, EOS, PAD = 256, 257, 258
    VOCAB_SIZE = 259

    def __init__(self) -> None:
        self.eos_token_ids = (self.EOS,)
        self.vocab_size = self.VOCAB_SIZE
        """Token ids the model embeds: ``[0, vocab_size)``."""
        self.fingerprint = tokenizer_fingerprint(
            None, chat_template="byte-level/v1\x00" + BYTE_CHAT_TEMPLATE)

    def encode(self, text: str) -> list[int]:
        return [self.BOS, *text.encode("utf-8")]

    def decode(self, token_ids: list[int]) -> str:
        return bytes(t for t in token_ids if t < 256).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        text = "".join(BYTE_CHAT_TEMPLATE.format(role=m["role"], content=m["content"])
                       for m in messages)
        return self.encode(text + "<|assistant|>\n")


class HFTokenizer:
    """A HF directory's tokenizer (``transformers.AutoTokenizer``, offline), falling back to
    ``tokenizers`` when ``transformers`` is absent (then no chat template).

    Raises ``FileNotFoundError`` when the directory holds no tokenizer files.
    """

    def __init__(self, model_dir: str | Path) -> None:
        d = Path(model_dir)
        self.fingerprint = tokenizer_fingerprint(d)
        self._hf = None
        try:
            from transformers import AutoTokenizer
            self._hf = AutoTokenizer.from_pretrained(str(d), local_files_only=True)
            eos = self._hf.eos_token_id
        except ImportError:
            from tokenizers import Tokenizer as RawTokenizer
            if not (d / "tokenizer.json").is_file():
                raise FileNotFoundError(f"{d}/tokenizer.json not found") from None
            self._raw = RawTokenizer.from_file(str(d / "tokenizer.json"))
            cfg = d / "tokenizer_config.json"
            eos_tok = json.loads(cfg.read_text()).get("eos_token") if cfg.is_file() else None
            eos = self._raw.token_to_id(eos_tok) if isinstance(eos_tok, str) else None
        self.eos_token_ids = () if eos is None else (int(eos),)
        self.vocab_size: int | None = None
        """Token ids the model embeds (``config.json``'s ``vocab_size``; None if unknown)."""
        cfg_path = d / "config.json"
        if cfg_path.is_file():
            with contextlib.suppress(ValueError, OSError):
                v = json.loads(cfg_path.read_text()).get("vocab_size")
                self.vocab_size = int(v) if isinstance(v, int) and v > 0 else None

    def encode(self, text: str) -> list[int]:
        if self._hf is not None:
            return list(self._hf.encode(text))
        return list(self._raw.encode(text).ids)

    def decode(self, token_ids: list[int]) -> str:
        if self._hf is not None:
            return str(self._hf.decode(token_ids, skip_special_tokens=True))
        return str(self._raw.decode(token_ids))

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        if self._hf is None or not getattr(self._hf, "chat_template", None):
            raise ValueError("this tokenizer has no chat template; pass a plain prompt")
        ids = self._hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)
