/* Paged attention on a bf16 cache in bf16 pair dot products (bf16_pairs_isa.h), both layouts of
 * paged_attention_isa.h (decodes; prefill tiles), included by it in the bodies that define BF16_PAIRS, for head
 * dims of a multiple of 2W (the scores are paged_attention_isa.h's scores_dot and scores_columns, kind
 * KEYS_PAIRS).
 * Nothing is widened: the query rows stay bf16 (as they arrive), each score is q . k in pairs_dot (the scale
 * applied to the sum), the chunk's probabilities are rounded to bf16 once after the softmax (as torch's CPU flash
 * attention rounds them for its bf16 P.V product), and the value rows of two keys are interleaved into the pairs
 * that multiply a (p[j], p[j + 1]) pair. The accumulators hold each 2W block in pairs order (pair_position); the
 * softmax's rescaling does not care, and the output is written back in head order. Per key and query row this is
 * head_dim / 2W instructions for the scores and as many for the values, where widening and fp32 FMAs take about
 * four times that. */

/* Whether attention on this cache runs in pairs (both layouts; other head dims widen). */
static inline int ISA(uses_pairs)(const attn_args *a) { return a->dtype == DTYPE_BF16 && a->head_dim % (2 * W) == 0; }

/* The chunk's probabilities of each row (fp32, softmax_chunk's: zero past the visible keys, up to a whole
 * vector) rounded to bf16, through key nk rounded up to a pair. */
static void ISA(probs_to_pairs)(const float *scores, int num_rows, int stride, int nk, uint16_t *probs)
{
    for (int r = 0; r < num_rows; r++)
        for (int j = 0; j < nk; j += W)
            ISA(store_bf16)(probs + (size_t)r * PROBS_STRIDE + j, ISA(load)(scores + (size_t)r * stride + j));
}

/* o[r][block d ...] += sum_j p[r][j] * values[j][d ...] for RB rows over DB blocks of 2W values from d, two keys
 * at a time (the last alone, its pair's second weight zero); the bf16 pair (p[r][j], p[r][j + 1]) at p + r *
 * r_stride + j / 2 * pair_stride. RB x 2DB accumulators in registers (constants at each call). Prefetches ahead[j]
 * (the row this pass reads AHEAD_KEYS keys later) at key j, when ahead is set. */
static inline __attribute__((always_inline)) void ISA(pv_pairs_block)(float *o, int head_dim, const uint16_t *p,
                                                                      int r_stride, int pair_stride,
                                                                      const void *const *values, int nk, int d,
                                                                      const char *const *ahead, size_t row_bytes,
                                                                      const int RB, const int DB)
{
    vf acc[4][8];
    for (int r = 0; r < RB; r++)
        for (int v = 0; v < 2 * DB; v++)
            acc[r][v] = ISA(load)(o + (size_t)r * head_dim + d + v * W);
    for (int j = 0; j < nk; j += 2) {
        const uint16_t *v0 = values[j], *v1 = j + 1 < nk ? values[j + 1] : v0;
        if (ahead) {
            ISA(prefetch_row)(ahead[j], row_bytes);
            if (j + 1 < nk)
                ISA(prefetch_row)(ahead[j + 1], row_bytes);
        }
        vb pairs[8];
        for (int b = 0; b < DB; b++) {
            vb x = ISA(pairs_load)(v0 + d + b * 2 * W), y = ISA(pairs_load)(v1 + d + b * 2 * W);
            pairs[2 * b] = ISA(pairs_lo)(x, y);
            pairs[2 * b + 1] = ISA(pairs_hi)(x, y);
        }
        for (int r = 0; r < RB; r++) {
            vb weight = ISA(pairs_splat)(p + (size_t)r * r_stride + (size_t)(j / 2) * pair_stride);
            for (int v = 0; v < 2 * DB; v++)
                acc[r][v] = ISA(pairs_dot)(acc[r][v], pairs[v], weight);
        }
    }
    for (int r = 0; r < RB; r++)
        for (int v = 0; v < 2 * DB; v++)
            ISA(store)(o + (size_t)r * head_dim + d + v * W, acc[r][v]);
}

/* pv_pairs_block over every block of RB rows from row r: DB blocks at a time, then two, then one; the first
 * prefetches. */
static inline __attribute__((always_inline)) void ISA(pv_pairs_rows)(float *acc, int head_dim, const uint16_t *probs,
                                                                     int r_stride, int pair_stride,
                                                                     const void *const *values, int nk, int r,
                                                                     const char *const *ahead, size_t row_bytes,
                                                                     const int RB, const int DB)
{
    float *o = acc + (size_t)r * head_dim;
    const uint16_t *p = probs + (size_t)r * r_stride;
#define PV_PAIRS(blocks)                                                                                 \
    ISA(pv_pairs_block)(o, head_dim, p, r_stride, pair_stride, values, nk, d, d == 0 ? ahead : NULL, row_bytes, \
                        RB, blocks)
    int d = 0;
    for (; d + DB * 2 * W <= head_dim; d += DB * 2 * W)
        PV_PAIRS(DB);
    if (DB > 2)
        for (; d + 4 * W <= head_dim; d += 4 * W)
            PV_PAIRS(2);
    for (; d < head_dim; d += 2 * W)
        PV_PAIRS(1);
#undef PV_PAIRS
}

