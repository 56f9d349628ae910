/* exp on eight lanes and what uses it (softmax, SiLU) for every CPU with AVX2 + FMA, AVX-512
 * ones included: GCC does not vectorise kernels.c's exp_neg loops, so without these the
 * softmax and the SiLU run one float at a time. #included by kernels.c, never compiled on
 * its own. */

/* exp_neg (kernels.c) on eight lanes: e^x for x <= 0, Cephes' expf, 0 below -87. */
static inline __m256 exp_neg8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.0f), magic = _mm256_set1_ps(12582912.0f);
    const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_max_ps(x, lo);
    const __m256 fn = _mm256_sub_ps(
        _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), magic), magic);
    const __m256 r = _mm256_fnmadd_ps(fn, _mm256_set1_ps(-2.12194440e-4f),
                                      _mm256_fnmadd_ps(fn, _mm256_set1_ps(0.693359375f), x));
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0f));
    const __m256i bits = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(fn), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(bits)));
}

/* softmax_unnormalised (kernels.c) eight lanes at a time: s[t] = e^(s[t] - max), returns
 * 1 / sum. */
static float softmax_unnormalised_avx2(float *s, int64_t n) {
    const int64_t nv = n / 8 * 8;
    float m = s[0];
    if (nv) {
        __m256 mv = _mm256_loadu_ps(s);
        for (int64_t t = 8; t < nv; t += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + t));
        float lanes[8];
        _mm256_storeu_ps(lanes, mv);
        for (int i = 0; i < 8; i++) m = lanes[i] > m ? lanes[i] : m;
    }
    for (int64_t t = nv; t < n; t++) m = s[t] > m ? s[t] : m;
    const __m256 mv = _mm256_set1_ps(m);
    __m256 sv = _mm256_setzero_ps();
    for (int64_t t = 0; t < nv; t += 8) {
        const __m256 e = exp_neg8(_mm256_sub_ps(_mm256_loadu_ps(s + t), mv));
        _mm256_storeu_ps(s + t, e);
        sv = _mm256_add_ps(sv, e);
    }
    float lanes[8], sum = 0.0f;
    _mm256_storeu_ps(lanes, sv);
    for (int i = 0; i < 8; i++) sum += lanes[i];
    if (nv < n) { /* the tail through the same lanes: zero-padded copy */
        float tail[8] = {0};
        for (int64_t t = nv; t < n; t++) tail[t - nv] = s[t];
        const __m256 e = exp_neg8(_mm256_sub_ps(_mm256_loadu_ps(tail), mv));
        _mm256_storeu_ps(tail, e);
        for (int64_t t = nv; t < n; t++) { s[t] = tail[t - nv]; sum += tail[t - nv]; }
    }
    return 1.0f / sum;
}

/* out[i] = silu(g[i]) * u[i] for i < n (silu_mul's row, kernels.c): e = e^-|g|,
 * sigmoid = (g > 0 ? 1 : e) / (1 + e). Returns the first index not done (n / 8 * 8). */
static int64_t silu_mul_row_avx2(const float *g, const float *u, int64_t n, float *out) {
    const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    const __m256 sign = _mm256_set1_ps(-0.0f);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 x = _mm256_loadu_ps(g + i);
        const __m256 e = exp_neg8(_mm256_or_ps(x, sign)); /* -|x| */
        const __m256 pos = _mm256_cmp_ps(x, zero, _CMP_GT_OQ);
        const __m256 sig = _mm256_div_ps(_mm256_blendv_ps(e, one, pos), _mm256_add_ps(one, e));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(x, sig), _mm256_loadu_ps(u + i)));
    }
    return i;
}
