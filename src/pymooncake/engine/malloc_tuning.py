"""glibc ``malloc`` settings for an engine process (``mallopt(3)``), set once at start.

Why: an engine step allocates and frees activations of megabytes whose sizes change with
every batch. With glibc's defaults, memory a step freed can go back to the kernel before
the next step: a non-main thread's arena is made of heaps of at most 64 MiB, and a heap
left empty is unmapped at once, so a step whose activations span more than one heap maps
and zero-fills the same memory again every step (the test: three 20-27 MiB blocks a step
on a thread, 128 k page faults in 30 steps, 256 tuned); heap tops past the (adaptive) trim
threshold are returned too, and blocks above the mmap threshold are mapped per
allocation. These three ``mallopt`` values keep freed memory in the process, up to the
sizes below, for the next step to reuse; CPU serving stacks get the same from a caching
allocator (vLLM's CPU backend preloads tcmalloc). In one ``bench serving`` replay on the
2-core Xeon guest they removed about a third of a prefill worker's page faults
(docs/benchmarks.md, "Issue 16, session 23"; most of the rest came from oneDNN's
per-shape primitives, see ``model.layers.onednn_rows``). The cost is resident memory
not returned to the kernel between steps.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import threading

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3
"""``mallopt`` parameter numbers (glibc ``malloc.h``)."""

TRIM_THRESHOLD_BYTES = 1 << 30
"""Free memory at a heap's top kept before trimming (glibc default 128 KiB)."""
TOP_PAD_BYTES = 64 << 20
"""Extra bytes asked of the kernel per heap growth and kept when trimming; at a thread
arena's full 64 MiB heap size it also stops glibc unmapping empty heaps (default 128 KiB)."""
MMAP_THRESHOLD_BYTES = 32 << 20
"""Blocks at least this big are ``mmap``-ed (and unmapped on free); 32 MiB is glibc's
largest allowed value on 64-bit (default 128 KiB, adapting upwards)."""

ENV_SWITCH = "PYMOONCAKE_MALLOC_TUNING"
"""Environment off-switch: ``0``/``false``/``no``/``off`` leaves glibc's defaults."""

USER_SETTINGS = ("GLIBC_TUNABLES", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_",
                 "MALLOC_MMAP_THRESHOLD_", "MALLOC_MMAP_MAX_")
"""Environment variables through which a user sets glibc's malloc; any of them (for
``GLIBC_TUNABLES``, one naming ``glibc.malloc.``) leaves malloc as the user set it."""

_done: bool | None = None
_lock = threading.Lock()


def tune_malloc() -> bool:
    """Apply the three settings above once per process (thread-safe); later calls return
    the first call's result. ``True`` when glibc accepted all three; ``False`` when
    switched off by ``PYMOONCAKE_MALLOC_TUNING``, when the user set glibc's malloc through
    the environment (``USER_SETTINGS``), when the C library is not glibc (no ``mallopt``),
    or when glibc refused a value (logged). Never raises: the settings are an optimisation."""
    global _done
    with _lock:
        if _done is None:
            _done = _apply()
        return _done


def _apply() -> bool:
    if os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    for name in USER_SETTINGS:
        value = os.environ.get(name)
        if value and (name != "GLIBC_TUNABLES" or "glibc.malloc." in value):
            logger.info("%s is set: leaving glibc's malloc settings as they are", name)
            return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    for param, value in ((M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES),
                         (M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES),
                         (M_TOP_PAD, TOP_PAD_BYTES)):
        if mallopt(param, value) != 1:
            logger.warning("mallopt(%d, %d) refused: keeping glibc's malloc defaults for it",
                           param, value)
            return False
    return True
