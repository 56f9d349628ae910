"""``pymooncake bench transfer``: the Transfer Engine against physical references and Mooncake.

A round writes a working set of ``batch`` requests of ``size_bytes`` each from this process
into a target process's registered memory and reads it back into a second buffer; a
subject's figure in one repeat is the median round. The subjects, run in every repeat in
a rotated order (interleaved, so load from other processes hits all of them alike):

* ``pymooncake``: our engine; tcp rounds use ``batch_transfer_sync`` (as Mooncake's bench
  does), local/shm rounds ``submit`` + ``wait`` (the asynchronous copy thread);
* ``memcpy``: numpy copies of the working set in ``size_bytes`` pieces;
* ``socket``: plain Python sockets from a child process, **as many connections as the
  engine has paths**, each sending its share (``sendall`` of ``min(size, 4 MiB)`` chunks,
  ``recv_into`` here, one thread per connection on both ends);
* ``mooncake``: the ``mooncake-transfer-engine-non-cuda`` wheel's engine (tcp, P2P
  handshake) doing the same rounds, run by ``mooncake_te.py`` under ``mooncake_python``
  (tcp only).

Every figure is reported as median, quartiles, min and max over the repeats; every ratio
is computed within each repeat and reported the same way, with a verdict against its
target: ``met`` (lower quartile at or above), ``missed`` (upper quartile below) or ``not
distinguishable`` (the margin is inside the spread). CPU seconds per GiB moved (all
processes and threads of a subject) are reported the same way: on a loaded machine they
move far less than throughput does.
Child processes talk over stdin/stdout lines (no pickle).
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pymooncake.bench import transfer_refs as refs
from pymooncake.bench.peer import interleaved_orders, stats
from pymooncake.transfer.batch import TransferOp, TransferRequest
from pymooncake.transfer.config import TransferConfig
from pymooncake.transfer.memory import view_at

MOONCAKE_SCRIPT = Path(__file__).with_name("mooncake_te.py")
GiB = 1024**3


@dataclass(frozen=True, slots=True)
class TransferBenchResult:
    transport: str
    size_bytes: int
    batch: int
    paths: int
    repeats: int
    rounds: int
    api: str
    throughput_bytes_per_s: float
    """Median over repeats of (write + read of the working set) bytes / median round."""
    write_bytes_per_s: float
    read_bytes_per_s: float
    requests_per_s: float
    verified: bool
    memcpy_bytes_per_s: float
    socket_bytes_per_s: float
    socket_connections: int
    mooncake_bytes_per_s: float | None
    mooncake_requests_per_s: float | None
    mooncake_note: str
    ratio_vs_memcpy: float
    ratio_vs_socket: float
    ratio_vs_mooncake: float | None
    figures: dict[str, dict[str, Any]]
    """Per subject: bytes/s ``median``, ``min``, ``max`` and the per-repeat ``values``."""
    ratios: dict[str, dict[str, Any]]
    """Per reference: the per-repeat ratio's median/min/max, ``target`` and ``verdict``."""
    cpu_s_per_gib: dict[str, dict[str, Any]]
    """Per subject: CPU seconds (all processes and threads of the subject) per GiB moved."""


def spread(values: Sequence[float]) -> dict[str, Any]:
    """Median, quartiles (the spread the verdicts use), min, max and the values."""
    out = stats(values)
    if len(values) >= 4:
        q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    else:
        q1, q3 = min(values), max(values)
    out["q1"], out["q3"] = q1, q3
    return out


def verdict(ratios: Sequence[float], target: float) -> str:
    """``met`` when the lower quartile of the per-repeat ratios reaches ``target``,
    ``missed`` when the upper quartile stays below it, else ``not distinguishable``
    (the margin is inside the spread). With fewer than 4 repeats: min and max; with one,
    there is no spread to judge by."""
    if len(ratios) < 2:
        return "no spread (1 repeat)"
    s = spread(ratios)
    if s["q1"] >= target:
        return "met"
    if s["q3"] < target:
        return "missed"
    return "not distinguishable"


def targets(transport: str, size_bytes: int) -> dict[str, float]:
    """The issue's targets for this configuration (issues 3 and 16)."""
    if transport != "tcp":
        return {"memcpy": 0.8}
    out = {"mooncake": 1.0 if size_bytes <= 64 * 1024 else 1.2}
    if size_bytes >= 1 << 20:
        out["socket"] = 0.8
    return out


