"""Building ``kernels.c`` with the system C compiler into a cached shared library (used by
``pymooncake.engine.kernels``; the module docstring there gives the flags and the cache)."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_name("kernels.c")
INCLUDED = tuple(Path(__file__).with_name(n)
                 for n in ("kernels_avx2.c", "kernels_vexp.c", "kernels_attn512.c",
                           "kernels_flash512.c", "kernels_decode.c"))
"""Files ``kernels.c`` #includes (part of the build key)."""
CFLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-ffp-contract=fast", "-std=gnu11", "-fPIC",
          "-shared")
OPENMP_FLAGS = ("-fopenmp",)
"""Added first: the prefill attention then runs its (KV head, query group) items on OpenMP
threads. At load, the library's ``libgomp.so.1`` is the one torch already loaded (same
soname), so these are torch's own intra-op threads, not a second pool fighting them for the
cores. Without OpenMP (the build fails) the library is rebuilt without it and the rows of a
chunk are split over Python threads (``kernels.parallel``)."""


def compiler() -> str | None:
    cc = os.environ.get("CC")
    if cc:
        return shutil.which(cc) or cc
    return next((p for p in map(shutil.which, ("cc", "gcc", "clang")) if p), None)


def cache_dir() -> Path:
    """Where built libraries are kept (created on demand)."""
    explicit = os.environ.get("PYMOONCAKE_KERNEL_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(base) / "pymooncake" / "kernels"


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def build(cc: str, extra: tuple[str, ...] = ()) -> Path:
    flags = (*CFLAGS, *extra)
    src = b"\0".join(p.read_bytes() for p in (SOURCE, *INCLUDED))
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256(b"\0".join([src, " ".join(flags).encode(), cc.encode(),
                                     version.encode(), _cpu_flags().encode()])).hexdigest()[:16]
    out_dir = cache_dir()
    target = out_dir / f"pmk_kernels_{key}.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        res = subprocess.run([cc, *flags, str(SOURCE), "-o", tmp, "-lm"], capture_output=True,
                             text=True, timeout=120)
        if res.returncode != 0:
            raise RuntimeError(f"{cc} exited {res.returncode}: {res.stderr.strip()[:500]}")
        os.replace(tmp, target)  # atomic: concurrent builders of one key all end with it
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target
