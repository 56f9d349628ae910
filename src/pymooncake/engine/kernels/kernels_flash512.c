/* Causal prefill attention for head_dim 64 on AVX-512, blocked over keys with an online
 * softmax (FlashAttention's recurrence, Dao et al. 2022, §3.1; the K/V blocks are read in
 * place from the paged cache). #included by kernels.c after qk_tile_simd, never compiled on
 * its own.
 *
 * Why blocked: the unblocked tile walks the whole context's K^T and V for every 6 query
 * vectors; past ~3k tokens (K^T + V of one KV head > 1.5 MB) they no longer stay in L2 and
 * the kernel becomes bound by L3 (measured on this repo's Xeon: 9.3 cycles per score at
 * 6,000 context tokens against 5.8 at 1,024). Here a group of up to PF_QVECS query vectors
 * walks the keys in blocks of PF_KEYS (K^T block 64 KB + V 64 KB, L2-resident), so each
 * block is reused by the group's PF_QVECS / PF_VECS tiles. Per query vector the state is
 * (running max m, running sum l, unnormalised output acc[64]); a block updates it as
 * m' = max(m, max s), acc = acc * e^(m - m') + sum_k e^(s_k - m') v_k, l likewise, and the
 * output is acc / l. exp on 16 lanes (exp_neg16: the same Cephes polynomial as exp_neg).
 *
 * A query vector's arithmetic depends only on itself and the fixed block boundaries
 * (multiples of PF_KEYS), not on which rows share its group or tile, so a chunk cut into
 * runs of rows (kernels/parallel.py) gives bit-identical results. */
#ifdef __AVX512F__
#define PF_KEYS 256  /* keys per block */
#define PF_QVECS 192 /* query vectors per group (a multiple of PF_VECS) */

/* exp_neg on sixteen lanes: e^x for x <= 0, 0 below -87 (and for -inf). */
static inline __m512 exp_neg16(__m512 x) {
    const __m512 lo = _mm512_set1_ps(-87.0f), magic = _mm512_set1_ps(12582912.0f);
    const __mmask16 keep = _mm512_cmp_ps_mask(x, lo, _CMP_GE_OQ);
    x = _mm512_max_ps(x, lo);
    const __m512 fn = _mm512_sub_ps(
        _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), magic), magic);
    const __m512 r = _mm512_fnmadd_ps(fn, _mm512_set1_ps(-2.12194440e-4f),
                                      _mm512_fnmadd_ps(fn, _mm512_set1_ps(0.693359375f), x));
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
    const __m512i bits = _mm512_slli_epi32(
        _mm512_add_epi32(_mm512_cvtps_epi32(fn), _mm512_set1_epi32(127)), 23);
    return _mm512_maskz_mul_ps(keep, p, _mm512_castsi512_ps(bits));
}

/* One query vector's block of scores s[0..nk) (its first `valid` are unmasked): turns them
 * into e^(s - m') in place (0 past valid), updates *m and *l, returns e^(m - m'), the factor
 * its acc must be scaled by. valid == 0: no change, returns 1. */
static inline float online_softmax_row(float *s, int64_t valid, int64_t nk, float *m, float *l) {
    if (valid == 0) {
        memset(s, 0, (size_t)nk * sizeof(float));
        return 1.0f;
    }
    __m512 mv = _mm512_set1_ps(-INFINITY);
    int64_t k = 0;
    for (; k + 16 <= valid; k += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(s + k));
    const __mmask16 tail = (__mmask16)((1u << (valid - k)) - 1u);
    if (valid > k) mv = _mm512_mask_max_ps(mv, tail, mv, _mm512_maskz_loadu_ps(tail, s + k));
    const float bm = _mm512_reduce_max_ps(mv);
    const float m_new = bm > *m ? bm : *m;
    const float alpha = exp_neg(*m - m_new); /* *m = -inf on the first block: 0 */
    const __m512 mn = _mm512_set1_ps(m_new);
    __m512 sum = _mm512_setzero_ps();
    for (k = 0; k + 16 <= valid; k += 16) {
        const __m512 e = exp_neg16(_mm512_sub_ps(_mm512_loadu_ps(s + k), mn));
        _mm512_storeu_ps(s + k, e);
        sum = _mm512_add_ps(sum, e);
    }
    if (valid > k) {
        const __m512 e = _mm512_maskz_mov_ps(
            tail, exp_neg16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + k), mn)));
        _mm512_storeu_ps(s + k, e); /* s has room up to nk rounded up to 16 */
        sum = _mm512_add_ps(sum, e);
        k += 16;
    }
    for (; k < nk; k += 16) _mm512_storeu_ps(s + k, _mm512_setzero_ps());
    *l = *l * alpha + _mm512_reduce_add_ps(sum);
    *m = m_new;
    return alpha;
}

/* acc[v] = acc[v] * alpha[v] + sum_{k < nk} p[v][k] V[k0 + k] for PF_VECS vectors, V read in
 * place from this KV head's paged plane vc. */
