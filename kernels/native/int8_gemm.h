/* The int8 GEMM over a weight packed once at load (kernels/cpu_int8.py packs it), included by cpu_ops.c:
 *   out[r][c] = sum_k x_q[r][k] * w_q[c][k], exact in int32, then scaled as rescale_rows scales (or left int32).
 *
 * Packed layout: output columns in panels of 64, each panel [k4][64][4] int8 (k4 = K / 4 rounded up, K and the
 * columns padded with zero weights): one k4 step of a panel is four 64-byte vectors, each 16 columns x 4
 * consecutive k, the operand of AVX-512 VNNI's vpdpbusd (16 int32 lanes, each += 4 u8 x s8 products).
 * vpdpbusd multiplies unsigned bytes by signed ones, so the activations arrive as codes q + 128 (quantize_rows
 * with offset 128) and each column's 128 * sum_k w[c][k] (``correction``, from the packing) is subtracted:
 * sum (q + 128) w - 128 sum w = sum q w. The sums wrap in int32 (vpdpbusd does not saturate), so the result
 * is exact whenever the true product fits, which |q w| <= 2^14 per term guarantees for K < 2^17.
 *
 * Two bodies on that layout: AVX-512 VNNI (6 rows x 64 columns of int32 accumulators in 24 registers, the
 * panel's four weight vectors loaded once per k4 step for all six rows, each row's 4 codes broadcast), and a
 * portable scalar one (any CPU: the tests run it everywhere to check the layout, the correction and the
 * epilogue bit for bit; it is not chosen by default, torch._int_mm is the GEMM where the CPU has no VNNI).
 * Threads split the panels, so each weight byte is read from memory once per call whatever the row count.
 */

#define INT8_PANEL 64      /* output columns per packed panel */
#define INT8_TILE_ROWS 6   /* rows per AVX-512 register tile */

enum { OUT_F32 = 0, OUT_BF16 = 1, OUT_INT32 = 2 };

typedef struct {
    const uint8_t *codes;       /* [rows][codes_stride]: q + 128, the K columns padded to a multiple of 4 */
    const int8_t *packed;       /* [panels][k4][64][4] */
    const int32_t *correction;  /* [panels * 64]: 128 * sum_k w[c][k] */
    const float *x_scales;      /* per row (x_scale_stride 1) or one for all (0); unused for int32 out */
    const float *w_scales;      /* [panels * 64] */
    const float *bias;          /* [panels * 64] fp32, or NULL */
    void *out;                  /* [rows][out_stride] */
    int64_t rows, codes_stride, x_scale_stride, out_stride;
    int cols, k4, out_dtype;
} gemm_args;

/* Product rounded to fp32 here, never fused into the add that follows (the torch code rounds each op). */
static inline float int8_rounded_mul(float x, float y)
{
    volatile float product = x * y;
    return product;
}

/* The scalar epilogue of `count` columns from `col` of row r. */
static void int8_epilogue_scalar(const gemm_args *g, int64_t r, int col, const int32_t *acc, int count)
{
    for (int c = 0; c < count && col + c < g->cols; c++) {
        int32_t v = (int32_t)((uint32_t)acc[c] - (uint32_t)g->correction[col + c]);
        size_t at = (size_t)r * g->out_stride + col + c;
        if (g->out_dtype == OUT_INT32) {
            ((int32_t *)g->out)[at] = v;
            continue;
        }
        float f = int8_rounded_mul(int8_rounded_mul((float)v, g->x_scales[r * g->x_scale_stride]), g->w_scales[col + c]);
        if (g->bias)
            f += g->bias[col + c];
        if (g->out_dtype == OUT_BF16)
            ((uint16_t *)g->out)[at] = float_to_bf16(f);
        else
            ((float *)g->out)[at] = f;
    }
}

