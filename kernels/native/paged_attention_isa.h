/* Paged attention for one instruction set: included by cpu_ops.c once per ISA, after vec_isa.h.
 *
 * One work item = one sequence, one KV head (or all of them, for decodes), a tile of that sequence's
 * query tokens. Its "rows" are (query token, query head of the KV head's group) pairs: a decode has G
 * rows per KV head (the GQA group), a prefill tile up to MAX_ROWS. Keys are visited in chunks, read in
 * place from their pages through the block table (no gathered copy), with an online softmax (running
 * max and sum per row) and the output accumulated in fp32. Two shapes:
 *   - few rows per KV head (decodes, short queries): each chunk's keys and values first staged head-major
 *     (see attend_item), then dot products of each row with each key row, over long chunks (up to
 *     DOT_CHUNK keys), so the softmax bookkeeping is paid rarely;
 *   - many rows (prefill tiles): the tile's queries transposed once to [head_dim][rows], then each
 *     chunk's scores computed transposed, [keys][rows], as register-blocked outer products straight
 *     from the cache (each key element serves a vector of rows), and the online softmax vectorized
 *     across rows.
 * Row-layout scores are [rows][stride]; column-layout scores [keys][rows_pad]. Bodies compiled with BF16_PAIRS
 * run both shapes on a bf16 cache in bf16 pair dot products instead (paged_attention_pairs_isa.h).
 */

/* W values of a cache row from element d, in the cache's dtype (a constant where inlined). */
static inline __attribute__((always_inline)) vf ISA(load_row)(const void *row, int d, const int is_bf16)
{
    return is_bf16 ? ISA(load_bf16)((const uint16_t *)row + d) : ISA(load)((const float *)row + d);
}

/* Prefetch one head row (row_bytes) of the cache, if there is one, into L2 (prefetcht1), not L1: measured on Zen 4
 * (one core, decodes of 310 tokens over 8 layers' caches, read from memory), an L1 prefetch (t0) read 6-7 GB/s
 * and this one 11-12 (21-25 against 37-45 ns per key and KV head, bf16 and fp32 alike; 2 threads 13.5 against
 * 19-23): an L1 prefetch holds one of the core's few L1 miss buffers for the whole trip to memory. */
static inline __attribute__((always_inline)) void ISA(prefetch_row)(const char *row, size_t row_bytes)
{
    if (row)
        for (size_t offset = 0; offset < row_bytes; offset += 64)
            __builtin_prefetch(row + offset, 0, 2);
}

#ifndef PV_VECTORS
/* Value vectors per row that pv_block holds in registers with four rows: AVX-512's 32 registers take a 64-wide
 * head's four (16 accumulators), narrower ones two. */
#define PV_VECTORS (VEC_BYTES == 64 ? 4 : 2)
#endif

#ifndef KEYS_F32
#define KEYS_F32 0   /* scores_dot's kinds: fp32 query rows and cache */
#define KEYS_BF16 1  /* fp32 query rows, a bf16 cache widened in registers */
#define KEYS_PAIRS 2 /* bf16 query rows and cache in bf16 pair dot products (BF16_PAIRS bodies) */
#endif

/* scores[r][j] = scale * (q[r] . keys[j]) for the chunk's nk key rows, read in place from the cache, two rows and
 * four keys at a time (q: fp32 rows, or bf16 ones for KEYS_PAIRS); ahead[j], the row this pass reads AHEAD_KEYS
 * keys later, prefetched at key j. */
