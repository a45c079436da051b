/* A mixture-of-experts layer's expert GEMMs in one call (kernels/cpu_moe.py packs the weights, once, at load),
 * included by cpu_ops.c: the rows arrive sorted by expert (expert e owns rows [offsets[e], offsets[e + 1])), and
 *   out[r][c] = sum_k x[r][k] * w_e[c][k]    in bf16, accumulated in fp32, rounded once to bf16 at the end.
 *
 * Packed layout, per expert: output columns in panels of 32, each panel [k2][32][2] bf16 (k2 = K / 2 rounded up,
 * K and the columns padded with zero weights): one k2 step of a panel is two 64-byte vectors, each 16 columns x
 * 2 consecutive k, the operand of AVX512-BF16's vdpbf16ps (16 fp32 lanes, each += 2 bf16 x bf16 products).
 * The experts follow one another, so the whole layer is one stream of panels.
 *
 * Why one call: in decode each expert has a few rows (1-20), and a GEMM call per expert (oneDNN, two per expert
 * and layer) read the weights at 14-20 GB/s of the machine's 36-45 (per-call overhead, and two threads splitting
 * each tiny GEMM). Here the work items are (expert with rows, panel), split over the threads in contiguous runs,
 * so each thread streams its part of the layer's weights once, whatever the rows.
 *
 * Two bodies on that layout: AVX512-BF16 (up to 8 rows x 32 columns of fp32 accumulators per tile, the panel's
 * two weight vectors loaded once per k2 step for all its rows, each row's bf16 pair broadcast), and a portable
 * scalar one (any CPU: the tests force it to check the layout; it is not chosen by default, the per-expert
 * oneDNN loop runs where the CPU has no AVX512-BF16). Neither sums in oneDNN's order, so the results differ from
 * it by fp32 rounding before the one rounding to bf16 (the tests bound it).
 */

#define MOE_PANEL 32     /* output columns per packed panel */
#define MOE_TILE_ROWS 8  /* rows per AVX-512 register tile */

typedef struct {
    const uint16_t *x;        /* [rows][x_stride] bf16, grouped by expert */
    const uint16_t *packed;   /* [num_experts][panels][k2][32][2] bf16 */
    const int64_t *offsets;   /* [num_experts + 1]: expert e's rows are [offsets[e], offsets[e + 1]) */
    const int32_t *experts;   /* the experts with rows, in order: work item i is (experts[i / panels], i % panels) */
    uint16_t *out;            /* [rows][out_stride] bf16 */
    int64_t x_stride, out_stride;
    int k, cols, panels;
    const float *bias;        /* fp32 bias [panels * 32] per expert, added before the rounding; or NULL */
    int64_t bias_expert_stride; /* floats from one expert's bias to the next's; 0: one bias for every expert */
} moe_args;

static inline size_t moe_panel_elements(const moe_args *m) { return (size_t)((m->k + 1) / 2) * MOE_PANEL * 2; }

static inline float moe_bf16_to_float(uint16_t v)
{
    uint32_t bits = (uint32_t)v << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static void moe_gemm_items_portable(const moe_args *m, int64_t first, int64_t last)
{
    float acc[MOE_PANEL];
    const int k2 = (m->k + 1) / 2;
    for (int64_t item = first; item < last; item++) {
        const int expert = m->experts[item / m->panels], p = (int)(item % m->panels);
        const uint16_t *panel = m->packed + ((size_t)expert * m->panels + p) * moe_panel_elements(m);
        const float *bias = m->bias ? m->bias + expert * m->bias_expert_stride : NULL;
        for (int64_t r = m->offsets[expert]; r < m->offsets[expert + 1]; r++) {
            const uint16_t *a = m->x + (size_t)r * m->x_stride;
            for (int c = 0; c < MOE_PANEL; c++)
                acc[c] = 0.0f;
            for (int k = 0; k < k2; k++) {
                const uint16_t *w = panel + (size_t)k * MOE_PANEL * 2;
                const float a0 = moe_bf16_to_float(a[2 * k]);
                const float a1 = 2 * k + 1 < m->k ? moe_bf16_to_float(a[2 * k + 1]) : 0.0f;
                for (int c = 0; c < MOE_PANEL; c++)
                    acc[c] += a0 * moe_bf16_to_float(w[2 * c]) + a1 * moe_bf16_to_float(w[2 * c + 1]);
            }
            for (int c = 0; c < MOE_PANEL && p * MOE_PANEL + c < m->cols; c++)
                m->out[(size_t)r * m->out_stride + p * MOE_PANEL + c] =
                    float_to_bf16(bias ? acc[c] + bias[p * MOE_PANEL + c] : acc[c]);
        }
    }
}

#if defined(__x86_64__) && defined(__GNUC__) && __GNUC__ >= 10
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")
#define HAS_MOE_AVX512_BF16 1

/* 16 fp32 columns of one row to bf16 (round to nearest even, as torch for finite values), masked past cols. */
static inline __attribute__((always_inline)) void moe_store_avx512(uint16_t *out, __m512 f, int remaining)
{
    if (remaining <= 0)
        return;
    __mmask16 mask = remaining >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << remaining) - 1);
    __m512i bits = _mm512_castps_si512(f);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    bits = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
    _mm256_mask_storeu_epi16(out, mask, _mm512_cvtepi32_epi16(bits));
}

