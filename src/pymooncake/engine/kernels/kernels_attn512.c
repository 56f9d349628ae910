/* Decode attention for head_dim 64 and up to 4 query heads per KV head on AVX-512 (SmolLM2
 * and most Llama-family GQA models); #included by kernels.c, never compiled on its own.
 * Used by pmk_paged_decode_f32 (batched and batch-1 decode alike). */

#ifdef __AVX512F__
/* Lane 4i of the result (i < 4) = the sum of the 16 lanes of a_i: four horizontal sums in
 * five shuffles and four adds (four _mm512_reduce_add_ps take about twice that). */
static inline __m512 hsum4x16(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
    const __m512 t0 = _mm512_add_ps(_mm512_shuffle_f32x4(a0, a1, 0x44),
                                    _mm512_shuffle_f32x4(a0, a1, 0xEE));
    const __m512 t1 = _mm512_add_ps(_mm512_shuffle_f32x4(a2, a3, 0x44),
                                    _mm512_shuffle_f32x4(a2, a3, 0xEE));
    const __m512 u = _mm512_add_ps(_mm512_shuffle_f32x4(t0, t1, 0x88),
                                   _mm512_shuffle_f32x4(t0, t1, 0xDD));
    const __m512 x = _mm512_add_ps(u, _mm512_permute_ps(u, 0x4E));
    return _mm512_add_ps(x, _mm512_permute_ps(x, 0xB1));
}

/* attend_group for one decode query group, head_dim 64, g_count <= 4: scores of four keys
 * at a time (one hsum4x16 per query per four keys), P.V with the group's outputs in
 * registers; the next K block and the current V block prefetched (paged blocks sit at
 * random addresses). Same maths as attend_group; sums in another order (float32
 * rounding). */
static void attend_decode64(const float *q, int64_t g_count, const float *kc,
                            const float *vc, const int64_t *table, int64_t bs, int64_t n,
                            float scale, float *scores, int64_t s_stride, float *out) {
    __m512 qv[4][4];
    for (int64_t g = 0; g < 4; g++)
        for (int c = 0; c < 4; c++)
            qv[g][c] = g < g_count ? _mm512_loadu_ps(q + g * 64 + 16 * c) : _mm512_setzero_ps();
    const __m512 sc = _mm512_set1_ps(scale);
    for (int64_t t0 = 0; t0 < n; t0 += bs) {
        const int64_t m = n - t0 < bs ? n - t0 : bs;
        const float *kb = kc + table[t0 / bs] * bs * 64;
        const float *kn = t0 + bs < n ? kc + table[(t0 + bs) / bs] * bs * 64 : NULL;
        const float *vb = vc + table[t0 / bs] * bs * 64;
        int64_t o = 0;
        for (; o + 4 <= m; o += 4) {
            const float *k0 = kb + o * 64;
            for (int64_t i = o; i < o + 4; i++) /* spread over the block: few lines in flight */
                for (int c = 0; c < 64; c += 16) {
                    if (kn) _mm_prefetch((const char *)(kn + i * 64 + c), _MM_HINT_T0);
                    _mm_prefetch((const char *)(vb + i * 64 + c), _MM_HINT_T0);
                }
            for (int64_t g = 0; g < g_count; g++) {
                __m512 a[4];
                for (int i = 0; i < 4; i++) {
                    const float *kr = k0 + i * 64;
                    __m512 acc = _mm512_mul_ps(qv[g][0], _mm512_loadu_ps(kr));
                    acc = _mm512_fmadd_ps(qv[g][1], _mm512_loadu_ps(kr + 16), acc);
                    acc = _mm512_fmadd_ps(qv[g][2], _mm512_loadu_ps(kr + 32), acc);
                    a[i] = _mm512_fmadd_ps(qv[g][3], _mm512_loadu_ps(kr + 48), acc);
                }
                const __m512 sums = _mm512_mul_ps(hsum4x16(a[0], a[1], a[2], a[3]), sc);
                _mm_storeu_ps(scores + g * s_stride + t0 + o,
                              _mm512_castps512_ps128(_mm512_maskz_compress_ps(0x1111, sums)));
            }
        }
        for (; o < m; o++) {
            const float *kr = kb + o * 64;
            for (int c = 0; c < 64; c += 16) {
                if (kn) _mm_prefetch((const char *)(kn + o * 64 + c), _MM_HINT_T0);
                _mm_prefetch((const char *)(vb + o * 64 + c), _MM_HINT_T0);
            }
            for (int64_t g = 0; g < g_count; g++) {
                __m512 acc = _mm512_mul_ps(qv[g][0], _mm512_loadu_ps(kr));
                acc = _mm512_fmadd_ps(qv[g][1], _mm512_loadu_ps(kr + 16), acc);
                acc = _mm512_fmadd_ps(qv[g][2], _mm512_loadu_ps(kr + 32), acc);
                acc = _mm512_fmadd_ps(qv[g][3], _mm512_loadu_ps(kr + 48), acc);
                scores[g * s_stride + t0 + o] = _mm512_reduce_add_ps(acc) * scale;
            }
        }
    }
    float inv[4];
    for (int64_t g = 0; g < g_count; g++) inv[g] = softmax_unnormalised(scores + g * s_stride, n);
    __m512 acc[4][4];
    for (int g = 0; g < 4; g++)
        for (int c = 0; c < 4; c++) acc[g][c] = _mm512_setzero_ps();
    for (int64_t t0 = 0; t0 < n; t0 += bs) {
        const int64_t m = n - t0 < bs ? n - t0 : bs;
        const float *vb = vc + table[t0 / bs] * bs * 64;
        for (int64_t o = 0; o < m; o++) {
            const float *vr = vb + o * 64;
            const __m512 v0 = _mm512_loadu_ps(vr), v1 = _mm512_loadu_ps(vr + 16),
                         v2 = _mm512_loadu_ps(vr + 32), v3 = _mm512_loadu_ps(vr + 48);
            for (int64_t g = 0; g < g_count; g++) {
                const __m512 p = _mm512_set1_ps(scores[g * s_stride + t0 + o]);
                acc[g][0] = _mm512_fmadd_ps(p, v0, acc[g][0]);
                acc[g][1] = _mm512_fmadd_ps(p, v1, acc[g][1]);
                acc[g][2] = _mm512_fmadd_ps(p, v2, acc[g][2]);
                acc[g][3] = _mm512_fmadd_ps(p, v3, acc[g][3]);
            }
        }
    }
    for (int64_t g = 0; g < g_count; g++) {
        const __m512 w = _mm512_set1_ps(inv[g]);
        for (int c = 0; c < 4; c++)
            _mm512_storeu_ps(out + g * 64 + 16 * c, _mm512_mul_ps(acc[g][c], w));
    }
}
#endif
