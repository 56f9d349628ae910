/* The engine's C kernels (float32; one thread, except the AVX-512 prefill attention, which
 * spreads over torch's OpenMP threads in a build with -fopenmp): attention over
 * pymooncake's paged KV cache (decode and causal prefill, read in place), RMSNorm, RoPE +
 * K/V write, the one-row GEMV and SwiGLU's SiLU-multiply.
 *
 * Built at first use by pymooncake/engine/kernels/__init__.py with the system C compiler
 * (-O3 -march=native -fopenmp-simd -ffp-contract=fast, no -ffast-math) and called through
 * ctypes; the engine falls back to PyTorch when no compiler is found. No Python or PyTorch
 * headers: plain C (GNU C11); AVX-512 paths where the CPU has it, portable C otherwise.
 *
 * Cache layout of one layer (engine/kv/kv_tensors.py, KV_LAYOUT "paged_l2hnbd"):
 * K plane [kv_heads, num_blocks, block_size, head_dim], the V plane right after it. A
 * sequence's token t lives in block table[t / block_size] at offset t % block_size. The
 * kernels read K/V there in place: no gather, no copy into a padded buffer.
 *
 * Softmax: two passes over the scores (max, then exp and sum), exp by exp_neg below. Sums
 * over head_dim use `omp simd` reductions (vectorised, so the order differs from PyTorch's
 * SDPA by float32 rounding only).
 */
#include <stdint.h>
#include <stdlib.h>
#include <math.h>
#include <string.h>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif
/* Software prefetch in the decode GEMVs (gemv4_rows512, gemv_rows_simd). While a tile of
 * weight rows streams, the weights PMK_GEMV_PF_LEAD bytes past the tile's start (or past
 * its end, if the tile is longer) are prefetched into L2 (PMK_GEMV_PF_HINT), one line for
 * each line read. Weights that come from DRAM stream 1.4-1.7x faster with it, and weights
 * already in cache slightly faster (docs/data/issue16_s38/sweep.txt, where the lead and the
 * hint were chosen). The flags are for that A/B; PMK_GEMV_NO_PREFETCH builds the GEMVs
 * without it. The addresses are integers (uintptr_t): near a matrix's end they point past
 * it, and a prefetch never faults. */
#ifndef PMK_GEMV_PF_LEAD
#define PMK_GEMV_PF_LEAD 16384
#endif
#ifndef PMK_GEMV_PF_HINT
#define PMK_GEMV_PF_HINT _MM_HINT_T1
#endif
#define PMK_GEMV_PF_START(tile_start, tile_bytes) \
    ((uintptr_t)(tile_start) + ((tile_bytes) > PMK_GEMV_PF_LEAD ? (tile_bytes) : PMK_GEMV_PF_LEAD))
/* The four lines from integer address a: what one iteration of either GEMV reads. */
#define PMK_GEMV_PREFETCH4(a)                                                       \
    do {                                                                            \
        for (int pf_l = 0; pf_l < 4; pf_l++)                                        \
            _mm_prefetch((const char *)((a) + 64 * pf_l), PMK_GEMV_PF_HINT);        \
    } while (0)
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define PMK_AVX2 1
#include "kernels_avx2.c"
#endif
#if defined(__AVX2__) && defined(__FMA__)
#define PMK_VEXP 1
#include "kernels_vexp.c"
#endif

/* e^x for x <= 0 (softmax arguments after subtracting the row max), vectorisable.
 * Cephes' expf: x = n ln2 + r, |r| <= ln2/2, degree-6 polynomial for e^r, 2^n by building
 * the exponent bits. Max relative error ~2 ulp; x < -87 gives 0 (e^-87 ~ 1.6e-38). */
static inline float exp_neg(float x) {
    const float LOG2E = 1.44269504088896341f, C1 = 0.693359375f, C2 = -2.12194440e-4f;
    const float MAGIC = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
    float under = x < -87.0f ? 0.0f : 1.0f;
    x = x < -87.0f ? -87.0f : x;
    float fn = (x * LOG2E + MAGIC) - MAGIC;
    float r = (x - fn * C1) - fn * C2;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)fn + 127) << 23;
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return p * two_n * under;
}

