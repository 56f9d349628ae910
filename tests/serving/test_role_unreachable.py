"""Role commands pointed at a server that is not there, or given a port that cannot exist
(issue 19 items 6, 7): the real ``pymooncake`` command exits 1 with one line naming the
server's flag and address (no traceback, no "ready"), or 2 with one line naming the port
flag and its value."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration


def _closed_port() -> int:
    """A loopback port nothing listens on (connections are refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(*argv: str, timeout_s: float = 120.0) -> tuple[int, str, str]:
    r = subprocess.run([sys.executable, "-m", "pymooncake", *argv], capture_output=True,
                       text=True, timeout=timeout_s)
    return r.returncode, r.stdout, r.stderr


def _in_proc(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """``pymooncake`` in process: main's return value (or argparse's exit status)."""
    from pymooncake.cli.main import main
    try:
        rc = main(list(argv))
    except SystemExit as e:
        rc = int(e.code or 0)
    out, err = capsys.readouterr()
    return rc, out, err


def _one_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def _start(*argv: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "pymooncake", *argv],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _result(p: subprocess.Popen, timeout_s: float = 120.0) -> tuple[int, str, str]:
    try:
        out, err = p.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        p.kill()
        p.communicate()
        raise
    return p.returncode, out, err


def test_workers_with_an_unreachable_metadata_service_or_store_master_are_one_line() -> None:
    """A prefill (http) and a decode (etcd) worker whose metadata service is down, and a
    prefill worker whose Store master is down: the three run at once (each spends seconds
    importing torch) and each exits 1 with its one line."""
    from pymooncake.metadata.http import MetadataHttpServer
    md = MetadataHttpServer("127.0.0.1", 0).start()
    master = f"127.0.0.1:{_closed_port()}"
    procs: list[subprocess.Popen] = []
    try:
        md_cases = []
        for role, scheme in (("prefill", "http"), ("decode", "etcd")):
            port = _closed_port()
            url = (f"http://127.0.0.1:{port}/metadata" if scheme == "http"
                   else f"etcd://127.0.0.1:{port}")
            procs.append(_start(role, "--id", "w0", "--conductor",
                                f"127.0.0.1:{_closed_port()}", "--model", "tiny",
                                "--metadata", url, "--register-timeout", "5"))
            md_cases.append((role, port, url))
        procs.append(_start("prefill", "--id", "p0", "--conductor",
                            f"127.0.0.1:{_closed_port()}", "--model", "tiny", "--metadata",
                            md.url, "--master", master, "--register-timeout", "5"))
        results = [_result(p) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(5)
        md.stop()
    for (role, port, url), (rc, out, err) in zip(md_cases, results[:2], strict=True):
        assert (rc, out) == (1, ""), (role, err)
        line = _one_line(err)
        assert line.startswith(f"pymooncake: error: {role} w0: cannot use the metadata "
                               f"service --metadata {url}: "), line
        assert f"127.0.0.1:{port}" in line.split(": ", 3)[3]   # the cause names the address
    rc, out, err = results[2]
    assert (rc, out) == (1, "")
    line = _one_line(err)
    assert line.startswith(f"pymooncake: error: prefill p0: Store master --master {master}: "
                           f"RPC_FAIL (-900): cannot connect to {master}"), line


@pytest.mark.parametrize("argv", [
    ("conductor", "--model", "tiny", "--port", "0", "--worker-port", "0", "--master", "{a}"),
    ("conductor", "--model", "tiny", "--port", "0", "--worker-port", "0",
     "--store-master", "etcd://{a}/c1"),
    ("master", "--port", "0", "--metadata", "http://{a}/metadata"),
])
def test_role_refuses_a_server_that_is_down_at_start(argv, capsys) -> None:
    a = f"127.0.0.1:{_closed_port()}"
    argv = tuple(x.replace("{a}", a) for x in argv)
    if argv[0] == "master":   # the entry point; the Conductor's checks in process
        rc, out, err = _run(*argv, timeout_s=60)
    else:
        rc, out, err = _in_proc(capsys, *argv)
    assert (rc, out) == (1, "")      # no ready line: nothing was served
    assert _one_line(err) == (f"pymooncake: error: {argv[0]}: {argv[-2]} {argv[-1]}: cannot "
                              f"connect to {a} (connection refused); is that server running?")


@pytest.mark.parametrize(("argv", "flag", "value"), [
    (("ep", "rank", "--port", "-5"), "--port", -5),
    (("ep", "rank", "--port", "70000"), "--port", 70000),
    (("ep", "serve", "--ranks", "127.0.0.1:17101", "--port", "99999"), "--port", 99999),
    (("conductor", "--model", "tiny", "--worker-port", "-1"), "--worker-port", -1),
    (("prefill", "--id", "p", "--conductor", "127.0.0.1:1", "--port", "65536"), "--port",
     65536),
])
def test_port_outside_0_to_65535_is_a_usage_error(argv, flag, value, capsys) -> None:
    if argv[-1] == "-5":  # the entry point once; the others in process
        rc, out, err = _run(*argv, timeout_s=60)
    else:
        rc, out, err = _in_proc(capsys, *argv)
    assert (rc, out) == (2, "")
    prog = "pymooncake " + " ".join(argv[:2] if argv[0] == "ep" else argv[:1])
    assert _one_line(err) == (f"{prog}: error: argument {flag}: port must be in 0..65535 "
                              f"(0 = any free port), got {value} (see --help)")
