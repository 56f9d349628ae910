"""``pymooncake bench p2p``: P2P Store distribution on namespaced hosts with tc-limited links.

Hosts are Linux network namespaces on one bridge (as tests/serving/test_multihost.py builds
them), each with its own hostname; every host's veth is shaped with ``tc tbf`` in both
directions (its upload and its download) to ``--rate-mbit``. etcd on the bridge is the
metadata service. Host 0 runs the seed (``pymooncake p2p register``) of a generated
safetensors checkpoint; hosts 1..N run ``pymooncake p2p get`` started at one instant.
Three runs: **baseline** (every receiver pulls from the seed alone: ``--no-share``),
**p2p** (receivers serve what they have; they keep serving until all are done), and
**p2p + kill** (one receiver holder is SIGKILLed mid-distribution). Time = last receiver's
verified finish − the common start; every receiver's files are re-hashed against the seed's
after each run (besides the per-shard BLAKE3 checks of the pull itself).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

TAG = f"p2pb{os.getpid() % 10000}"
NET = f"10.232.{os.getpid() % 200 + 20}"


class BenchError(Exception):
    """The benchmark cannot run here (reason in the message) or a run failed."""


def add_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--receivers", type=int, default=8, help="receiver hosts (default 8)")
    p.add_argument("--size-mib", type=int, default=256, help="checkpoint MiB (default 256)")
    p.add_argument("--files", type=int, default=4, help="safetensors files (default 4)")
    p.add_argument("--rate-mbit", type=float, default=300.0,
                   help="every host's link, each direction, Mbit/s (default 300)")
    p.add_argument("--shard-mib", type=float, default=4.0, help="shard size MiB (default 4)")
    p.add_argument("--parallel", type=int, default=8,
                   help="shards in flight per receiver (default 8)")
    p.add_argument("--runs", default="baseline,p2p,kill",
                   help="comma-separated subset of baseline,p2p,kill (default all)")
    p.add_argument("--work-dir", default=None, help="where files go (default: a tmp dir)")


def missing_requirement() -> str | None:
    """Why namespaced hosts cannot be built here, or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, tc)"
    for tool in ("ip", "tc", "unshare"):
        if shutil.which(tool) is None:
            return f"no `{tool}` binary"
    if _etcd() is None:
        return "no etcd binary (apt-get install etcd-server)"
    r = subprocess.run(["ip", "netns", "add", f"{TAG}probe"], capture_output=True, text=True)
    if r.returncode != 0:
        return f"cannot create a network namespace: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", f"{TAG}probe"], capture_output=True)
    return None


def _etcd() -> str | None:
    return shutil.which("etcd") or next(
        (p for p in ("/usr/bin/etcd", "/usr/local/bin/etcd") if Path(p).exists()), None)


def _sh(*cmd: str) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise BenchError(f"`{' '.join(cmd)}` failed: {r.stderr.strip()}")


def make_checkpoint(root: Path, size_mib: int, files: int) -> Path:
    """A safetensors directory of ``files`` files of random uint8 tensors, ``size_mib`` MiB
    in all (header + data, written by hand: no torch needed)."""
    root.mkdir(parents=True, exist_ok=True)
    per = (size_mib << 20) // files
    for i in range(files):
        header = json.dumps({"w": {"dtype": "U8", "shape": [per], "data_offsets": [0, per]}})
        header += " " * (-len(header) % 8)
        with open(root / f"model-{i + 1:05d}-of-{files:05d}.safetensors", "wb") as f:
            f.write(len(header).to_bytes(8, "little") + header.encode())
            for _ in range(0, per, 1 << 24):
                f.write(os.urandom(min(1 << 24, per - f.tell() + 8 + len(header))))
    (root / "config.json").write_text('{"model_type": "bench"}\n')
    return root


def _digests(root: Path) -> dict[str, str]:
    import blake3
    out = {}
    for f in sorted(p for p in root.rglob("*") if p.is_file()):
        h = blake3.blake3(max_threads=1)
        h.update_mmap(f) if f.stat().st_size else None
        out[f.relative_to(root).as_posix()] = h.hexdigest()
    return out


