/* One decoder layer of a one-token step (batch-1 decode) in one call; #included at the end
 * of kernels.c, never compiled on its own. The same kernels in the same order as
 * engine/model/fused.py's per-call path (so the same float32 results): RMSNorm, the qkv
 * GEMV (+ bias), RoPE + the K/V write, paged decode attention, the o GEMV + residual,
 * RMSNorm, the gate|up GEMV, SiLU-multiply, the down GEMV + residual.
 *
 * lp  the layer's plan, int64 [DL_PLAN]: weight addresses (a bias address may be 0) and
 *     sizes, built once per model (engine/kernels/__init__.py, decode_plan)
 * st  the step, int64 [DL_STEP]: position, slot, block-table address, context length
 *     (incl. this token), RoPE cos and sin table addresses
 * x   the residual stream [hidden], updated in place
 * scratch  room for hidden + qkv + heads * d + 2 * inter + inter + hidden floats
 * Returns pmk_paged_decode_f32's code (0, or -1 on a failed scratch allocation). */
enum { DL_IN_NORM, DL_QKV_W, DL_QKV_B, DL_O_W, DL_POST_NORM, DL_GU_W, DL_DOWN_W, DL_CACHE,
       DL_HIDDEN, DL_HEADS, DL_KV_HEADS, DL_D, DL_INTER, DL_BLOCKS, DL_BS, DL_PLAN };
enum { DS_POS, DS_SLOT, DS_TABLE, DS_CTX, DS_COS, DS_SIN, DL_STEP };

int pmk_decode_layer_f32(const int64_t *lp, const int64_t *st, float eps, float scale,
                         float *x, float *scratch) {
#define P(i) ((float *)(intptr_t)lp[i])
    const int64_t hidden = lp[DL_HIDDEN], heads = lp[DL_HEADS], kvh = lp[DL_KV_HEADS];
    const int64_t d = lp[DL_D], inter = lp[DL_INTER], nb = lp[DL_BLOCKS], bs = lp[DL_BS];
    const int64_t qkv_n = (heads + 2 * kvh) * d, q_n = heads * d;
    float *h = scratch, *qkv = h + hidden, *att = qkv + qkv_n, *gu = att + q_n;
    float *act = gu + 2 * inter, *tmp = act + inter;
    float *cache = P(DL_CACHE);
    pmk_rms_norm_f32(x, 1, hidden, hidden, P(DL_IN_NORM), eps, h, 1);
    pmk_gemv_f32(P(DL_QKV_W), h, qkv_n, hidden, P(DL_QKV_B), NULL, qkv);
    pmk_rope_write_f32(qkv, 1, qkv_n, heads, kvh, d, &st[DS_POS],
                       (const float *)(intptr_t)st[DS_COS], (const float *)(intptr_t)st[DS_SIN],
                       cache, nb, bs, &st[DS_SLOT], 1);
    const int rc = pmk_paged_decode_f32(qkv, qkv_n, cache, kvh, nb, bs, d,
                                        (const int64_t *)(intptr_t)st[DS_TABLE], 0,
                                        &st[DS_CTX], 1, heads, scale, att, 1);
    pmk_gemv_f32(P(DL_O_W), att, hidden, q_n, NULL, x, tmp);
    memcpy(x, tmp, (size_t)hidden * sizeof(float));
    pmk_rms_norm_f32(x, 1, hidden, hidden, P(DL_POST_NORM), eps, h, 1);
    pmk_gemv_f32(P(DL_GU_W), h, 2 * inter, hidden, NULL, NULL, gu);
    pmk_silu_mul_f32(gu, 1, inter, act, 1);
    pmk_gemv_f32(P(DL_DOWN_W), act, hidden, inter, NULL, x, tmp);
    memcpy(x, tmp, (size_t)hidden * sizeof(float));
    return rc;
#undef P
}

/* y[r] = W . x[r] (+ bias) (+ residual[r]) for m input rows, every output the sum
 * pmk_gemv_f32 makes for that row alone, in its order: a row's floats do not depend on m
 * or on the other rows (a decode batch is batch-invariant). AVX-512: gemv4_rows512 (the
 * one-row GEMV's own tile) over up to 4 input rows, each weight vector loaded once per 4
 * rows, the row groups inside each weight tile (a decode batch streams the weights from
 * memory once, not m times). Elsewhere: pmk_gemv_f32 per row
 * over output tiles of at most GEMV_TILE_FLOATS weights (each tile then read from L2
 * for the later rows; tiles start at multiples of 8 rows, so the 8-row groups of the
 * AVX2 GEMV fall as in one whole call). x [m, k] and y, residual [m, n_out] contiguous;
 * bias and residual may be NULL. */
#define GEMV_TILE_FLOATS 32768