static void pv_block64(const float *p, int64_t p_stride, const float *vc, const int64_t *table,
                       int64_t bs, int64_t k0, int64_t nk, const float *alpha,
                       float *const *acc) {
    __m512 a[PF_VECS][4];
    for (int v = 0; v < PF_VECS; v++) {
        const __m512 w = _mm512_set1_ps(alpha[v]);
        for (int c = 0; c < 4; c++) a[v][c] = _mm512_mul_ps(_mm512_loadu_ps(acc[v] + 16 * c), w);
    }
    for (int64_t k = 0; k < nk;) {
        const int64_t key = k0 + k, off = key % bs;
        const int64_t m = bs - off < nk - k ? bs - off : nk - k; /* keys left in this block */
        const float *vb = vc + (table[key / bs] * bs + off) * 64;
        for (int64_t o = 0; o < m; o++) {
            const float *vrow = vb + o * 64;
            const __m512 v0 = _mm512_loadu_ps(vrow), v1 = _mm512_loadu_ps(vrow + 16),
                         v2 = _mm512_loadu_ps(vrow + 32), v3 = _mm512_loadu_ps(vrow + 48);
            for (int v = 0; v < PF_VECS; v++) {
                const __m512 w = _mm512_set1_ps(p[v * p_stride + k + o]);
                a[v][0] = _mm512_fmadd_ps(w, v0, a[v][0]);
                a[v][1] = _mm512_fmadd_ps(w, v1, a[v][1]);
                a[v][2] = _mm512_fmadd_ps(w, v2, a[v][2]);
                a[v][3] = _mm512_fmadd_ps(w, v3, a[v][3]);
            }
        }
        k += m;
    }
    for (int v = 0; v < PF_VECS; v++)
        for (int c = 0; c < 4; c++) _mm512_storeu_ps(acc[v] + 16 * c, a[v][c]);
}

/* Scratch of one thread: K^T of a block, a tile's scores, a group's state. */
struct flash_scratch {
    float *kt, *s, *acc, *m, *l, *zero;
};

static int flash_scratch_alloc(struct flash_scratch *w) {
    w->kt = aligned_alloc(64, (size_t)(64 * PF_KEYS) * sizeof(float));
    w->s = aligned_alloc(64, (size_t)(PF_VECS * PF_KEYS) * sizeof(float));
    w->acc = aligned_alloc(64, (size_t)((PF_QVECS + PF_VECS) * 64) * sizeof(float));
    w->m = malloc((size_t)(2 * (PF_QVECS + PF_VECS)) * sizeof(float));
    w->zero = calloc(64, sizeof(float));
    w->l = w->m ? w->m + PF_QVECS + PF_VECS : NULL;
    return w->kt && w->s && w->acc && w->m && w->zero ? 0 : -1;
}

static void flash_scratch_free(struct flash_scratch *w) {
    free(w->kt); free(w->s); free(w->acc); free(w->m); free(w->zero);
}

/* Query vectors g0 .. g0 + gn - 1 (vector = row * g_count + head in group) of KV head kh. */
static void flash_group(const float *q, int64_t q_stride, int64_t n, const float *kc,
                        const float *vc, int64_t bs, const int64_t *table, int64_t ctx,
                        int64_t kh, int64_t g_count, int64_t g0, int64_t gn, float scale,
                        float *out, int64_t out_stride, struct flash_scratch *w) {
    const int64_t d = 64;
    const int64_t glen = ctx - n + (g0 + gn - 1) / g_count + 1; /* the longest row's keys */
    float *kt = w->kt, *s = w->s, *acc = w->acc, *mrun = w->m, *lrun = w->l;
    for (int64_t v = 0; v < gn + PF_VECS; v++) mrun[v] = -INFINITY, lrun[v] = 0.0f;
    memset(acc, 0, (size_t)((gn + PF_VECS) * d) * sizeof(float));
    for (int64_t k0 = 0; k0 < glen; k0 += PF_KEYS) {
        const int64_t kb = glen - k0 < PF_KEYS ? glen - k0 : PF_KEYS;
        for (int64_t t = 0; t < kb; t += 16) { /* K^T of the block: kt[j][k] */
            const float *rows[16];
            for (int i = 0; i < 16; i++) {
                const int64_t key = k0 + t + i;
                rows[i] = key < ctx ? kc + (table[key / bs] * bs + key % bs) * d : w->zero;
            }
            for (int64_t j0 = 0; j0 < d; j0 += 16)
                transpose16_simd(rows, j0, kt + j0 * PF_KEYS + t, PF_KEYS);
        }
        for (int64_t t0 = 0; t0 < gn; t0 += PF_VECS) {
            const float *qv[PF_VECS];
            float *av[PF_VECS];
            int64_t len[PF_VECS], tl = 0;
            float alpha[PF_VECS];
            for (int v = 0; v < PF_VECS; v++) {
                const int64_t vi = g0 + t0 + v;
                av[v] = acc + (t0 + v) * d;
                if (t0 + v < gn) {
                    const int64_t i = vi / g_count, g = vi % g_count;
                    qv[v] = q + i * q_stride + (kh * g_count + g) * d;
                    len[v] = ctx - n + i + 1;
                } else {
                    qv[v] = w->zero; len[v] = 0;
                }
                tl = len[v] > tl ? len[v] : tl;
            }
            if (tl <= k0) continue; /* every row of the tile ends before this block */
            const int64_t nk = tl - k0 < kb ? tl - k0 : kb;
            qk_tile_simd(qv, kt, PF_KEYS, d, nk, scale, s, PF_KEYS);
            for (int v = 0; v < PF_VECS; v++) {
                int64_t valid = len[v] - k0;
                valid = valid < 0 ? 0 : valid > nk ? nk : valid;
                alpha[v] = online_softmax_row(s + v * PF_KEYS, valid, nk, mrun + t0 + v,
                                              lrun + t0 + v);
            }
            pv_block64(s, PF_KEYS, vc, table, bs, k0, nk, alpha, av);
        }
    }
    for (int64_t v = 0; v < gn; v++) {
        const int64_t vi = g0 + v, i = vi / g_count, g = vi % g_count;
        float *o = out + i * out_stride + (kh * g_count + g) * d;
        const __m512 wv = _mm512_set1_ps(1.0f / lrun[v]);
        for (int c = 0; c < 4; c++)
            _mm512_storeu_ps(o + 16 * c, _mm512_mul_ps(_mm512_loadu_ps(acc + v * d + 16 * c), wv));
    }
}