static inline __attribute__((always_inline)) void ISA(scores_dot_rows)(const void *q, int num_rows, int head_dim,
                                                                       const void *const *keys, int nk, float *scores,
                                                                       int stride, const char *const *ahead,
                                                                       size_t row_bytes, float scale, const int kind)
{
    for (int j = 0; j < nk; j += 4) {
        const void *k0 = keys[j], *k1 = keys[j + 1 < nk ? j + 1 : j], *k2 = keys[j + 2 < nk ? j + 2 : j],
                   *k3 = keys[j + 3 < nk ? j + 3 : j];
        for (int t = 0; t < 4 && j + t < nk; t++)
            ISA(prefetch_row)(ahead[j + t], row_bytes);
        for (int r = 0; r < num_rows; r += 2) {
            vf a00 = {0}, a01 = {0}, a02 = {0}, a03 = {0}, a10 = {0}, a11 = {0}, a12 = {0}, a13 = {0};
#ifdef BF16_PAIRS
            if (kind == KEYS_PAIRS) {
                const uint16_t *q0 = (const uint16_t *)q + (size_t)r * head_dim;
                const uint16_t *q1 = r + 1 < num_rows ? q0 + head_dim : q0;
#pragma GCC unroll 4
                for (int d = 0; d < head_dim; d += 2 * W) {
                    vb x0 = ISA(pairs_load)(q0 + d), x1 = ISA(pairs_load)(q1 + d);
                    vb y0 = ISA(pairs_load)((const uint16_t *)k0 + d), y1 = ISA(pairs_load)((const uint16_t *)k1 + d);
                    vb y2 = ISA(pairs_load)((const uint16_t *)k2 + d), y3 = ISA(pairs_load)((const uint16_t *)k3 + d);
                    a00 = ISA(pairs_dot)(a00, x0, y0); a01 = ISA(pairs_dot)(a01, x0, y1);
                    a02 = ISA(pairs_dot)(a02, x0, y2); a03 = ISA(pairs_dot)(a03, x0, y3);
                    a10 = ISA(pairs_dot)(a10, x1, y0); a11 = ISA(pairs_dot)(a11, x1, y1);
                    a12 = ISA(pairs_dot)(a12, x1, y2); a13 = ISA(pairs_dot)(a13, x1, y3);
                }
            } else
#endif
            {
                const int is_bf16 = kind == KEYS_BF16;
                const float *q0 = (const float *)q + (size_t)r * head_dim;
                const float *q1 = r + 1 < num_rows ? q0 + head_dim : q0;
#pragma GCC unroll 4
                for (int d = 0; d < head_dim; d += W) {
                    vf x0 = ISA(load)(q0 + d), x1 = ISA(load)(q1 + d);
                    vf y0 = ISA(load_row)(k0, d, is_bf16), y1 = ISA(load_row)(k1, d, is_bf16);
                    vf y2 = ISA(load_row)(k2, d, is_bf16), y3 = ISA(load_row)(k3, d, is_bf16);
                    a00 += x0 * y0; a01 += x0 * y1; a02 += x0 * y2; a03 += x0 * y3;
                    a10 += x1 * y0; a11 += x1 * y1; a12 += x1 * y2; a13 += x1 * y3;
                }
            }
            float *s0 = scores + (size_t)r * stride + j, sums[8];
            ISA(hsum8)(a00, a01, a02, a03, a10, a11, a12, a13, sums);
            for (int t = 0; t < 4 && j + t < nk; t++) {
                s0[t] = sums[t] * scale;
                if (r + 1 < num_rows)
                    s0[stride + t] = sums[4 + t] * scale;
            }
        }
    }
}

/* scores_dot_rows for a kind known only at run time (each kind compiled on its own); the widening kinds' queries
 * are scaled already (scale 1, exact). */
static void ISA(scores_dot)(const void *q, int num_rows, int head_dim, const void *const *keys, int nk, float *scores,
                            int stride, const char *const *ahead, size_t row_bytes, float scale, int kind)
{
#ifdef BF16_PAIRS
    if (kind == KEYS_PAIRS) {
        ISA(scores_dot_rows)(q, num_rows, head_dim, keys, nk, scores, stride, ahead, row_bytes, scale, KEYS_PAIRS);
        return;
    }
#endif
    if (kind == KEYS_BF16)
        ISA(scores_dot_rows)(q, num_rows, head_dim, keys, nk, scores, stride, ahead, row_bytes, scale, KEYS_BF16);
    else
        ISA(scores_dot_rows)(q, num_rows, head_dim, keys, nk, scores, stride, ahead, row_bytes, scale, KEYS_F32);
}

/* qt[d][r] = q[r][d] for rows [0, num_rows), zero for the padding rows up to rows_pad. */
static void ISA(transpose_rows)(const float *q, int num_rows, int rows_pad, int head_dim, float *qt)
{
    for (int d = 0; d < head_dim; d++) {
        float *column = qt + (size_t)d * rows_pad;
        for (int r = 0; r < num_rows; r++)
            column[r] = q[(size_t)r * head_dim + d];
        for (int r = num_rows; r < rows_pad; r++)
            column[r] = 0.0f;
    }
}

/* st[j][r : r + RV * W] = scale * (keys[j] . q[r ...]) for KB keys from j: KB x RV accumulators in registers,
 * each key element (KEYS_PAIRS: bf16 pair, straight from the cache, onto qt's 32-bit pairs of rows) broadcast once
 * per RV row vectors (callers pass constants, so the loops unroll). */
