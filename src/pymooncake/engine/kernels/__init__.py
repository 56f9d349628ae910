"""Small C kernels for the engine's hot loops, built at first use, with a PyTorch fallback.

``kernels.c`` (plain C, no Python or PyTorch headers) is compiled once per machine with
the system C compiler (``$CC``, else ``cc``/``gcc``/``clang``: Debian's ``gcc`` package) as
``-O3 -march=native -fopenmp-simd -ffp-contract=fast`` (plus ``-fopenmp`` where it builds:
``OPENMP_FLAGS``) into a shared library cached under
``$PYMOONCAKE_KERNEL_CACHE`` (default ``$XDG_CACHE_HOME/pymooncake/kernels`` or
``~/.cache/pymooncake/kernels``), keyed by the source, the flags, the compiler and the CPU's
feature flags; it is loaded with ``ctypes`` (which releases the GIL during each call). Build
time is about a second. Without a compiler, on a failed build, or with
``PYMOONCAKE_KERNELS=0``, ``available()`` is ``False`` and the engine keeps its PyTorch paths
(same maths, other float32 rounding).

Allowed by issue 15 ("a small C++/ISPC/numba kernel if it installs from the registries on a
fresh machine and has a pure-torch fallback").
"""

from __future__ import annotations

import ctypes
import functools
import os
import subprocess
import threading

import torch

from pymooncake.engine.kernels.build import OPENMP_FLAGS, build, compiler
from pymooncake.engine.kernels.decode_layers import DECODE_ROWS_MAX as DECODE_ROWS_MAX
from pymooncake.engine.kernels.decode_layers import DecodeLayers as DecodeLayers
from pymooncake.engine.kernels.decode_layers import decode_rows_max as decode_rows_max
from pymooncake.engine.kernels.parallel import run_rows
from pymooncake.obs.logging import init_logger

log = init_logger(__name__)

OMP_SPLIT_MIN_WORK = 16 * 1024
"""Query×key pairs of a prefill chunk from which the kernel's own OpenMP threads share its
attention (``pmk_prefill_threads_inside``): an OpenMP team costs microseconds, far less than
the Python threads of ``kernels.parallel`` (``SPLIT_MIN_WORK``), so a 64-token chunk after
a few hundred tokens already gains from the second thread."""

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
_why_not = ""


def _declare(lib: ctypes.CDLL) -> None:
    i64, ptr, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
    fn = lib.pmk_paged_decode_f32
    fn.restype = ctypes.c_int
    fn.argtypes = [ptr, i64, ptr, i64, i64, i64, i64, ptr, i64, ptr, i64, i64, f32, ptr, i64]
    fn = lib.pmk_prefill_attn_f32
    fn.restype = ctypes.c_int
    fn.argtypes = [ptr, i64, i64, ptr, i64, i64, i64, i64, ptr, i64, i64, f32, ptr, i64, i64]
    fn = lib.pmk_prefill_threads_inside
    fn.restype = ctypes.c_int
    fn.argtypes = [i64]
    if hasattr(lib, "pmk_flash_group_vecs"):     # AVX-512 builds only
        fn = lib.pmk_flash_group_vecs
        fn.restype = i64
        fn.argtypes = [i64, i64, i64]
    fn = lib.pmk_gemv_f32
    fn.restype = None
    fn.argtypes = [ptr, ptr, i64, i64, ptr, ptr, ptr]
    fn = lib.pmk_silu_mul_f32
    fn.restype = None
    fn.argtypes = [ptr, i64, i64, ptr, i64]
    fn = lib.pmk_rms_norm_f32
    fn.restype = None
    fn.argtypes = [ptr, i64, i64, i64, ptr, f32, ptr, i64]
    fn = lib.pmk_rope_write_f32
    fn.restype = None
    fn.argtypes = [ptr, i64, i64, i64, i64, i64, ptr, ptr, ptr, ptr, i64, i64, ptr, i64]
    fn = lib.pmk_decode_layer_f32
    fn.restype = ctypes.c_int
    fn.argtypes = [ptr, ptr, f32, f32, ptr, ptr]
    fn = lib.pmk_gemv_rows_f32
    fn.restype = None
    fn.argtypes = [ptr, ptr, i64, i64, i64, ptr, ptr, ptr]
    fn = lib.pmk_decode_layer_rows_f32
    fn.restype = ctypes.c_int
    fn.argtypes = [ptr, ptr, i64, f32, f32, ptr, ptr]
    fn = lib.pmk_argmax_rows_f32
    fn.restype = None
    fn.argtypes = [ptr, i64, i64, i64, ptr]
    fn = lib.pmk_gemv_row_tile
    fn.restype = ctypes.c_int
    fn.argtypes = []
    fn = lib.pmk_gemv_lanes
    fn.restype = ctypes.c_int
    fn.argtypes = []