/* Rows [row, row + R) x the 32 columns of one panel; R is a constant at each call (the switch below), so the rows
 * past it drop out; the accumulators are named variables, not an array, so that they stay in registers. */
#define MOE_ROW_ACCS(r) __m512 acc##r##_0 = zero, acc##r##_1 = zero;
#define MOE_ROW_STEP(r)                                                                        \
    if (R > r) {                                                                               \
        uint32_t pair;                                                                         \
        memcpy(&pair, a + r * stride + 2 * k, 4);                                              \
        __m512bh x = (__m512bh)_mm512_set1_epi32((int)pair);                                   \
        acc##r##_0 = _mm512_dpbf16_ps(acc##r##_0, x, w0);                                      \
        acc##r##_1 = _mm512_dpbf16_ps(acc##r##_1, x, w1);                                      \
    }
#define MOE_ROW_LAST(r) /* K odd: the last pair is (x[K - 1], 0) */                              \
    if (R > r) {                                                                               \
        __m512bh x = (__m512bh)_mm512_set1_epi32((int)a[r * stride + 2 * k]);                 \
        acc##r##_0 = _mm512_dpbf16_ps(acc##r##_0, x, w0);                                      \
        acc##r##_1 = _mm512_dpbf16_ps(acc##r##_1, x, w1);                                      \
    }