/* The scratch of attend_group_any for g_count query rows over up to ctx keys: `scores`
 * (g_count rows, *s_stride floats apart) and `acc` (g_count * d floats), both on 64-byte
 * lines. `acc`, read and written for every key, at 16 or 48 bytes past a line (malloc's
 * alignment) made the same call ~15 % slower (tiny model, 448 tokens, one thread: 8.0 or
 * 8.6-9.6 ms, as the heap fell at a worker's start-up). The scores rows are rounded to 16
 * floats so that the size is a multiple of 64. Either pointer may come back NULL; free
 * both with free(). */
static void attn_scratch(int64_t g_count, int64_t ctx, int64_t d, float **scores,
                         float **acc, int64_t *s_stride) {
    *s_stride = (ctx + 15) / 16 * 16;
    *scores = aligned_alloc(64, (size_t)(g_count * *s_stride) * sizeof(float));
    *acc = aligned_alloc(64, (size_t)((g_count * d + 15) / 16 * 16) * sizeof(float));
}

/* Softmax weights in place over s[0..n): returns 1 / sum (the caller scales at the end). */
static float softmax_unnormalised(float *s, int64_t n) {
#ifdef PMK_VEXP
    return softmax_unnormalised_avx2(s, n);
#endif
    float m = s[0];
#pragma omp simd reduction(max : m)
    for (int64_t t = 1; t < n; t++) m = s[t] > m ? s[t] : m;
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < n; t++) {
        float e = exp_neg(s[t] - m);
        s[t] = e;
        sum += e;
    }
    return 1.0f / sum;
}

/* One query group (the g_count query heads sharing KV head kh) of one sequence over its
 * first n context tokens. q: g_count rows of d floats (row stride q_stride); scores: g_count
 * rows of room for n floats (row stride s_stride); out: g_count rows of d (stride out_stride).
 * Query i of the group sees tokens < limit[i]; limit NULL: all n. */
static void attend_group(const float *q, int64_t q_stride, int64_t g_count,
                         const float *kc, const float *vc, const int64_t *table,
                         int64_t bs, int64_t d, int64_t n, const int64_t *limit, float scale,
                         float *scores, int64_t s_stride, float *acc,
                         float *out, int64_t out_stride) {
    for (int64_t t0 = 0; t0 < n; t0 += bs) {
        const int64_t blk = table[t0 / bs];
        const int64_t m = n - t0 < bs ? n - t0 : bs;
        const float *kb = kc + blk * bs * d;
#ifdef __AVX512F__
        if (d == 64 && g_count <= 8) {
            /* blocks sit at random addresses: prefetch the next K block and this V block
             * (read by the P.V pass below) while the scores of this one are computed */
            const float *kn = t0 + bs < n ? kc + table[(t0 + bs) / bs] * bs * d : NULL;
            const float *vb_pf = vc + blk * bs * d;
            for (int64_t o = 0; o < m; o++) {
                const float *krow = kb + o * d;
                for (int c = 0; c < 64; c += 16) {
                    if (kn) _mm_prefetch((const char *)(kn + o * d + c), _MM_HINT_T0);
                    _mm_prefetch((const char *)(vb_pf + o * d + c), _MM_HINT_T0);
                }
                __m512 k0 = _mm512_loadu_ps(krow), k1 = _mm512_loadu_ps(krow + 16),
                       k2 = _mm512_loadu_ps(krow + 32), k3 = _mm512_loadu_ps(krow + 48);
                for (int64_t g = 0; g < g_count; g++) {
                    const float *qg = q + g * q_stride;
                    __m512 a = _mm512_mul_ps(_mm512_loadu_ps(qg), k0);
                    a = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16), k1, a);
                    a = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 32), k2, a);
                    a = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 48), k3, a);
                    scores[g * s_stride + t0 + o] = _mm512_reduce_add_ps(a) * scale;
                }
            }
            continue;
        }
