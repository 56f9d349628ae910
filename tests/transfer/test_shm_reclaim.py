"""Shared buffers of a process killed with SIGKILL are reclaimed by the next one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

from pymooncake.transfer.memory import SHM_DIR, SharedBuffer, reclaim_stale_shared_buffers

CHILD = textwrap.dedent("""
    import sys, time
    from pymooncake.transfer.memory import SharedBuffer
    buf = SharedBuffer(4096)
    print(buf.name, flush=True)
    time.sleep(60)
""")


def test_killed_owner_files_are_unlinked_live_ones_kept(tmp_path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
    try:
        name = proc.stdout.readline().strip()
        assert os.path.exists(os.path.join(SHM_DIR, name))
        # while the owner lives, a sweep keeps its file
        assert name not in reclaim_stale_shared_buffers()
        assert os.path.exists(os.path.join(SHM_DIR, name))
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        assert os.path.exists(os.path.join(SHM_DIR, name))  # SIGKILL leaves it behind
        mine = SharedBuffer(4096)                            # the next buffer sweeps it up
        try:
            assert not os.path.exists(os.path.join(SHM_DIR, name))
            assert os.path.exists(os.path.join(SHM_DIR, mine.name))
        finally:
            mine.close()
    finally:
        proc.kill()
        proc.wait(10)


def test_sweep_ignores_foreign_names(tmp_path) -> None:
    for name in ("pymooncake-notapid-x", "other-1-2", "pymooncake-999999999-abc"):
        (tmp_path / name).write_bytes(b"x")
    removed = reclaim_stale_shared_buffers(str(tmp_path))
    assert removed == ["pymooncake-999999999-abc"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other-1-2", "pymooncake-notapid-x"]