/* Query vectors per group for nvec vectors, kv_heads KV heads, `threads` threads: PF_QVECS,
 * or, where that leaves fewer than PF_ITEMS_PER_THREAD items (KV head x group) per thread,
 * smaller groups (a multiple of PF_VECS, at least PF_MIN_QVECS) so every thread gets about
 * equal work. A 64-token chunk of a 9-head / 3-KV-head model is 192 vectors: one group per
 * KV head gave 3 items on 2 threads, one thread idle a third of the time. Each group
 * transposes the K blocks it reads once more; from PF_MIN_QVECS vectors on that is a few
 * percent of its QK^T. The group size never changes a vector's arithmetic (see the top). */
#define PF_ITEMS_PER_THREAD 6
#define PF_MIN_QVECS 24
int64_t pmk_flash_group_vecs(int64_t nvec, int64_t kv_heads, int64_t threads) {
    if (threads <= 1 || nvec <= 0 || kv_heads <= 0) return PF_QVECS;
    const int64_t per_head = (PF_ITEMS_PER_THREAD * threads + kv_heads - 1) / kv_heads;
    int64_t g = (nvec + per_head - 1) / per_head;
    g = (g + PF_VECS - 1) / PF_VECS * PF_VECS;
    if (g < PF_MIN_QVECS) g = PF_MIN_QVECS;
    return g < PF_QVECS ? g : PF_QVECS;
}

/* pmk_prefill_attn_f32's d == 64 path (same arguments; g_count checked by the caller). The
 * (KV head, group) items run on up to `threads` OpenMP threads (the OpenMP runtime torch
 * loaded: the same threads as its GEMMs), the costliest groups (the last rows) first. */
static int prefill_attn64_flash(const float *q, int64_t q_stride, int64_t n, const float *cache,
                                int64_t kv_heads, int64_t num_blocks, int64_t bs,
                                const int64_t *table, int64_t ctx, int64_t g_count, float scale,
                                float *out, int64_t out_stride, int64_t threads) {
    const int64_t d = 64, plane = kv_heads * num_blocks * bs * d;
    const int64_t head_stride = num_blocks * bs * d, nvec = n * g_count;
    const int64_t gq = pmk_flash_group_vecs(nvec, kv_heads, threads);
    const int64_t ngroups = (nvec + gq - 1) / gq, items = kv_heads * ngroups;
    int rc = 0;
#ifdef _OPENMP
#pragma omp parallel num_threads(threads > 1 && items > 1 ? (int)threads : 1) reduction(| : rc)
#endif
    {
        struct flash_scratch w;
        const int ok = flash_scratch_alloc(&w) == 0;
        rc |= ok ? 0 : -1;
#ifdef _OPENMP
#pragma omp for schedule(dynamic, 1)
#endif
        for (int64_t it = 0; it < items; it++) {
            const int64_t gi = ngroups - 1 - it / kv_heads, kh = it % kv_heads;
            const int64_t g0 = gi * gq, gn = nvec - g0 < gq ? nvec - g0 : gq;
            if (ok)
                flash_group(q, q_stride, n, cache + kh * head_stride,
                            cache + plane + kh * head_stride, bs, table, ctx, kh, g_count, g0,
                            gn, scale, out, out_stride, &w);
        }
        flash_scratch_free(&w);
    }
    return rc;
}
#endif
