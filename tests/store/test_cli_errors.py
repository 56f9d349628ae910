"""Start-up errors of ``pymooncake master`` / ``store-server`` are one line, never a
traceback: busy ports (exit 1, the flag named), unreachable or silent services (exit 1,
bounded), bad flags (exit 2, checked before connecting)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

from tests.store.procs import ROOT


def _run(*args: str, timeout_s: float = 30.0) -> tuple[int, str, float]:
    import os

    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + env.get("PYTHONPATH", "")
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "pymooncake", *args], capture_output=True,
                       text=True, timeout=timeout_s, env=env, cwd=ROOT)
    return r.returncode, r.stderr, time.monotonic() - t0


def _main(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    """``pymooncake *args`` in this process (no Python start, no torch import): its exit
    status and stderr. For the usage errors (exit 2, checked before connecting); one test
    of them, ``test_store_server_bad_master_echoes_it_as_given[x:y]``, runs the real
    command."""
    from pymooncake.cli.main import main

    capsys.readouterr()
    try:
        rc = main(list(args))
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else 1
    return rc, capsys.readouterr().err


def _one_line(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr
    return lines[0]


@pytest.fixture()
def busy_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(64)  # listens, never accepts nor answers
    try:
        yield s.getsockname()[1]
    finally:
        s.close()


@pytest.mark.parametrize("flags", [
    ("--port", "{p}"),
    ("--port", "0", "--enable-http-metadata-server", "--http-metadata-server-port", "{p}"),
    ("--port", "0", "--metrics-port", "{p}"),
])
def test_master_busy_port_is_one_line_naming_the_flag(busy_port, flags):
    args = [f.format(p=busy_port) for f in flags]
    rc, err, _ = _run("master", *args)
    line = _one_line(err)
    flag = args[-2]
    assert rc == 1
    assert f"{flag} {busy_port}" in line and "already in use" in line


def test_store_server_unreachable_master_and_metadata():
    rc, err, _ = _run("store-server", "--master", "127.0.0.1:1", "--metadata",
                      "http://127.0.0.1:1/metadata", "--global-segment-size", "1M")
    line = _one_line(err)
    assert rc == 1
    assert "unreachable" in line and "http://127.0.0.1:1/metadata" in line


def test_store_server_silent_services_bounded(busy_port):
    """A port that listens but never answers: exit 1 within a bounded time, not a hang."""
    url = f"http://127.0.0.1:{busy_port}/metadata"
    rc, err, wall_s = _run("store-server", "--master", f"127.0.0.1:{busy_port}", "--metadata",
                           url, "--global-segment-size", "1M", "--startup-timeout", "1")
    line = _one_line(err)
    assert rc == 1
    assert "no answer in time" in line
    assert wall_s < 20.0


def test_store_server_silent_master_bounded(busy_port):
    from pymooncake.metadata.http import MetadataHttpServer

    md = MetadataHttpServer("127.0.0.1", 0).start()
    try:
        rc, err, wall_s = _run("store-server", "--master", f"127.0.0.1:{busy_port}",
                               "--metadata", md.url, "--global-segment-size", "1M",
                               "--startup-timeout", "1")
    finally:
        md.stop()
    line = _one_line(err)
    assert rc == 1
    assert "RPC_TIMEOUT" in line and f"127.0.0.1:{busy_port}" in line
    assert wall_s < 20.0


@pytest.mark.parametrize(("flags", "named"), [
    (("--ssd-capacity", "10M"), "--ssd-capacity"),
    (("--ssd-path", "/tmp/x"), "--ssd-path"),
    (("--heartbeat-interval", "-1"), "--heartbeat-interval"),
    (("--heartbeat-interval", "0"), "--heartbeat-interval"),
    (("--global-segment-size", "0"), "--global-segment-size"),
    (("--startup-timeout", "0"), "--startup-timeout"),
])
def test_store_server_bad_flags_exit_2_before_connecting(capsys, flags, named):
    # the master/metadata addresses are unreachable: exit 2 shows nothing was contacted
    rc, err = _main(capsys, "store-server", "--master", "127.0.0.1:1", "--metadata",
                      "http://127.0.0.1:1/metadata", *flags)
    line = _one_line(err)
    assert rc == 2
    assert named in line


@pytest.mark.parametrize(("make", "why"), [
    (lambda d: (d / "afile").write_text("x") and d / "afile", "exists and is not a directory"),
    (lambda d: (d / "afile").write_text("x") and d / "afile" / "sub",
     "cannot create the directory: Not a directory"),
    (lambda d: "/proc/pymooncake-no-such-dir", "cannot create the directory"),
])
def test_store_server_unusable_ssd_path_one_line_naming_it(capsys, tmp_path, make, why):
    path = str(make(tmp_path))
    rc, err = _main(capsys, "store-server", "--master", "127.0.0.1:1", "--metadata",
                      "http://127.0.0.1:1/metadata", "--ssd-path", path,
                      "--ssd-capacity", "10M")
    line = _one_line(err)
    assert rc == 2
    assert line.startswith(f"pymooncake: error: --ssd-path {path}: {why}"), line


@pytest.mark.parametrize(("master", "want"), [
    ("etcd://x:y", "master address 'etcd://x:y': expected etcd://host:port[/cluster_id] "
                   "('x:y' is not host:port)"),
    ("a:1,b", "master address 'a:1,b': expected host:port,host:port ('b' is not host:port)"),
    ("x:y", "master address 'x:y': expected host:port"),
])
def test_store_server_bad_master_echoes_it_as_given(capsys, master, want):
    args = ("store-server", "--master", master, "--metadata", "http://127.0.0.1:1/metadata")
    if master == "x:y":     # the real command, once
        rc, err, _ = _run(*args)
    else:
        rc, err = _main(capsys, *args)
    assert rc == 2
    assert _one_line(err) == f"pymooncake: error: --master: {want}"


@pytest.mark.parametrize("cmd", [
    ("store-server", "--master", "127.0.0.1:1", "--global-segment-size", "1M"),
    ("master", "--port", "0"),
])
def test_unknown_metadata_scheme_is_one_line_exit_2(capsys, cmd):
    # (newcomer: store-server printed a 20-line ValueError traceback; master started anyway)
    rc, err = _main(capsys, *cmd, "--metadata", "bogus")
    line = _one_line(err)
    assert rc == 2
    assert "--metadata 'bogus': not a metadata service URL" in line


@pytest.mark.parametrize(("args", "want"), [
    (("--client-ttl", "-1"), "--client-ttl -1.0: must be > 0"),
    (("--eviction-ratio", "2"), "--eviction-ratio 2.0: must be in [0, 1]"),
    (("--put-start-discard-timeout", "5", "--put-start-release-timeout", "1"),
     "--put-start-release-timeout must be >= --put-start-discard-timeout"),
    (("--ha", "--etcd-endpoints", "127.0.0.1:1", "--ha-lease-ttl", "0"),
     "--ha: --ha-lease-ttl 0.0: must be whole seconds >= 1"),
])
def test_master_config_errors_name_the_flag_not_the_field(capsys, args, want):
    """A bad master setting is reported with the flag the user typed, not the config
    field behind it (a newcomer read ``client_ttl_s=-1.0`` and looked for that flag)."""
    rc, err = _main(capsys, "master", "--port", "0", *args)
    assert rc == 2
    line = _one_line(err)
    assert want in line, line
    assert "_s=" not in line and "_ttl_s" not in line