#endif
        for (int64_t o = 0; o < m; o++) {
            const float *krow = kb + o * d;
            for (int64_t g = 0; g < g_count; g++) {
                const float *qg = q + g * q_stride;
                float a = 0.0f;
#pragma omp simd reduction(+ : a)
                for (int64_t j = 0; j < d; j++) a += qg[j] * krow[j];
                scores[g * s_stride + t0 + o] = a * scale;
            }
        }
    }
    float inv[64];
    for (int64_t g = 0; g < g_count; g++) {
        int64_t len = limit ? limit[g] : n;
        inv[g] = softmax_unnormalised(scores + g * s_stride, len);
        for (int64_t t = len; t < n; t++) scores[g * s_stride + t] = 0.0f;
    }
    memset(acc, 0, (size_t)(g_count * d) * sizeof(float));
    for (int64_t t0 = 0; t0 < n; t0 += bs) {
        const int64_t blk = table[t0 / bs];
        const int64_t m = n - t0 < bs ? n - t0 : bs;
        const float *vb = vc + blk * bs * d;
        for (int64_t o = 0; o < m; o++) {
            const float *vrow = vb + o * d;
            for (int64_t g = 0; g < g_count; g++) {
                const float p = scores[g * s_stride + t0 + o];
                float *ag = acc + g * d;
#pragma omp simd
                for (int64_t j = 0; j < d; j++) ag[j] += p * vrow[j];
            }
        }
    }
    for (int64_t g = 0; g < g_count; g++) {
        float *og = out + g * out_stride;
        const float *ag = acc + g * d;
        const float w = inv[g];
#pragma omp simd
        for (int64_t j = 0; j < d; j++) og[j] = ag[j] * w;
    }
}


/* attend_group with head_dim a compile-time constant (the common 64 and 128): the compiler
 * unrolls the head_dim loops into whole vector registers. */
#define ATTEND_FIXED(D)                                                                    \
    static void attend_group_d##D(const float *q, int64_t q_stride, int64_t g_count,      \
                                  const float *kc, const float *vc, const int64_t *table, \
                                  int64_t bs, int64_t n, const int64_t *limit,            \
                                  float scale, float *scores, int64_t s_stride,           \
                                  float *acc, float *out, int64_t out_stride) {           \
        attend_group(q, q_stride, g_count, kc, vc, table, bs, D, n, limit, scale, scores, \
                     s_stride, acc, out, out_stride);                                     \
    }
ATTEND_FIXED(64)
ATTEND_FIXED(128)

static void attend_group_any(const float *q, int64_t q_stride, int64_t g_count,
                             const float *kc, const float *vc, const int64_t *table,
                             int64_t bs, int64_t d, int64_t n, const int64_t *limit,
                             float scale, float *scores, int64_t s_stride, float *acc,
                             float *out, int64_t out_stride) {
    if (d == 64)
        attend_group_d64(q, q_stride, g_count, kc, vc, table, bs, n, limit, scale, scores,
                         s_stride, acc, out, out_stride);
    else if (d == 128)
        attend_group_d128(q, q_stride, g_count, kc, vc, table, bs, n, limit, scale, scores,
                          s_stride, acc, out, out_stride);
    else
        attend_group(q, q_stride, g_count, kc, vc, table, bs, d, n, limit, scale, scores,
                     s_stride, acc, out, out_stride);
}

#include "kernels_attn512.c"

/* Decode attention: one query per sequence over its paged context.
 * q       [num_seqs, heads, d] (token stride q_stride floats, heads contiguous)
 * cache   one layer's K plane followed by its V plane (see the header)
 * tables  [num_seqs, table_stride] int64 block ids; ctx_lens [num_seqs] tokens (incl. the
 *         new one, already written to the cache)
 * out     [num_seqs, heads, d] contiguous.
 * Returns 0, or -1 when a scratch allocation fails or heads > 64 * kv_heads. */
/* Decode attention splits its (sequence, KV head) items over `threads` OpenMP threads (each
 * with its own scratch) once the keys read reach this many floats per K or V plane: a decode
 * step's attention reads every context token's K and V, memory-bound, and a second core
 * brings its own share of the bandwidth. Items are independent, so the bits do not change. */
#define PMK_DEC_PAR_MIN_WORK 65536