#define MOE_ROW_STORE(r)                                                                       \
    if (R > r) {                                                                               \
        uint16_t *o = m->out + (size_t)(row + r) * m->out_stride + col;                        \
        moe_store_avx512(o, acc##r##_0, m->cols - col);                                        \
        moe_store_avx512(o + 16, acc##r##_1, m->cols - col - 16);                              \
    }
#define MOE_ROW_BIAS(r)                                                                        \
    if (R > r) {                                                                               \
        acc##r##_0 = _mm512_add_ps(acc##r##_0, bias0);                                         \
        acc##r##_1 = _mm512_add_ps(acc##r##_1, bias1);                                         \
    }

static inline __attribute__((always_inline)) void moe_tile_avx512(const moe_args *m, const uint16_t *panel,
                                                                  const float *bias, int64_t row, int col,
                                                                  const int R)
{
    const __m512 zero = _mm512_setzero_ps();
    MOE_ROW_ACCS(0) MOE_ROW_ACCS(1) MOE_ROW_ACCS(2) MOE_ROW_ACCS(3)
    MOE_ROW_ACCS(4) MOE_ROW_ACCS(5) MOE_ROW_ACCS(6) MOE_ROW_ACCS(7)
    const uint16_t *a = m->x + (size_t)row * m->x_stride, *w = panel;
    const size_t stride = (size_t)m->x_stride;
    const int whole = m->k / 2;
    int k = 0;
    for (; k < whole; k++, w += MOE_PANEL * 2) {
        __m512bh w0 = (__m512bh)_mm512_loadu_si512(w), w1 = (__m512bh)_mm512_loadu_si512(w + 32);
        MOE_ROW_STEP(0) MOE_ROW_STEP(1) MOE_ROW_STEP(2) MOE_ROW_STEP(3)
        MOE_ROW_STEP(4) MOE_ROW_STEP(5) MOE_ROW_STEP(6) MOE_ROW_STEP(7)
    }
    if (m->k & 1) {
        __m512bh w0 = (__m512bh)_mm512_loadu_si512(w), w1 = (__m512bh)_mm512_loadu_si512(w + 32);
        MOE_ROW_LAST(0) MOE_ROW_LAST(1) MOE_ROW_LAST(2) MOE_ROW_LAST(3)
        MOE_ROW_LAST(4) MOE_ROW_LAST(5) MOE_ROW_LAST(6) MOE_ROW_LAST(7)
    }
    if (bias) { /* fp32, added before the one rounding */
        const __m512 bias0 = _mm512_loadu_ps(bias + col), bias1 = _mm512_loadu_ps(bias + col + 16);
        MOE_ROW_BIAS(0) MOE_ROW_BIAS(1) MOE_ROW_BIAS(2) MOE_ROW_BIAS(3)
        MOE_ROW_BIAS(4) MOE_ROW_BIAS(5) MOE_ROW_BIAS(6) MOE_ROW_BIAS(7)
    }
    MOE_ROW_STORE(0) MOE_ROW_STORE(1) MOE_ROW_STORE(2) MOE_ROW_STORE(3)
    MOE_ROW_STORE(4) MOE_ROW_STORE(5) MOE_ROW_STORE(6) MOE_ROW_STORE(7)
}
#undef MOE_ROW_ACCS
#undef MOE_ROW_STEP
#undef MOE_ROW_LAST
#undef MOE_ROW_STORE
#undef MOE_ROW_BIAS

static void moe_gemm_items_avx512_bf16(const moe_args *m, int64_t first, int64_t last)
{
    for (int64_t item = first; item < last; item++) {
        const int expert = m->experts[item / m->panels], p = (int)(item % m->panels);
        const uint16_t *panel = m->packed + ((size_t)expert * m->panels + p) * moe_panel_elements(m);
        const float *bias = m->bias ? m->bias + expert * m->bias_expert_stride : NULL;
        const int64_t end = m->offsets[expert + 1];
        for (int64_t row = m->offsets[expert]; row < end; row += MOE_TILE_ROWS) {
            switch (end - row < MOE_TILE_ROWS ? (int)(end - row) : MOE_TILE_ROWS) {
            case 1: moe_tile_avx512(m, panel, bias, row, p * MOE_PANEL, 1); break;
            case 2: moe_tile_avx512(m, panel, bias, row, p * MOE_PANEL, 2); break;
            case 3: moe_tile_avx512(m, panel, bias, row, p * MOE_PANEL, 3); break;
            case 4: moe_tile_avx512(m, panel, bias, row, p * MOE_PANEL, 4); break;
            case 5: moe_tile_avx512(m, panel, bias, row, p * MOE_PANEL, 5); break;
            case 6: moe_tile_avx512(m, panel, bias, row, p * MOE_PANEL, 6); break;
            case 7: moe_tile_avx512(m, panel, bias, row, p * MOE_PANEL, 7); break;
            default: moe_tile_avx512(m, panel, bias, row, p * MOE_PANEL, 8); break;
            }
        }
    }
}
#pragma GCC pop_options
#endif

typedef struct {
    const char *name;
    int test_only; /* never selected at import */
    void (*items)(const moe_args *, int64_t, int64_t);
} moe_gemm_entry;

static const moe_gemm_entry MOE_GEMMS[] = {
#ifdef HAS_MOE_AVX512_BF16
    {"avx512_bf16", 0, moe_gemm_items_avx512_bf16},
#endif
    {"portable", 1, moe_gemm_items_portable},
};
#define NUM_MOE_GEMMS ((int)(sizeof(MOE_GEMMS) / sizeof(MOE_GEMMS[0])))

static int moe_gemm_supported(const moe_gemm_entry *gemm)
{
#ifdef HAS_MOE_AVX512_BF16
    __builtin_cpu_init();
    if (strcmp(gemm->name, "avx512_bf16") == 0)
        return CPU_HAS_AVX512_AND("avx512bf16");
#endif
    (void)gemm;
    return 1;
}