static inline __attribute__((always_inline)) void ISA(column_block)(const void *qt, int rows_pad, int head_dim,
                                                                    const void *const *keys, int nk, int j, int r,
                                                                    float *st, float scale, const int KB, const int RV,
                                                                    const int kind)
{
    const void *key[4];
    for (int t = 0; t < KB; t++)
        key[t] = keys[j + t < nk ? j + t : j];  /* past the chunk: computed, never stored */
    vf acc[4][4];
    for (int t = 0; t < KB; t++)
        for (int v = 0; v < RV; v++)
            acc[t][v] = (vf){0};
#ifdef BF16_PAIRS
    if (kind == KEYS_PAIRS) {
        const uint32_t *column = (const uint32_t *)qt + r;
#pragma GCC unroll 2
        for (int dp = 0; dp < head_dim / 2; dp++, column += rows_pad) {
            vb q[4];
            for (int v = 0; v < RV; v++)
                q[v] = ISA(pairs_load)((const uint16_t *)(column + v * W));
            for (int t = 0; t < KB; t++) {
                vb k = ISA(pairs_splat)((const uint16_t *)key[t] + 2 * dp);
                for (int v = 0; v < RV; v++)
                    acc[t][v] = ISA(pairs_dot)(acc[t][v], q[v], k);
            }
        }
    } else
#endif
    {
        const float *column = (const float *)qt + r;
#pragma GCC unroll 4
        for (int d = 0; d < head_dim; d++, column += rows_pad) {
            vf q[4];
            for (int v = 0; v < RV; v++)
                q[v] = ISA(load)(column + v * W);
            for (int t = 0; t < KB; t++) {
                vf k = ISA(splat)(((const float *)key[t])[d]);
                for (int v = 0; v < RV; v++)
                    acc[t][v] += k * q[v];
            }
        }
    }
    for (int t = 0; t < KB && j + t < nk; t++)
        for (int v = 0; v < RV; v++)
            ISA(store)(st + (size_t)(j + t) * rows_pad + r + v * W, acc[t][v] * scale);
}

/* st[j][r] = scale * (keys[j] . q[r]) from qt (a multiple of W rows): fp32 ([head_dim][rows_pad], keys fp32), four
 * keys by two row vectors at a time (8 accumulators: with the loads, what AVX2's 16 registers hold without
 * spilling); KEYS_PAIRS (transpose_pairs' [head_dim / 2][rows_pad] pairs, keys bf16 in the cache), four keys by up
 * to four row vectors (AVX-512's 32 registers). */
static void ISA(scores_columns)(const void *qt, int rows_pad, int head_dim, const void *const *keys, int nk,
                                float *st, float scale, int kind)
{
    for (int j = 0; j < nk; j += 4) {
        int r = 0;
#ifdef BF16_PAIRS
        if (kind == KEYS_PAIRS) {
            for (; r + 4 * W <= rows_pad; r += 4 * W)
                ISA(column_block)(qt, rows_pad, head_dim, keys, nk, j, r, st, scale, 4, 4, KEYS_PAIRS);
            for (; r + 2 * W <= rows_pad; r += 2 * W)
                ISA(column_block)(qt, rows_pad, head_dim, keys, nk, j, r, st, scale, 4, 2, KEYS_PAIRS);
            for (; r < rows_pad; r += W)
                ISA(column_block)(qt, rows_pad, head_dim, keys, nk, j, r, st, scale, 4, 1, KEYS_PAIRS);
            continue;
        }
#endif
        (void)kind;
#if VEC_BYTES == 64
        for (; r + 4 * W <= rows_pad; r += 4 * W)
            ISA(column_block)(qt, rows_pad, head_dim, keys, nk, j, r, st, scale, 4, 4, KEYS_F32);
#endif
        for (; r + 2 * W <= rows_pad; r += 2 * W)
            ISA(column_block)(qt, rows_pad, head_dim, keys, nk, j, r, st, scale, 4, 2, KEYS_F32);
        for (; r < rows_pad; r += W)
            ISA(column_block)(qt, rows_pad, head_dim, keys, nk, j, r, st, scale, 4, 1, KEYS_F32);
    }
}

/* The online softmax of a column-layout chunk (st [nk][rows_pad]), a vector of rows at a time: row r
 * sees keys [lo[r], hi[r]) of the chunk (padding rows see none). Leaves unnormalised probabilities. */