int pmk_paged_decode_f32(const float *q, int64_t q_stride, const float *cache,
                         int64_t kv_heads, int64_t num_blocks, int64_t bs, int64_t d,
                         const int64_t *tables, int64_t table_stride, const int64_t *ctx_lens,
                         int64_t num_seqs, int64_t heads, float scale, float *out,
                         int64_t threads) {
    const int64_t g_count = heads / kv_heads;
    if (g_count > 64 || g_count * kv_heads != heads) return -1;
    int64_t max_ctx = 1, total_ctx = 0;
    for (int64_t b = 0; b < num_seqs; b++) {
        max_ctx = ctx_lens[b] > max_ctx ? ctx_lens[b] : max_ctx;
        total_ctx += ctx_lens[b];
    }
    const int64_t plane = kv_heads * num_blocks * bs * d, head_stride = num_blocks * bs * d;
    const int64_t items = num_seqs * kv_heads;
    int rc = 0;
#pragma omp parallel num_threads((int)threads) \
    if (threads > 1 && items > 1 && total_ctx * kv_heads * d >= PMK_DEC_PAR_MIN_WORK)
    {
        float *scores, *acc;
        int64_t s_stride;
        attn_scratch(g_count, max_ctx, d, &scores, &acc, &s_stride);
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; it++) {
            if (!scores || !acc) {
#pragma omp atomic write
                rc = -1;
                continue;
            }
            const int64_t b = it / kv_heads, kh = it % kv_heads, n = ctx_lens[b];
#ifdef __AVX512F__
            if (d == 64 && g_count <= 4) {
                attend_decode64(q + b * q_stride + kh * g_count * d, g_count,
                                cache + kh * head_stride, cache + plane + kh * head_stride,
                                tables + b * table_stride, bs, n, scale, scores, s_stride,
                                out + (b * heads + kh * g_count) * d);
                continue;
            }
#endif
            attend_group_any(q + b * q_stride + kh * g_count * d, d, g_count,
                         cache + kh * head_stride, cache + plane + kh * head_stride,
                         tables + b * table_stride, bs, d, n, NULL, scale,
                         scores, s_stride, acc, out + (b * heads + kh * g_count) * d, d);
        }
        free(scores);
        free(acc);
    }
    return rc;
}

/* RMSNorm of rows: out[r] = w * (x[r] / sqrt(mean(x[r]^2) + eps)), float32 throughout
 * (as Hugging Face's LlamaRMSNorm for float32 inputs). x rows at x_stride floats; out
 * contiguous [rows, dim]. */
/* Rows of the row-wise kernels (RMSNorm, RoPE + K/V write, SiLU-multiply) go over `threads`
 * OpenMP threads (torch's, see pmk_prefill_threads_inside) from this many floats of work. */
#define PMK_PAR_MIN_WORK 32768

void pmk_rms_norm_f32(const float *x, int64_t rows, int64_t dim, int64_t x_stride,
                      const float *w, float eps, float *out, int64_t threads) {
#ifdef _OPENMP
#pragma omp parallel for if (threads > 1 && rows * dim >= PMK_PAR_MIN_WORK) \
    num_threads((int)threads)
#else
    (void)threads;
#endif
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * x_stride;
        float *orow = out + r * dim;
        float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (int64_t j = 0; j < dim; j++) ss += xr[j] * xr[j];
        const float inv = 1.0f / sqrtf(ss / (float)dim + eps);
#pragma omp simd
        for (int64_t j = 0; j < dim; j++) orow[j] = w[j] * (xr[j] * inv);
    }
}

/* Rotary embedding (Hugging Face's rotate_half form) applied in place to the q and k heads
 * of each token's fused qkv row, then the token's K (rotated) and V written to its slot of
 * one layer's paged cache.
 * qkv     [tokens, row_stride] float32: heads q heads, kv_heads k heads, kv_heads v heads,
 *         each d floats, contiguous in that order from the row start
 * cos_t, sin_t  [max_position, d] tables (the two halves equal); positions [tokens]
 * cache   K plane [kv_heads, num_blocks, bs, d] then the V plane; slots [tokens] int64
 *         (block * bs + offset). */
void pmk_rope_write_f32(float *qkv, int64_t tokens, int64_t row_stride, int64_t heads,
                        int64_t kv_heads, int64_t d, const int64_t *positions,
                        const float *cos_t, const float *sin_t, float *cache,
                        int64_t num_blocks, int64_t bs, const int64_t *slots,
                        int64_t threads) {
    const int64_t half = d / 2, plane = kv_heads * num_blocks * bs * d;
#ifdef _OPENMP
#pragma omp parallel for if (threads > 1 && tokens * row_stride >= PMK_PAR_MIN_WORK) \
    num_threads((int)threads)
#else
    (void)threads;
#endif
    for (int64_t t = 0; t < tokens; t++) {
        float *row = qkv + t * row_stride;
        const float *c = cos_t + positions[t] * d, *s = sin_t + positions[t] * d;
        for (int64_t h = 0; h < heads + kv_heads; h++) {
            float *x = row + h * d;
#pragma omp simd
            for (int64_t j = 0; j < half; j++) {
                const float x1 = x[j], x2 = x[j + half];
                x[j] = x1 * c[j] - x2 * s[j];
                x[j + half] = x2 * c[j + half] + x1 * s[j + half];
            }
        }
        const int64_t blk = slots[t] / bs, off = slots[t] % bs;
        for (int64_t h = 0; h < kv_heads; h++) {
            float *kdst = cache + ((h * num_blocks + blk) * bs + off) * d;
            memcpy(kdst, row + (heads + h) * d, (size_t)d * sizeof(float));
            memcpy(kdst + plane, row + (heads + kv_heads + h) * d, (size_t)d * sizeof(float));
        }
    }
}