class Hosts:
    """A bridge, N namespaces with shaped veths, and etcd on the bridge."""

    def __init__(self, n: int, rate_mbit: float, work: Path) -> None:
        self.n, self.rate, self.work = n, rate_mbit, work
        self.bridge = f"{TAG}br"
        self.made: list[str] = []
        self.procs: list[subprocess.Popen] = []
        self.etcd: subprocess.Popen | None = None

    def ip(self, i: int) -> str:
        return f"{NET}.{10 + i}"

    def ns(self, i: int) -> str:
        return f"{TAG}h{i}"

    def up(self) -> str:
        _sh("ip", "link", "add", self.bridge, "type", "bridge")
        self.made.append("bridge")
        _sh("ip", "addr", "add", f"{NET}.1/24", "dev", self.bridge)
        _sh("ip", "link", "set", self.bridge, "up")
        tbf = ["tbf", "rate", f"{self.rate:g}mbit", "burst", "256kb", "latency", "100ms"]
        for i in range(self.n):
            ns, veth = self.ns(i), f"{TAG}v{i}"
            _sh("ip", "netns", "add", ns)
            self.made.append(ns)
            _sh("ip", "link", "add", veth, "type", "veth", "peer", "name", veth + "p")
            _sh("ip", "link", "set", veth + "p", "master", self.bridge)
            _sh("ip", "link", "set", veth + "p", "up")
            _sh("tc", "qdisc", "add", "dev", veth + "p", "root", *tbf)      # host download
            _sh("ip", "link", "set", veth, "netns", ns)
            _sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{self.ip(i)}/24", "dev", veth)
            _sh("ip", "netns", "exec", ns, "ip", "link", "set", veth, "up")
            _sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
            _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", veth, "root", *tbf)
        cu, pu = f"http://{NET}.1:2379", f"http://{NET}.1:2380"
        self.etcd = subprocess.Popen(
            [str(_etcd()), "--name", "b", "--data-dir", str(self.work / "etcd"),
             "--listen-client-urls", cu, "--advertise-client-urls", cu,
             "--listen-peer-urls", pu, "--initial-advertise-peer-urls", pu,
             "--initial-cluster", f"b={pu}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection((f"{NET}.1", 2379), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise BenchError("etcd did not start on the bridge") from None
                time.sleep(0.2)
        time.sleep(0.5)
        return f"etcd://{NET}.1:2379"

    def start(self, i: int, *argv: str) -> subprocess.Popen:
        inner = " ".join([sys.executable, "-m", "pymooncake", *argv])
        p = subprocess.Popen(
            ["ip", "netns", "exec", self.ns(i), "unshare", "-u", "sh", "-c",
             f"hostname {TAG}-host{i} && exec {inner}"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=dict(os.environ, PYTHONUNBUFFERED="1"), start_new_session=True)
        self.procs.append(p)
        return p

    def down(self) -> None:
        for p in self.procs + ([self.etcd] if self.etcd else []):
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.kill()
            p.wait()
        for ns in self.made:
            if ns != "bridge":
                subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        if "bridge" in self.made:
            subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)


def _json_line(p: subprocess.Popen, what: str, timeout_s: float) -> dict[str, Any]:
    """The first JSON line on ``p``'s stdout (ready line, or --json document)."""
    import selectors
    assert p.stdout is not None
    sel = selectors.DefaultSelector()
    sel.register(p.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout_s
    buf = ""
    while time.monotonic() < deadline:
        if sel.select(timeout=0.2):
            line = p.stdout.readline()
            if not line:
                break
            buf += line
            if buf.lstrip().startswith("{"):
                try:
                    return json.loads(buf)
                except json.JSONDecodeError:
                    continue
            buf = ""
    err = p.stderr.read() if p.poll() is not None and p.stderr else ""
    raise BenchError(f"{what}: no result in {timeout_s:.0f} s (exit {p.poll()}): "
                     f"{err.strip()[-3000:]}")


def _one_run(hosts: Hosts, md: str, kind: str, args: argparse.Namespace, src: Path,
             want: dict[str, str], kill_after_s: float | None,
             progress: Callable[[str], None]) -> dict[str, Any]:
    name = f"ckpt-{kind}-{int(time.time())}"
    seed = hosts.start(0, "p2p", "register", name, str(src), "--metadata", md, "--host",
                       hosts.ip(0), "--shard-size", str(args.shard_mib))
    _json_line(seed, "seed", 120)
    outs = [hosts.work / f"out-{kind}-{i}" for i in range(1, hosts.n)]
    t0 = time.time() + 3.0 + 0.5 * hosts.n            # every receiver started and connected
    recv = []
    for i, out in enumerate(outs, start=1):
        extra = ["--no-share", "--json"] if kind == "baseline" else ["--hold"]
        recv.append(hosts.start(i, "p2p", "get", name, str(out), "--metadata", md, "--host",
                                hosts.ip(i), "--start-at", f"{t0:.3f}", "--parallel",
                                str(args.parallel), "--stall-timeout", "60", *extra))
    killed = None
    if kill_after_s is not None:
        time.sleep(max(0.0, t0 + kill_after_s - time.time()))
        killed = 1
        os.killpg(recv[0].pid, signal.SIGKILL)
        progress(f"  killed receiver host 1 at t+{time.time() - t0:.1f} s")
    docs = {}
    for i, p in enumerate(recv, start=1):
        if i == killed:
            continue
        docs[i] = _json_line(p, f"receiver {i}", 900)
    end = max(d["finished_at"] for d in docs.values())
    for p in [seed, *recv]:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
    for p in [seed, *recv]:
        try:
            p.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    for i in docs:
        got = _digests(outs[i - 1])
        if got != want:
            raise BenchError(f"{kind}: receiver {i}'s files differ from the seed's")
    for out in outs:
        shutil.rmtree(out, ignore_errors=True)
    seconds = end - t0
    from_seed = sum(d["bytes_from"].get(_seed_segment(d, name), 0) for d in docs.values())
    total = sum(d["bytes"] for d in docs.values())
    return {"run": kind, "seconds": round(seconds, 2), "receivers_done": len(docs),
            "killed_host": killed, "verified": True,
            "max_start_lag_s": round(max(d["started_at"] for d in docs.values()) - t0, 3),
            "per_receiver_s": sorted(round(d["finished_at"] - t0, 2) for d in docs.values()),
            "bytes_from_seed_fraction": round(from_seed / total, 3) if total else 0.0,
            "transfer_failures": sum(d["transfer_failures"] for d in docs.values()),
            "receivers_cpu_s": round(sum(d["cpu_s"] for d in docs.values()), 1),
            "checksum_failures": sum(d["checksum_failures"] for d in docs.values())}


def _seed_segment(doc: dict[str, Any], name: str) -> str:
    return next((s for s in doc["bytes_from"] if f"{TAG}-host0-" in s), "")


def run_bench(args: argparse.Namespace, progress: Callable[[str], None]) -> dict[str, Any]:
    """Run the benchmark; the result document (figures per run, ratio p2p/baseline).
    Raises :class:`BenchError` when it cannot run (the reason) or a run fails."""
    why = missing_requirement()
    if why:
        raise BenchError(f"cannot build namespaced hosts: {why}")
    runs = [r for r in args.runs.replace(" ", "").split(",") if r]
    if not runs or set(runs) - {"baseline", "p2p", "kill"}:
        raise BenchError(f"--runs must be a subset of baseline,p2p,kill, got {args.runs!r}")
    if args.receivers < 1 or args.size_mib < 1 or args.files < 1 or not args.rate_mbit > 0:
        raise BenchError("need --receivers, --size-mib, --files >= 1 and --rate-mbit > 0")
    import tempfile
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="p2p-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    src = make_checkpoint(work / "seed", args.size_mib, args.files)
    want = _digests(src)
    hosts = Hosts(args.receivers + 1, args.rate_mbit, work)
    results: dict[str, Any] = {}
    try:
        md = hosts.up()
        progress(f"{args.receivers + 1} hosts up at {args.rate_mbit:g} Mbit/s each way; "
                 f"checkpoint {args.size_mib} MiB in {args.files} files")
        for kind in runs:
            kill_at = None
            if kind == "kill":
                ref = results.get("p2p", {}).get("seconds") or (
                    args.size_mib * 8.39 / args.rate_mbit * 1.5)
                kill_at = 0.4 * ref
            progress(f"run {kind} ...")
            results[kind] = _one_run(hosts, md, kind, args, src, want, kill_at, progress)
            progress(f"  {kind}: {results[kind]['seconds']} s")
    finally:
        hosts.down()
        if not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)
    doc: dict[str, Any] = {
        "receivers": args.receivers, "size_mib": args.size_mib, "files": args.files,
        "rate_mbit": args.rate_mbit, "shard_mib": args.shard_mib, "parallel": args.parallel,
        "ideal_one_copy_s": round(args.size_mib * 8 * 1.048576 / args.rate_mbit, 2),
        "runs": results}
    if "baseline" in results and "p2p" in results:
        doc["p2p_over_baseline"] = round(results["p2p"]["seconds"]
                                         / results["baseline"]["seconds"], 3)
    return doc


def format_human(doc: dict[str, Any]) -> str:
    lines = [f"1 seed -> {doc['receivers']} receivers, {doc['size_mib']} MiB checkpoint, "
             f"{doc['rate_mbit']:g} Mbit/s per host each way (one copy over one link: "
             f"{doc['ideal_one_copy_s']} s)"]
    for kind, r in doc["runs"].items():
        lines.append(f"  {kind:9s} {r['seconds']:7.2f} s  receivers done {r['receivers_done']}"
                     f"  from seed {r['bytes_from_seed_fraction']:.0%}  transfer failures "
                     f"{r['transfer_failures']}  receivers' CPU {r['receivers_cpu_s']} s  "
                     "all bytes verified")
    if "p2p_over_baseline" in doc:
        lines.append(f"  p2p / baseline = {doc['p2p_over_baseline']:.3f}x")
    return "\n".join(lines)
