"""The opt-in ``mooncake`` alias (``python -m pymooncake.compat``): Mooncake's import lines
resolve to pymooncake, child processes inherit it, and a real ``mooncake`` package is never
shadowed silently. Also the shim's ``MooncakeConfig`` and ``KVBootstrapServer``."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
import urllib.request
from pathlib import Path

import pytest

from pymooncake.compat import SHIM_DIR, real_mooncake

ROOT = Path(__file__).resolve().parents[2]


def _run(args: list[str], env: dict[str, str] | None = None, cwd: Path = ROOT
         ) -> subprocess.CompletedProcess[str]:
    e = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "pymooncake.compat", *args], env=e,
                          cwd=cwd, capture_output=True, text=True, timeout=120)


def test_run_script_imports_mooncake_names(tmp_path) -> None:
    script = tmp_path / "s.py"
    script.write_text(textwrap.dedent("""
        import sys, multiprocessing as mp
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig, TaskStatus
        from mooncake.engine import TransferEngine
        from mooncake.async_store import MooncakeDistributedStoreAsync
        from mooncake.buffer_pool import BufferPool
        from mooncake.mooncake_config import MooncakeConfig
        import mooncake.store as ms
        assert MooncakeDistributedStore.__module__.startswith("pymooncake.")
        assert issubclass(MooncakeDistributedStoreAsync, MooncakeDistributedStore)
        def child(q):
            import mooncake.engine
            q.put(mooncake.engine.TransferEngine.__module__)
        if __name__ == "__main__":
            ctx = mp.get_context("spawn")   # a fresh interpreter: the alias must follow
            q = ctx.Queue(); p = ctx.Process(target=child, args=(q,)); p.start()
            print(q.get(timeout=60), sys.argv[1:]); p.join()
    """))
    r = _run(["run", str(script), "a", "b"])
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["pymooncake.transfer.compat", "['a',", "'b']"]


def test_run_module_and_path() -> None:
    r = _run(["run", "-m", "mooncake.http_metadata_server", "--help"])
    assert r.returncode == 0 and "--port" in r.stdout
    assert _run(["path"]).stdout.strip() == str(SHIM_DIR)
    assert "no real mooncake" in _run(["check"]).stdout
    assert _run(["run"]).returncode != 0  # nothing to run: a usage error


def test_run_of_a_missing_script_or_module_is_one_line(tmp_path) -> None:
    """As ``python SCRIPT`` (exit 2) and ``python -m MODULE`` (exit 1): one line, no
    traceback."""
    missing = str(tmp_path / "nonexistent.py")
    r = _run(["run", missing])
    assert (r.returncode, r.stderr) == (
        2, f"pymooncake.compat run: can't open file {missing!r}: no such file\n")
    r = _run(["run", "-m", "no_such_module_xyz"])
    assert (r.returncode, r.stderr) == (
        1, "pymooncake.compat run: no module named 'no_such_module_xyz'\n")


def test_real_mooncake_is_not_shadowed(tmp_path) -> None:
    fake = tmp_path / "site" / "mooncake"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("REAL = True\n")
    env = {"PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{tmp_path / 'site'}"}
    script = tmp_path / "s.py"
    script.write_text("import mooncake; print(getattr(mooncake, 'REAL', False))\n")
    r = _run(["run", str(script)], env)
    assert r.returncode == 2 and "real 'mooncake' package" in r.stderr
    assert "--shadow" in r.stderr
    r = _run(["run", "--shadow", str(script)], env)
    assert r.returncode == 0 and r.stdout.strip() == "False"
    assert "WARNING" in r.stderr and str(fake) in r.stderr
    assert real_mooncake([str(tmp_path / "site")]) == str(fake)
    # the shim put on PYTHONPATH by hand, with the real package further down: warns
    env["PYTHONPATH"] = os.pathsep.join([str(SHIM_DIR), str(ROOT / "src"),
                                         str(tmp_path / "site")])
    p = subprocess.run([sys.executable, "-c", "import mooncake.store"], env=dict(
        os.environ, **env), capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "hides" in p.stderr


def _shim(name: str):  # noqa: ANN202
    sys.path.insert(0, str(SHIM_DIR))
    try:
        import importlib

        return importlib.import_module(name)
    finally:
        sys.path.remove(str(SHIM_DIR))
        for m in [m for m in sys.modules if m == "mooncake" or m.startswith("mooncake.")]:
            del sys.modules[m]


def test_mooncake_config(tmp_path, monkeypatch) -> None:
    mc = _shim("mooncake.mooncake_config")
    cfg = {"local_hostname": "h", "metadata_server": "P2PHANDSHAKE",
           "master_server_address": "m:1", "global_segment_size": "16MB",
           "local_buffer_size": "1.5g", "protocol": "TCP", "enable_ssd_offload": "no"}
    p = tmp_path / "c.json"
    p.write_text(json.dumps(cfg))
    c = mc.MooncakeConfig.from_file(str(p))
    assert (c.global_segment_size, c.local_buffer_size) == (16 << 20, 3 << 29)
    assert c.protocol == "tcp" and c.enable_ssd_offload is False and c.tenant_id == "default"
    for k in ("MOONCAKE_CONFIG_PATH", "MOONCAKE_MASTER"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(ValueError):
        mc.MooncakeConfig.load_from_env()
    monkeypatch.setenv("MOONCAKE_MASTER", "127.0.0.1:50051")
    monkeypatch.setenv("MOONCAKE_GLOBAL_SEGMENT_SIZE", "1024")
    e = mc.MooncakeConfig.load_from_env()
    assert (e.metadata_server, e.global_segment_size, e.local_buffer_size) == (
        "P2PHANDSHAKE", 1024, 1 << 30)
    with pytest.raises(ValueError):
        mc.MooncakeConfig("h", "m", -1, 0, "tcp", "", "a:1")
    with pytest.raises(ValueError):
        mc._size("12XB")


def test_kv_bootstrap_server() -> None:
    hm = _shim("mooncake.http_metadata_server")
    s = hm.KVBootstrapServer(port=0, host="127.0.0.1")

    class Req:
        def __init__(self, method: str, key: str | None, body: bytes = b"") -> None:
            self.method, self.body = method, body
            self.query = {} if key is None else {"key": key}

        async def read(self) -> bytes:
            return self.body

    async def go() -> list[int]:
        return [(await s._handle_metadata(r)).status for r in (
            Req("PUT", None, b"v"), Req("PUT", "  ", b"v"), Req("PUT", " k ", b"v"),
            Req("GET", "k"), Req("GET", "x"), Req("PUT", "mooncake/rpc_meta/a", b"1"),
            Req("PUT", "mooncake/rpc_meta/a", b"2"), Req("DELETE", "k"), Req("DELETE", "k"))]

    assert asyncio.run(go()) == [400, 400, 200, 200, 404, 200, 400, 200, 404]
    s.run()
    try:
        url = f"http://127.0.0.1:{s.port}/metadata?key=web"
        urllib.request.urlopen(urllib.request.Request(url, b"val", method="PUT")).read()
        assert urllib.request.urlopen(url).read() == b"val" and s.store["web"] == b"val"
        assert s.poll() == hm.KVPoll.Success
    finally:
        s.close()