def library() -> ctypes.CDLL | None:
    """The loaded kernel library, building it on first use; ``None`` when unavailable
    (``why_unavailable()`` says why)."""
    global _lib, _tried, _why_not
    if _tried:
        return _lib
    with _lock:
        if _tried:
            return _lib
        if os.environ.get("PYMOONCAKE_KERNELS", "1").strip().lower() in ("0", "false", "no",
                                                                          "off"):
            _why_not = "PYMOONCAKE_KERNELS=0"
        elif (cc := compiler()) is None:
            _why_not = "no C compiler (cc, gcc or clang) on PATH"
        else:
            for extra in (OPENMP_FLAGS, ()):
                try:
                    lib = ctypes.CDLL(str(build(cc, extra)))
                    _declare(lib)
                    _lib, _why_not = lib, ""
                    break
                except (OSError, RuntimeError, subprocess.SubprocessError, AttributeError) as e:
                    _why_not = f"kernel build failed: {e}"
        if _lib is None:
            log.info("C attention kernels unavailable (%s); using the PyTorch paths", _why_not)
        _tried = True
        return _lib


def available() -> bool:
    return library() is not None


def why_unavailable() -> str:
    """Empty when ``available()``; otherwise the reason."""
    library()
    return _why_not


def paged_decode(q: torch.Tensor, layer_cache: torch.Tensor, tables: torch.Tensor,
                 ctx_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Decode attention read in place from the paged cache: one query per sequence.

    ``q`` ``[B, heads, head_dim]`` float32 (heads and head_dim contiguous; any token
    stride); ``layer_cache`` one layer's ``[2, kv_heads, num_blocks, block_size, head_dim]``
    float32, contiguous; ``tables`` ``[B, W]`` int64 block ids (row ``b`` covers
    ``ctx_lens[b]`` tokens); ``ctx_lens`` ``[B]`` int64 context lengths in tokens, each
    >= 1, the new token's K/V already written. Returns ``[B, heads, head_dim]`` float32.

    Raises ``ValueError`` on a dtype, layout or shape the kernel cannot read and
    ``RuntimeError`` when the library is unavailable or the kernel fails (allocation).
    """
    lib = library()
    if lib is None:
        raise RuntimeError(f"C attention kernels unavailable: {_why_not}")
    b, heads, d = q.shape
    two, kv_heads, num_blocks, bs, d2 = layer_cache.shape
    if (q.dtype != torch.float32 or layer_cache.dtype != torch.float32 or two != 2 or d2 != d
            or q.stride(2) != 1 or q.stride(1) != d or not layer_cache.is_contiguous()):
        raise ValueError("paged_decode: float32 q [B, heads, D] with contiguous heads and a "
                         "contiguous float32 [2, kv_heads, blocks, block_size, D] cache needed")
    if (tables.dtype != torch.int64 or ctx_lens.dtype != torch.int64 or tables.dim() != 2
            or tables.shape[0] != b or ctx_lens.shape != (b,) or not tables.is_contiguous()
            or not ctx_lens.is_contiguous()):
        raise ValueError("paged_decode: int64 tables [B, W] and ctx_lens [B], contiguous")
    out = torch.empty(b, heads, d, dtype=torch.float32)
    rc = lib.pmk_paged_decode_f32(q.data_ptr(), q.stride(0), layer_cache.data_ptr(), kv_heads,
                                  num_blocks, bs, d, tables.data_ptr(), tables.shape[1],
                                  ctx_lens.data_ptr(), b, heads, scale, out.data_ptr(),
                                  torch.get_num_threads())
    if rc != 0:
        raise RuntimeError("paged_decode: kernel failed (scratch allocation or heads > "
                           "64 x kv_heads)")
    return out


@functools.cache
def _threads_inside(lib: ctypes.CDLL, d: int) -> bool:
    """``pmk_prefill_threads_inside(d)``, asked once per library and head_dim (it is fixed at
    build time; ``prefill_attention`` runs per layer per step)."""
    return bool(lib.pmk_prefill_threads_inside(d))


def _need() -> ctypes.CDLL:
    lib = library()
    if lib is None:
        raise RuntimeError(f"C kernels unavailable: {_why_not}")
    return lib


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of ``x`` ``[rows, dim]`` float32 (rows at any stride, dim
    contiguous): ``weight * x / sqrt(mean(x**2) + eps)`` as Hugging Face's ``LlamaRMSNorm``.
    Returns a new contiguous ``[rows, dim]`` float32 tensor. Raises ``ValueError`` on
    another dtype or layout."""
    lib = _need()
    rows, dim = x.shape
    if (x.dtype != torch.float32 or weight.dtype != torch.float32 or x.stride(1) != 1
            or weight.shape != (dim,) or not weight.is_contiguous()):
        raise ValueError("rms_norm: float32 x [rows, dim] (dim contiguous) and weight [dim]")
    out = torch.empty(rows, dim, dtype=torch.float32)
    lib.pmk_rms_norm_f32(x.data_ptr(), rows, dim, x.stride(0), weight.data_ptr(), eps,
                         out.data_ptr(), torch.get_num_threads())
    return out


def rope_write(qkv: torch.Tensor, positions: torch.Tensor, cos_t: torch.Tensor,
               sin_t: torch.Tensor, layer_cache: torch.Tensor, slots: torch.Tensor,
               heads: int, kv_heads: int) -> None:
    """Rotate the q and k heads of ``qkv`` ``[T, (heads + 2 kv_heads) * D]`` float32 (rows
    contiguous) in place by RoPE at ``positions`` ``[T]`` int64 (tables ``cos_t``/``sin_t``
    ``[P, D]`` float32, rotate-half form), then write each token's K and V into
    ``layer_cache`` ``[2, kv_heads, blocks, block_size, D]`` at ``slots`` ``[T]`` int64.

    The caller guarantees positions < P and slots < blocks * block_size (the scheduler's
    own values); raises ``ValueError`` on a dtype, shape or layout mismatch."""
    lib = _need()
    t, width = qkv.shape
    two, kvh, num_blocks, bs, d = layer_cache.shape
    if (qkv.dtype != torch.float32 or qkv.stride(1) != 1 or width < (heads + 2 * kv_heads) * d
            or kvh != kv_heads or two != 2 or not layer_cache.is_contiguous()
            or layer_cache.dtype != torch.float32 or cos_t.shape[-1] != d
            or not cos_t.is_contiguous() or not sin_t.is_contiguous()
            or positions.dtype != torch.int64 or slots.dtype != torch.int64
            or positions.shape != (t,) or slots.shape != (t,)
            or not positions.is_contiguous() or not slots.is_contiguous()):
        raise ValueError("rope_write: float32 qkv [T, width], contiguous float32 cache and "
                         "tables, int64 positions/slots [T]")
    lib.pmk_rope_write_f32(qkv.data_ptr(), t, qkv.stride(0), heads, kv_heads, d,
                           positions.data_ptr(), cos_t.data_ptr(), sin_t.data_ptr(),
                           layer_cache.data_ptr(), num_blocks, bs, slots.data_ptr(),
                           torch.get_num_threads())


def prefill_attention(q: torch.Tensor, layer_cache: torch.Tensor, blocks: torch.Tensor,
                      ctx_len: int, scale: float, out: torch.Tensor) -> None:
    """Causal attention of one prefill chunk, K/V read in place from the paged cache.

    ``q`` ``[n, heads, head_dim]`` float32 (heads and head_dim contiguous, any token
    stride): the chunk's queries at positions ``ctx_len - n .. ctx_len - 1``, whose K/V are
    already in the cache; ``blocks`` ``[>= ceil(ctx_len / block_size)]`` int64 block ids of
    the sequence; writes ``[n, heads, head_dim]`` into ``out`` (same layout rules as ``q``).
    Raises ``ValueError`` on a layout it cannot read, ``RuntimeError`` if the kernel fails.
    With ``torch.get_num_threads() > 1`` a long chunk runs on that many threads: on torch's
    OpenMP threads inside the kernel where the library has them (AVX-512, head_dim 64: the
    blocked kernel of ``kernels_flash512.c``; from ``OMP_SPLIT_MIN_WORK`` query x key pairs),
    else as runs of rows of equal work on Python threads (``kernels.parallel``, from its
    ``SPLIT_MIN_WORK``). Bit-identical either way.
    """
    lib = _need()
    n, heads, d = q.shape
    two, kv_heads, num_blocks, bs, d2 = layer_cache.shape
    if (q.dtype != torch.float32 or out.dtype != torch.float32 or d2 != d or two != 2
            or q.stride(2) != 1 or q.stride(1) != d or out.shape != q.shape
            or out.stride(2) != 1 or out.stride(1) != d or not layer_cache.is_contiguous()
            or layer_cache.dtype != torch.float32 or blocks.dtype != torch.int64
            or not blocks.is_contiguous() or blocks.numel() * bs < ctx_len or n > ctx_len):
        raise ValueError("prefill_attention: float32 q/out [n, heads, D] with contiguous "
                         "heads, a contiguous float32 cache, int64 blocks covering ctx_len")
    qp, qs, op, os_ = q.data_ptr(), q.stride(0), out.data_ptr(), out.stride(0)

    def rows(a: int, b: int, threads: int = 1) -> int:   # queries a..b-1
        return lib.pmk_prefill_attn_f32(qp + 4 * a * qs, qs, b - a, layer_cache.data_ptr(),
                                        kv_heads, num_blocks, bs, d, blocks.data_ptr(),
                                        ctx_len - n + b, heads, scale, op + 4 * a * os_, os_,
                                        threads)

    if _threads_inside(lib, d):
        threads = torch.get_num_threads() if n * ctx_len >= OMP_SPLIT_MIN_WORK else 1
        rc = rows(0, n, threads)
    else:
        rc = run_rows(rows, n, ctx_len)
    if rc != 0:
        raise RuntimeError("prefill_attention: kernel failed (scratch allocation or heads > "
                           "64 x kv_heads)")


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         residual: torch.Tensor | None = None) -> torch.Tensor:
    """Linear layer for a few rows, memory-bound (decode): ``x`` ``[m, in]`` float32
    contiguous, ``weight`` ``[out, in]`` float32 contiguous (row-major, as ``nn.Linear``
    stores it), optional ``bias`` ``[out]`` and ``residual`` ``[m, out]`` (contiguous,
    added). Returns ``[m, out]`` float32. One row is ``pmk_gemv_f32``; more rows read each
    tile of the weight once for all of them (``pmk_gemv_rows_f32``) and give every row the
    floats it gets alone. Raises ``ValueError`` on another layout."""
    lib = _need()
    n_out, k = weight.shape
    m = x.shape[0] if x.dim() == 2 else 0
    if (x.dtype != torch.float32 or weight.dtype != torch.float32 or m < 1
            or x.shape[1] != k or not x.is_contiguous() or not weight.is_contiguous()
            or (bias is not None and (bias.numel() != n_out or not bias.is_contiguous()))
            or (residual is not None and (residual.numel() != m * n_out
                                          or not residual.is_contiguous()))):
        raise ValueError("gemv: float32 x [m, in] and weight [out, in], contiguous")
    y = torch.empty(m, n_out, dtype=torch.float32)
    b = None if bias is None else bias.data_ptr()
    r = None if residual is None else residual.data_ptr()
    if m == 1:
        lib.pmk_gemv_f32(weight.data_ptr(), x.data_ptr(), n_out, k, b, r, y.data_ptr())
    else:
        lib.pmk_gemv_rows_f32(weight.data_ptr(), x.data_ptr(), m, n_out, k, b, r,
                              y.data_ptr())
    return y


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up`` ``[rows, 2 n]`` float32 contiguous (gate then up,
    as ``SwiGLU.gate_up_proj`` outputs); returns ``[rows, n]``."""
    lib = _need()
    rows, width = gate_up.shape
    if gate_up.dtype != torch.float32 or not gate_up.is_contiguous() or width % 2:
        raise ValueError("silu_mul: float32 gate_up [rows, 2n], contiguous")
    out = torch.empty(rows, width // 2, dtype=torch.float32)
    lib.pmk_silu_mul_f32(gate_up.data_ptr(), rows, width // 2, out.data_ptr(),
                         torch.get_num_threads())
    return out


def argmax_rows(logits: torch.Tensor) -> list[int]:
    """Greedy tokens: the first index of each row's largest value of ``logits`` ``[rows,
    vocab]`` (``torch.argmax(logits, dim=-1)``'s answer, NaN counted as the largest), by
    ``pmk_argmax_rows_f32`` for float32 rows with unit stride (about 5x faster than
    ``torch.argmax`` on a 16 x 49,152 batch), else by ``torch.argmax``."""
    lib = library()
    if (lib is None or logits.dtype != torch.float32 or logits.dim() != 2
            or logits.stride(1) != 1 or logits.shape[1] == 0):
        return torch.argmax(logits, dim=-1).tolist()
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    lib.pmk_argmax_rows_f32(logits.data_ptr(), logits.shape[0], logits.shape[1],
                            logits.stride(0), out.data_ptr())
    return out.tolist()