def _spawn(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "pymooncake.bench.transfer", *args],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env=refs.child_env())


def _digest(addr: int, n: int) -> str:
    return hashlib.blake2b(view_at(addr, n), digest_size=16).hexdigest()


# ------------------------------------------------------------------------ pymooncake
def measure_pymooncake(transport: str, size_bytes: int, batch: int, paths: int,
                       min_time_s: float) -> tuple[float, float, int, bool, float]:
    """(write_s, read_s, rounds, verified, CPU s/GiB): median round halves of our engine;
    the CPU of both processes (initiator and target)."""
    from pymooncake.metadata.http import MetadataHttpServer
    from pymooncake.transfer.engine import TransferEngine

    total = size_bytes * batch
    server = MetadataHttpServer("127.0.0.1", 0).start()
    proc = None
    transports = {"local": ("local",), "shm": ("local", "shm"), "tcp": ("local", "tcp")}
    cfg = TransferConfig(num_paths=paths, transports=transports[transport])
    eng = TransferEngine(f"bench-initiator-{os.getpid()}", server.url, config=cfg).start()
    try:
        src = np.random.default_rng(2).integers(0, 256, total, dtype=np.uint8)
        dst = np.zeros(total, dtype=np.uint8)
        src_addr, dst_addr = eng.register_memory(src), eng.register_memory(dst)
        if transport == "local":
            target = eng.segment_name
            tbuf = np.zeros(total, dtype=np.uint8)
            taddr = eng.register_memory(tbuf)
        else:
            target = f"bench-target-{os.getpid()}"
            proc = _spawn("--serve", server.url, target, str(total),
                          "shm" if transport == "shm" else "plain")
            taddr = int(refs.readline(proc))
        writes = [TransferRequest(TransferOp.WRITE, src_addr + i * size_bytes, target,
                                  taddr + i * size_bytes, size_bytes) for i in range(batch)]
        reads = [TransferRequest(TransferOp.READ, dst_addr + i * size_bytes, target,
                                 taddr + i * size_bytes, size_bytes) for i in range(batch)]
        ok = True

        def async_round(reqs: list[TransferRequest]) -> bool:
            bid = eng.allocate_batch(len(reqs))
            eng.submit(bid, reqs)
            st = eng.wait(bid)
            eng.free_batch(bid)
            return all(s.ok for s in st)

        def sync_round(reqs: list[TransferRequest]) -> bool:
            return all(s.ok for s in eng.batch_transfer_sync(reqs))

        do = sync_round if transport == "tcp" else async_round

        def one() -> tuple[float, float]:
            nonlocal ok
            t0 = time.perf_counter()
            okw = do(writes)
            t1 = time.perf_counter()
            okr = do(reads)
            t2 = time.perf_counter()
            ok = ok and okw and okr
            return t1 - t0, t2 - t1

        one()  # warm-up: connections, mappings
        dst[:] = 0
        cpu = refs.CpuMeter(*([proc.pid] if proc is not None else []))
        w, r, rounds = refs.median_rounds(one, 3, min_time_s)
        cpu_per_gib = cpu.seconds() / (2 * total * rounds / GiB)
        verified = ok and bool(np.array_equal(dst, src))
        if proc is not None:
            verified = verified and refs.ask(proc, "digest") == _digest(src_addr, total)
        return w, r, rounds, verified, cpu_per_gib
    finally:
        if proc is not None:
            refs.stop(proc)
        eng.close()
        server.stop()


def _serve(metadata_url: str, name: str, total: int, kind: str) -> None:
    from pymooncake.transfer.engine import TransferEngine

    eng = TransferEngine(name, metadata_url).start()
    if kind == "shm":
        addr = eng.allocate_shared(total).addr
    else:
        buf = np.zeros(total, dtype=np.uint8)
        addr = eng.register_memory(buf)
    print(addr, flush=True)
    for line in sys.stdin:
        if line.strip() == "digest":
            print(_digest(addr, total), flush=True)
        elif line.strip() == "exit":
            break
    eng.close()


