"""Content fingerprints for the namespace: tokenizer + chat template, and adapters.

Identity is over the token ids the model consumed, never the text, so whatever maps text
to ids (tokenizer files, chat template) must be fingerprinted by *content*, and so must an
adapter (CASES BUG-02: a name can refer to two different weights; a content digest can't).
"""

from __future__ import annotations

from pathlib import Path

import blake3

# Files of a Hugging Face tokenizer directory that decide the token ids.
TOKENIZER_FILES: tuple[str, ...] = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "chat_template.jinja",
    "chat_template.json",
)


def _hash_files(tag: bytes, files: list[tuple[str, bytes]]) -> str:
    h = blake3.blake3(tag)
    for name, data in sorted(files):
        encoded = name.encode()
        h.update(len(encoded).to_bytes(8, "little") + encoded)
        h.update(len(data).to_bytes(8, "little") + data)
    return h.hexdigest()


def tokenizer_fingerprint(tokenizer_dir: str | Path | None = None,
                          chat_template: str | None = None) -> str:
    """BLAKE3 hex digest of a tokenizer directory's id-deciding files and a chat template.

    Args:
        tokenizer_dir: a Hugging Face tokenizer/model directory; the files of
            ``TOKENIZER_FILES`` present in it are hashed (name and content,
            length-prefixed). ``None`` when only a template (or a built-in tokenizer) is
            fingerprinted.
        chat_template: an explicit chat template string, overriding/adding to the files.

    Raises:
        FileNotFoundError: ``tokenizer_dir`` is not a directory or holds none of the files.
        TypeError: ``tokenizer_dir`` is not a path or ``chat_template`` not a str.
    """
    files: list[tuple[str, bytes]] = []
    if tokenizer_dir is not None and not isinstance(tokenizer_dir, str | Path):
        raise TypeError(f"tokenizer_dir must be a path, got {type(tokenizer_dir).__name__}")
    if chat_template is not None and not isinstance(chat_template, str):
        raise TypeError(f"chat_template must be a str, got {type(chat_template).__name__}")
    if tokenizer_dir is not None:
        d = Path(tokenizer_dir)
        if not d.is_dir():
            what = "is a file, not a directory" if d.exists() else "does not exist"
            raise FileNotFoundError(f"tokenizer directory {d} {what}")
        files = [(n, (d / n).read_bytes()) for n in TOKENIZER_FILES if (d / n).is_file()]
        if not files:
            raise FileNotFoundError(f"{d} holds none of the tokenizer files {TOKENIZER_FILES}")
    if chat_template is not None:
        files.append(("<chat_template>", chat_template.encode()))
    return _hash_files(b"pymooncake.identity.tokenizer/v1\x00", files)


def adapter_fingerprint(adapter_files: dict[str, bytes] | str | Path) -> str:
    """BLAKE3 hex digest of an adapter's content (a directory, or name → bytes).

    A directory is hashed over every regular file in it (relative path and content); the
    adapter's *name* is not part of it, so one content has one identity on every instance
    and two contents registered under one name have two (CASES BUG-02).
    Raises ``FileNotFoundError`` for a missing or empty directory, ``ValueError`` for an
    empty mapping or one whose values are not bytes.
    """
    if isinstance(adapter_files, dict):
        files = list(adapter_files.items())
        if not files:
            raise ValueError("adapter_files is empty: give the adapter's files (name -> bytes)")
        for name, data in files:
            if not isinstance(name, str) or not isinstance(data, bytes | bytearray | memoryview):
                raise ValueError(f"adapter_files must map str names to bytes, got {name!r}: "
                                 f"{type(data).__name__}")
    else:
        if not isinstance(adapter_files, str | Path):
            raise TypeError("adapter_files must be a directory path or a dict of name -> bytes, "
                            f"got {type(adapter_files).__name__}")
        d = Path(adapter_files)
        if not d.is_dir():
            what = "is a file, not a directory" if d.exists() else "does not exist"
            raise FileNotFoundError(f"adapter directory {d} {what}")
        files = [(str(p.relative_to(d)), p.read_bytes()) for p in d.rglob("*") if p.is_file()]
        if not files:
            raise FileNotFoundError(f"adapter directory {d} is empty")
    return _hash_files(b"pymooncake.identity.adapter/v1\x00", files)