static void ISA(softmax_columns)(float *st, int num_rows, int rows_pad, int nk, const int32_t *lo, const int32_t *hi,
                                 float *row_max, float *row_sum, float *acc, int head_dim)
{
    const vf minus_inf = ISA(splat)(-INFINITY);
    for (int r = 0; r < rows_pad; r += W) {
        vi first = *(const vi *)(lo + r), end = *(const vi *)(hi + r);
        int all_visible = 1;  /* every row of the vector sees the whole chunk (a prefix's chunks): nothing to mask */
        for (int i = 0; i < W; i++)
            all_visible &= first[i] == 0 && end[i] == nk;
        vf vmax = minus_inf;
        if (all_visible)
            for (int j = 0; j < nk; j++)
                vmax = ISA(larger)(ISA(load)(st + (size_t)j * rows_pad + r), vmax);
        else
            for (int j = 0; j < nk; j++) {
                float *x = st + (size_t)j * rows_pad + r;
                vi index = (vi){0} + j;
                vi is_visible = (index >= first) & (index < end);
                vf v = (vf)(((vi)ISA(load)(x) & is_visible) | ((vi)minus_inf & ~is_visible));
                ISA(store)(x, v);
                vmax = ISA(larger)(v, vmax);
            }
        vf old_max = ISA(load)(row_max + r);
        vf new_max = ISA(larger)(vmax, old_max);
        vi has_seen = new_max != minus_inf;
        vf shift = (vf)((vi)new_max & has_seen);  /* rows that saw nothing yet: 0, their exps are masked anyway */
        vf sum = {0};
        for (int j = 0; j < nk; j++) {
            float *x = st + (size_t)j * rows_pad + r;
            vf v = ISA(load)(x);
            vf p = (vf)((vi)ISA(vexp)(v - shift) & (v != minus_inf));
            ISA(store)(x, p);
            sum += p;
        }
        vf correction = (vf)((vi)ISA(vexp)(old_max - shift) & (old_max != minus_inf));
        ISA(store)(row_sum + r, ISA(load)(row_sum + r) * correction + sum);
        ISA(store)(row_max + r, new_max);
        for (int i = 0; i < W && r + i < num_rows; i++) {  /* padding rows own no accumulator */
            if (correction[i] == 1.0f)
                continue;
            float *o = acc + (size_t)(r + i) * head_dim;
            for (int d = 0; d < head_dim; d += W)
                ISA(store)(o + d, ISA(load)(o + d) * correction[i]);
        }
    }
}

/* o[r][d : d + DB * W] += sum_j p[r][j] * values[j][d : ...] for RB rows, p[r][j] at p[r * r_stride +
 * j * j_stride], values in the cache's dtype: RB x DB accumulators held in registers across the chunk's
 * keys (the callers pass constants, so the loops unroll). Prefetches ahead[j], the row this pass reads
 * AHEAD_KEYS keys later, at key j (ahead NULL: nothing to prefetch). */
static inline __attribute__((always_inline)) void ISA(pv_block)(float *o, int head_dim, const float *p, int r_stride,
                                                                int j_stride, const void *const *values, int nk,
                                                                int d, const char *const *ahead, size_t row_bytes,
                                                                const int RB, const int DB, const int is_bf16)
{
    vf acc[4][8];
    for (int r = 0; r < RB; r++)
        for (int v = 0; v < DB; v++)
            acc[r][v] = ISA(load)(o + (size_t)r * head_dim + d + v * W);
#pragma GCC unroll 4
    for (int j = 0; j < nk; j++) {
        if (ahead)
            ISA(prefetch_row)(ahead[j], row_bytes);
        vf row[8];
        for (int v = 0; v < DB; v++)
            row[v] = ISA(load_row)(values[j], d + v * W, is_bf16);
        for (int r = 0; r < RB; r++) {
            vf weight = ISA(splat)(p[(size_t)r * r_stride + (size_t)j * j_stride]);
            for (int v = 0; v < DB; v++)
                acc[r][v] += weight * row[v];
        }
    }
    for (int r = 0; r < RB; r++)
        for (int v = 0; v < DB; v++)
            ISA(store)(o + (size_t)r * head_dim + d + v * W, acc[r][v]);
}

/* pv_block over every d of RB rows from row r: DB vectors at a time, then one at a time; the first
 * block prefetches (ahead), the others not. */
static inline __attribute__((always_inline)) void ISA(pv_rows)(float *acc, int head_dim, const float *probs,
                                                               int r_stride, int j_stride, const void *const *values,
                                                               int nk, int r, const char *const *ahead,
                                                               size_t row_bytes, const int RB, const int DB,
                                                               const int is_bf16)
{
    float *o = acc + (size_t)r * head_dim;
    const float *p = probs + (size_t)r * r_stride;
    int d = 0;
    for (; d + DB * W <= head_dim; d += DB * W)
        ISA(pv_block)(o, head_dim, p, r_stride, j_stride, values, nk, d, d == 0 ? ahead : NULL, row_bytes, RB, DB,
                      is_bf16);
    for (; d < head_dim; d += W)
        ISA(pv_block)(o, head_dim, p, r_stride, j_stride, values, nk, d, d == 0 ? ahead : NULL, row_bytes, RB, 1,
                      is_bf16);
}

/* acc[r] += sum_j probs[r][j] * values[j] over rows r and the chunk's nk value rows, probs[r][j] at
 * probs[r * r_stride + j * j_stride] (8 accumulators: 4 rows x 2 vectors, 2 x 4, or 1 x 8, by how many
 * rows are left); ahead as pv_block's, prefetched by the first group of rows only. */
