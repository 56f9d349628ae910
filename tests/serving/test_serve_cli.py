"""``pymooncake serve`` as a user runs it: one command starts the cluster, Ctrl-C (SIGINT)
or SIGTERM stops every process it started — no orphans."""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.serving.conftest import workers

ROOT = Path(__file__).resolve().parents[2]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is gone for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _assert_children_gone(pids: dict[str, int]) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_alive(x) for x in pids.values()):
        time.sleep(0.1)
    assert not [n for n, x in pids.items() if _alive(x)], "children left running"


def _reap(p: subprocess.Popen, pids: dict[str, int]) -> None:
    """Whatever a test left: kill serve and every child it started."""
    if p.poll() is None:
        p.kill()
        p.wait(5)
    for x in pids.values():
        if _alive(x):
            os.kill(x, signal.SIGKILL)


@pytest.mark.parametrize("sig", [signal.SIGINT])
def test_serve_starts_answers_and_stops_every_child(sig, tmp_path):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    errfile = open(tmp_path / "serve.err", "wb")  # noqa: SIM115 - children log here, not a pipe
    env["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + env.get("PYTHONPATH", "")
    p = subprocess.Popen([sys.executable, "-m", "pymooncake", "serve", "--port", "0",
                          "--model", "tiny", "--decode", "2", "--num-kv-blocks", "256"],
                         stdout=subprocess.PIPE, stderr=errfile, env=env, cwd=ROOT)
    pids: dict[str, int] = {}
    try:
        sel = selectors.DefaultSelector()
        sel.register(p.stdout, selectors.EVENT_READ)
        info = None
        deadline = time.monotonic() + 90
        while info is None and time.monotonic() < deadline and p.poll() is None:
            if sel.select(0.2):
                line = p.stdout.readline()
                if line.startswith(b"{"):
                    info = json.loads(line)
        sel.close()
        assert info is not None and info["event"] == "ready", "serve did not get ready"
        pids = info["pids"]
        assert set(pids) == {"master", "conductor", "prefill-0", "decode-0", "decode-1"}
        r = httpx.post(info["url"] + "/v1/chat/completions", timeout=60, json={
            "model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] >= 1
        metrics = httpx.get(info["url"] + "/metrics", timeout=10).text
        assert "pymooncake_api_ttft_seconds_bucket" in metrics
        assert "pymooncake_api_cached_tokens_total" in metrics
        # a worker that dies is reported and the others serve on (docs/serving.md)
        os.kill(pids["decode-1"], signal.SIGKILL)
        deadline = time.monotonic() + 15
        while "decode-1" in workers(info["url"]) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert set(workers(info["url"])) == {"prefill-0", "decode-0"}
        r = httpx.post(info["url"] + "/v1/chat/completions", timeout=60, json={
            "model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
        assert r.status_code == 200, r.text
        assert p.poll() is None, "serve stopped when one worker died"
        p.send_signal(sig)
        assert p.wait(30) == 0
        errfile.close()
        err = (tmp_path / "serve.err").read_text(errors="replace")
        assert "decode-1 exited with status -9" in err, err
        _assert_children_gone(pids)
    finally:
        _reap(p, pids)
        errfile.close()


def test_serve_stops_and_exits_1_when_a_role_has_no_worker_left(tmp_path):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + env.get("PYTHONPATH", "")
    with open(tmp_path / "serve.err", "wb") as errfile:
        p = subprocess.Popen([sys.executable, "-m", "pymooncake", "serve", "--port", "0",
                              "--model", "tiny", "--num-kv-blocks", "256"], stdout=subprocess.PIPE,
                             stderr=errfile, env=env, cwd=ROOT)
        pids: dict[str, int] = {}
        try:
            line = p.stdout.readline()       # the ready line (or EOF if serve failed)
            info = json.loads(line)
            pids = info["pids"]
            os.kill(pids["decode-0"], signal.SIGKILL)
            assert p.wait(30) == 1
            _assert_children_gone(pids)
        finally:
            _reap(p, pids)
    err = (tmp_path / "serve.err").read_text(errors="replace")
    assert "no decode worker is left; stopping the cluster" in err, err


def _main_rc(args: list[str]) -> int:
    """``pymooncake`` in process: main's return value, or argparse's exit status."""
    from pymooncake.cli.main import main
    try:
        return main(args)
    except SystemExit as e:
        return int(e.code or 0)


@pytest.mark.parametrize("flag", ["--port", "--worker-port"])
def test_conductor_on_a_used_port_is_a_one_line_error(flag, capsys):
    import socket
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    try:
        other = "--worker-port" if flag == "--port" else "--port"
        argv = ["conductor", flag, str(busy.getsockname()[1]), other, "0"]
        if flag == "--port":  # the entry point once; the other in process
            r = subprocess.run([sys.executable, "-m", "pymooncake", *argv],
                               capture_output=True, text=True, timeout=60)
            rc, err = r.returncode, r.stderr
        else:
            rc, err = _main_rc(argv), capsys.readouterr().err
    finally:
        busy.close()
    assert rc == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1 and flag in lines[0] and "in use" in lines[0], err


def _run_bg(argv: list[str]) -> subprocess.Popen:
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(p: subprocess.Popen, timeout_s: float = 90) -> subprocess.CompletedProcess[str]:
    try:
        out, err = p.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        p.kill()
        p.communicate()
        raise
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def test_worker_that_cannot_join_exits_with_one_line():
    """A worker the Conductor refuses (different cache namespace: block size 32 vs 16) or
    never reaches exits 1 with one line instead of printing "ready" and hanging."""
    from pymooncake.cli.cluster import ClusterSpec, LocalCluster
    cluster = LocalCluster(ClusterSpec(port=0, quiet=True, num_prefill=1, num_decode=1))
    procs: list[subprocess.Popen] = []
    try:
        cluster.start()
        base = [sys.executable, "-m", "pymooncake", "decode", "--model", "tiny", "--metadata",
                cluster.metadata_url, "--register-timeout", "2"]
        # the three workers run at once (each spends seconds importing torch)
        lost = _run_bg([*base, "--id", "d-lost", "--conductor", "127.0.0.1:1"])
        procs.append(lost)
        odd = _run_bg([*base, "--id", "d-odd", "--conductor", cluster.worker_addr,
                       "--block-size", "32"])
        # the Conductor admits 8192-token requests (serve: --context-length = max-model-len)
        short = _run_bg([*base, "--id", "d-short", "--conductor", cluster.worker_addr,
                         "--max-model-len", "4096"])
        procs += [odd, short]
        r = _finish(odd)
        assert r.returncode == 1, r.stderr
        last = r.stderr.strip().splitlines()[-1]
        assert "refused this worker" in last and "namespace" in last, r.stderr
        assert "block_size 32 (cluster: 16)" in last, r.stderr
        assert '"ready"' not in r.stdout, "a refused worker printed its ready line"
        r = _finish(short)
        assert r.returncode == 1, r.stderr
        last = r.stderr.strip().splitlines()[-1]
        assert "refused this worker" in last and "--max-model-len >= 8192" in last, r.stderr
        assert '"ready"' not in r.stdout
        assert set(workers(cluster.url)) == {"prefill-0", "decode-0"}
        r = _finish(lost)
        assert r.returncode == 1
        assert "not reachable for" in r.stderr.strip().splitlines()[-1], r.stderr
        assert '"ready"' not in r.stdout
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(5)
        cluster.stop()


@pytest.mark.parametrize(("flags", "named"), [
    (["--port", "70000"], "--port"),
    (["--max-model-len", "0"], "--max-model-len"), (["--ttft-slo", "-1"], "--ttft-slo"),
    (["--metadata", "zk://x"], "--metadata"),
    (["--colocated", "--decode", "2"], "--decode"), (["--no-prefix-cache"], "--no-prefix-cache"),
    (["--json"], "--json"),
])
def test_serve_refuses_bad_flags_before_starting_anything(flags, named, capsys):
    if named == "--port":  # the entry point once; the others in process
        r = subprocess.run([sys.executable, "-m", "pymooncake", "serve", *flags],
                           capture_output=True, text=True, timeout=60)
        rc, err = r.returncode, r.stderr
    else:
        rc, err = _main_rc(["serve", *flags]), capsys.readouterr().err
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and named in lines[0], err
    # (a --model that cannot be read is exit 1, like any unreadable input:
    # tests/serving/test_bad_model.py)