static void int8_gemm_panels_portable(const gemm_args *g, int64_t first, int64_t last)
{
    int32_t acc[INT8_PANEL];
    for (int64_t p = first; p < last; p++) {
        const int8_t *panel = g->packed + (size_t)p * g->k4 * INT8_PANEL * 4;
        for (int64_t r = 0; r < g->rows; r++) {
            const uint8_t *a = g->codes + (size_t)r * g->codes_stride;
            memset(acc, 0, sizeof(acc));
            for (int k = 0; k < g->k4; k++) {
                const int8_t *w = panel + (size_t)k * INT8_PANEL * 4;
                const int32_t a0 = a[4 * k], a1 = a[4 * k + 1], a2 = a[4 * k + 2], a3 = a[4 * k + 3];
                for (int c = 0; c < INT8_PANEL; c++) /* unsigned wrap-around, as vpdpbusd's int32 lanes */
                    acc[c] = (int32_t)((uint32_t)acc[c] + (uint32_t)(a0 * w[4 * c] + a1 * w[4 * c + 1]
                                                                     + a2 * w[4 * c + 2] + a3 * w[4 * c + 3]));
            }
            int8_epilogue_scalar(g, r, (int)(p * INT8_PANEL), acc, INT8_PANEL);
        }
    }
}

#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")
#define HAS_INT8_VNNI 1

#define INT8_KEEP(v) __asm__("" : "+v"(v)) /* the product is rounded here: no FMA with the bias add */

/* 16 columns of row r from `col`: the correction, then the scales and bias, stored (masked past cols). */
static inline __attribute__((always_inline)) void int8_epilogue_avx512(const gemm_args *g, int64_t r, int col,
                                                                        __m512i acc)
{
    int remaining = g->cols - col;
    if (remaining <= 0)
        return;
    __mmask16 mask = remaining >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << remaining) - 1);
    __m512i v = _mm512_sub_epi32(acc, _mm512_loadu_si512(g->correction + col));
    size_t at = (size_t)r * g->out_stride + col;
    if (g->out_dtype == OUT_INT32) {
        _mm512_mask_storeu_epi32((int32_t *)g->out + at, mask, v);
        return;
    }
    __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(v), _mm512_set1_ps(g->x_scales[r * g->x_scale_stride]));
    INT8_KEEP(f);
    f = _mm512_mul_ps(f, _mm512_loadu_ps(g->w_scales + col));
    INT8_KEEP(f);
    if (g->bias)
        f = _mm512_add_ps(f, _mm512_loadu_ps(g->bias + col));
    if (g->out_dtype == OUT_F32) {
        _mm512_mask_storeu_ps((float *)g->out + at, mask, f);
        return;
    }
    /* to bf16, round to nearest even as torch (finite values) */
    __m512i bits = _mm512_castps_si512(f);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    bits = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
    _mm256_mask_storeu_epi16((uint16_t *)g->out + at, mask, _mm512_cvtepi32_epi16(bits));
}

/* Rows [row, row + R) x the 64 columns of panel p. R is a constant at each call (the switch below), so the
 * rows past it drop out; the accumulators are named variables, not an array, so that they stay in registers. */
#define INT8_ROW_ACCS(r) __m512i acc##r##_0 = zero, acc##r##_1 = zero, acc##r##_2 = zero, acc##r##_3 = zero;
#define INT8_ROW_STEP(r)                                                                          \
    if (R > r) {                                                                                  \
        int32_t quad;                                                                             \
        memcpy(&quad, a + r * stride + 4 * k, 4);                                                 \
        __m512i x = _mm512_set1_epi32(quad);                                                      \
        acc##r##_0 = _mm512_dpbusd_epi32(acc##r##_0, x, w0);                                      \
        acc##r##_1 = _mm512_dpbusd_epi32(acc##r##_1, x, w1);                                      \
        acc##r##_2 = _mm512_dpbusd_epi32(acc##r##_2, x, w2);                                      \
        acc##r##_3 = _mm512_dpbusd_epi32(acc##r##_3, x, w3);                                      \
    }