static inline __attribute__((always_inline)) void ISA(accumulate_rows)(float *acc, int num_rows, int head_dim,
                                                                       const float *probs, int r_stride,
                                                                       int j_stride, const void *const *values,
                                                                       int nk, const char *const *ahead,
                                                                       size_t row_bytes, const int is_bf16)
{
    int r = 0;
    for (; r + 4 <= num_rows; r += 4, ahead = NULL)
        ISA(pv_rows)(acc, head_dim, probs, r_stride, j_stride, values, nk, r, ahead, row_bytes, 4, PV_VECTORS, is_bf16);
    for (; r + 2 <= num_rows; r += 2, ahead = NULL)
        ISA(pv_rows)(acc, head_dim, probs, r_stride, j_stride, values, nk, r, ahead, row_bytes, 2, 4, is_bf16);
    for (; r < num_rows; r++, ahead = NULL)
        ISA(pv_rows)(acc, head_dim, probs, r_stride, j_stride, values, nk, r, ahead, row_bytes, 1, 8, is_bf16);
}

static void ISA(accumulate_values)(float *acc, int num_rows, int head_dim, const float *probs, int r_stride,
                                   int j_stride, const void *const *values, int nk, const char *const *ahead,
                                   size_t row_bytes, int is_bf16)
{
    if (is_bf16)
        ISA(accumulate_rows)(acc, num_rows, head_dim, probs, r_stride, j_stride, values, nk, ahead, row_bytes, 1);
    else
        ISA(accumulate_rows)(acc, num_rows, head_dim, probs, r_stride, j_stride, values, nk, ahead, row_bytes, 0);
}

/* Online softmax over one chunk of scores (nk keys, rows of `stride`): rescales each row's accumulator
 * and running sum to the new running max and turns its scores into unnormalised probabilities, zero
 * where not visible. Row r belongs to token r / group, whose visible columns are [lo, hi). */
static void ISA(softmax_chunk)(float *scores, int num_rows, int group, int stride, int nk, int head_dim,
                               const int32_t *lo, const int32_t *hi, float *row_max, float *row_sum, float *acc)
{
    const int nv = (nk + W - 1) / W;
    for (int r = 0; r < num_rows; r++) {
        float *s = scores + (size_t)r * stride;
        int32_t first = lo[r / group], end = hi[r / group];
        if (first >= end) {  /* nothing visible in this chunk */
            for (int v = 0; v < nv; v++)
                ISA(store)(s + v * W, (vf){0});
            continue;
        }
        for (int j = 0; j < first; j++)
            s[j] = -INFINITY;
        for (int j = end; j < nv * W; j++)
            s[j] = -INFINITY;
        vf vmax = ISA(load)(s);
        for (int v = 1; v < nv; v++) {
            vf x = ISA(load)(s + v * W);
            vmax = ISA(larger)(x, vmax);
        }
        float chunk_max = vmax[0];
        for (int i = 1; i < W; i++)
            chunk_max = vmax[i] > chunk_max ? vmax[i] : chunk_max;
        float new_max = chunk_max > row_max[r] ? chunk_max : row_max[r];
        vf sum = {0};
        for (int v = 0; v < nv; v++) {
            vf x = ISA(load)(s + v * W);
            vi is_visible = x != -INFINITY;
            vf p = (vf)((vi)ISA(vexp)(x - new_max) & is_visible);
            ISA(store)(s + v * W, p);
            sum += p;
        }
        float chunk_sum = ISA(hsum)(sum);
        if (new_max != row_max[r]) {
            float correction = row_max[r] == -INFINITY ? 0.0f : ISA(vexp)(ISA(splat)(row_max[r] - new_max))[0];
            float *o = acc + (size_t)r * head_dim;
            for (int d = 0; d < head_dim; d += W)
                ISA(store)(o + d, ISA(load)(o + d) * correction);
            row_sum[r] *= correction;
            row_max[r] = new_max;
        }
        row_sum[r] += chunk_sum;
    }
}

static void ISA(bf16_to_float)(float *dst, const uint16_t *src, int n)
{
    for (int i = 0; i < n; i += W)
        ISA(store)(dst + i, ISA(load_bf16)(src + i));
}

/* The token rows (every head) of key positions [start, start + nk). */
static void ISA(chunk_rows)(const attn_args *a, const int32_t *table, int32_t start, int nk, size_t element,
                            const char **k_tokens, const char **v_tokens)
{
    int32_t page = start / a->page_size, slot = start % a->page_size;
    for (int j = 0; j < nk; j++, slot++) {
        if (slot == a->page_size) {
            slot = 0;
            page++;
        }
        size_t block = (size_t)table[page];
        k_tokens[j] = (const char *)a->k_cache + (block * a->k_block_stride + (size_t)slot * a->k_token_stride) * element;
        v_tokens[j] = (const char *)a->v_cache + (block * a->v_block_stride + (size_t)slot * a->v_token_stride) * element;
    }
}

