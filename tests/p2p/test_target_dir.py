"""Where a file payload is pulled to: a target that cannot take the files is refused before
anything is pulled, and a failed pull leaves nothing it created behind (its ``.p2p-part``
files and the directories it made), while what existed before stays."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from pymooncake.p2p import NoHolderError, P2PStore, PullOptions

SHARD = 32 * 1024
FAST = PullOptions(parallel=2, stall_timeout_s=0.5, retry_backoff_s=0.1, refresh_s=0.05)


@pytest.fixture()
def pair(tmp_path: Path) -> Iterator[tuple[P2PStore, P2PStore, Path]]:
    md = f"embedded://tgt-{uuid.uuid4().hex[:8]}"
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "w.bin").write_bytes(os.urandom(3 * SHARD + 5))
    (src / "sub" / "t.json").write_bytes(os.urandom(SHARD // 2))
    seed, peer = P2PStore(md, holder_ttl_s=2.0), P2PStore(md, holder_ttl_s=2.0)
    try:
        seed.register("m", [src], shard_bytes=SHARD)
        yield seed, peer, src
    finally:
        peer.close()
        seed.close()


def _tree(p: Path) -> list[str]:
    return sorted(x.relative_to(p).as_posix() for x in p.rglob("*"))


def test_target_that_is_a_file_is_refused_and_untouched(pair, tmp_path) -> None:
    _, peer, _ = pair
    f = tmp_path / "f"
    f.write_text("x\n")
    with pytest.raises(NotADirectoryError) as e:
        peer.get_replica("m", f, FAST)
    assert e.value.filename == str(f) and "not a directory" in str(e.value)
    with pytest.raises(NotADirectoryError) as e:        # a parent that is a file
        peer.get_replica("m", f / "deeper", FAST)
    assert e.value.filename == str(f)
    assert f.read_text() == "x\n"
    assert peer.holders("m") and all(h.segment != peer.segment for h in peer.holders("m"))


def test_entry_that_would_replace_a_directory_is_refused_first(pair, tmp_path) -> None:
    _, peer, _ = pair
    into = tmp_path / "into"
    (into / "w.bin").mkdir(parents=True)              # a directory where a file goes
    with pytest.raises(IsADirectoryError):
        peer.get_replica("m", into, FAST)
    assert _tree(into) == ["w.bin"]                     # nothing created, nothing removed


def test_failed_pull_removes_the_directories_it_created(pair, tmp_path) -> None:
    seed, peer, _ = pair
    seed.delete_replica("m")                            # registered, held by nobody
    into = tmp_path / "new" / "deep"
    with pytest.raises(NoHolderError):
        peer.get_replica("m", into, FAST)
    assert not (tmp_path / "new").exists()              # deep/, sub/ and new/ all gone
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_failed_pull_keeps_a_directory_that_existed(pair, tmp_path) -> None:
    seed, peer, _ = pair
    seed.delete_replica("m")
    into = tmp_path / "mine"
    (into / "sub").mkdir(parents=True)
    (into / "keep.txt").write_text("mine")
    with pytest.raises(NoHolderError):
        peer.get_replica("m", into, FAST)
    assert _tree(into) == ["keep.txt", "sub"]           # only the .p2p-part files went
