"""Run Mooncake's own public Python test scripts, unchanged, on pymooncake through the
``mooncake`` alias (``python -m pymooncake.compat run``).

The dummy-client scripts attach to a real client (``python -m pymooncake.compat
real-client``) started on 127.0.0.1:50052, the address they hard-code; the multi-dummy
script runs as two concurrent processes (``--client-id client1`` / ``client2``), as
Mooncake's ``run_tests.sh`` runs it.

The scripts are read from a Mooncake git repository at run time (``git show REF:PATH``
into a temporary directory; nothing of Mooncake's is kept in this project)::

    python tests/compat/mooncake_scripts.py --repo /path/to/Mooncake[.git] [--ref HEAD]

For each script a fresh pymooncake master (``--default-kv-lease-ttl 500``, as Mooncake's
``scripts/run_tests.sh``) with its HTTP metadata server is started on 127.0.0.1:50051 (the
buffer-pool test hard-codes that address), the script runs in a child process with the
``MOONCAKE_*`` / ``MC_*`` variables Mooncake's CI sets, and its unittest/pytest summary is
parsed into passed/failed/errors/skipped counts. Prints a table and a JSON line; exit status
1 when any test failed or a script could not run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MASTER_PORT = 50051


@dataclass
class Script:
    name: str
    path: str  # in the Mooncake repository
    runner: str  # "unittest" | "pytest" | "te-pair"
    args: tuple[str, ...] = ()


SCRIPTS = [
    Script("upsert", "scripts/test_upsert_api.py", "unittest"),
    Script("tensor", "scripts/test_tensor_api.py", "unittest"),
    Script("async-store", "scripts/test_async_store.py", "unittest"),
    Script("copy-move", "scripts/test_copy_move_api.py", "unittest"),
    Script("transfer-engine", "mooncake-wheel/tests/transfer_engine_initiator_test.py",
           "te-pair"),
    Script("buffer-pool", "mooncake-wheel/tests/test_buffer_pool_native.py", "pytest"),
    Script("http-metadata", "mooncake-wheel/tests/test_http_metadata_server.py", "unittest"),
    Script("dummy-client", "mooncake-wheel/tests/test_dummy_client.py", "dummy"),
    Script("multi-dummy", "mooncake-wheel/tests/test_multi_dummy_clients.py", "multi-dummy"),
]
REAL_CLIENT_PORT = 50052  # the dummy-client scripts hard-code 127.0.0.1:50052
TE_TARGET = "mooncake-wheel/tests/transfer_engine_target.py"


@dataclass
class Result:
    name: str
    ran: int = 0
    passed: int = 0
    failed: int = 0
    errors: int = 0
    skipped: int = 0
    rc: int = 0
    note: str = ""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_busy(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def extract(repo: str, ref: str, dest: Path) -> None:
    """Writes every script (and the TE target) from ``repo`` at ``ref`` under ``dest``."""
    git_dir = Path(repo) / ".git" if (Path(repo) / ".git").exists() else Path(repo)
    for path in [s.path for s in SCRIPTS] + [TE_TARGET]:
        out = subprocess.run(["git", f"--git-dir={git_dir}", "show", f"{ref}:{path}"],
                             capture_output=True, check=True).stdout
        (dest / path).parent.mkdir(parents=True, exist_ok=True)
        (dest / path).write_bytes(out)


def _env(md_url: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + env.get("PYTHONPATH", "")
    env.update({
        "MOONCAKE_MASTER": f"127.0.0.1:{MASTER_PORT}",
        "MOONCAKE_TE_META_DATA_SERVER": md_url, "MC_METADATA_SERVER": md_url,
        "PYMOONCAKE_P2P_METADATA_SERVER": md_url,
        "MOONCAKE_PROTOCOL": "tcp", "MOONCAKE_DEVICE": "", "MC_FORCE_TCP": "true",
        "MOONCAKE_GLOBAL_SEGMENT_SIZE": str(1 << 30), "MOONCAKE_LOCAL_BUFFER_SIZE": str(512 << 20),
        "DEFAULT_KV_LEASE_TTL": "500", "PYTHONUNBUFFERED": "1",
        "TARGET_SERVER_NAME": f"127.0.0.1:{_free_port()}",
        "INITIATOR_SERVER_NAME": f"127.0.0.1:{_free_port()}",
    })
    return env


def _start_master(md_port: int) -> subprocess.Popen:
    p = subprocess.Popen(["nice", "-n", "19", sys.executable, "-m", "pymooncake", "master",
                          "--port", str(MASTER_PORT), "--default-kv-lease-ttl", "500",
                          "--enable-http-metadata-server", "--http-metadata-server-port",
                          str(md_port)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                         env=_env(""), cwd=ROOT)
    line = p.stdout.readline() if p.stdout else b""
    if b'"ready"' not in line:
        p.kill()
        raise RuntimeError(f"master did not start: {line!r}")
    return p


def parse(text: str) -> tuple[int, int, int, int]:
    """(ran, failed, errors, skipped) from a unittest or pytest summary."""
    m = re.findall(r"^Ran (\d+) tests?", text, re.M)
    if m:
        ran = int(m[-1])
        tail = text[text.rfind("Ran "):]

        def count(word: str) -> int:
            x = re.search(rf"{word}=(\d+)", tail)
            return int(x.group(1)) if x else 0
        return ran, count("failures"), count("errors"), count("skipped")
    last = [ln for ln in text.splitlines() if re.search(r"\d+ (passed|failed|error)", ln)]
    if not last:
        return 0, 0, 0, 0
    words = dict((w, int(n)) for n, w in re.findall(r"(\d+) (passed|failed|errors?|skipped)",
                                                     last[-1]))
    errs = words.get("error", 0) + words.get("errors", 0)
    ran = words.get("passed", 0) + words.get("failed", 0) + errs + words.get("skipped", 0)
    return ran, words.get("failed", 0), errs, words.get("skipped", 0)


def _alias(*args: str) -> list[str]:
    return ["nice", "-n", "19", sys.executable, "-m", "pymooncake.compat", "run", *args]


def run_one(s: Script, tmp: Path, md_url: str, log_dir: Path, timeout_s: float) -> Result:
    env = _env(md_url)
    script = tmp / s.path
    cmd = (_alias("-m", "pytest", "-v", "-p", "no:cacheprovider", str(script))
           if s.runner == "pytest" else _alias(str(script), *s.args))
    target = None
    if s.runner == "te-pair":
        target = subprocess.Popen(_alias(str(tmp / TE_TARGET)), env=env, cwd=script.parent,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  start_new_session=True)
        line = b""
        deadline = time.monotonic() + 60
        while b"ready" not in line and time.monotonic() < deadline and target.stdout:
            line = target.stdout.readline()
            if not line and target.poll() is not None:
                break
    if s.runner in ("dummy", "multi-dummy"):
        target = subprocess.Popen(
            ["nice", "-n", "19", sys.executable, "-m", "pymooncake.compat", "real-client",
             "--master-server-address", f"127.0.0.1:{MASTER_PORT}", "--metadata-server",
             md_url, "--port", str(REAL_CLIENT_PORT), "--global-segment-size", "1GB"],
            env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            start_new_session=True)
        if target.stdout is not None:
            target.stdout.readline()  # {"event": "ready", ...}
    cmds = [cmd] if s.runner != "multi-dummy" else [
        cmd + ["--client-id", f"client{i}"] for i in (1, 2)]
    outs, rc = [], 0
    try:
        procs = [subprocess.Popen(c, env=env, cwd=script.parent, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT) for c in cmds]
        for p in procs:
            try:
                out_b, _ = p.communicate(timeout=timeout_s)
                rc = rc or p.returncode
            except subprocess.TimeoutExpired:
                p.kill()
                out_b, _ = p.communicate()
                rc = 124
            outs.append(out_b.decode(errors="replace"))
    finally:
        if target is not None:
            os.killpg(target.pid, signal.SIGKILL)
            target.wait(10)
    out = "\n".join(outs)
    (log_dir / f"{s.name}.log").write_text(out)
    counts = [parse(o) for o in outs]
    ran, failed, errors, skipped = (sum(c[i] for c in counts) for i in range(4))
    note = "" if ran or rc == 0 else "no test summary (see log)"
    return Result(s.name, ran, max(0, ran - failed - errors - skipped), failed, errors, skipped, rc,
                  note)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repo", required=True, help="a Mooncake git checkout or git dir")
    ap.add_argument("--ref", default="HEAD")
    ap.add_argument("--only", action="append", default=None,
                    help=f"run only these ({', '.join(s.name for s in SCRIPTS)})")
    ap.add_argument("--logs", default=None, help="keep each script's output here")
    ap.add_argument("--timeout", type=float, default=900.0, help="per script (s)")
    a = ap.parse_args(argv)
    for port, why in ((MASTER_PORT, "the master (the buffer-pool script hard-codes it)"),
                      (REAL_CLIENT_PORT, "the real client of the dummy-client scripts")):
        if _port_busy(port):
            print(f"port {port} is in use; it is needed for {why}", file=sys.stderr)
            return 2
    results = []
    with tempfile.TemporaryDirectory(prefix="mooncake-scripts-") as td:
        tmp = Path(td)
        extract(a.repo, a.ref, tmp)
        log_dir = Path(a.logs) if a.logs else tmp / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        for s in SCRIPTS:
            if a.only and s.name not in a.only:
                continue
            md_port = _free_port()
            master = _start_master(md_port)
            try:
                r = run_one(s, tmp, f"http://127.0.0.1:{md_port}/metadata", log_dir,
                            a.timeout)
            finally:
                master.send_signal(signal.SIGTERM)
                try:
                    master.wait(10)
                except subprocess.TimeoutExpired:
                    master.kill()
            results.append(r)
            print(f"{r.name:16} ran {r.ran:3}  passed {r.passed:3}  failed {r.failed}  "
                  f"errors {r.errors}  skipped {r.skipped:3}  rc {r.rc} {r.note}", flush=True)
    total = {k: sum(getattr(r, k) for r in results)
             for k in ("ran", "passed", "failed", "errors", "skipped")}
    print(json.dumps({"ref": a.ref, "total": total, "scripts": [asdict(r) for r in results]}))
    bad = any(r.failed or r.errors or r.rc or not r.ran for r in results)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