#ifdef BF16_PAIRS
#include "paged_attention_pairs_isa.h"
#else
static inline int ISA(uses_pairs)(const attn_args *a) { (void)a; return 0; }
#endif

/* The few-rows path (decodes) over one chunk of nk keys, whose token rows (every head) are k_tokens /
 * v_tokens, listed up to `listed` (past nk: the next chunk's, for the prefetch). Rows are read in place
 * in the cache's dtype, token-major: DECODE_KEYS keys at a time across every head, then the next keys,
 * so the cache is read in address order (a page's token rows are contiguous) and the prefetch of the
 * rows AHEAD_KEYS on (in this pass, else the next), one head row per key, spreads evenly. Visiting one
 * head over the whole chunk and then the next read each page in four strided passes: ~25 % slower from
 * memory (docs/cpu-kernels.md). */
static void ISA(decode_chunk)(const attn_args *a, const work_item *item, scratch *s, const char *const *k_tokens,
                              const char *const *v_tokens, int nk, int listed, int chunk)
{
    const int head_dim = a->head_dim, group = a->num_q_heads / a->num_kv_heads, is_bf16 = a->dtype == DTYPE_BF16;
    const int rows_per_head = item->num_tokens * group, pairs = ISA(uses_pairs)(a);
    const size_t row_bytes = (size_t)head_dim * (is_bf16 ? 2 : 4);
    const void *rows[DECODE_KEYS];
    const char *ahead[DECODE_KEYS];
    for (int pass = 0; pass < 2; pass++) {  /* scores from K, then (after the softmax) values from V */
        const char *const *tokens = pass == 0 ? k_tokens : v_tokens;
        for (int first = 0; first < nk; first += DECODE_KEYS) {
            int n = nk - first < DECODE_KEYS ? nk - first : DECODE_KEYS;
            for (int h = 0; h < item->num_heads; h++) {
                size_t offset = (size_t)(item->kv_head + h) * row_bytes;
                for (int t = 0; t < n; t++) {  /* read next: this pass's rows, then V's first (or the next chunk's K) */
                    int later = first + t + AHEAD_KEYS;
                    rows[t] = tokens[first + t] + offset;
                    if (later < nk)
                        ahead[t] = tokens[later] + offset;
                    else if (pass == 0)
                        ahead[t] = later - nk < nk ? v_tokens[later - nk] + offset : NULL;
                    else
                        ahead[t] = later < listed ? k_tokens[later] + offset : NULL;
                }
                size_t first_row = (size_t)h * rows_per_head;
                float *scores = s->scores + first_row * chunk + first;
                if (pass == 0) {
                    const void *q = pairs ? (const void *)((const uint16_t *)s->q + first_row * head_dim)
                                          : (const void *)(s->q + first_row * head_dim);
                    ISA(scores_dot)(q, rows_per_head, head_dim, rows, n, scores, chunk, ahead, row_bytes,
                                    pairs ? a->scale : 1.0f, pairs ? KEYS_PAIRS : is_bf16 ? KEYS_BF16 : KEYS_F32);
                }
#ifdef BF16_PAIRS
                else if (pairs)
                    ISA(accumulate_pairs)(s->acc + first_row * head_dim, rows_per_head, head_dim,
                                          s->probs + first_row * PROBS_STRIDE + first, PROBS_STRIDE, 2, rows, n,
                                          ahead, row_bytes);
#endif
                else
                    ISA(accumulate_values)(s->acc + first_row * head_dim, rows_per_head, head_dim, scores, chunk, 1,
                                           rows, n, ahead, row_bytes, is_bf16);
            }
        }
        if (pass == 0)
            for (int h = 0; h < item->num_heads; h++) {
                size_t first_row = (size_t)h * rows_per_head;
                ISA(softmax_chunk)(s->scores + first_row * chunk, rows_per_head, group, chunk, nk, head_dim, s->lo,
                                   s->hi, s->row_max + first_row, s->row_sum + first_row,
                                   s->acc + first_row * head_dim);
#ifdef BF16_PAIRS
                if (pairs)
                    ISA(probs_to_pairs)(s->scores + first_row * chunk, rows_per_head, chunk, nk,
                                        s->probs + first_row * PROBS_STRIDE);
#endif
            }
    }
}

/* What a row's fp32 accumulator is multiplied by at the end: 1 / its softmax sum (0 for a row that saw no key);
 * with an attention sink (gpt-oss) the sink's exp(sink - max) joins the sum, taken against the larger of the two so
 * that neither exp overflows: out = acc * exp(m - M) / (sum * exp(m - M) + exp(sink - M)), M = max(m, sink). */