#ifdef __AVX512F__
/* dst[i][c] = rows[c][col + i] for i, c < 16: a 16 x 16 block transposed in registers
 * (32-bit, then 64-bit interleaves, then two 128-bit lane shuffles); dst rows ds apart. */
static inline void transpose16_simd(const float *const *rows, int64_t col, float *dst,
                                      int64_t ds) {
    __m512 r[16], t[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_ps(rows[i] + col);
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        const __m512d a = _mm512_castps_pd(t[i]), b = _mm512_castps_pd(t[i + 1]),
                      c = _mm512_castps_pd(t[i + 2]), e = _mm512_castps_pd(t[i + 3]);
        r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
        r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
        r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, e));
        r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, e));
    }
    for (int h = 0; h < 16; h += 8)
        for (int i = 0; i < 4; i++) {
            t[h + i] = _mm512_shuffle_f32x4(r[h + i], r[h + i + 4], 0x88);
            t[h + i + 4] = _mm512_shuffle_f32x4(r[h + i], r[h + i + 4], 0xdd);
        }
    for (int i = 0; i < 8; i++) {
        _mm512_storeu_ps(dst + i * ds, _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88));
        _mm512_storeu_ps(dst + (i + 8) * ds, _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd));
    }
}

#define PF_VECS 6 /* query vectors (query row x head) per register tile */

/* Scores of PF_VECS query vectors against keys [0, nk) (nk rounded up to 16), reading the
 * transposed keys kt [d][ld]: s[v][k] = scale * q_v . k. One zmm of 16 keys per FMA: no
 * horizontal sums. */
static void qk_tile_simd(const float *const *qv, const float *kt, int64_t ld, int64_t d,
                           int64_t nk, float scale, float *s, int64_t s_stride) {
    const __m512 sc = _mm512_set1_ps(scale);
    int64_t k0 = 0;
    for (; k0 + 16 < nk; k0 += 32) { /* two tiles of 16 keys: 12 independent FMA chains */
        __m512 a[PF_VECS], b[PF_VECS];
        for (int v = 0; v < PF_VECS; v++) a[v] = b[v] = _mm512_setzero_ps();
        for (int64_t j = 0; j < d; j++) {
            const __m512 ka = _mm512_loadu_ps(kt + j * ld + k0);
            const __m512 kb = _mm512_loadu_ps(kt + j * ld + k0 + 16);
            for (int v = 0; v < PF_VECS; v++) {
                const __m512 qj = _mm512_set1_ps(qv[v][j]);
                a[v] = _mm512_fmadd_ps(qj, ka, a[v]);
                b[v] = _mm512_fmadd_ps(qj, kb, b[v]);
            }
        }
        for (int v = 0; v < PF_VECS; v++) {
            _mm512_storeu_ps(s + v * s_stride + k0, _mm512_mul_ps(a[v], sc));
            _mm512_storeu_ps(s + v * s_stride + k0 + 16, _mm512_mul_ps(b[v], sc));
        }
    }
    for (; k0 < nk; k0 += 16) {
        __m512 a[PF_VECS];
        for (int v = 0; v < PF_VECS; v++) a[v] = _mm512_setzero_ps();
        for (int64_t j = 0; j < d; j++) {
            const __m512 ka = _mm512_loadu_ps(kt + j * ld + k0);
            for (int v = 0; v < PF_VECS; v++)
                a[v] = _mm512_fmadd_ps(_mm512_set1_ps(qv[v][j]), ka, a[v]);
        }
        for (int v = 0; v < PF_VECS; v++)
            _mm512_storeu_ps(s + v * s_stride + k0, _mm512_mul_ps(a[v], sc));
    }
}

#include "kernels_flash512.c"
#endif

/* 1 when pmk_prefill_attn_f32 spreads head_dim d over its `threads` itself (the blocked
 * AVX-512 path in a build with OpenMP), else 0 (the caller splits rows over threads). */