void pmk_gemv_rows_f32(const float *w, const float *x, int64_t m, int64_t n_out, int64_t k,
                       const float *bias, const float *residual, float *y) {
#ifdef __AVX512F__
    const int64_t n4 = n_out / 4 * 4;
    /* row groups inside the weight tiles: a tile read for the first 4 rows is still in L1
     * for the next 4, so 5-8 rows stream the weights once, not twice */
    for (int64_t o = 0; o < n4; o += 4) {
        for (int64_t r0 = 0; r0 < m; r0 += 4) {
            const int64_t left = m - r0;
            const float *xr = x + r0 * k;
            float *yr = y + r0 * n_out;
            switch (left >= 4 ? 4 : left) { /* constant R: the r loops unroll */
            case 4: gemv4_rows512(w, xr, 4, k, o, yr, n_out); break;
            case 3: gemv4_rows512(w, xr, 3, k, o, yr, n_out); break;
            case 2: gemv4_rows512(w, xr, 2, k, o, yr, n_out); break;
            default: gemv4_rows512(w, xr, 1, k, o, yr, n_out); break;
            }
        }
    }
    for (int64_t r = 0; r < m; r++) /* pmk_gemv_f32's scalar rows, bias, residual */
        gemv_finish(w, x + r * k, n4, n_out, k, bias, residual ? residual + r * n_out : NULL,
                    y + r * n_out);
#else
    int64_t tile = GEMV_TILE_FLOATS / (k > 0 ? k : 1) / 8 * 8;
    if (tile < 8) tile = 8;
    for (int64_t o0 = 0; o0 < n_out; o0 += tile) {
        const int64_t n = n_out - o0 < tile ? n_out - o0 : tile;
        for (int64_t r = 0; r < m; r++)
            pmk_gemv_f32(w + o0 * k, x + r * k, n, k, bias ? bias + o0 : NULL,
                         residual ? residual + r * n_out + o0 : NULL, y + r * n_out + o0);
    }
#endif
}

/* pmk_decode_layer_f32 for m one-token sequences at once (a decode batch): st is [m,
 * DL_STEP], one step per sequence; x [m, hidden] updated in place; scratch holds m times
 * pmk_decode_layer_f32's room. The GEMVs read each weight once for the m rows
 * (pmk_gemv_rows_f32); RoPE + K/V write and attention run per sequence, as in the
 * one-row call. Every row's floats equal pmk_decode_layer_f32's on that row alone.
 * Returns 0, or -1 when an attention scratch allocation fails. */
int pmk_decode_layer_rows_f32(const int64_t *lp, const int64_t *st, int64_t m, float eps,
                              float scale, float *x, float *scratch) {
#define P(i) ((float *)(intptr_t)lp[i])
    const int64_t hidden = lp[DL_HIDDEN], heads = lp[DL_HEADS], kvh = lp[DL_KV_HEADS];
    const int64_t d = lp[DL_D], inter = lp[DL_INTER], nb = lp[DL_BLOCKS], bs = lp[DL_BS];
    const int64_t qkv_n = (heads + 2 * kvh) * d, q_n = heads * d;
    float *h = scratch, *qkv = h + m * hidden, *att = qkv + m * qkv_n, *gu = att + m * q_n;
    float *act = gu + m * 2 * inter, *tmp = act + m * inter;
    float *cache = P(DL_CACHE);
    int rc = 0;
    pmk_rms_norm_f32(x, m, hidden, hidden, P(DL_IN_NORM), eps, h, 1);
    pmk_gemv_rows_f32(P(DL_QKV_W), h, m, qkv_n, hidden, P(DL_QKV_B), NULL, qkv);
    for (int64_t r = 0; r < m; r++) {
        const int64_t *s = st + r * DL_STEP;
        pmk_rope_write_f32(qkv + r * qkv_n, 1, qkv_n, heads, kvh, d, &s[DS_POS],
                           (const float *)(intptr_t)s[DS_COS],
                           (const float *)(intptr_t)s[DS_SIN], cache, nb, bs, &s[DS_SLOT], 1);
        rc |= pmk_paged_decode_f32(qkv + r * qkv_n, qkv_n, cache, kvh, nb, bs, d,
                                   (const int64_t *)(intptr_t)s[DS_TABLE], 0, &s[DS_CTX], 1,
                                   heads, scale, att + r * q_n, 1);
    }
    pmk_gemv_rows_f32(P(DL_O_W), att, m, hidden, q_n, NULL, x, tmp);
    memcpy(x, tmp, (size_t)(m * hidden) * sizeof(float));
    pmk_rms_norm_f32(x, m, hidden, hidden, P(DL_POST_NORM), eps, h, 1);
    pmk_gemv_rows_f32(P(DL_GU_W), h, m, 2 * inter, hidden, NULL, NULL, gu);
    pmk_silu_mul_f32(gu, m, inter, act, 1);
    pmk_gemv_rows_f32(P(DL_DOWN_W), act, m, hidden, inter, NULL, x, tmp);
    memcpy(x, tmp, (size_t)(m * hidden) * sizeof(float));
    return rc;
#undef P
}
