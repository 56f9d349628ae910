"""``pymooncake ep`` as a newcomer meets it: bad arguments exit 2 and runtime failures
exit 1, each with one ``pymooncake: error:`` line and no traceback; a client never hangs
on a port that is not an EP front; a front binds its own port before touching any rank and
does not take ranks that belong to another live front unless told (``--take-over``)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from pymooncake.cli import ep as ep_cli
from pymooncake.cli.main import main
from pymooncake.engine.ep.dispatch import EPOptions
from pymooncake.rpc import SyncRpcClient
from tests.ep.conftest import Cluster, Rank, ready_line

pytestmark = pytest.mark.integration


def _cli(*args: str, timeout_s: float = 60.0) -> tuple[int, str, str, float]:
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "pymooncake", "ep", *args], capture_output=True,
                       text=True, timeout=timeout_s, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    return p.returncode, p.stdout, p.stderr, time.monotonic() - t0


def _one_error_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("pymooncake: error: "), err
    assert "Traceback" not in err
    return lines[0]


def _in_proc(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    rc = main(["ep", *args])
    out, err = capsys.readouterr()
    return rc, out, err


@contextlib.contextmanager
def _silent_server() -> Iterator[int]:
    """A TCP server that accepts connections and reads, but never answers."""
    srv = socket.create_server(("127.0.0.1", 0))
    conns: list[socket.socket] = []
    stop = threading.Event()

    def serve() -> None:
        srv.settimeout(0.1)
        while not stop.is_set():
            with contextlib.suppress(TimeoutError, OSError):
                c, _ = srv.accept()
                conns.append(c)
    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        yield srv.getsockname()[1]
    finally:
        stop.set()
        t.join(2)
        for c in conns:
            c.close()
        srv.close()


def _start(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "pymooncake", "ep", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


# -- E1: a client against something that is not an EP front ------------------------------

def test_client_times_out_on_a_silent_server(capsys) -> None:
    with _silent_server() as port:
        for cmd in (["generate", "--prompt", "Hi"], ["status"]):
            t0 = time.monotonic()
            rc, _, err = _in_proc(capsys, *cmd, "--server", f"127.0.0.1:{port}",
                                  "--timeout", "1.5")
            assert rc == 1 and time.monotonic() - t0 < 6, (cmd, err)
            assert "is it an `ep serve` front?" in _one_error_line(err)


def test_client_against_a_metadata_server(capsys) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ms = subprocess.Popen([sys.executable, "-m", "pymooncake", "metadata-server",
                           "--port", str(port)], stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
                break
            time.sleep(0.2)
        rc, _, err, took = _cli("generate", "--server", f"127.0.0.1:{port}", "--prompt", "Hi",
                                "--timeout", "2")
        assert rc == 1 and took < 20, err
        _one_error_line(err)
        t0 = time.monotonic()  # (status in process: `generate` above ran the entry point)
        rc, _, err = _in_proc(capsys, "status", "--server", f"127.0.0.1:{port}",
                              "--timeout", "2")
        assert rc == 1 and time.monotonic() - t0 < 20, err
        _one_error_line(err)
    finally:
        ms.kill()
        ms.wait(5)


def test_bad_timeout_is_a_usage_error(capsys) -> None:
    rc, _, err = _in_proc(capsys, "status", "--server", "127.0.0.1:1", "--timeout", "0")
    assert rc == 2 and "--timeout" in _one_error_line(err)


# -- E2: a port already in use --------------------------------------------------------------

def test_rank_and_serve_on_a_taken_port(capsys) -> None:
    # in process (the real entry point's serve is run by test_second_front_...)
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        for cmd in (["rank"], ["serve"]):
            rc, _, err = _in_proc(capsys, *cmd, "--port", str(port))
            assert rc == 1, err
            assert f"cannot listen on 127.0.0.1:{port}" in _one_error_line(err)


# -- E3: a second front on the same ranks ---------------------------------------------------

@pytest.fixture(scope="module")
def _rank_pair() -> Iterator[Cluster]:
    c = Cluster(2)
    yield c
    c.close()


@pytest.fixture()
def two_ranks(_rank_pair: Cluster) -> list[Rank]:
    """Two rank processes shared by the module (a test that killed one gets it back)."""
    _rank_pair.restore()
    return _rank_pair.ranks


def _status(port: int) -> dict:
    return SyncRpcClient("127.0.0.1", port, timeout_s=10).call("ep.status")


def test_second_front_does_not_break_the_first(two_ranks, capsys) -> None:
    # the fronts are real `ep serve` processes; the clients and the refused second
    # `serve`s run in process (no torch import per call)
    spec = ",".join(f"127.0.0.1:{r.port}" for r in two_ranks)
    first = _start(["serve", "--ranks", spec])
    try:
        port = int(ready_line(first)["port"])
        rc, out, err = _in_proc(capsys, "generate", "--server", f"127.0.0.1:{port}", "--ids",
                                "256,72", "--max-tokens", "4", "--json")
        assert rc == 0, err
        # 1) same port: fails on its own bind, before touching the ranks
        rc, _, err = _in_proc(capsys, "serve", "--ranks", spec, "--port", str(port))
        assert rc == 1 and "cannot listen" in _one_error_line(err)
        # 2) own port, but ranks of a live front: refused without --take-over
        rc, _, err = _in_proc(capsys, "serve", "--ranks", spec)
        assert rc == 1 and "--take-over" in _one_error_line(err)
        time.sleep(1.0)  # past several heartbeats: the first front still owns both ranks
        rc, sout, err = _in_proc(capsys, "status", "--server", f"127.0.0.1:{port}", "--json")
        assert rc == 0, err  # `ep status --json` is accepted: its answer is JSON either way
        st = json.loads(sout)
        assert [r["alive"] for r in st["ranks"]] == [True, True] and st["missing"] == [], st
        rc, out2, err = _in_proc(capsys, "generate", "--server", f"127.0.0.1:{port}", "--ids",
                                 "256,72", "--max-tokens", "4", "--json")
        assert rc == 0, err
        assert json.loads(out2)["token_ids"] == json.loads(out)["token_ids"]
        # 3) --take-over: the second front gets the ranks, the first sees them go
        second = _start(["serve", "--ranks", spec, "--take-over"])
        try:
            port2 = int(ready_line(second)["port"])
            rc, _, err = _in_proc(capsys, "generate", "--server", f"127.0.0.1:{port2}",
                                  "--ids", "256,72", "--max-tokens", "4")
            assert rc == 0, err
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                if not any(r["alive"] for r in _status(port)["ranks"]):
                    break
                time.sleep(0.2)
            assert not any(r["alive"] for r in _status(port)["ranks"])
        finally:
            _stop(second)
    finally:
        _stop(first)


def test_rank_refuses_a_foreign_front_unless_taken_over(two_ranks) -> None:
    from pymooncake.engine.ep.dispatch import RemoteExperts
    ranks = [("127.0.0.1", two_ranks[0].port)]
    opts = {"slots_per_rank": 8, "deadline_s": 1.0}
    # (an earlier test's front may still hold the lease: claim the rank explicitly)
    a = RemoteExperts(ranks, [1], 8, 64, options=EPOptions(**opts, take_over=True)).start()
    try:
        with pytest.raises(RuntimeError, match="another live front"):
            RemoteExperts(ranks, [1], 8, 64, options=EPOptions(**opts)).start()
        time.sleep(0.5)
        assert a.ranks[0].alive and a.missing() == []
        c = RemoteExperts(ranks, [1], 8, 64, options=EPOptions(**opts, take_over=True)).start()
        try:
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and a.ranks[0].alive:
                time.sleep(0.1)
            assert not a.ranks[0].alive and c.ranks[0].alive  # the old front let it go
        finally:
            c.close()
    finally:
        a.close()


# -- E4 / E5: argument errors, checked before any connection ---------------------------

@pytest.mark.parametrize("args", [
    ["--prompt", "Hi", "--max-tokens", "0"],
    ["--prompt", "Hi", "--max-tokens", "-5"],
    ["--prompt", "Hi", "--ids", "1,2"],
    ["--ids", "1,x"],
    ["--ids", "1,-2"],
    [],
])
def test_generate_argument_errors(capsys, args) -> None:
    with _silent_server() as port:  # never reached: arguments are checked first
        t0 = time.monotonic()
        rc, _, err = _in_proc(capsys, "generate", "--server", f"127.0.0.1:{port}", *args)
    assert rc == 2 and time.monotonic() - t0 < 5, err
    _one_error_line(err)


@pytest.mark.parametrize("spec", ["127.0.0.1:1,,127.0.0.1:2", "127.0.0.1:1,",
                                  "127.0.0.1:1,127.0.0.1:1", "nohost"])
def test_serve_bad_ranks(capsys, spec) -> None:
    rc, _, err = _in_proc(capsys, "serve", "--ranks", spec)
    assert rc == 2, err
    line = _one_error_line(err)
    assert "--ranks" in line or "bad address" in line


@pytest.mark.parametrize(("args", "named"), [
    (["--ranks", "0"], "--ranks 0"),
    (["--ranks", "2", "--kill-rank", "5"], "--kill-rank 5"),
    (["--kill-rank", "-1"], "--kill-rank -1"),
    (["--concurrency", "0"], "--concurrency 0"),
    (["--after-s", "0"], "--after-s 0"),
])
def test_bench_argument_errors_before_any_rank_starts(capsys, args, named) -> None:
    t0 = time.monotonic()
    rc, _, err = _in_proc(capsys, "bench", *args)
    assert rc == 2 and time.monotonic() - t0 < 5, err  # was: the whole run, then IndexError
    assert named in _one_error_line(err)


def test_request_errors_have_the_standard_prefix(front, capsys) -> None:
    f = front([])  # experts in the front process
    server = f"127.0.0.1:{f.port}"
    for args in (["--ids", "1,2,99999"], ["--ids", "1,2", "--max-tokens", "100000"]):
        rc, out, err = _in_proc(capsys, "generate", "--server", server, *args)
        assert rc == 1 and out == "", (out, err)
        _one_error_line(err)
    rc, out, err = _in_proc(capsys, "generate", "--server", server, "--ids", "256,72",
                            "--max-tokens", "3")
    assert rc == 0 and err == "" and "degraded" not in out


def test_text_of_a_normal_and_a_degraded_result() -> None:
    ok = {"text": "abc", "token_ids": [1], "degraded": False, "missing_experts": []}
    assert ep_cli._text(ok) == "abc"
    deg = dict(ok, degraded=True, missing_experts=[[1, 3]])
    assert ep_cli._text(deg).startswith("abc\n[degraded:") and "layer 1 expert 3" in \
        ep_cli._text(deg)


@pytest.mark.parametrize(("flag", "value", "line"), [
    ("--slots-per-rank", "0", "--slots-per-rank must be >= 1, got 0"),
    ("--heartbeat", "0", "--heartbeat must be > 0 seconds, got 0"),
    ("--deadline", "-1", "--deadline must be > 0 seconds, got -1"),
])
def test_serve_names_the_one_bad_flag_and_its_value(capsys, flag, value, line) -> None:
    """Issue 19 item 9: one line naming the flag and the value, not the three flags."""
    rc, out, err = _in_proc(capsys, "serve", flag, value, "--port", "0")
    assert (rc, out) == (2, "")
    assert _one_error_line(err) == f"pymooncake: error: {line}"


def test_serve_with_an_unreachable_metadata_service_is_one_line(capsys, two_ranks) -> None:
    """Issue 19 item 6 for the EP front: its Transfer Engine cannot publish its segment."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]            # closed again: connections are refused
    url = f"http://127.0.0.1:{port}/metadata"
    # in process; the segment is published before any rank is contacted
    rc, out, err = _in_proc(capsys, "serve", "--ranks", f"127.0.0.1:{two_ranks[0].port}",
                            "--port", "0", "--metadata", url)
    assert (rc, out) == (1, "")
    assert _one_error_line(err) == (
        f"pymooncake: error: ep serve: cannot use the metadata service --metadata {url}: "
        f"metadata server http://127.0.0.1:{port} unreachable: ConnectError('All connection "
        "attempts failed')")


def test_plain_text_says_degraded(front, capsys, two_ranks) -> None:
    ranks = two_ranks  # the module's pair: an earlier test's front may still hold the lease
    # 8 experts on 2 ranks x 4 slots: no copies; no re-plan: a dead rank's experts stay lost
    f = front(ranks, options=EPOptions(slots_per_rank=4, replan_on_failure=False,
                                       take_over=True), degraded_topk=True)
    ranks[1].kill()  # (the next test using the pair starts it again)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not f.client().call("ep.status")["missing"]:
        time.sleep(0.2)
    rc, out, err = _in_proc(capsys, "generate", "--server", f"127.0.0.1:{f.port}",
                            "--ids", "256,72,101,108", "--max-tokens", "4")
    assert rc == 0, err
    assert "[degraded:" in out and "layer " in out, out