int pmk_prefill_threads_inside(int64_t d) {
#if defined(__AVX512F__) && defined(_OPENMP)
    return d == 64;
#else
    (void)d;
    return 0;
#endif
}

/* Causal prefill attention of one sequence's chunk over its paged context, read in place.
 * The chunk's n queries sit at positions ctx - n .. ctx - 1 (their K/V already written);
 * query i attends to keys 0 .. ctx - n + i.
 * q    [n, heads, d] at token stride q_stride (heads contiguous)
 * out  [n, heads, d] at token stride out_stride
 * threads: OpenMP threads the call may use (see pmk_prefill_threads_inside).
 * Returns 0, or -1 when scratch memory cannot be allocated or heads > 64 * kv_heads. */
int pmk_prefill_attn_f32(const float *q, int64_t q_stride, int64_t n, const float *cache,
                         int64_t kv_heads, int64_t num_blocks, int64_t bs, int64_t d,
                         const int64_t *table, int64_t ctx, int64_t heads, float scale,
                         float *out, int64_t out_stride, int64_t threads) {
    const int64_t g_count = heads / kv_heads;
    if (g_count > 64 || g_count * kv_heads != heads || n > ctx) return -1;
    const int64_t plane = kv_heads * num_blocks * bs * d, head_stride = num_blocks * bs * d;
#ifdef __AVX512F__
    if (d == 64)
        return prefill_attn64_flash(q, q_stride, n, cache, kv_heads, num_blocks, bs, table, ctx,
                                    g_count, scale, out, out_stride, threads);
#endif
    (void)threads;
#if defined(PMK_AVX2)
    if (d == 64) {
        const int64_t ld = (ctx + 15) / 16 * 16;
        float *kt = aligned_alloc(64, (size_t)(d * ld) * sizeof(float));
        float *s = aligned_alloc(64, (size_t)(PF_VECS * ld) * sizeof(float));
        float *zero = calloc((size_t)d, sizeof(float));
        if (!kt || !s || !zero) { free(kt); free(s); free(zero); return -1; }
        const int64_t nvec = n * g_count;
        for (int64_t kh = 0; kh < kv_heads; kh++) {
            const float *kc = cache + kh * head_stride, *vc = cache + plane + kh * head_stride;
            for (int64_t k0 = 0; k0 < ld; k0 += 16) { /* transpose K: kt[j][k] */
                const float *rows[16];
                for (int i = 0; i < 16; i++) {
                    const int64_t k = k0 + i;
                    rows[i] = k < ctx ? kc + (table[k / bs] * bs + k % bs) * d : zero;
                }
                for (int64_t j0 = 0; j0 < d; j0 += 16)
                    transpose16_simd(rows, j0, kt + j0 * ld + k0, ld);
            }
            for (int64_t v0 = 0; v0 < nvec; v0 += PF_VECS) {
                const float *qv[PF_VECS];
                float *ov[PF_VECS];
                int64_t len[PF_VECS];
                float inv[PF_VECS];
                int64_t nk = 0;
                for (int v = 0; v < PF_VECS; v++) {
                    const int64_t vi = v0 + v;
                    if (vi < nvec) {
                        const int64_t i = vi / g_count, g = vi % g_count;
                        qv[v] = q + i * q_stride + (kh * g_count + g) * d;
                        ov[v] = out + i * out_stride + (kh * g_count + g) * d;
                        len[v] = ctx - n + i + 1;
                        nk = len[v] > nk ? len[v] : nk;
                    } else {
                        qv[v] = zero; ov[v] = NULL; len[v] = 0;
                    }
                }
                qk_tile_simd(qv, kt, ld, d, nk, scale, s, ld);
                for (int v = 0; v < PF_VECS; v++) {
                    float *sv = s + v * ld;
                    if (len[v] == 0) { memset(sv, 0, (size_t)nk * sizeof(float)); inv[v] = 0.0f; continue; }
                    inv[v] = softmax_unnormalised(sv, len[v]);
                    for (int64_t k = len[v]; k < nk; k++) sv[k] = 0.0f;
                }
                pv_tile64_simd(s, ld, vc, table, bs, nk, inv, ov);
            }
        }
        free(kt); free(s); free(zero);
        return 0;
    }
#endif
    float *scores, *acc;
    int64_t s_stride;
    attn_scratch(g_count, ctx, d, &scores, &acc, &s_stride);
    if (!scores || !acc) { free(scores); free(acc); return -1; }
    for (int64_t i = 0; i < n; i++) {
        const int64_t len = ctx - n + i + 1;
        for (int64_t kh = 0; kh < kv_heads; kh++)
            attend_group_any(q + i * q_stride + kh * g_count * d, d, g_count,
                             cache + kh * head_stride, cache + plane + kh * head_stride, table,
                             bs, d, len, NULL, scale, scores, s_stride, acc,
                             out + i * out_stride + kh * g_count * d, d);
    }
    free(scores);
    free(acc);
    return 0;
}