/* acc[r] += sum_j p[r][j] * values[j] over the rows and the chunk's nk value rows, the pairs of p laid out as
 * pv_pairs_block's: 4 rows x 2 blocks, 2 x 4, or 1 x 4 (at most 16 accumulators); ahead as accumulate_rows'. */
static void ISA(accumulate_pairs)(float *acc, int num_rows, int head_dim, const uint16_t *probs, int r_stride,
                                  int pair_stride, const void *const *values, int nk, const char *const *ahead,
                                  size_t row_bytes)
{
    int r = 0;
    for (; r + 4 <= num_rows; r += 4, ahead = NULL)
        ISA(pv_pairs_rows)(acc, head_dim, probs, r_stride, pair_stride, values, nk, r, ahead, row_bytes, 4, 2);
    for (; r + 2 <= num_rows; r += 2, ahead = NULL)
        ISA(pv_pairs_rows)(acc, head_dim, probs, r_stride, pair_stride, values, nk, r, ahead, row_bytes, 2, 4);
    for (; r < num_rows; r++, ahead = NULL)
        ISA(pv_pairs_rows)(acc, head_dim, probs, r_stride, pair_stride, values, nk, r, ahead, row_bytes, 1, 4);
}

/* ---- the many-rows (prefill tile) layout: queries transposed once into pairs, scores [keys][rows] */

typedef uint32_t ISA(vpair) __attribute__((vector_size(VEC_BYTES), aligned(4), may_alias));

/* qt[dp][r] = (q[r][2dp], q[r][2dp + 1]) as one 32-bit pair, for rows [0, num_rows); zero up to rows_pad. */
static void ISA(transpose_pairs)(const uint16_t *q, int num_rows, int rows_pad, int head_dim, uint32_t *qt)
{
    for (int dp = 0; dp < head_dim / 2; dp++) {
        uint32_t *column = qt + (size_t)dp * rows_pad;
        for (int r = 0; r < num_rows; r++)
            memcpy(column + r, q + (size_t)r * head_dim + 2 * dp, 4);
        for (int r = num_rows; r < rows_pad; r++)
            column[r] = 0;
    }
}

/* The column layout's probabilities (st [nk][rows_pad], fp32) as bf16 pairs: pairs[j / 2][r] = (p[j][r], p[j + 1][r])
 * (zero past key nk), W rows at a time. */
static void ISA(probs_column_pairs)(const float *st, int rows_pad, int nk, uint32_t *pairs)
{
    for (int j = 0; j < nk; j += 2)
        for (int r = 0; r < rows_pad; r += W) {
            vu lo = (vu)ISA(round_bf16)(ISA(load)(st + (size_t)j * rows_pad + r)) >> 16, hi = {0};
            if (j + 1 < nk)
                hi = (vu)ISA(round_bf16)(ISA(load)(st + (size_t)(j + 1) * rows_pad + r));
            *(ISA(vpair) *)(pairs + (size_t)(j / 2) * rows_pad + r) = hi | lo;
        }
}

/* One chunk of a prefill tile for KV head kv_head + h, its nk keys' token rows k_tokens / v_tokens read in place:
 * scores, the online softmax (softmax_columns, shared with the widening path), then P.V in pairs. */
static void ISA(column_chunk_pairs)(const attn_args *a, const work_item *item, scratch *s, int h, int rows_per_head,
                                    int rows_pad, const char *const *k_tokens, const char *const *v_tokens, int nk)
{
    const int head_dim = a->head_dim;
    const size_t head_offset = (size_t)(item->kv_head + h) * head_dim * 2;
    const void *keys[COLUMN_CHUNK], *values[COLUMN_CHUNK];
    for (int j = 0; j < nk; j++) {
        keys[j] = k_tokens[j] + head_offset;
        values[j] = v_tokens[j] + head_offset;
    }
    size_t first_row = (size_t)h * rows_pad;
    float *acc = s->acc + (size_t)h * rows_per_head * head_dim;
    ISA(scores_columns)((const uint32_t *)s->qt + first_row * head_dim / 2, rows_pad, head_dim, keys, nk, s->scores,
                        a->scale, KEYS_PAIRS);
    ISA(softmax_columns)(s->scores, rows_per_head, rows_pad, nk, s->lo, s->hi, s->row_max + first_row,
                         s->row_sum + first_row, acc, head_dim);
    ISA(probs_column_pairs)(s->scores, rows_pad, nk, (uint32_t *)s->probs);
    ISA(accumulate_pairs)(acc, rows_per_head, head_dim, s->probs, 2, 2 * rows_pad, values, nk, NULL, 0);
}

/* Value d of an accumulator row held in pairs order. */
static inline float ISA(pairs_value)(const float *o, int d)
{
    int block = d / (2 * W) * (2 * W);
    return o[block + ISA(pair_position)(d - block)];
}
