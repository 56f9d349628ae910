"""``pymooncake bench transfer``: the Transfer Engine against physical references and Mooncake.

A round writes a working set of ``batch`` requests of ``size_bytes`` each from this process
into a target process's registered memory and reads it back into a second buffer; a
subject's figure in one repeat is its median round. Every subject is set up once; a repeat
alternates single rounds of them (one of each per cycle, forwards then backwards, the
order rotated from repeat to repeat), so the load of other processes and the host's
swings in memory bandwidth, which move within a second, hit all of them alike
(``transfer_subjects``). The subjects:

* ``pymooncake``: our engine; tcp rounds use ``batch_transfer_sync`` (as Mooncake's bench
  does), local/shm/cma rounds ``submit`` + ``wait`` (the asynchronous copy thread). shm's
  target is a ``/dev/shm`` buffer of the target process, cma's an ordinary numpy array
  there (``transports/cma.py``);
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

import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from pymooncake.bench import transfer_refs as refs
from pymooncake.bench import transfer_subjects as subjects
from pymooncake.bench.peer import stats
from pymooncake.bench.transfer_subjects import (
    MOONCAKE_SCRIPT,
    Memcpy,
    Mooncake,
    MooncakeFailed,
    Ours,
    Sockets,
    Subject,
)

GiB = 1024**3
MIN_CYCLES = 3
"""Least rounds of each subject in one repeat."""
MAX_CYCLES = 10_000
MAX_WORKING_SET = 1 << 30
"""Largest ``size * batch`` (bytes): the subjects hold ~12 working sets at once."""


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


def _serve(metadata_url: str, name: str, total: int, kind: str) -> None:
    """The target process: ``total`` bytes registered, in ``/dev/shm`` for ``kind`` shm,
    ordinary memory otherwise (offered over ``cma`` too for ``kind`` cma)."""
    from pymooncake.transfer.config import TransferConfig
    from pymooncake.transfer.engine import TransferEngine

    cfg = TransferConfig(transports=("local", "shm", "cma", "tcp") if kind == "cma"
                         else ("local", "shm", "tcp"))
    eng = TransferEngine(name, metadata_url, config=cfg).start()
    if kind == "shm":
        addr = eng.allocate_shared(total).addr
    else:
        buf = np.zeros(total, dtype=np.uint8)
        addr = eng.register_memory(buf)
    print(addr, flush=True)
    for line in sys.stdin:
        if line.strip() == "digest":
            print(subjects.digest(addr, total), flush=True)
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


def measure_rounds(live: Sequence[Subject], min_time_s: float, rotation: int = 0,
                   min_cycles: int = MIN_CYCLES, max_cycles: int = MAX_CYCLES
                   ) -> dict[str, tuple[float, float, int, float, bool]]:
    """One repeat: cycles of one round of each subject until ``min_cycles`` cycles and
    ``min_time_s`` × the number of subjects seconds have passed, at most ``max_cycles``.
    Every subject runs the same number of rounds, so the time splits in proportion to
    their round times. The order is ``live`` rotated by ``rotation``, run forwards in even
    cycles and backwards in odd ones (A B C, C B A, A B C, ...: no subject always follows
    the same one, and each is first and last alike).

    Per subject: ``(median write_s, median read_s, rounds, CPU seconds, checked)``. CPU:
    its child processes' over the whole repeat (a child that spins while the others run
    pays for it), plus this process's around the subject's own rounds when
    ``parent_cpu``. ``checked``: the subject's ``check()`` after the last round (every
    byte read back in the repeat equals the source)."""
    base = list(live)
    base = base[rotation % len(base):] + base[:rotation % len(base)]
    ws: dict[str, list[float]] = {s.name: [] for s in base}
    rs: dict[str, list[float]] = {s.name: [] for s in base}
    cpu = dict.fromkeys(ws, 0.0)
    child0 = {s.name: s.child_cpu_s() for s in base}
    t_end = time.perf_counter() + min_time_s * len(base)
    cycles = 0
    while cycles < max_cycles and (cycles < min_cycles or time.perf_counter() < t_end):
        for s in (base if cycles % 2 == 0 else base[::-1]):
            p0 = time.process_time()
            w, r = s.round()
            if s.parent_cpu:
                cpu[s.name] += time.process_time() - p0
            ws[s.name].append(w)
            rs[s.name].append(r)
        cycles += 1
    for s in base:
        cpu[s.name] += s.child_cpu_s() - child0[s.name]
    return {s.name: (statistics.median(ws[s.name]), statistics.median(rs[s.name]),
                     len(ws[s.name]), cpu[s.name], s.check()) for s in base}


# ------------------------------------------------------------------------------ main
def run(transport: str, size_bytes: int, batch: int, paths: int, min_time_s: float = 1.0,
        compare_mooncake: bool = True, repeat: int = 1,
        mooncake_python: str | None = None) -> TransferBenchResult:
    """Run every subject ``repeat`` times, interleaved; see the module doc.

    ``mooncake_python``: the interpreter that has the Mooncake wheel (default: this one,
    or ``$PYMOONCAKE_MOONCAKE_PYTHON``). Raises ``ValueError`` for bad arguments.
    """
    if transport not in ("local", "shm", "cma", "tcp"):
        raise ValueError(f"transport must be local, shm, cma or tcp, got {transport!r}")
    if size_bytes <= 0 or batch <= 0 or paths <= 0 or repeat <= 0:
        raise ValueError("size, batch, paths and repeat must be positive")
    if size_bytes * batch > MAX_WORKING_SET:
        raise ValueError("working set size*batch must be <= 1 GiB (every subject holds its "
                         "buffers at once: about 12 working sets in all)")
    total = size_bytes * batch
    python = mooncake_python or os.environ.get("PYMOONCAKE_MOONCAKE_PYTHON") or sys.executable
    use_mooncake, note = False, "Mooncake comparison runs for --transport tcp only"
    if transport == "tcp" and not compare_mooncake:
        note = "Mooncake comparison disabled (--no-mooncake)"
    elif transport == "tcp":
        use_mooncake, note = mooncake_available(python)
    with contextlib.ExitStack() as stack:
        live: list[Subject] = [
            stack.enter_context(contextlib.closing(Ours(transport, size_bytes, batch, paths))),
            stack.enter_context(contextlib.closing(Memcpy(size_bytes, batch))),
            stack.enter_context(contextlib.closing(Sockets(size_bytes, batch, paths)))]
        if use_mooncake:
            try:
                live.append(stack.enter_context(
                    contextlib.closing(Mooncake(python, size_bytes, batch))))
            except MooncakeFailed as e:  # report it; the run goes on without Mooncake
                note, use_mooncake = f"mooncake run failed: {e}", False
        per: dict[str, list[float]] = {s.name: [] for s in live}
        cpu: dict[str, list[float]] = {s.name: [] for s in live}
        ws: list[float] = []
        rs: list[float] = []
        rounds, verified = 0, True
        for rep in range(repeat):
            try:
                got = measure_rounds(live, min_time_s, rotation=rep)
            except MooncakeFailed as e:  # the repeat again without it (its figures partial)
                note, use_mooncake = f"mooncake run failed: {e}", False
                live = [s for s in live if s.name != "mooncake"]
                got = measure_rounds(live, min_time_s, rotation=rep)
            for s in live:
                w, r, n, c, ok = got[s.name]
                per[s.name].append(s.bytes_per_round / (w + r))
                cpu[s.name].append(c / (s.bytes_per_round * n / GiB))
                if s.name == "mooncake" and not ok:
                    note += f"; Mooncake's read-back did not verify in repeat {rep + 1}"
                elif s.name != "mooncake":
                    verified = verified and ok
            w, r, n, _, _ = got["pymooncake"]
            ws.append(w)
            rs.append(r)
            rounds += n
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