# -------------------------------------------------------------------------- mooncake
def mooncake_available(python: str) -> tuple[bool, str]:
    """Whether ``python`` imports the wheel's engine (checked in a child process)."""
    try:
        out = subprocess.run([python, str(MOONCAKE_SCRIPT), "check"], capture_output=True,
                             text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, f"mooncake-transfer-engine-non-cuda not importable ({e!r})"
    if out.returncode != 0 or out.stdout.strip() != "ok":
        last = (out.stderr.strip().splitlines() or ["?"])[-1]
        return False, f"mooncake-transfer-engine-non-cuda not importable ({last[:120]})"
    return True, (f"mooncake-transfer-engine-non-cuda under {python}, tcp transport, "
                  "P2PHANDSHAKE metadata")


def measure_mooncake(python: str, size_bytes: int, batch: int, min_time_s: float
                     ) -> tuple[float, float, int, bool, float]:
    """Same rounds through Mooncake's engine, initiator and target in child processes."""
    proc = subprocess.Popen([python, str(MOONCAKE_SCRIPT), "initiate", str(size_bytes),
                             str(batch), str(min_time_s)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env=refs.child_env())
    try:
        out = json.loads(refs.readline(proc, timeout_s=120 + 4 * min_time_s))
    finally:
        refs.stop(proc)
    return (out["write_s"], out["read_s"], out["rounds"], out["verified"],
            out["cpu_s_per_gib"])


# ------------------------------------------------------------------------------ main
def run(transport: str, size_bytes: int, batch: int, paths: int, min_time_s: float = 1.0,
        compare_mooncake: bool = True, repeat: int = 1,
        mooncake_python: str | None = None) -> TransferBenchResult:
    """Run every subject ``repeat`` times, interleaved; see the module doc.

    ``mooncake_python``: the interpreter that has the Mooncake wheel (default: this one,
    or ``$PYMOONCAKE_MOONCAKE_PYTHON``). Raises ``ValueError`` for bad arguments.
    """
    if transport not in ("local", "shm", "tcp"):
        raise ValueError(f"transport must be local, shm or tcp, got {transport!r}")
    if size_bytes <= 0 or batch <= 0 or paths <= 0 or repeat <= 0:
        raise ValueError("size, batch, paths and repeat must be positive")
    if size_bytes * batch > 2 * 1024**3:
        raise ValueError("working set size*batch must be <= 2 GiB")
    total = size_bytes * batch
    python = mooncake_python or os.environ.get("PYMOONCAKE_MOONCAKE_PYTHON") or sys.executable
    use_mooncake, note = False, "Mooncake comparison runs for --transport tcp only"
    if transport == "tcp" and not compare_mooncake:
        note = "Mooncake comparison disabled (--no-mooncake)"
    elif transport == "tcp":
        use_mooncake, note = mooncake_available(python)
    subjects = ["pymooncake", "memcpy", "socket"] + (["mooncake"] if use_mooncake else [])
    per: dict[str, list[float]] = {s: [] for s in subjects}
    cpu: dict[str, list[float]] = {s: [] for s in subjects}
    ws: list[float] = []
    rs: list[float] = []
    rounds, verified = 0, True
    for order in interleaved_orders(subjects, repeat):
        for subject in order:
            if subject == "pymooncake":
                w, r, n, ok, c = measure_pymooncake(transport, size_bytes, batch, paths,
                                                    min_time_s)
                cpu[subject].append(c)
                ws.append(w)
                rs.append(r)
                per[subject].append(2 * total / (w + r))
                rounds += n
                verified = verified and ok
            elif subject == "memcpy":
                bps, c = refs.measure_memcpy(size_bytes, batch, min_time_s / 2)
                per[subject].append(bps)
                cpu[subject].append(c)
            elif subject == "socket":
                bps, c = refs.measure_socket_stream(size_bytes, batch, paths, min_time_s / 2)
                per[subject].append(bps)
                cpu[subject].append(c)
            elif use_mooncake:
                try:
                    mw, mr, _, mok, c = measure_mooncake(python, size_bytes, batch,
                                                         min_time_s)
                    per[subject].append(2 * total / (mw + mr))
                    cpu[subject].append(c)
                    if not mok:
                        note += "; Mooncake's read-back did not verify"
                except Exception as e:  # noqa: BLE001 - report, do not fail the benchmark
                    note, use_mooncake = f"mooncake run failed: {e!r}", False
    figures = {s: spread(v) for s, v in per.items() if v}
    cpu_figures = {s: spread(v) for s, v in cpu.items() if v}
    ours = per["pymooncake"]
    ratios: dict[str, dict[str, Any]] = {}
    goal = targets(transport, size_bytes)
    for ref in ("memcpy", "socket", "mooncake"):
        vals = per.get(ref, [])
        if len(vals) != len(ours):
            continue
        r = [a / b for a, b in zip(ours, vals, strict=True)]
        entry = {k: v for k, v in spread(r).items() if k != "values"}
        entry["parity"] = verdict(r, 1.0).replace("met", "faster").replace("missed", "slower")
        if ref in goal:
            entry["target"], entry["verdict"] = goal[ref], verdict(r, goal[ref])
        if len(cpu.get(ref, [])) == len(cpu["pymooncake"]):
            c = [a / b for a, b in zip(cpu["pymooncake"], cpu[ref], strict=True) if b > 0]
            if c:
                entry["cpu_per_byte"] = {k: v for k, v in spread(c).items()
                                         if k != "values"}
        ratios[ref] = entry
    thr = figures["pymooncake"]["median"]
    mc = figures.get("mooncake", {}).get("median")
    return TransferBenchResult(
        transport=transport, size_bytes=size_bytes, batch=batch, paths=paths,
        repeats=repeat, rounds=rounds,
        api="batch_transfer_sync" if transport == "tcp" else "submit+wait",
        throughput_bytes_per_s=thr, write_bytes_per_s=total / statistics.median(ws),
        read_bytes_per_s=total / statistics.median(rs), requests_per_s=thr / size_bytes,
        verified=verified, memcpy_bytes_per_s=figures["memcpy"]["median"],
        socket_bytes_per_s=figures["socket"]["median"], socket_connections=paths,
        mooncake_bytes_per_s=mc, mooncake_requests_per_s=mc / size_bytes if mc else None,
        mooncake_note=note, ratio_vs_memcpy=ratios["memcpy"]["median"],
        ratio_vs_socket=ratios["socket"]["median"],
        ratio_vs_mooncake=ratios["mooncake"]["median"] if "mooncake" in ratios else None,
        figures=figures, ratios=ratios, cpu_s_per_gib=cpu_figures)


def to_json(result: TransferBenchResult) -> dict[str, object]:
    return asdict(result)


def format_human(p: dict[str, Any]) -> str:
    """The result as text: each subject's median [lower–upper quartile] and each ratio's
    verdict (the JSON also has min, max and every repeat's value)."""
    lines = [f"transfer {p['transport']}: {p['batch']} x {p['size_bytes']} B, "
             f"{p['paths']} path(s), {p['repeats']} interleaved repeats, {p['api']}, "
             f"verified={p['verified']}"]
    for s, f in p["figures"].items():
        c = p["cpu_s_per_gib"][s]
        lines.append(f"  {s:<11} {f['median'] / GiB:7.3f} GiB/s "
                     f"[{f['q1'] / GiB:.3f}–{f['q3'] / GiB:.3f}], "
                     f"CPU {c['median']:.3f} s/GiB [{c['q1']:.3f}–{c['q3']:.3f}]"
                     + (f" ({p['socket_connections']} connections)" if s == "socket" else ""))
    for ref, r in p["ratios"].items():
        goal = (f", target ≥ {r['target']}: {r['verdict']}" if "target" in r else "")
        cpb = r.get("cpu_per_byte")
        cpu_text = (f"; CPU per byte {cpb['median']:.2f}x [{cpb['q1']:.2f}–{cpb['q3']:.2f}]"
                    if cpb else "")
        lines.append(f"  vs {ref:<8} {r['median']:.2f}x [{r['q1']:.2f}–{r['q3']:.2f}] "
                     f"({r['parity']}{goal}){cpu_text}")
    if "mooncake" not in p["figures"]:
        lines.append(f"  mooncake    n/a ({p['mooncake_note']})")
    return "\n".join(lines)


def _child_main(argv: list[str]) -> None:
    import argparse

    ap = argparse.ArgumentParser(prog="pymooncake.bench.transfer")
    ap.add_argument("--serve", nargs=4, metavar=("URL", "NAME", "BYTES", "KIND"))
    ap.add_argument("--stream-send", nargs=4, type=int,
                    metavar=("PORT", "BYTES", "CHUNK", "CONNECTIONS"))
    a = ap.parse_args(argv)
    if a.serve:
        _serve(a.serve[0], a.serve[1], int(a.serve[2]), a.serve[3])
    elif a.stream_send:
        refs.stream_send(*a.stream_send)
    else:
        print(json.dumps(to_json(run("tcp", 1 << 20, 16, 2))))


if __name__ == "__main__":
    _child_main(sys.argv[1:])
