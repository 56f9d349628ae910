"""The metadata hot paths of issue 16 answer exactly as the per-key paths they shortcut:
``MasterCore.exist_many`` (the master's ``batch_exist``) against ``exist`` key by key,
the client's all-keys-good check (``MasterOps._keys_ok``) and the compat store's key
conversion (``keys_arg``) on good and bad input."""

from __future__ import annotations

import pytest

from pymooncake.store.client_base import MAX_KEY_BYTES
from pymooncake.store.client_master import MasterOps
from pymooncake.store.compat._types import key_arg, keys_arg
from pymooncake.store.config import MasterConfig, ReplicateConfig
from pymooncake.store.errors import ErrorCode, StoreError
from pymooncake.store.master.core import MasterCore

MiB = 1 << 20


class Key(str):
    """A str subclass: passes the key checks, takes the per-key path (not exactly str)."""


def _core() -> MasterCore:
    core = MasterCore(MasterConfig(max_key_bytes=64))
    core.mount_segment("c0", "s0", "h0", 1 << 32, 16 * MiB, 0.0)
    core.mount_segment("c1", "s1", "h1", 2 << 32, 16 * MiB, 0.0)
    for key, seg in (("a", "s0"), ("b", "s1"), ("é/x", "s0")):
        h = core.put_start("c0", key, 100, ReplicateConfig(preferred_segment=seg), 0.0)
        core.put_end("c0", key, h.generation, 0.0)
    core.put_start("c0", "writing", 100, ReplicateConfig(), 0.0)
    return core


def _one(core: MasterCore, key: object, now: float, ex: frozenset[str]) -> object:
    try:
        return core.exist("r", key, now, ex)  # type: ignore[arg-type]
    except StoreError as e:
        return e.code


@pytest.mark.parametrize("keys", [
    ["a", "b", "nope", "writing"],                  # all good: the one-pass check
    ["a", "", "b"],                                 # an empty key among good ones
    ["a", "k" * 65, "b"],                           # over max_key_bytes (64)
    ["k" * 64, "j" * 40, "a"],                      # each within 64, together over it
    ["é/x", "a", "é" * 40],                         # non-ASCII: 80 UTF-8 bytes > 64
    ["a", 7, "b"],                                  # not a str
    ["a", Key("b")],                                # a str subclass: the per-key path
    [],
])
@pytest.mark.parametrize("exclude", [frozenset(), frozenset({"s1"})])
def test_exist_many_answers_as_exist_key_by_key(keys: list, exclude: frozenset) -> None:
    core = _core()
    got = core.exist_many(keys, 5.0, exclude)
    assert [x.code if isinstance(x, StoreError) else x for x in got] == \
        [_one(_core(), k, 5.0, exclude) for k in keys]
    # a present key's LRU recency is refreshed, never moved back; no lease is granted
    if "a" in keys:
        assert core.objects.get("a").last_access_ms == 5.0
        core.exist_many(["a"], 1.0)
        assert core.objects.get("a").last_access_ms == 5.0
        assert core.lease_count("a", 5.0) == 0


def test_exist_many_excluded_segments() -> None:
    core = _core()
    assert core.exist_many(["a", "b"], 1.0, frozenset({"s1"})) == [True, False]
    assert core.exist_many(["a", "b"], 1.0, frozenset({"s0", "s1"})) == [False, False]


@pytest.mark.parametrize(("keys", "ok"), [
    (["a", "b/c", "x" * MAX_KEY_BYTES], True),
    ([], False),
    (["a", ""], False),
    (["a", "b\x00c"], False),
    (["a", "é"], False),
    (["a", "x" * (MAX_KEY_BYTES + 1)], False),
    (["x" * MAX_KEY_BYTES, "y" * MAX_KEY_BYTES], True),  # together over the limit
    (["x" * (MAX_KEY_BYTES - 1), "y" * (MAX_KEY_BYTES + 1)], False),
    (["a", b"b"], False),
    (["a", Key("b")], False),
    (("a", "b"), True),
])
def test_keys_ok_only_when_every_key_passes(keys: list, ok: bool) -> None:
    assert MasterOps._keys_ok(keys) is ok
    if ok:  # then the key-by-key check passes every key too
        assert [MasterOps._check_key(k) for k in keys] == list(keys)


def test_keys_arg_fast_path_and_refusals() -> None:
    keys = ["a", "b"]
    out = keys_arg("f", keys)
    assert out == keys and out is not keys                  # a new list, as before
    assert keys_arg("f", ("a", "b")) == ["a", "b"]
    assert keys_arg("f", ["a", b"b"]) == ["a", "b"]         # bytes: std::string
    assert keys_arg("f", []) == []
    with pytest.raises(TypeError, match=r"keys\[1\] takes str"):
        keys_arg("f", ["a", 5])
    with pytest.raises(TypeError, match="keys takes a list"):
        keys_arg("f", "ab")
    assert key_arg("f", b"k") == "k"


def test_store_error_codes_unchanged() -> None:
    """The batch answer's refused key keeps its code (what compat maps to -1)."""
    core = _core()
    (err,) = core.exist_many([""], 0.0)
    assert isinstance(err, StoreError) and err.code is ErrorCode.INVALID_KEY


def test_client_batch_exist_passes_bools_through_and_converts_errors() -> None:
    """All-bool answers come back as they are; a refused key's ``{"e": ...}`` becomes its
    ``StoreError`` (and a wrong count is an error)."""
    ops = MasterOps.__new__(MasterOps)
    ops.client_id, ops._bad = "c", {}
    answers: list = [True, False]
    ops._master = lambda method, params, reply_type=None: answers  # type: ignore[method-assign]
    assert ops.batch_exist(["a", "b"]) == [True, False]
    answers[:] = [True, {"e": [int(ErrorCode.INVALID_KEY), "bad"]}]
    got = ops.batch_exist(["a", "b"])
    assert got[0] is True and isinstance(got[1], StoreError)
    assert got[1].code is ErrorCode.INVALID_KEY
    answers[:] = [True]
    with pytest.raises(StoreError, match="1 answers for 2 keys"):
        ops.batch_exist(["a", "b"])


def test_remove_in_two_halves_matches_remove() -> None:
    """The live master answers ``remove`` after ``removable`` and frees after the answer
    (``finish_remove``): the check changes nothing, refuses as ``remove`` does, and a
    stale object (its key removed and written again meanwhile) is left alone."""
    core = _core()
    used = core.pool.used_bytes()
    obj = core.removable("a", 0.0)
    assert core.exist("r", "a", 0.0, frozenset()) is True  # nothing changed yet
    assert core.pool.used_bytes() == used
    with pytest.raises(StoreError) as e:
        core.removable("writing", 0.0)
    assert e.value.code is ErrorCode.REPLICA_IS_NOT_READY
    with pytest.raises(StoreError) as e:
        core.removable("nope", 0.0)
    assert e.value.code is ErrorCode.OBJECT_NOT_FOUND
    core.finish_remove(obj)
    assert core.exist("r", "a", 0.0, frozenset()) is False
    assert used - core.pool.used_bytes() >= 100  # its range is free again
    # "a" written again: the old object's finish_remove must not delete the new one
    h = core.put_start("c0", "a", 100, ReplicateConfig(preferred_segment="s0"), 0.0)
    core.put_end("c0", "a", h.generation, 0.0)
    core.finish_remove(obj)
    assert core.exist("r", "a", 0.0, frozenset()) is True
