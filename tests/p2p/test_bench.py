"""``pymooncake bench p2p`` harness: the checkpoint it writes, and one small namespaced run
(2 receivers, 8 MiB, 200 Mbit/s: p2p and a holder killed) when namespaces can be built."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from pymooncake.bench.p2p import format_human, make_checkpoint, missing_requirement


def test_checkpoint_is_safetensors_of_the_asked_size(tmp_path: Path) -> None:
    d = make_checkpoint(tmp_path / "ckpt", size_mib=3, files=2)
    shards = sorted(d.glob("*.safetensors"))
    assert [p.name for p in shards] == ["model-00001-of-00002.safetensors",
                                        "model-00002-of-00002.safetensors"]
    for p in shards:
        raw = p.read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8:8 + n])
        begin, end = header["w"]["data_offsets"]
        assert end - begin == (3 << 20) // 2 == len(raw) - 8 - n
    assert (d / "config.json").is_file()


@pytest.mark.integration
@pytest.mark.slow
def test_small_namespaced_run(tmp_path: Path) -> None:
    why = missing_requirement()
    if why:
        pytest.skip(why)
    r = subprocess.run([sys.executable, "-m", "pymooncake", "bench", "p2p", "--receivers", "2",
                        "--size-mib", "8", "--files", "2", "--rate-mbit", "200", "--shard-mib",
                        "1", "--runs", "p2p,kill", "--work-dir", str(tmp_path), "--json"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(r.stdout)
    assert doc["runs"]["p2p"]["receivers_done"] == 2 and doc["runs"]["p2p"]["verified"]
    assert doc["runs"]["kill"]["receivers_done"] == 1 and doc["runs"]["kill"]["killed_host"] == 1
    assert "p2p" in format_human(doc)
    assert "p2pb" not in subprocess.run(["ip", "netns"], capture_output=True, text=True).stdout