#define INT8_ROW_STORE(r)                                                                         \
    if (R > r) {                                                                                  \
        int8_epilogue_avx512(g, row + r, col, acc##r##_0);                                        \
        int8_epilogue_avx512(g, row + r, col + 16, acc##r##_1);                                   \
        int8_epilogue_avx512(g, row + r, col + 32, acc##r##_2);                                   \
        int8_epilogue_avx512(g, row + r, col + 48, acc##r##_3);                                   \
    }

static inline __attribute__((always_inline)) void int8_tile_avx512(const gemm_args *g, int64_t row, int64_t p, const int R)
{
    const __m512i zero = _mm512_setzero_si512();
    INT8_ROW_ACCS(0) INT8_ROW_ACCS(1) INT8_ROW_ACCS(2) INT8_ROW_ACCS(3) INT8_ROW_ACCS(4) INT8_ROW_ACCS(5)
    const int8_t *w = g->packed + (size_t)p * g->k4 * INT8_PANEL * 4;
    const uint8_t *a = g->codes + (size_t)row * g->codes_stride;
    const size_t stride = (size_t)g->codes_stride;
    for (int k = 0; k < g->k4; k++, w += INT8_PANEL * 4) {
        __m512i w0 = _mm512_loadu_si512(w), w1 = _mm512_loadu_si512(w + 64);
        __m512i w2 = _mm512_loadu_si512(w + 128), w3 = _mm512_loadu_si512(w + 192);
        INT8_ROW_STEP(0) INT8_ROW_STEP(1) INT8_ROW_STEP(2) INT8_ROW_STEP(3) INT8_ROW_STEP(4) INT8_ROW_STEP(5)
    }
    const int col = (int)(p * INT8_PANEL);
    INT8_ROW_STORE(0) INT8_ROW_STORE(1) INT8_ROW_STORE(2) INT8_ROW_STORE(3) INT8_ROW_STORE(4) INT8_ROW_STORE(5)
}
#undef INT8_ROW_ACCS
#undef INT8_ROW_STEP
#undef INT8_ROW_STORE

static void int8_gemm_panels_avx512_vnni(const gemm_args *g, int64_t first, int64_t last)
{
    for (int64_t p = first; p < last; p++) {
        for (int64_t row = 0; row < g->rows; row += INT8_TILE_ROWS) {
            switch (g->rows - row < INT8_TILE_ROWS ? (int)(g->rows - row) : INT8_TILE_ROWS) {
            case 1: int8_tile_avx512(g, row, p, 1); break;
            case 2: int8_tile_avx512(g, row, p, 2); break;
            case 3: int8_tile_avx512(g, row, p, 3); break;
            case 4: int8_tile_avx512(g, row, p, 4); break;
            case 5: int8_tile_avx512(g, row, p, 5); break;
            default: int8_tile_avx512(g, row, p, 6); break;
            }
        }
    }
}
#undef INT8_KEEP
#pragma GCC pop_options
#endif

typedef struct {
    const char *name;
    int test_only; /* never selected at import */
    void (*panels)(const gemm_args *, int64_t, int64_t);
} int8_gemm_entry;

static const int8_gemm_entry INT8_GEMMS[] = {
#ifdef HAS_INT8_VNNI
    {"avx512_vnni", 0, int8_gemm_panels_avx512_vnni},
#endif
    {"portable", 1, int8_gemm_panels_portable},
};
#define NUM_INT8_GEMMS ((int)(sizeof(INT8_GEMMS) / sizeof(INT8_GEMMS[0])))

static int int8_gemm_supported(const int8_gemm_entry *gemm)
{
#ifdef HAS_INT8_VNNI
    __builtin_cpu_init();
    if (strcmp(gemm->name, "avx512_vnni") == 0)
        return CPU_HAS_AVX512_AND("avx512vnni");
#endif
    (void)gemm;
    return 1;
}