/* The end of a one-row GEMV: y[o] for rows [o0, n_out) the SIMD loops left (one scalar
 * sum each), then + bias, then + residual over all n_out (either may be NULL). Shared by
 * pmk_gemv_f32 and pmk_gemv_rows_f32 so both sum a row the same way. */
static inline void gemv_finish(const float *w, const float *x, int64_t o0, int64_t n_out,
                               int64_t k, const float *bias, const float *residual,
                               float *y) {
    for (int64_t o = o0; o < n_out; o++) {
        const float *wr = w + o * k;
        float a = 0.0f;
#pragma omp simd reduction(+ : a)
        for (int64_t j = 0; j < k; j++) a += wr[j] * x[j];
        y[o] = a;
    }
    if (bias)
        for (int64_t i = 0; i < n_out; i++) y[i] += bias[i];
    if (residual)
        for (int64_t i = 0; i < n_out; i++) y[i] += residual[i];
}

#ifdef __AVX512F__
/* Weight rows [o0, o0 + 4) against R <= 4 input rows: every weight vector loaded once for
 * the R rows (16 accumulators); per output one FMA chain over 16-float lanes, a masked
 * tail, one reduction. pmk_gemv_f32 runs it with R = 1, pmk_gemv_rows_f32
 * (kernels_decode.c) with R up to 4: the same sums, so a row's floats do not depend on
 * its batch. */
static inline void gemv4_rows512(const float *w, const float *x, const int R, int64_t k,
                                 int64_t o0, float *y, int64_t n_out) {
    const int64_t kv = k / 16 * 16;
    const __mmask16 tail = (__mmask16)((1u << (k - kv)) - 1u);
    const float *w0 = w + o0 * k, *w1 = w0 + k, *w2 = w1 + k, *w3 = w2 + k;
    __m512 a[4][4];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < 4; c++) a[r][c] = _mm512_setzero_ps();
#ifndef PMK_GEMV_NO_PREFETCH
    /* the weights ahead, four lines an iteration as this tile's 4 rows read four (without
     * it the GEMV streamed the tiny model's 1 KiB rows from DRAM at ~9 GB/s) */
    const uintptr_t pf = PMK_GEMV_PF_START(w0, 4 * k * (int64_t)sizeof(float));