static inline float ISA(normalizer)(float row_max, float row_sum, const float *sink)
{
    if (!sink || row_max == -INFINITY)
        return row_sum > 0.0f ? 1.0f / row_sum : 0.0f;
    if (*sink <= row_max)
        return 1.0f / (row_sum + ISA(vexp)(ISA(splat)(*sink - row_max))[0]);
    float below = ISA(vexp)(ISA(splat)(row_max - *sink))[0];
    return below / (row_sum * below + 1.0f);
}

/* One work item, using the calling thread's scratch. Rows are head-major: the rows of KV head
 * kv_head + h are [h * rows_per_head, (h + 1) * rows_per_head), token-major within (token i, member g). */
static void ISA(attend_item)(const attn_args *a, const work_item *item, scratch *s)
{
    const int head_dim = a->head_dim, group = a->num_q_heads / a->num_kv_heads;
    const int num_tokens = item->num_tokens, num_heads = item->num_heads;
    const int rows_per_head = num_tokens * group, num_rows = rows_per_head * num_heads;
    const int32_t q_first = a->cu_seqlens_q[item->seq], q_len = a->cu_seqlens_q[item->seq + 1] - q_first;
    const int32_t context_len = a->context_lens[item->seq];
    const int32_t first_pos = context_len - q_len + item->first_token;  /* key position of the tile's first token */
    const int32_t *table = a->block_tables + (size_t)item->seq * a->block_table_stride;
    const int is_bf16 = a->dtype == DTYPE_BF16;
    const size_t element = is_bf16 ? 2 : 4;
    /* many rows per head: the column layout (queries transposed once, scores [keys][rows]) */
    const int is_columns = rows_per_head > PACKED_MIN_ROWS;
    const int rows_pad = (rows_per_head + W - 1) / W * W;
    /* a bf16 cache, where the body has bf16 pairs: queries, keys, probabilities and values stay bf16 */
    const int pairs = ISA(uses_pairs)(a);

    for (int h = 0; h < num_heads; h++) {
        for (int i = 0; i < num_tokens; i++) {
            size_t token = (size_t)(q_first + item->first_token + i);
            for (int g = 0; g < group; g++) {
                size_t offset = token * a->q_token_stride + (size_t)((item->kv_head + h) * group + g) * head_dim;
                size_t r = (size_t)(h * rows_per_head + i * group + g);
                float *row = s->q + r * head_dim;
                if (pairs) {  /* bf16 as it came, the scale applied to the scores */
                    memcpy((uint16_t *)s->q + r * head_dim, (const uint16_t *)a->query + offset, head_dim * 2);
                    continue;
                }
                if (is_bf16)
                    ISA(bf16_to_float)(row, (const uint16_t *)a->query + offset, head_dim);
                else
                    for (int d = 0; d < head_dim; d++)
                        row[d] = ((const float *)a->query)[offset + d];
                for (int d = 0; d < head_dim; d++)
                    row[d] *= a->scale;
            }
        }
#ifdef BF16_PAIRS
        if (is_columns && pairs)
            ISA(transpose_pairs)((const uint16_t *)s->q + (size_t)h * rows_per_head * head_dim, rows_per_head,
                                 rows_pad, head_dim, (uint32_t *)s->qt + (size_t)h * rows_pad * head_dim / 2);
        else
#endif
        if (is_columns)
            ISA(transpose_rows)(s->q + (size_t)h * rows_per_head * head_dim, rows_per_head, rows_pad, head_dim,
                                s->qt + (size_t)h * rows_pad * head_dim);
    }
    for (int r = 0; r < num_heads * rows_pad; r++) {  /* padded per head in the column layout */
        s->row_max[r] = -INFINITY;
        s->row_sum[r] = 0.0f;
    }
    for (size_t i = 0; i < (size_t)num_rows * head_dim; i++)
        s->acc[i] = 0.0f;

    const int32_t key_end = first_pos + num_tokens;  /* one past the last token's position */
    int32_t key_begin = 0;
    if (a->sliding_window > 0 && first_pos - a->sliding_window + 1 > 0)
        key_begin = first_pos - a->sliding_window + 1;
    /* Few rows (decodes): decode_chunk, reading K/V in place. Many rows (prefill tiles): bf16 rows are
     * widened once per chunk and head into k_rows / v_rows, which every row then reads (in bf16 pairs: read
     * in place, column_chunk_pairs). */
    const int chunk = is_columns ? COLUMN_CHUNK : DOT_CHUNK;
    const char *k_tokens[DOT_CHUNK + AHEAD_KEYS], *v_tokens[DOT_CHUNK + AHEAD_KEYS]; /* token rows (all heads) */
    const float *keys[COLUMN_CHUNK], *values[COLUMN_CHUNK];  /* the column layout's fp32 rows */
    for (int32_t start = key_begin; start < key_end; start += chunk) {
        int nk = key_end - start < chunk ? key_end - start : chunk;
        int listed = nk;  /* token rows listed: the chunk's, and for decodes up to AHEAD_KEYS past it */
        if (!is_columns)
            listed = key_end - start < nk + AHEAD_KEYS ? key_end - start : nk + AHEAD_KEYS;
        ISA(chunk_rows)(a, table, start, listed, element, k_tokens, v_tokens);
        /* visible columns [lo, hi) of each token: causal, inside the window, inside the chunk */
        for (int i = 0; i < num_tokens; i++) {
            int32_t pos = first_pos + i;
            int32_t lo = 0, hi = pos + 1 - start;
            if (hi > nk)
                hi = nk;
            if (a->sliding_window > 0 && pos - a->sliding_window + 1 - start > 0)
                lo = pos - a->sliding_window + 1 - start;
            if (is_columns) {  /* per row, padding rows seeing nothing */
                for (int g = 0; g < group; g++) {
                    s->lo[i * group + g] = lo;
                    s->hi[i * group + g] = hi;
                }
            } else {
                s->lo[i] = lo;
                s->hi[i] = hi;
            }
        }
        if (!is_columns) {
            ISA(decode_chunk)(a, item, s, k_tokens, v_tokens, nk, listed, chunk);
            continue;
        }
        for (int r = rows_per_head; r < rows_pad; r++)  /* padding rows see nothing */
            s->lo[r] = s->hi[r] = 0;
        for (int h = 0; h < num_heads; h++) {
#ifdef BF16_PAIRS
            if (pairs) {
                ISA(column_chunk_pairs)(a, item, s, h, rows_per_head, rows_pad, k_tokens, v_tokens, nk);
                continue;
            }
#endif
            size_t head_offset = (size_t)(item->kv_head + h) * head_dim * element;
            for (int j = 0; j < nk; j++) {
                if (is_bf16) {
                    float *k_row = s->k_rows + (size_t)j * head_dim, *v_row = s->v_rows + (size_t)j * head_dim;
                    ISA(bf16_to_float)(k_row, (const uint16_t *)(k_tokens[j] + head_offset), head_dim);
                    ISA(bf16_to_float)(v_row, (const uint16_t *)(v_tokens[j] + head_offset), head_dim);
                    keys[j] = k_row;
                    values[j] = v_row;
                } else {
                    keys[j] = (const float *)(k_tokens[j] + head_offset);
                    values[j] = (const float *)(v_tokens[j] + head_offset);
                }
            }
            size_t first_row = (size_t)h * rows_pad;
            float *acc = s->acc + (size_t)h * rows_per_head * head_dim;
            ISA(scores_columns)(s->qt + first_row * head_dim, rows_pad, head_dim, (const void *const *)keys, nk,
                                s->scores, 1.0f, KEYS_F32);
            ISA(softmax_columns)(s->scores, rows_per_head, rows_pad, nk, s->lo, s->hi, s->row_max + first_row,
                                 s->row_sum + first_row, acc, head_dim);
            ISA(accumulate_values)(acc, rows_per_head, head_dim, s->scores, 1, rows_pad, (const void *const *)values,
                                   nk, NULL, 0, 0);
        }
    }

    for (int h = 0; h < num_heads; h++) {
        for (int i = 0; i < num_tokens; i++) {
            size_t token = (size_t)(q_first + item->first_token + i);
            for (int g = 0; g < group; g++) {
                int r = h * rows_per_head + i * group + g;
                int stat = is_columns ? h * rows_pad + i * group + g : r;
                float inv = ISA(normalizer)(s->row_max[stat], s->row_sum[stat],
                                            a->sinks ? a->sinks + (item->kv_head + h) * group + g : NULL);
                const float *o = s->acc + (size_t)r * head_dim;
                size_t offset = token * a->out_token_stride + (size_t)((item->kv_head + h) * group + g) * head_dim;
                if (pairs) {
#ifdef BF16_PAIRS
                    uint16_t *dst = (uint16_t *)a->out + offset;
                    for (int d = 0; d < head_dim; d++)
                        dst[d] = float_to_bf16(ISA(pairs_value)(o, d) * inv);
#endif
                } else if (is_bf16) {
                    uint16_t *dst = (uint16_t *)a->out + offset;
                    for (int d = 0; d < head_dim; d++)
                        dst[d] = float_to_bf16(o[d] * inv);
                } else {
                    float *dst = (float *)a->out + offset;
                    for (int d = 0; d < head_dim; d++)
                        dst[d] = o[d] * inv;
                }
            }
        }
    }
}
