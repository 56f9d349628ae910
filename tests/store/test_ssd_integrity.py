"""SSD tier integrity: checksums on every read, an idempotent recovery scan that skips
damaged entries (case BUG-60), one owner per directory (case BUG-29)."""

from __future__ import annotations

import struct
from pathlib import Path

import blake3
import pytest

from pymooncake.store.checksum import digests
from pymooncake.store.tiers.ssd import (
    SsdCorrupt,
    SsdDirectoryInUse,
    SsdTier,
    file_name,
)

from .procs import MiB
from .test_store_processes import pattern, status_of, wait_until

KiB = 1024


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and not p.is_symlink()}


def test_bug_60_recovery_scan_is_idempotent_and_skips_damaged_entries(tmp_path) -> None:
    d = tmp_path / "ssd"
    outside = tmp_path / "outside"
    outside.mkdir()
    tier = SsdTier(d, 64 * MiB)
    vals = {f"k{i:03d}": pattern(i, 256 * KiB) for i in range(100)}
    for k, v in vals.items():
        tier.put(k, v)
    used, count = tier.used_bytes, len(tier.keys())
    assert (used, count) == (100 * 256 * KiB, 100)
    for _ in range(3):  # three simulated master restarts on the same backend
        rep = tier.scan()
        assert (tier.used_bytes, len(tier.keys())) == (used, count)
        assert rep.registered == 100 and not rep.skipped

    # damage the directory
    f_trunc, f_flip, f_ren = (d / file_name(k) for k in ("k000", "k001", "k002"))
    f_trunc.write_bytes(f_trunc.read_bytes()[: f_trunc.stat().st_size // 2])
    raw = bytearray(f_flip.read_bytes())
    raw[-1000] ^= 0xFF
    f_flip.write_bytes(bytes(raw))
    f_ren.rename(d / file_name("k_renamed"))
    (d / "junk.tmp").write_bytes(b"junk")
    # a valid object file for "k_sym" lives outside; the tier's entry is only a symlink
    other = SsdTier(outside / "t", MiB)
    other.put("k_sym", b"s" * 4096)
    other.close()
    target = outside / "t" / file_name("k_sym")
    (d / file_name("k_sym")).symlink_to(target)
    outside_before = _tree(outside)
    atime = target.stat().st_atime_ns

    rep = tier.scan()  # no exception escapes
    skipped = {name for name, _ in rep.skipped}
    assert {file_name("k000"), file_name("k001"), file_name("k_renamed"),
            file_name("k_sym"), "junk.tmp"} <= skipped
    assert rep.registered == 97
    assert tier.used_bytes == 97 * 256 * KiB and len(tier.keys()) == 97
    assert (d / "junk.tmp").read_bytes() == b"junk"  # a stray file is left alone
    for k, v in vals.items():
        if k in ("k000", "k001", "k002"):
            assert tier.get(k) is None  # NOT_FOUND, never the damaged bytes
        else:
            assert tier.get(k) == v
    assert tier.get("k_sym") is None and tier.get("k_renamed") is None
    # the symlink was never followed: nothing outside was read or written
    assert target.stat().st_atime_ns == atime and _tree(outside) == outside_before
    tier.close()


def test_bug_60_flipped_byte_of_a_registered_object_is_an_error(tmp_path) -> None:
    tier = SsdTier(tmp_path, 4 * MiB)
    v = pattern(7, 256 * KiB)
    tier.put("k", v)
    f = tmp_path / file_name("k")
    raw = bytearray(f.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    f.write_bytes(bytes(raw))
    with pytest.raises(SsdCorrupt):
        tier.get("k")
    assert tier.get("k") is None and tier.used_bytes == 0 and tier.num_corrupt == 1


def test_files_written_before_xxh3_are_read_with_blake3_and_unknown_formats_refused(
        tmp_path) -> None:
    """A ``PMS1`` file (32-byte BLAKE3 header digest, before XXH3) still reads and scans;
    a damaged one and a file of an unknown format are refused, never misread."""
    tier = SsdTier(tmp_path, 4 * MiB)
    tier.put("new", pattern(1, 100 * KiB))
    assert (tmp_path / file_name("new")).read_bytes()[:4] == b"PMS2"
    v = pattern(2, 100 * KiB)

    def v1_file(key: bytes, payload: bytes) -> bytes:
        h = blake3.blake3(key)
        h.update(payload)
        return struct.pack("<4sIQ32s", b"PMS1", len(key), len(payload), h.digest()) + key + payload

    (tmp_path / file_name("old")).write_bytes(v1_file(b"old", v))
    bad = bytearray(v1_file(b"old-bad", v))
    bad[-10] ^= 0x04
    (tmp_path / file_name("old-bad")).write_bytes(bytes(bad))
    (tmp_path / file_name("alien")).write_bytes(b"PMS9" + v1_file(b"alien", v)[4:])
    rep = tier.scan(drop_bad=True)
    assert rep.registered == 2 and sorted(tier.keys()) == ["new", "old"]
    assert sorted(why.split(": ")[-1] for _, why in rep.skipped) == [
        "checksum mismatch", "not an object file"]
    assert tier.get("old") == v and rep.checksums["old"] == digests(v)


def test_bug_60_keys_never_escape_the_directory(tmp_path) -> None:
    d = tmp_path / "ssd"
    tier = SsdTier(d, 4 * MiB)
    bad = ["../../escape", "a/b", "x\0y", "..", "/abs/path"]
    for i, k in enumerate(bad):
        tier.put(k, bytes([i]) * 100)
    assert {p.name for p in tmp_path.iterdir()} == {"ssd"}
    assert all(p.parent == d for p in d.rglob("*"))
    for i, k in enumerate(bad):
        assert tier.get(k) == bytes([i]) * 100
    assert tier.scan().registered == len(bad)


def test_bug_60_spilled_bytes_flipped_on_disk_are_never_served(cluster_factory,
                                                               tmp_path) -> None:
    cl = cluster_factory("--default-kv-lease-ttl", "300")
    cl.store_server(2 * MiB, "--ssd-path", str(tmp_path / "ssd"), "--ssd-capacity",
                    str(64 * MiB))
    c = cl.client()
    vals = {f"s{i:02d}": pattern(i, 256 * KiB) for i in range(24)}
    for k, v in vals.items():
        c.put(k, v)
    assert wait_until(lambda: c.stats()["ssd_used_bytes"] >= 8 * 256 * KiB, 10.0)
    files = sorted((tmp_path / "ssd").rglob("*.obj"))
    assert files
    damaged = {}
    by_name = {file_name(k): k for k in vals}
    for f in files:  # flip one payload byte in every spilled file
        raw = bytearray(f.read_bytes())
        raw[-100] ^= 0xFF
        f.write_bytes(bytes(raw))
        damaged[by_name[f.name]] = f
    for k, v in vals.items():
        st = status_of(c.get, k)
        if k in damaged:
            assert st in ("INTEGRITY_ERROR", "NOT_FOUND"), (k, st)
        else:
            assert st == "OK" and c.get(k) == v
    assert any(status_of(c.get, k) == "NOT_FOUND" for k in damaged)  # dropped after


def test_bug_29_one_owner_per_ssd_directory(tmp_path) -> None:
    a = SsdTier(tmp_path, MiB)
    a.put("mine", b"a" * 1000)
    with pytest.raises(SsdDirectoryInUse):
        SsdTier(tmp_path, MiB)  # refused: it would have deleted a's files
    assert a.get("mine") == b"a" * 1000
    b = SsdTier.claim(tmp_path / "shared", MiB)
    c = SsdTier.claim(tmp_path / "shared", MiB)
    assert b.path != c.path  # each its own subdirectory
    b.put("x", b"b" * 100)
    c.put("x", b"c" * 100)
    assert b.get("x") == b"b" * 100 and c.get("x") == b"c" * 100
    a.close()
    a2 = SsdTier(tmp_path, MiB)  # after the owner is gone the directory can be taken
    assert a2.get("mine") is None
    for t in (a2, b, c):
        t.close()


def test_bug_29_clients_sharing_an_ssd_path_keep_their_own_files(cluster_factory,
                                                                 tmp_path) -> None:
    cl = cluster_factory("--default-kv-lease-ttl", "300")
    ssd = str(tmp_path / "ssd")
    kw = {"global_segment_size": 2 * MiB, "ssd_path": ssd, "ssd_capacity": 64 * MiB}
    c1, c2 = cl.client(**kw), cl.client(**kw)
    vals: dict[str, bytes] = {}

    def write(c, tag: str, seed: int) -> None:
        for i in range(100):
            k = f"{tag}{i:03d}"
            vals[k] = pattern(seed + i, 64 * KiB)
            c.put(k, vals[k])

    write(c1, "a", 0)
    write(c2, "b", 1000)
    assert wait_until(lambda: c1.stats()["ssd_used_bytes"] >= 40 * 64 * KiB, 10.0)
    assert all(c2.get(k) == v for k, v in vals.items())
    on_c2_ssd = set(c2.ssd.keys())
    assert len(on_c2_ssd) >= 20
    # restart c1 only: c2 is alive, and none of the objects on its SSD tier may be lost
    c1.close()
    c1 = cl.client(**kw)
    assert wait_until(lambda: c1.stats()["num_segments"] == 2, 10.0)
    for k in sorted(on_c2_ssd):
        assert c1.get(k) == vals[k]
    c2.close()
    c2 = cl.client(**kw)
    write(c1, "c", 2000)
    write(c2, "d", 3000)
    for reader in (c1, c2):
        for k, v in vals.items():  # exact bytes or NOT_FOUND, never another object's
            try:
                got = reader.get(k)
            except Exception as e:
                assert getattr(e, "status", "") == "NOT_FOUND", (k, e)
                assert k[0] in "ab"  # only objects written before a restart may be gone
                continue
            assert got == v, k
    assert len(list(Path(ssd).iterdir())) == 2
