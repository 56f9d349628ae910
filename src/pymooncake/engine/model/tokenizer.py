"""Tokenizers: byte-level (tiny model), a GGUF file's, or a HF directory's.

Identity is over token ids (DESIGN.md §3); ``fingerprint`` is what goes into the cache
namespace (``identity.tokenizer_fingerprint`` of the files and chat template, or a BLAKE3
digest of a GGUF file's vocabulary, merges, special tokens and template).
``load_tokenizer(resolve_model(spec))`` picks the right one for a ``--model`` spec.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from pymooncake.identity import tokenizer_fingerprint

if TYPE_CHECKING:
    from pymooncake.engine.model.registry import ModelSource


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



# --- GGUF ---------------------------------------------------------------------------------

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types

_GPT2_SPLIT = None  # tokenizers' ByteLevel(use_regex=True) is the GPT-2 split regex
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DIGITS = "digits"
_GGUF_PRE: dict[str, str | None] = {
    # tokenizer.ggml.pre -> how text is split before BPE (llama.cpp's llama-vocab.cpp).
    # "digits": every \p{N} on its own, then the GPT-2 regex -- the split SmolLM2's own
    # tokenizer.json makes (Digits(individual_digits) + ByteLevel).
    "default": _GPT2_SPLIT, "gpt-2": _GPT2_SPLIT, "gpt2": _GPT2_SPLIT,
    "smollm": _DIGITS, "starcoder": _DIGITS, "refact": _DIGITS, "codeshell": _DIGITS,
    "llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
}
_GGUF_MODEL_MAX_LENGTH = 8192


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the spelling of byte-level tokens)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
            *range(ord("\u00ae"), ord("\u00ff") + 1)]
    table, n = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + n)
            n += 1
    return table


class GGUFTokenizer:
    """The byte-level BPE tokenizer (``tokenizer.ggml.model == "gpt2"``) a GGUF file
    describes, with its chat template.

    The metadata is read by ``gguf_file.read_gguf_metadata``; the BPE itself is a
    ``tokenizers.Tokenizer`` built from the vocabulary and merges (``raw``). Control tokens
    (type 3) become special added tokens (matched whole in text, skipped by ``decode``),
    user-defined ones (type 4) plain added tokens; no BOS is added unless the file says
    ``add_bos_token``. The chat template is rendered as Hugging Face does: a sandboxed
    jinja2 environment with ``trim_blocks``/``lstrip_blocks``, ``raise_exception``,
    ``tojson``, the special tokens as variables, and ``add_generation_prompt=True``.

    Raises:
        ValueError: not a GGUF file, an unsupported ``tokenizer.ggml.model`` or
            ``tokenizer.ggml.pre``, or a missing/inconsistent key (named in the message).
    """

    def __init__(self, path: str | Path) -> None:
        from pymooncake.engine.model.gguf_file import read_gguf_metadata

        self.path = Path(path)
        meta = read_gguf_metadata(self.path, _GGUF_KEYS)
        model = meta.get("tokenizer.ggml.model")
        if model is None:
            raise ValueError(f"{self.path}: GGUF metadata has no tokenizer.ggml.model")
        if model != "gpt2":
            raise ValueError(f"{self.path}: tokenizer.ggml.model {model!r} is not supported "
                             "(only 'gpt2', byte-level BPE)")
        pre = meta.get("tokenizer.ggml.pre", "default")
        if pre not in _GGUF_PRE:
            raise ValueError(f"{self.path}: tokenizer.ggml.pre {pre!r} is not supported "
                             f"(known: {', '.join(sorted(_GGUF_PRE))})")
        tokens = _need(meta, "tokenizer.ggml.tokens", self.path)
        merges = _need(meta, "tokenizer.ggml.merges", self.path)
        types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        if len(types) != len(tokens):
            raise ValueError(f"{self.path}: tokenizer.ggml.token_type has {len(types)} entries, "
                             f"tokenizer.ggml.tokens {len(tokens)}")
        self.tokens: list[str] = tokens
        self.merges: list[str] = merges
        self.token_types: list[int] = list(types)
        self.pre = pre
        self.chat_template: str | None = meta.get("tokenizer.chat_template")
        self.add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
        ids = {name: meta.get(f"tokenizer.ggml.{key}") for name, key in (
            ("bos", "bos_token_id"), ("eos", "eos_token_id"), ("unk", "unknown_token_id"),
            ("pad", "padding_token_id"))}
        for name, i in ids.items():
            if i is not None and not 0 <= i < len(tokens):
                raise ValueError(f"{self.path}: tokenizer.ggml.{name} id {i} is outside the "
                                 f"vocabulary of {len(tokens)}")
        self.special_token_ids = ids
        self.special_tokens: dict[str, str | None] = {
            f"{name}_token": (None if i is None else tokens[i]) for name, i in ids.items()}
        self.vocab_size = len(tokens)
        """Token ids the model embeds: ``[0, vocab_size)``."""
        eos = ids["eos"]
        # The end-of-turn token of a chat template ends a reply too, even when the file's
        # eos is another token.
        eot = [i for i, t in enumerate(tokens)
               if types[i] == _CONTROL and t in ("<|im_end|>", "<|eot_id|>")]
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(
            ([eos] if eos is not None else []) + eot))
        self.raw = self._build()
        """The ``tokenizers.Tokenizer`` doing the BPE (incremental decoding uses it)."""
        self._template = None if self.chat_template is None else _compile_template(
            self.chat_template)
        self.fingerprint = self._fingerprint()

    def _build(self):  # -> tokenizers.Tokenizer
        from tokenizers import AddedToken, Regex, decoders, pre_tokenizers, processors
        from tokenizers import Tokenizer as RawTokenizer
        from tokenizers.models import BPE

        alphabet = _byte_alphabet()
        spelled = set(alphabet.values())
        vocab: dict[str, int] = {}
        for i, t in enumerate(self.tokens):
            if not set(t) <= spelled:  # stored as text, not in the byte alphabet
                t = "".join(alphabet[b] for b in t.encode("utf-8", errors="surrogateescape"))
            vocab.setdefault(t, i)
        pairs = []
        for n, m in enumerate(self.merges):
            a, sep, b = m.partition(" ")
            if not sep or not a or not b:
                raise ValueError(f"{self.path}: tokenizer.ggml.merges[{n}] {m!r} is not "
                                 "two space-separated tokens")
            pairs.append((a, b))
        tk = RawTokenizer(BPE(vocab, pairs, fuse_unk=False, byte_fallback=False))
        split = _GGUF_PRE[self.pre]
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if split == _DIGITS:
            tk.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Digits(individual_digits=True), byte_level])
        elif split is not None:
            tk.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        else:
            tk.pre_tokenizer = byte_level
        tk.decoder = decoders.ByteLevel()
        bos = self.special_tokens["bos_token"]
        if self.add_bos and bos is not None:
            tk.post_processor = processors.TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                special_tokens=[(bos, self.special_token_ids["bos"])])
        special = [AddedToken(t, special=True, normalized=False)
                   for t, ty in zip(self.tokens, self.token_types, strict=True)
                   if ty == _CONTROL and set(t) <= spelled]
        user = [AddedToken(t, special=False, normalized=False)
                for t, ty in zip(self.tokens, self.token_types, strict=True)
                if ty == _USER_DEFINED and t in vocab]
        tk.add_special_tokens(special)
        tk.add_tokens(user)
        if tk.get_vocab_size(with_added_tokens=True) != len(self.tokens):
            raise ValueError(f"{self.path}: the tokenizer built from tokenizer.ggml.tokens has "
                             f"{tk.get_vocab_size(with_added_tokens=True)} ids, expected "
                             f"{len(self.tokens)} (duplicate tokens?)")
        return tk

    def _fingerprint(self) -> str:
        import blake3
        h = blake3.blake3(b"pymooncake.identity.tokenizer.gguf/v1\x00")
        doc = {"model": "gpt2", "pre": self.pre, "add_bos": self.add_bos,
               "special_ids": self.special_token_ids, "eos_token_ids": self.eos_token_ids,
               "chat_template": self.chat_template, "token_type": self.token_types}
        for part in (json.dumps(doc, sort_keys=True).encode(),
                     "\n".join(self.tokens).encode("utf-8", errors="surrogateescape"),
                     "\n".join(self.merges).encode("utf-8", errors="surrogateescape")):
            h.update(len(part).to_bytes(8, "little") + part)
        return str(h.hexdigest())

    def encode(self, text: str) -> list[int]:
        return list(self.raw.encode(text, add_special_tokens=self.add_bos).ids)

    def decode(self, token_ids: list[int]) -> str:
        return str(self.raw.decode(list(token_ids), skip_special_tokens=True))

    def render_chat_template(self, messages: list[dict[str, str]],
                             add_generation_prompt: bool = True) -> str:
        """The chat template's text for ``messages`` (Hugging Face's rendering contract)."""
        if self._template is None:
            raise ValueError(f"{self.path} has no tokenizer.chat_template; pass a plain prompt")
        return str(self._template.render(
            messages=[dict(m) for m in messages], tools=None, documents=None,
            add_generation_prompt=add_generation_prompt, **self.special_tokens))

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        text = self.render_chat_template(messages)
        return list(self.raw.encode(text, add_special_tokens=False).ids)

    def save_pretrained(self, out_dir: str | Path) -> Path:
        """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json``
        so that ``transformers.AutoTokenizer.from_pretrained(out_dir)`` gives the same ids
        and the same chat-template output. Returns ``out_dir``."""
        d = Path(out_dir)
        d.mkdir(parents=True, exist_ok=True)
        self.raw.save(str(d / "tokenizer.json"))
        added = {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                          "single_word": False, "special": ty == _CONTROL}
                 for i, (t, ty) in enumerate(zip(self.tokens, self.token_types, strict=True))
                 if ty in (_CONTROL, _USER_DEFINED)}
        specials = {k: v for k, v in self.special_tokens.items() if v is not None}
        config = {"add_bos_token": self.add_bos, "add_eos_token": False,
                  "added_tokens_decoder": added, "clean_up_tokenization_spaces": False,
                  "model_max_length": _GGUF_MODEL_MAX_LENGTH,
                  "tokenizer_class": "PreTrainedTokenizerFast", **specials}
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        (d / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False)
                                                 + "\n")
        (d / "special_tokens_map.json").write_text(json.dumps(specials, indent=2) + "\n")
        return d


_GGUF_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens",
              "tokenizer.ggml.token_type", "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id",
              "tokenizer.ggml.eos_token_id", "tokenizer.ggml.unknown_token_id",
              "tokenizer.ggml.padding_token_id", "tokenizer.ggml.add_bos_token",
              "tokenizer.chat_template")


def _need(meta: dict, key: str, path: Path) -> list:
    v = meta.get(key)
    if not isinstance(v, list) or not v:
        raise ValueError(f"{path}: GGUF metadata has no {key}")
    return v


def _compile_template(source: str):  # -> jinja2.Template
    """Compile a chat template the way Hugging Face does: sandboxed (templates from model
    files are untrusted), ``trim_blocks``/``lstrip_blocks``, loop controls, and the globals
    templates expect (``raise_exception``, ``strftime_now``) plus a ``tojson`` that does
    not HTML-escape."""
    from datetime import datetime

    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ValueError(f"tokenizer.chat_template does not compile: {e}") from None


def load_tokenizer(source: ModelSource) -> Tokenizer:
    """The tokenizer of a resolved ``--model`` spec: ``ByteTokenizer`` for ``tiny``,
    ``GGUFTokenizer`` for a GGUF file, ``HFTokenizer`` for a HF directory.

    Raises ``ValueError`` for an unknown kind or a GGUF file whose tokenizer cannot be built.
    """
    if source.kind == "tiny":
        return ByteTokenizer()
    if source.path is None:
        raise ValueError(f"model source of kind {source.kind!r} has no path")
    if source.kind == "gguf":
        return GGUFTokenizer(source.path)
    if source.kind == "hf":
        return HFTokenizer(source.path)
    raise ValueError(f"unknown model source kind {source.kind!r} (tiny, gguf or hf)")
