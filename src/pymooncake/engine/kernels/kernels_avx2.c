/* AVX2 + FMA kernels for CPUs without AVX-512 (e.g. AMD Zen 3); #included by kernels.c,
 * never compiled on its own. Same maths and tiling as the AVX-512 code there, 8-float
 * vectors: the causal prefill attention tiles (scores of PF_VECS query vectors against 16
 * transposed keys, no horizontal sums; P.V with head_dim 64 in two 32-float halves) and
 * the one-row GEMV (8 rows at a time, one FMA chain per row, one shared x load). */

#define PF_VECS 6 /* query vectors (query row x head) per register tile */

/* dst[i][c] = rows[c][col + i] for i, c < 16 (dst rows ds apart). Scalar: K is
 * transposed once per KV head, a small cost beside the tiles. */
static inline void transpose16_simd(const float *const *rows, int64_t col, float *dst,
                                    int64_t ds) {
    for (int i = 0; i < 16; i++)
        for (int c = 0; c < 16; c++) dst[i * ds + c] = rows[c][col + i];
}

/* s[v][k] = scale * q_v . k for keys [0, nk) rounded up to 16, from kt [d][ld]. */
static void qk_tile_simd(const float *const *qv, const float *kt, int64_t ld, int64_t d,
                         int64_t nk, float scale, float *s, int64_t s_stride) {
    const __m256 sc = _mm256_set1_ps(scale);
    for (int64_t k0 = 0; k0 < nk; k0 += 16) { /* 12 independent FMA chains */
        __m256 a[PF_VECS], b[PF_VECS];
        for (int v = 0; v < PF_VECS; v++) a[v] = b[v] = _mm256_setzero_ps();
        for (int64_t j = 0; j < d; j++) {
            const __m256 ka = _mm256_loadu_ps(kt + j * ld + k0);
            const __m256 kb = _mm256_loadu_ps(kt + j * ld + k0 + 8);
            for (int v = 0; v < PF_VECS; v++) {
                const __m256 qj = _mm256_broadcast_ss(qv[v] + j);
                a[v] = _mm256_fmadd_ps(qj, ka, a[v]);
                b[v] = _mm256_fmadd_ps(qj, kb, b[v]);
            }
        }
        for (int v = 0; v < PF_VECS; v++) {
            _mm256_storeu_ps(s + v * s_stride + k0, _mm256_mul_ps(a[v], sc));
            _mm256_storeu_ps(s + v * s_stride + k0 + 8, _mm256_mul_ps(b[v], sc));
        }
    }
}

/* o_v = inv[v] * sum_k p[v][k] * V[k] for PF_VECS vectors, head_dim 64, keys [0, nk) read
 * in place from the paged V plane (vc: this KV head's [num_blocks, bs, 64]); p rows are 0
 * past each vector's own length. Three vectors x 32 floats per pass (12 accumulators). */
static void pv_tile64_simd(const float *p, int64_t p_stride, const float *vc,
                           const int64_t *table, int64_t bs, int64_t nk, const float *inv,
                           float *const *ov) {
    for (int vg = 0; vg < PF_VECS; vg += 3)
        for (int hf = 0; hf < 64; hf += 32) {
            __m256 acc[3][4];
            for (int v = 0; v < 3; v++)
                for (int c = 0; c < 4; c++) acc[v][c] = _mm256_setzero_ps();
            for (int64_t k0 = 0; k0 < nk; k0 += bs) {
                const float *vb = vc + table[k0 / bs] * bs * 64 + hf;
                const int64_t m = nk - k0 < bs ? nk - k0 : bs;
                for (int64_t o = 0; o < m; o++) {
                    const float *vrow = vb + o * 64;
                    const float *pk = p + vg * p_stride + k0 + o;
                    const __m256 v0 = _mm256_loadu_ps(vrow), v1 = _mm256_loadu_ps(vrow + 8),
                                 v2 = _mm256_loadu_ps(vrow + 16), v3 = _mm256_loadu_ps(vrow + 24);
                    for (int v = 0; v < 3; v++) {
                        const __m256 w = _mm256_broadcast_ss(pk + v * p_stride);
                        acc[v][0] = _mm256_fmadd_ps(w, v0, acc[v][0]);
                        acc[v][1] = _mm256_fmadd_ps(w, v1, acc[v][1]);
                        acc[v][2] = _mm256_fmadd_ps(w, v2, acc[v][2]);
                        acc[v][3] = _mm256_fmadd_ps(w, v3, acc[v][3]);
                    }
                }
            }
            for (int v = 0; v < 3; v++) {
                float *o = ov[vg + v];
                if (!o) continue;
                const __m256 w = _mm256_set1_ps(inv[vg + v]);
                for (int c = 0; c < 4; c++)
                    _mm256_storeu_ps(o + hf + 8 * c, _mm256_mul_ps(acc[v][c], w));
            }
        }
}

/* The sums of eight vectors: lane i of the result = horizontal sum of a[i]. */
static inline __m256 hsum8x8(const __m256 *a) {
    const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                         _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* y[o] = W[o, :] . x for rows [0, n_out / 8 * 8), eight rows at a time (eight independent
 * FMA chains sharing each x load); returns the first row not done. */
static int64_t gemv_rows_simd(const float *w, const float *x, int64_t n_out, int64_t k,
                              float *y) {
    const int64_t kv = k / 8 * 8;
    int64_t o = 0;
    for (; o + 8 <= n_out; o += 8) {
        const float *r = w + o * k;
#ifndef PMK_GEMV_NO_PREFETCH
        /* the weights ahead, four lines an iteration as the 8 rows read four (kernels.c) */
        const uintptr_t pf = PMK_GEMV_PF_START(r, 8 * k * (int64_t)sizeof(float));
#endif
        __m256 a[8];
        for (int i = 0; i < 8; i++) a[i] = _mm256_setzero_ps();
        for (int64_t j = 0; j < kv; j += 8) {
#ifndef PMK_GEMV_NO_PREFETCH
            PMK_GEMV_PREFETCH4(pf + 32 * j);
#endif
            const __m256 xv = _mm256_loadu_ps(x + j);
            for (int i = 0; i < 8; i++)
                a[i] = _mm256_fmadd_ps(_mm256_loadu_ps(r + i * k + j), xv, a[i]);
        }
        _mm256_storeu_ps(y + o, hsum8x8(a));
        for (int64_t j = kv; j < k; j++)
            for (int i = 0; i < 8; i++) y[o + i] += r[i * k + j] * x[j];
    }
    return o;
}