#endif
    for (int64_t j = 0; j < kv; j += 16) {
#ifndef PMK_GEMV_NO_PREFETCH
        PMK_GEMV_PREFETCH4(pf + 16 * j);
#endif
        const __m512 v0 = _mm512_loadu_ps(w0 + j), v1 = _mm512_loadu_ps(w1 + j),
                     v2 = _mm512_loadu_ps(w2 + j), v3 = _mm512_loadu_ps(w3 + j);
        for (int r = 0; r < R; r++) {
            const __m512 xv = _mm512_loadu_ps(x + r * k + j);
            a[r][0] = _mm512_fmadd_ps(v0, xv, a[r][0]);
            a[r][1] = _mm512_fmadd_ps(v1, xv, a[r][1]);
            a[r][2] = _mm512_fmadd_ps(v2, xv, a[r][2]);
            a[r][3] = _mm512_fmadd_ps(v3, xv, a[r][3]);
        }
    }
    if (tail) {
        const __m512 v0 = _mm512_maskz_loadu_ps(tail, w0 + kv),
                     v1 = _mm512_maskz_loadu_ps(tail, w1 + kv),
                     v2 = _mm512_maskz_loadu_ps(tail, w2 + kv),
                     v3 = _mm512_maskz_loadu_ps(tail, w3 + kv);
        for (int r = 0; r < R; r++) {
            const __m512 xv = _mm512_maskz_loadu_ps(tail, x + r * k + kv);
            a[r][0] = _mm512_fmadd_ps(v0, xv, a[r][0]);
            a[r][1] = _mm512_fmadd_ps(v1, xv, a[r][1]);
            a[r][2] = _mm512_fmadd_ps(v2, xv, a[r][2]);
            a[r][3] = _mm512_fmadd_ps(v3, xv, a[r][3]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < 4; c++) y[r * n_out + o0 + c] = _mm512_reduce_add_ps(a[r][c]);
}
#endif

/* Input rows the decode GEMV's register tile reads each weight vector once for: 4 on
 * AVX-512 (gemv4_rows512), 1 elsewhere (kernels.decode_rows_max asks). */
int pmk_gemv_row_tile(void) {
#ifdef __AVX512F__
    return 4;
#else
    return 1;
#endif
}

/* Floats per vector of the hand-written SIMD decode GEMV: 16 on AVX-512 (gemv4_rows512),
 * 8 on AVX2 + FMA (gemv_rows_simd; both prefetch their weights), 1 where there is none
 * (gemv_finish's compiler-vectorised loop only, no prefetch). The rows bound for
 * memory-bound weights was measured on the first two only (kernels.decode_rows_max
 * asks). */
int pmk_gemv_lanes(void) {
#if defined(__AVX512F__)
    return 16;
#elif defined(PMK_AVX2)
    return 8;
#else
    return 1;
#endif
}

/* One-row GEMM (batch-1 decode), memory-bound: y[o] = W[o, :] . x (+ bias[o])
 * (+ residual[o]) for W [n_out, k] row-major float32, streamed once, four rows at a time.
 * bias and residual may be NULL. */
void pmk_gemv_f32(const float *w, const float *x, int64_t n_out, int64_t k,
                  const float *bias, const float *residual, float *y) {
    int64_t o = 0;
#ifdef PMK_AVX2
    o = gemv_rows_simd(w, x, n_out, k, y);
#endif
#ifdef __AVX512F__
    for (; o + 4 <= n_out; o += 4) gemv4_rows512(w, x, 1, k, o, y, n_out);
#endif
    gemv_finish(w, x, o, n_out, k, bias, residual, y);
}

/* SwiGLU's activation: out[i] = silu(gu[i]) * gu[n + i] for the fused gate|up row(s)
 * gu [rows, 2n] -> out [rows, n]; silu(g) = g / (1 + e^-g) with exp_neg on -|g|. */
void pmk_silu_mul_f32(const float *gu, int64_t rows, int64_t n, float *out, int64_t threads) {
#ifdef _OPENMP
#pragma omp parallel for if (threads > 1 && rows * n >= PMK_PAR_MIN_WORK) \
    num_threads((int)threads)
#else
    (void)threads;
#endif
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gu + r * 2 * n, *u = g + n;
        float *o = out + r * n;
        int64_t i0 = 0;
#ifdef PMK_VEXP
        i0 = silu_mul_row_avx2(g, u, n, o);
#endif
#pragma omp simd
        for (int64_t i = i0; i < n; i++) {
            const float x = g[i];
            const float e = exp_neg(x > 0.0f ? -x : x); /* e^-|x| */
            const float sig = (x > 0.0f ? 1.0f : e) / (1.0f + e); /* one division */
            o[i] = x * sig * u[i];
        }
    }
}

/* Greedy sampling: out[r] = the first index of the largest value of row r of x (rows at
 * `stride` floats, n values each), as torch.argmax answers; a row holding a NaN answers
 * its first NaN's index (torch.argmax counts NaN as the largest). Two vectorised passes:
 * the maximum (and whether a NaN is there), then the first 64-float chunk holding it. */
void pmk_argmax_rows_f32(const float *x, int64_t rows, int64_t n, int64_t stride,
                         int64_t *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * stride;
        float m = row[0];
        int nan = 0;
#pragma omp simd reduction(max : m) reduction(| : nan)
        for (int64_t t = 0; t < n; t++) {
            m = row[t] > m ? row[t] : m;
            nan |= row[t] != row[t];
        }
        int64_t best = 0;
        for (int64_t t0 = 0; t0 < n; t0 += 64) {
            const int64_t end = n - t0 < 64 ? n : t0 + 64;
            int hit = 0;
#pragma omp simd reduction(| : hit)
            for (int64_t t = t0; t < end; t++) hit |= nan ? row[t] != row[t] : row[t] == m;
            if (!hit) continue;
            for (best = t0; best < end; best++)
                if (nan ? row[best] != row[best] : row[best] == m) break;
            break;
        }
        out[r] = best;
    }
}

#include "kernels_decode.c"
