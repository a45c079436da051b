/* kernels._cpu_ops: native CPU kernels of the hot path (kernels/cpu_backend.py wraps them), each with
 * the contract of its torch reference in the kernels/ *_ref.py modules, the oracle it is tested against:
 *   paged_attention  causal attention of a flat batch of queries (prefill chunks, decodes, short verify
 *                    queries, mixed) over each sequence's K/V read in place from the paged cache: GQA,
 *                    sliding windows (paged_attention_isa.h; on a bf16 cache in bf16 pair dot products where
 *                    the CPU has AVX512-BF16: paged_attention_pairs_isa.h)
 *   rms_norm         RMSNorm, the residual add fused (elementwise_isa.h)
 *   rotary           rotate-half rotary embedding of q and k, in place
 *   store_kv         new K/V rows into their cache slots
 *   silu_and_mul     SiLU(gate) * up of a fused gate/up projection
 *   moe_combine      a mixture-of-experts layer's rows, grouped by expert, weighted and summed into their tokens
 * all in fp32 or bf16 (fp32 arithmetic inside), and the W8A8 int8 linear's pieces (quantization/int8.py's
 * torch code is their oracle, kernels/cpu_int8.py wraps them):
 *   quantize_int8    activations to int8 codes per row, absmax and rounding in one pass (int8_isa.h)
 *   rescale_int8     an int32 product to fp32 / bf16 with both scales and the bias (int8_isa.h)
 *   int8_gemm        int8 x int8 -> int32 over a weight packed once, with that rescale fused (int8_gemm.h;
 *                    its own choice of body: AVX-512 VNNI, or the portable one the tests force)
 * and a mixture-of-experts layer's expert GEMMs over rows grouped by expert, bf16, all experts in one call
 * (kernels/cpu_moe.py wraps it):
 *   moe_gemm         each expert's rows x its weight packed once (moe_gemm.h; its own choice of body:
 *                    AVX512-BF16, or the portable one the tests force)
 * and, chaining those, a bf16 Llama-family model's decoder layers for one step in one call
 * (kernels/cpu_decoder_stack.py wraps it):
 *   decoder_stack    norms, q/k/v, rotary, the KV store, attention, o, gate/up, SiLU, down (decoder_stack.h)
 *
 * Each body is compiled once per instruction set and the best one the CPU runs is chosen once, at
 * import: AVX-512 with AVX512-BF16 (avx512's body, attention in bf16 pairs), AVX-512, AVX2 + FMA, 16-byte vectors
 * (SSE2 / NEON), and plain scalar; a row length the chosen
 * width does not divide takes the widest one that does. Work (attention items: sequence x KV head x
 * query tile; elementwise ops: token rows) is spread over OpenMP threads. The module is linked
 * against libgomp.so.1, which torch loads first (it ships one under that name), so these threads are
 * torch's own pool, not a second one competing for the same cores. Tensors arrive as addresses and
 * strides from the Python side, which checks them; the GIL is released while the kernel runs.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif




#define COLUMN_CHUNK 64   /* keys per online-softmax step of a prefill tile (Zen 4: 32 5-8 % slower, 128 1-4 % faster)*/
#define DOT_CHUNK 256     /* ... of a decode (fewer rows: the bookkeeping is amortised over more keys) */
#define DECODE_KEYS 16    /* keys a decode visits across every head before the next ones */
/* Keys ahead a decode prefetches its K/V rows. Measured on Zen 5 (one core, bf16 cache, 4 KV heads of 64, decodes of
 * 310 tokens read from memory): 16 and 64 were 10-25 % slower than 32; on Zen 4 with the L2 prefetch
 * (paged_attention_isa.h's prefetch_row), 16 was as fast in bf16 pairs and 15 % slower widening, 64-128 15-30 %
 * slower. */
#ifndef AHEAD_KEYS
#define AHEAD_KEYS 32
#endif
#define MAX_ROWS 64       /* rows (query tokens x group heads) per work item */
#define MAX_HEAD_DIM 576 /* DeepSeek's latent rows (MLA: 512 + 64, kernels/cpu_mla_attention.py) */
#define PACKED_MIN_ROWS 8 /* more rows per KV head than this: the column layout (queries transposed once) */

enum { DTYPE_F32 = 0, DTYPE_BF16 = 1 };

typedef struct {
    const void *query, *k_cache, *v_cache;
    void *out;
    const int32_t *cu_seqlens_q, *context_lens, *block_tables;
    int num_q_heads, num_kv_heads, head_dim, page_size, dtype, sliding_window;
    int64_t q_token_stride, out_token_stride, k_block_stride, k_token_stride, v_block_stride, v_token_stride;
    int64_t block_table_stride;
    float scale;
    const float *sinks; /* [num_q_heads] attention-sink logits (gpt-oss), fp32, or NULL: each joins its head's
                         * softmax denominator and attends to nothing */
} attn_args;

typedef struct {
    int32_t seq, kv_head, num_heads, first_token, num_tokens;
    int64_t cost; /* rows x keys: heavy items are handed out first */
} work_item;

/* bf16 pairs: a decode chunk's bf16 probabilities per row, padded (a prefill chunk's take less: its pairs) */
#define PROBS_STRIDE (DOT_CHUNK + 32)

typedef struct {
    float *q, *qt, *acc, *scores, *k_rows, *v_rows, *row_max, *row_sum;
    int32_t *lo, *hi;
    uint16_t *probs; /* [MAX_ROWS][PROBS_STRIDE] */
} scratch;

static inline uint16_t float_to_bf16(float x)
{
    uint32_t bits;
    memcpy(&bits, &x, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((bits >> 16) | 0x40); /* quiet NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u);      /* round to nearest even, as torch does */
    return (uint16_t)(bits >> 16);
}

typedef struct {
    const void *x, *weight, *residual; /* residual NULL: no residual add */
    void *residual_out, *out;
    int64_t x_stride, residual_stride, out_stride; /* elements between rows (residual_out: hidden) */
    int hidden, dtype;
    size_t element;
    float eps;
    int offset_weight; /* 1: Gemma's norm, scaled by 1 + weight in fp32 before the one rounding; 0: Llama's */
} norm_args;

typedef struct {
    const void *query, *key;
    void *query_out, *key_out; /* contiguous rows */
    const int64_t *positions;
    const float *cos_sin; /* [max_positions][head_dim]: cos | sin halves, fp32 */
    int64_t q_stride, k_stride;
    int num_q_heads, num_kv_heads, head_dim, dtype;
    size_t element;
} rotary_args;

typedef struct {
    const void *x;
    void *out;
    int64_t x_stride, out_stride;
    int width, dtype; /* width: of gate (and of up, and of out) */
    size_t element;
    int activation; /* ACT_SILU, ACT_GELU_TANH (Gemma's GELU-gated MLP) or ACT_CLAMPED_SWIGLU (gpt-oss's experts) */
    float alpha, limit; /* ACT_CLAMPED_SWIGLU's swiglu_alpha and swiglu_limit */
} silu_args;

enum { ACT_SILU = 0, ACT_GELU_TANH = 1, ACT_CLAMPED_SWIGLU = 2 };

typedef struct {
    const void *rows;          /* [num_rows][rows_stride] fp32 / bf16: the experts' outputs, grouped by expert */
    const int64_t *positions;  /* [num_tokens * top_k]: where (token, choice) is among the grouped rows */
    const float *weights;      /* [num_tokens * top_k]: its routing weight */
    void *out;                 /* [num_tokens][out_stride], the rows' dtype */
    int64_t rows_stride, out_stride;
    int top_k, hidden, dtype;
    size_t element;
} combine_args;
#define MAX_COMBINE_TOP_K 64

typedef struct {
    const void *x;          /* [rows][x_stride] fp32 / bf16 */
    uint8_t *codes;         /* [rows][codes_stride]: q + offset, columns [cols, padded_cols) the code of zero */
    float *scales;          /* per row, written when static_scale <= 0 */
    int64_t x_stride, codes_stride;
    float static_scale;     /* > 0: every row's scale */
    int cols, padded_cols, offset, dtype;
    size_t element;
} quant_args;

typedef struct {
    const int32_t *acc;     /* [rows][acc_stride] */
    const float *x_scales;  /* per row (x_scale_stride 1) or one (0) */
    const float *w_scales;  /* [cols] */
    const float *bias;      /* [cols] fp32, or NULL */
    void *out;              /* [rows][out_stride] fp32 / bf16 */
    int64_t acc_stride, x_scale_stride, out_stride;
    int cols, out_dtype;
} rescale_args;

/* ------------------------------------------------------------------ one body per instruction set */
#define ISA(name) name##_scalar
#define VEC_BYTES 4
#include "vec_isa.h"
#include "paged_attention_isa.h"
#include "elementwise_isa.h"
#include "int8_isa.h"
#include "isa_undef.h"

#define ISA(name) name##_vec128
#define VEC_BYTES 16
#include "vec_isa.h"
#include "paged_attention_isa.h"
#include "elementwise_isa.h"
#include "int8_isa.h"
#include "isa_undef.h"

/* The 16-lane bodies in portable vectors: never chosen by default, there so that every machine's tests
 * run the avx512 logic (lane counts, tails, blocking) even where the CPU has no AVX-512. */
#define ISA(name) name##_vec512
#define VEC_BYTES 64
#include "vec_isa.h"
#include "paged_attention_isa.h"
#include "elementwise_isa.h"
#include "int8_isa.h"
#include "isa_undef.h"

/* The same in portable vectors with bf16 pairs in attention (test only, as vec512: the avx512_bf16 logic on any CPU) */
#define BF16_PAIRS 1
#define ISA(name) name##_vec512_bf16
#define VEC_BYTES 64
#include "vec_isa.h"
#include "bf16_pairs_isa.h"
#include "paged_attention_isa.h"
#include "isa_undef.h"
#undef BF16_PAIRS

#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#define ISA(name) name##_avx2
#define VEC_BYTES 32
#include "vec_isa.h"
#include "paged_attention_isa.h"
#include "elementwise_isa.h"
#include "int8_isa.h"
#include "isa_undef.h"
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma")
#define ISA(name) name##_avx512
#define VEC_BYTES 64
#include "vec_isa.h"
#include "paged_attention_isa.h"
#include "elementwise_isa.h"
#include "int8_isa.h"
#include "isa_undef.h"
#pragma GCC pop_options
#define HAS_X86_VARIANTS 1

/* AVX-512 with AVX512-BF16: attention on a bf16 cache in vdpbf16ps (paged_attention_pairs_isa.h); the elementwise
 * ops are avx512's */
#if __GNUC__ >= 10
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")
#define BF16_PAIRS 1
#define ISA(name) name##_avx512_bf16
#define VEC_BYTES 64
#include "vec_isa.h"
#include "bf16_pairs_isa.h"
#include "paged_attention_isa.h"
#include "isa_undef.h"
#undef BF16_PAIRS
#pragma GCC pop_options
#define HAS_AVX512_BF16_PAIRS 1
#endif
#endif

typedef struct {
    const char *name;
    int width; /* floats per vector: row lengths (head_dim, hidden) must be multiples */
    int test_only; /* never selected at import */
    void (*attend)(const attn_args *, const work_item *, scratch *);
    void (*rms_norm)(const norm_args *, int64_t, int64_t);
    void (*rotary)(const rotary_args *, int64_t, int64_t);
    void (*silu_and_mul)(const silu_args *, int64_t, int64_t);
    void (*moe_combine)(const combine_args *, int64_t, int64_t);
    void (*quantize_rows)(const quant_args *, int64_t, int64_t);
    void (*rescale_rows)(const rescale_args *, int64_t, int64_t);
} isa_entry;

#define ISA_ENTRY(isa, width, test_only) {#isa, width, test_only, attend_item_##isa, rms_norm_rows_##isa, rotary_rows_##isa, silu_and_mul_rows_##isa, moe_combine_rows_##isa, quantize_rows_##isa, rescale_rows_##isa}
/* an attention body with bf16 pairs beside another body's elementwise ops */
#define PAIRS_ENTRY(isa, elementwise, test_only)                                                               \
    {#isa, 16, test_only, attend_item_##isa, rms_norm_rows_##elementwise, rotary_rows_##elementwise,              \
     silu_and_mul_rows_##elementwise, moe_combine_rows_##elementwise, quantize_rows_##elementwise,                \
     rescale_rows_##elementwise}
static const isa_entry ISAS[] = {
#ifdef HAS_AVX512_BF16_PAIRS
    PAIRS_ENTRY(avx512_bf16, avx512, 0),
#endif
#ifdef HAS_X86_VARIANTS
    ISA_ENTRY(avx512, 16, 0),
    ISA_ENTRY(avx2, 8, 0),
#endif
    /* widest first, so that isa_for falls back to a narrower body; vec512 after the x86 bodies, so a
     * row avx2 cannot take (not a multiple of 8) is not one vec512 can */
    PAIRS_ENTRY(vec512_bf16, vec512, 1),
    ISA_ENTRY(vec512, 16, 1),
    ISA_ENTRY(vec128, 4, 0),
    ISA_ENTRY(scalar, 1, 0),
};
#define NUM_ISAS ((int)(sizeof(ISAS) / sizeof(ISAS[0])))

#ifdef HAS_X86_VARIANTS
/* The AVX-512 subsets every AVX-512 body here is compiled for (foundation, byte/word, vector length, dq), and
 * ``extra`` on top (a string literal, as __builtin_cpu_supports wants); after __builtin_cpu_init(). */
#define CPU_HAS_AVX512_AND(extra)                                                                          \
    (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&                            \
     __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports(extra))
#endif

static int isa_supported(const isa_entry *isa)
{
#ifdef HAS_X86_VARIANTS
    __builtin_cpu_init();
    if (strcmp(isa->name, "avx512") == 0)
        return CPU_HAS_AVX512_AND("fma");
    if (strcmp(isa->name, "avx512_bf16") == 0)
        return CPU_HAS_AVX512_AND("fma") && __builtin_cpu_supports("avx512bf16");
    if (strcmp(isa->name, "avx2") == 0)
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#endif
    (void)isa;
    return 1;
}

static int selected_isa = -1; /* index into ISAS: the widest the CPU runs, or the one set_isa chose */

/* The selected ISA, or the widest narrower one whose width divides row_length. */
static const isa_entry *isa_for(int row_length)
{
    for (int i = selected_isa; i < NUM_ISAS; i++)
        if (row_length % ISAS[i].width == 0)
            return &ISAS[i];
    return &ISAS[NUM_ISAS - 1];
}

/* Rows [0, num_rows) of an elementwise op, split into contiguous ranges over the threads when there is
 * enough work to pay for waking them. */
#define MIN_ELEMENTS_PER_THREAD 16384
static void run_rows(void (*fn)(const void *, int64_t, int64_t), const void *args, int64_t num_rows, int64_t row_elements,
                     int num_threads)
{
#ifdef _OPENMP
    int64_t useful = num_rows * row_elements / MIN_ELEMENTS_PER_THREAD;
    if (num_threads > useful)
        num_threads = (int)(useful > 1 ? useful : 1);
    if (num_threads > num_rows)
        num_threads = (int)num_rows;
    if (num_threads > 1) {
#pragma omp parallel num_threads(num_threads)
        {
            int64_t part = omp_get_thread_num(), parts = omp_get_num_threads();
            fn(args, num_rows * part / parts, num_rows * (part + 1) / parts);
        }
        return;
    }
#endif
    (void)row_elements;
    (void)num_threads;
    fn(args, 0, num_rows);
}

#include "int8_gemm.h"

static int selected_int8_gemm = -1; /* index into INT8_GEMMS: the VNNI body the CPU runs, or set_int8_gemm_isa's; -1 none */

#include "moe_gemm.h"

static int selected_moe_gemm = -1; /* index into MOE_GEMMS: the AVX512-BF16 body the CPU runs, or set_moe_gemm_isa's; -1 none */

/* ------------------------------------------------------------------ each kernel's launch, in one place
 * (the bindings below and decoder_stack.h's chain call these: the same bodies, work split and thread counts) */
typedef void (*rows_fn)(const void *, int64_t, int64_t);

static void launch_rms_norm(const norm_args *a, int64_t num_rows, int num_threads)
{
    run_rows((rows_fn)isa_for(a->hidden)->rms_norm, a, num_rows, a->hidden, num_threads);
}

static void launch_rotary(const rotary_args *a, int64_t num_rows, int num_threads)
{
    run_rows((rows_fn)isa_for(a->head_dim / 2)->rotary, a, num_rows,
             (int64_t)(a->num_q_heads + a->num_kv_heads) * a->head_dim, num_threads);
}

static void launch_silu_and_mul(const silu_args *a, int64_t num_rows, int num_threads)
{
    run_rows((rows_fn)isa_for(a->width)->silu_and_mul, a, num_rows, 3 * (int64_t)a->width, num_threads);
}

static void launch_quantize_int8(const quant_args *a, int64_t num_rows, int num_threads)
{
    run_rows((rows_fn)isa_for(a->cols)->quantize_rows, a, num_rows, a->cols, num_threads);
}

/* per panel: rows x K multiply-adds x 64 columns, counted in units run_rows weighs against its minimum */
static void launch_int8_gemm(const gemm_args *g, int num_threads)
{
    run_rows((rows_fn)INT8_GEMMS[selected_int8_gemm].panels, g, (g->cols + INT8_PANEL - 1) / INT8_PANEL,
             g->rows * g->k4 * 16, num_threads);
}

/* per item: one panel's weights, K x 32, counted in units run_rows weighs against its minimum */
static void launch_moe_gemm(const moe_args *m, int64_t num_experts_with_rows, int num_threads)
{
    run_rows((rows_fn)MOE_GEMMS[selected_moe_gemm].items, m, num_experts_with_rows * m->panels,
             (int64_t)m->k * MOE_PANEL, num_threads);
}

/* K/V rows (row_bytes each) into their slots; slot < 0 is skipped. Strides in bytes. */
static void store_kv_rows(const char *key, const char *value, char *k_cache, char *v_cache, const int64_t *slot,
                          int64_t num_rows, int64_t k_stride, int64_t v_stride, int64_t k_block_stride,
                          int64_t k_slot_stride, int64_t v_block_stride, int64_t v_slot_stride, int page_size,
                          size_t row_bytes)
{
    for (int64_t t = 0; t < num_rows; t++) {
        if (slot[t] < 0)
            continue;
        int64_t block = slot[t] / page_size, offset = slot[t] % page_size;
        memcpy(k_cache + block * k_block_stride + offset * k_slot_stride, key + t * k_stride, row_bytes);
        memcpy(v_cache + block * v_block_stride + offset * v_slot_stride, value + t * v_stride, row_bytes);
    }
}

/* ------------------------------------------------------------------ scratch and work items */
/* Rows padded to a multiple of the widest vector, per KV head, in the column layout. */
#define MAX_ROWS_PADDED (MAX_ROWS + 16)

static int scratch_alloc(scratch *s, int head_dim)
{
    size_t rows_x_dim = (size_t)MAX_ROWS * head_dim;
    size_t padded_x_dim = (size_t)(MAX_ROWS + 16 * (MAX_ROWS / 2)) * head_dim; /* qt: up to 16-row padding per head */
    size_t scores = (size_t)COLUMN_CHUNK * MAX_ROWS_PADDED > (size_t)MAX_ROWS * DOT_CHUNK
                        ? (size_t)COLUMN_CHUNK * MAX_ROWS_PADDED : (size_t)MAX_ROWS * DOT_CHUNK; /* decodes: every head's rows */
    size_t converted = (size_t)COLUMN_CHUNK * head_dim, rows = MAX_ROWS + 16 * (MAX_ROWS / 2);
    size_t floats = rows_x_dim + padded_x_dim + rows_x_dim + scores + 2 * converted + 2 * rows;
    size_t bytes = (floats * sizeof(float) + 2 * rows * sizeof(int32_t) + 63) / 64 * 64;
    float *base = aligned_alloc(64, bytes + (size_t)MAX_ROWS * PROBS_STRIDE * sizeof(uint16_t));
    if (!base)
        return -1;
    s->q = base;
    s->qt = s->q + rows_x_dim;
    s->acc = s->qt + padded_x_dim;
    s->scores = s->acc + rows_x_dim;
    s->k_rows = s->scores + scores;
    s->v_rows = s->k_rows + converted;
    s->row_max = s->v_rows + converted;
    s->row_sum = s->row_max + rows;
    s->lo = (int32_t *)(s->row_sum + rows);
    s->hi = s->lo + rows;
    s->probs = (uint16_t *)((char *)base + bytes);
    return 0;
}

static int by_cost_descending(const void *x, const void *y)
{
    int64_t a = ((const work_item *)x)->cost, b = ((const work_item *)y)->cost;
    return (a < b) - (a > b);
}

/* Items: each sequence's query tokens in tiles of at most MAX_ROWS rows. A tile whose rows for every
 * KV head fit (decodes, short queries) takes all heads at once, reading each page's token rows whole;
 * longer tiles take one KV head each. With fewer sequences than threads, decodes split by head too. */
static work_item *make_items(const attn_args *a, int num_seqs, int num_threads, int64_t *num_items)
{
    int group = a->num_q_heads / a->num_kv_heads;
    int tile = MAX_ROWS / group > 0 ? MAX_ROWS / group : 1;
    int heads_together = a->num_q_heads <= MAX_ROWS && num_seqs >= 2 * num_threads;
    int64_t count = 0;
    for (int s = 0; s < num_seqs; s++) {
        int q_len = a->cu_seqlens_q[s + 1] - a->cu_seqlens_q[s];
        count += (int64_t)((q_len + tile - 1) / tile) * a->num_kv_heads;
    }
    work_item *items = malloc((count > 0 ? count : 1) * sizeof(work_item));
    if (!items)
        return NULL;
    int64_t n = 0;
    for (int s = 0; s < num_seqs; s++) {
        int q_len = a->cu_seqlens_q[s + 1] - a->cu_seqlens_q[s];
        int context_len = a->context_lens[s];
        int all_heads = heads_together && q_len * a->num_q_heads <= MAX_ROWS;
        for (int first = 0; first < q_len; first += tile) {
            int num_tokens = all_heads ? q_len : (q_len - first < tile ? q_len - first : tile);
            int64_t keys = context_len - q_len + first + num_tokens;
            if (a->sliding_window > 0 && keys > a->sliding_window + num_tokens)
                keys = a->sliding_window + num_tokens;
            if (all_heads) {
                items[n++] = (work_item){s, 0, a->num_kv_heads, first, num_tokens, keys * num_tokens * a->num_kv_heads};
                break;
            }
            for (int h = 0; h < a->num_kv_heads; h++)
                items[n++] = (work_item){s, h, 1, first, num_tokens, keys * num_tokens};
        }
    }
    *num_items = n;
    return items;
}

static int run_attention(const attn_args *a, int num_seqs, int num_threads)
{
    const isa_entry *isa = isa_for(a->head_dim);
    int64_t num_items = 0;
    work_item *items = make_items(a, num_seqs, num_threads, &num_items);
    if (!items)
        return -1;
    int failed = 0;
#ifdef _OPENMP
    if (num_threads > num_items)
        num_threads = (int)num_items;
    if (num_threads > 1) {
        qsort(items, num_items, sizeof(work_item), by_cost_descending);
        int64_t next = 0;
#pragma omp parallel num_threads(num_threads)
        {
            scratch s;
            if (scratch_alloc(&s, a->head_dim) != 0) {
#pragma omp atomic write
                failed = 1;
            } else {
                for (;;) {
                    int64_t i;
#pragma omp atomic capture
                    i = next++;
                    if (i >= num_items)
                        break;
                    isa->attend(a, &items[i], &s);
                }
                free(s.q);
            }
        }
        free(items);
        return failed ? -1 : 0;
    }
#endif
    (void)num_threads;
    scratch s;
    if (scratch_alloc(&s, a->head_dim) != 0) {
        free(items);
        return -1;
    }
    for (int64_t i = 0; i < num_items; i++)
        isa->attend(a, &items[i], &s);
    free(s.q);
    free(items);
    return failed;
}

/* ------------------------------------------------------------------ Python bindings */
static PyObject *py_paged_attention(PyObject *self, PyObject *args)
{
    (void)self;
    unsigned long long query, k_cache, v_cache, out, cu_seqlens_q, context_lens, block_tables, sinks = 0;
    int num_seqs, num_threads;
    attn_args a;
    long long strides[7];
    if (!PyArg_ParseTuple(args, "KKKKKKKiiiiiiiLLLLLLLfi|K", &query, &k_cache, &v_cache, &out, &cu_seqlens_q,
                          &context_lens, &block_tables, &num_seqs, &a.num_q_heads, &a.num_kv_heads, &a.head_dim,
                          &a.page_size, &a.dtype, &a.sliding_window, &strides[0], &strides[1], &strides[2],
                          &strides[3], &strides[4], &strides[5], &strides[6], &a.scale, &num_threads, &sinks))
        return NULL;
    a.sinks = (const float *)(uintptr_t)sinks;
    if (a.num_kv_heads <= 0 || a.num_q_heads % a.num_kv_heads != 0 || a.num_q_heads / a.num_kv_heads > MAX_ROWS) {
        PyErr_SetString(PyExc_ValueError, "paged_attention: num_q_heads must be a multiple of num_kv_heads (group <= 64)");
        return NULL;
    }
    if (a.head_dim <= 0 || a.head_dim > MAX_HEAD_DIM || a.page_size <= 0 || (a.dtype != DTYPE_F32 && a.dtype != DTYPE_BF16)) {
        PyErr_SetString(PyExc_ValueError, "paged_attention: unsupported head_dim, page_size or dtype");
        return NULL;
    }
    a.query = (const void *)(uintptr_t)query;
    a.k_cache = (const void *)(uintptr_t)k_cache;
    a.v_cache = (const void *)(uintptr_t)v_cache;
    a.out = (void *)(uintptr_t)out;
    a.cu_seqlens_q = (const int32_t *)(uintptr_t)cu_seqlens_q;
    a.context_lens = (const int32_t *)(uintptr_t)context_lens;
    a.block_tables = (const int32_t *)(uintptr_t)block_tables;
    a.q_token_stride = strides[0];
    a.out_token_stride = strides[1];
    a.k_block_stride = strides[2];
    a.k_token_stride = strides[3];
    a.v_block_stride = strides[4];
    a.v_token_stride = strides[5];
    a.block_table_stride = strides[6];
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = run_attention(&a, num_seqs, num_threads);
    Py_END_ALLOW_THREADS
    if (status != 0)
        return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *py_rms_norm(PyObject *self, PyObject *args)
{
    (void)self;
    unsigned long long x, weight, residual, residual_out, out;
    long long num_rows;
    int num_threads;
    norm_args a;
    a.offset_weight = 0;
    if (!PyArg_ParseTuple(args, "KKKKKLLLLiifi|p", &x, &weight, &residual, &residual_out, &out, &num_rows,
                          &a.x_stride, &a.residual_stride, &a.out_stride, &a.hidden, &a.dtype, &a.eps, &num_threads,
                          &a.offset_weight))
        return NULL;
    a.x = (const void *)(uintptr_t)x;
    a.weight = (const void *)(uintptr_t)weight;
    a.residual = (const void *)(uintptr_t)residual;
    a.residual_out = (void *)(uintptr_t)residual_out;
    a.out = (void *)(uintptr_t)out;
    a.element = a.dtype == DTYPE_BF16 ? 2 : 4;
    Py_BEGIN_ALLOW_THREADS
    launch_rms_norm(&a, num_rows, num_threads);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_rotary(PyObject *self, PyObject *args)
{
    (void)self;
    unsigned long long query, key, query_out, key_out, positions, cos_sin;
    long long num_rows;
    int num_threads;
    rotary_args a;
    if (!PyArg_ParseTuple(args, "KKKKKKLLLiiiii", &query, &key, &query_out, &key_out, &positions, &cos_sin, &num_rows,
                          &a.q_stride, &a.k_stride, &a.num_q_heads, &a.num_kv_heads, &a.head_dim, &a.dtype,
                          &num_threads))
        return NULL;
    a.query = (const void *)(uintptr_t)query;
    a.key = (const void *)(uintptr_t)key;
    a.query_out = (void *)(uintptr_t)query_out;
    a.key_out = (void *)(uintptr_t)key_out;
    a.positions = (const int64_t *)(uintptr_t)positions;
    a.cos_sin = (const float *)(uintptr_t)cos_sin;
    a.element = a.dtype == DTYPE_BF16 ? 2 : 4;
    Py_BEGIN_ALLOW_THREADS
    launch_rotary(&a, num_rows, num_threads);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_silu_and_mul(PyObject *self, PyObject *args)
{
    (void)self;
    unsigned long long x, out;
    long long num_rows;
    int num_threads;
    silu_args a;
    a.activation = ACT_SILU;
    a.alpha = a.limit = 0.0f;
    if (!PyArg_ParseTuple(args, "KKLLLiii|iff", &x, &out, &num_rows, &a.x_stride, &a.out_stride, &a.width, &a.dtype,
                          &num_threads, &a.activation, &a.alpha, &a.limit))
        return NULL;
    if (a.activation != ACT_SILU && a.activation != ACT_GELU_TANH && a.activation != ACT_CLAMPED_SWIGLU) {
        PyErr_Format(PyExc_ValueError, "activation must be 0 (SiLU), 1 (GELU-tanh) or 2 (clamped SwiGLU), got %d",
                     a.activation);
        return NULL;
    }
    a.x = (const void *)(uintptr_t)x;
    a.out = (void *)(uintptr_t)out;
    a.element = a.dtype == DTYPE_BF16 ? 2 : 4;
    Py_BEGIN_ALLOW_THREADS
    launch_silu_and_mul(&a, num_rows, num_threads);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* Each token's top_k rows, weighted, summed into it (moe_combine_rows in elementwise_isa.h). */
static PyObject *py_moe_combine(PyObject *self, PyObject *args)
{
    (void)self;
    unsigned long long rows, positions, weights, out;
    long long num_tokens;
    int num_threads;
    combine_args a;
    if (!PyArg_ParseTuple(args, "KKKKLLLiiii", &rows, &positions, &weights, &out, &num_tokens, &a.rows_stride,
                          &a.out_stride, &a.top_k, &a.hidden, &a.dtype, &num_threads))
        return NULL;
    if (a.top_k < 1 || a.top_k > MAX_COMBINE_TOP_K) {
        PyErr_SetString(PyExc_ValueError, "moe_combine: top_k must be 1 to 64");
        return NULL;
    }
    a.rows = (const void *)(uintptr_t)rows;
    a.positions = (const int64_t *)(uintptr_t)positions;
    a.weights = (const float *)(uintptr_t)weights;
    a.out = (void *)(uintptr_t)out;
    a.element = a.dtype == DTYPE_BF16 ? 2 : 4;
    Py_BEGIN_ALLOW_THREADS
    run_rows((rows_fn)isa_for(a.hidden)->moe_combine, &a, num_tokens, (int64_t)(a.top_k + 1) * a.hidden, num_threads);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* K/V rows (num_kv_heads * head_dim contiguous elements each) into their slots; slot < 0 is skipped. */
static PyObject *py_store_kv(PyObject *self, PyObject *args)
{
    (void)self;
    unsigned long long key, value, k_cache, v_cache, slots;
    long long num_rows, k_stride, v_stride, k_block_stride, k_slot_stride, v_block_stride, v_slot_stride;
    int page_size, row_bytes;
    if (!PyArg_ParseTuple(args, "KKKKKLLLLLLLii", &key, &value, &k_cache, &v_cache, &slots, &num_rows, &k_stride,
                          &v_stride, &k_block_stride, &k_slot_stride, &v_block_stride, &v_slot_stride, &page_size,
                          &row_bytes))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    store_kv_rows((const char *)(uintptr_t)key, (const char *)(uintptr_t)value, (char *)(uintptr_t)k_cache,
                  (char *)(uintptr_t)v_cache, (const int64_t *)(uintptr_t)slots, num_rows, k_stride, v_stride,
                  k_block_stride, k_slot_stride, v_block_stride, v_slot_stride, page_size, (size_t)row_bytes);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_quantize_int8(PyObject *self, PyObject *args)
{
    (void)self;
    unsigned long long x, codes, scales;
    long long num_rows;
    int num_threads;
    quant_args a;
    if (!PyArg_ParseTuple(args, "KKKLLLfiiiii", &x, &codes, &scales, &num_rows, &a.x_stride, &a.codes_stride,
                          &a.static_scale, &a.cols, &a.padded_cols, &a.offset, &a.dtype, &num_threads))
        return NULL;
    if (a.cols <= 0 || a.padded_cols < a.cols || a.codes_stride < a.padded_cols || (a.offset != 0 && a.offset != 128)) {
        PyErr_SetString(PyExc_ValueError, "quantize_int8: bad column counts or offset");
        return NULL;
    }
    a.x = (const void *)(uintptr_t)x;
    a.codes = (uint8_t *)(uintptr_t)codes;
    a.scales = (float *)(uintptr_t)scales;
    a.element = a.dtype == DTYPE_BF16 ? 2 : 4;
    Py_BEGIN_ALLOW_THREADS
    launch_quantize_int8(&a, num_rows, num_threads);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_rescale_int8(PyObject *self, PyObject *args)
{
    (void)self;
    unsigned long long acc, x_scales, w_scales, bias, out;
    long long num_rows;
    int num_threads;
    rescale_args a;
    if (!PyArg_ParseTuple(args, "KKKKKLLLLiii", &acc, &x_scales, &w_scales, &bias, &out, &num_rows, &a.acc_stride,
                          &a.x_scale_stride, &a.out_stride, &a.cols, &a.out_dtype, &num_threads))
        return NULL;
    a.acc = (const int32_t *)(uintptr_t)acc;
    a.x_scales = (const float *)(uintptr_t)x_scales;
    a.w_scales = (const float *)(uintptr_t)w_scales;
    a.bias = (const float *)(uintptr_t)bias;
    a.out = (void *)(uintptr_t)out;
    Py_BEGIN_ALLOW_THREADS
    run_rows((rows_fn)isa_for(a.cols)->rescale_rows, &a, num_rows, a.cols, num_threads);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_int8_gemm(PyObject *self, PyObject *args)
{
    (void)self;
    unsigned long long codes, packed, correction, x_scales, w_scales, bias, out;
    int num_threads;
    gemm_args g;
    if (!PyArg_ParseTuple(args, "KKKKKKKLLLLiiii", &codes, &packed, &correction, &x_scales, &w_scales, &bias, &out,
                          &g.rows, &g.codes_stride, &g.x_scale_stride, &g.out_stride, &g.cols, &g.k4, &g.out_dtype,
                          &num_threads))
        return NULL;
    if (selected_int8_gemm < 0) {
        PyErr_SetString(PyExc_RuntimeError, "int8_gemm: this CPU has no int8 GEMM body chosen (no VNNI)");
        return NULL;
    }
    if (g.cols <= 0 || g.k4 <= 0 || g.codes_stride < 4 * (int64_t)g.k4 || g.out_dtype < OUT_F32 || g.out_dtype > OUT_INT32) {
        PyErr_SetString(PyExc_ValueError, "int8_gemm: bad shapes or output dtype");
        return NULL;
    }
    g.codes = (const uint8_t *)(uintptr_t)codes;
    g.packed = (const int8_t *)(uintptr_t)packed;
    g.correction = (const int32_t *)(uintptr_t)correction;
    g.x_scales = (const float *)(uintptr_t)x_scales;
    g.w_scales = (const float *)(uintptr_t)w_scales;
    g.bias = (const float *)(uintptr_t)bias;
    g.out = (void *)(uintptr_t)out;
    Py_BEGIN_ALLOW_THREADS
    launch_int8_gemm(&g, num_threads);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_int8_gemm_isa(PyObject *self, PyObject *args)
{
    (void)self;
    (void)args;
    if (selected_int8_gemm < 0)
        Py_RETURN_NONE;
    return PyUnicode_FromString(INT8_GEMMS[selected_int8_gemm].name);
}

static PyObject *py_moe_gemm(PyObject *self, PyObject *args)
{
    (void)self;
    unsigned long long x, packed, offsets, out, bias;
    int num_experts, num_threads;
    moe_args m;
    m.bias_expert_stride = 0;
    if (!PyArg_ParseTuple(args, "KKKKiLLiiiK|L", &x, &packed, &offsets, &out, &num_experts, &m.x_stride,
                          &m.out_stride, &m.k, &m.cols, &num_threads, &bias, &m.bias_expert_stride))
        return NULL;
    const int64_t padded_cols = (int64_t)((m.cols + MOE_PANEL - 1) / MOE_PANEL) * MOE_PANEL;
    if (bias && num_experts != 1 && m.bias_expert_stride < padded_cols) {
        PyErr_SetString(PyExc_ValueError, "moe_gemm: several experts' bias needs bias_expert_stride >= the padded "
                        "columns (one bias per expert)");
        return NULL;
    }
    m.bias = (const float *)(uintptr_t)bias;
    if (selected_moe_gemm < 0) {
        PyErr_SetString(PyExc_RuntimeError, "moe_gemm: this CPU has no MoE GEMM body chosen (no AVX512-BF16)");
        return NULL;
    }
    if (num_experts <= 0 || m.k <= 0 || m.cols <= 0 || m.x_stride < m.k || m.out_stride < m.cols) {
        PyErr_SetString(PyExc_ValueError, "moe_gemm: bad shapes");
        return NULL;
    }
    m.x = (const uint16_t *)(uintptr_t)x;
    m.packed = (const uint16_t *)(uintptr_t)packed;
    m.offsets = (const int64_t *)(uintptr_t)offsets;
    m.out = (uint16_t *)(uintptr_t)out;
    m.panels = (m.cols + MOE_PANEL - 1) / MOE_PANEL;
    int32_t *experts = malloc(sizeof(int32_t) * (size_t)num_experts);
    if (!experts)
        return PyErr_NoMemory();
    int64_t num_with_rows = 0;
    for (int e = 0; e < num_experts; e++)
        if (m.offsets[e + 1] > m.offsets[e])
            experts[num_with_rows++] = e;
    m.experts = experts;
    Py_BEGIN_ALLOW_THREADS
    launch_moe_gemm(&m, num_with_rows, num_threads);
    Py_END_ALLOW_THREADS
    free(experts);
    Py_RETURN_NONE;
}

static PyObject *py_moe_gemm_isa(PyObject *self, PyObject *args)
{
    (void)self;
    (void)args;
    if (selected_moe_gemm < 0)
        Py_RETURN_NONE;
    return PyUnicode_FromString(MOE_GEMMS[selected_moe_gemm].name);
}

/* A table of interchangeable bodies (the instruction sets, the int8 GEMMs): how many, each one's name, whether this
 * CPU runs it, and what to call one in an error. Listing the ones this CPU runs and choosing one by name, for
 * Python, are written once over it. */
typedef struct {
    int count;
    const char *(*name)(int);
    int (*supported)(int);
    const char *kind;
} variant_table;

static const char *isa_name(int i) { return ISAS[i].name; }
static int isa_index_supported(int i) { return isa_supported(&ISAS[i]); }
static const char *int8_gemm_name(int i) { return INT8_GEMMS[i].name; }
static int int8_gemm_index_supported(int i) { return int8_gemm_supported(&INT8_GEMMS[i]); }
static const variant_table ISA_TABLE = {NUM_ISAS, isa_name, isa_index_supported, "instruction set"};
static const variant_table INT8_GEMM_TABLE = {NUM_INT8_GEMMS, int8_gemm_name, int8_gemm_index_supported,
                                              "int8 GEMM body"};
static const char *moe_gemm_name(int i) { return MOE_GEMMS[i].name; }
static int moe_gemm_index_supported(int i) { return moe_gemm_supported(&MOE_GEMMS[i]); }
static const variant_table MOE_GEMM_TABLE = {NUM_MOE_GEMMS, moe_gemm_name, moe_gemm_index_supported, "MoE GEMM body"};

/* A list of the names of the table's entries this CPU runs. */
static PyObject *supported_names(const variant_table *table)
{
    PyObject *names = PyList_New(0);
    for (int i = 0; names && i < table->count; i++) {
        if (!table->supported(i))
            continue;
        PyObject *name = PyUnicode_FromString(table->name(i));
        if (!name || PyList_Append(names, name) != 0) {
            Py_XDECREF(name);
            Py_DECREF(names);
            return NULL;
        }
        Py_DECREF(name);
    }
    return names;
}

/* *selected = the entry called name; ValueError (returns NULL) when there is none or this CPU does not run it. */
static PyObject *select_variant(const variant_table *table, const char *name, int *selected)
{
    for (int i = 0; i < table->count; i++) {
        if (strcmp(table->name(i), name) == 0) {
            if (!table->supported(i)) {
                PyErr_Format(PyExc_ValueError, "this CPU does not run %s", name);
                return NULL;
            }
            *selected = i;
            Py_RETURN_NONE;
        }
    }
    PyErr_Format(PyExc_ValueError, "unknown %s %s", table->kind, name);
    return NULL;
}

static PyObject *py_supported_int8_gemm_isas(PyObject *self, PyObject *args)
{
    (void)self;
    (void)args;
    return supported_names(&INT8_GEMM_TABLE);
}

/* select_variant for a table whose choice may also be none (``None``: -1, the torch path a CPU without the body runs). */
static PyObject *select_optional_variant(const variant_table *table, PyObject *args, int *selected)
{
    PyObject *name_object;
    if (!PyArg_ParseTuple(args, "O", &name_object))
        return NULL;
    if (name_object == Py_None) {
        *selected = -1;
        Py_RETURN_NONE;
    }
    const char *name = PyUnicode_AsUTF8(name_object);
    if (!name)
        return NULL;
    return select_variant(table, name, selected);
}

static PyObject *py_set_int8_gemm_isa(PyObject *self, PyObject *args)
{
    (void)self; /* None: torch._int_mm, as on a CPU without VNNI */
    return select_optional_variant(&INT8_GEMM_TABLE, args, &selected_int8_gemm);
}

static PyObject *py_supported_moe_gemm_isas(PyObject *self, PyObject *args)
{
    (void)self;
    (void)args;
    return supported_names(&MOE_GEMM_TABLE);
}

static PyObject *py_set_moe_gemm_isa(PyObject *self, PyObject *args)
{
    (void)self; /* None: the per-expert oneDNN loop, as on a CPU without AVX512-BF16 */
    return select_optional_variant(&MOE_GEMM_TABLE, args, &selected_moe_gemm);
}

static PyObject *py_isa(PyObject *self, PyObject *args)
{
    (void)self;
    (void)args;
    return PyUnicode_FromString(ISAS[selected_isa].name);
}

static PyObject *py_supported_isas(PyObject *self, PyObject *args)
{
    (void)self;
    (void)args;
    return supported_names(&ISA_TABLE);
}

static PyObject *py_set_isa(PyObject *self, PyObject *args)
{
    (void)self;
    const char *name;
    if (!PyArg_ParseTuple(args, "s", &name))
        return NULL;
    return select_variant(&ISA_TABLE, name, &selected_isa);
}

#include "decoder_stack.h"

static PyMethodDef METHODS[] = {
    {"paged_attention", py_paged_attention, METH_VARARGS,
     "paged_attention(query, k_cache, v_cache, out, cu_seqlens_q, context_lens, block_tables (addresses), "
     "num_seqs, num_q_heads, num_kv_heads, head_dim, page_size, dtype (0 fp32, 1 bf16), sliding_window (0 none), "
     "q_token_stride, out_token_stride, k_block_stride, k_token_stride, v_block_stride, v_token_stride, "
     "block_table_stride (elements), scale, num_threads, sinks=0 (address of num_q_heads fp32 attention-sink "
     "logits, gpt-oss's; 0: none)"},
    {"rms_norm", py_rms_norm, METH_VARARGS,
     "rms_norm(x, weight, residual (0: none), residual_out, out (addresses), num_rows, x_stride, residual_stride, "
     "out_stride, hidden, dtype, eps, num_threads, offset_weight=False): residual_out = x + residual when given "
     "(contiguous rows); out = RMSNorm(residual_out or x), Llama's, or with offset_weight Gemma's (scaled by "
     "1 + weight in fp32)"},
    {"rotary", py_rotary, METH_VARARGS,
     "rotary(query, key, query_out, key_out, positions (int64), cos_sin (fp32) (addresses), num_rows, q_stride, "
     "k_stride, num_q_heads, num_kv_heads, head_dim, dtype, num_threads): rotate-half rotary embedding into the "
     "(contiguous) outputs"},
    {"silu_and_mul", py_silu_and_mul, METH_VARARGS,
     "silu_and_mul(x, out (addresses), num_rows, x_stride, out_stride, width, dtype, num_threads, activation=0, "
     "alpha=0, limit=0): out = act(x[:, :width]) * x[:, width:], act SiLU (0) or GELU's tanh approximation (1); or "
     "(2) gpt-oss's clamped SwiGLU of the two halves with swiglu_alpha and swiglu_limit"},
    {"moe_combine", py_moe_combine, METH_VARARGS,
     "moe_combine(rows, positions (int64), weights (fp32), out (addresses), num_tokens, rows_stride, out_stride, "
     "top_k, hidden, dtype, num_threads): each token's top_k rows times their weights, summed in fp32, into out"},
    {"store_kv", py_store_kv, METH_VARARGS,
     "store_kv(key, value, k_cache, v_cache, slot_mapping (int64) (addresses), num_rows, key_stride, value_stride, "
     "k_block_stride, k_slot_stride, v_block_stride, v_slot_stride (bytes), page_size, row_bytes)"},
    {"quantize_int8", py_quantize_int8, METH_VARARGS,
     "quantize_int8(x, codes, scales (addresses), num_rows, x_stride, codes_stride, static_scale (<= 0: per row, "
     "written to scales), cols, padded_cols, offset (0 or 128), dtype, num_threads): codes = round(x / scale) "
     "clamped to [-128, 127], + offset, as bytes"},
    {"rescale_int8", py_rescale_int8, METH_VARARGS,
     "rescale_int8(acc (int32), x_scales, w_scales, bias (0: none), out (addresses), num_rows, acc_stride, "
     "x_scale_stride (0: one scale), out_stride, cols, out_dtype (0 fp32, 1 bf16), num_threads): "
     "out = acc * x_scale * w_scale (+ bias), each product rounded to fp32"},
    {"int8_gemm", py_int8_gemm, METH_VARARGS,
     "int8_gemm(codes (u8, q + 128), packed, correction, x_scales, w_scales, bias (0: none), out (addresses), "
     "num_rows, codes_stride, x_scale_stride, out_stride, cols, k4, out_dtype (0 fp32, 1 bf16, 2 int32), "
     "num_threads): the packed weight's product (int8_gemm.h), rescaled as rescale_int8 or left int32"},
    {"int8_gemm_isa", py_int8_gemm_isa, METH_NOARGS,
     "The int8 GEMM body in use (avx512_vnni, or portable when set), None where the CPU has no VNNI."},
    {"supported_int8_gemm_isas", py_supported_int8_gemm_isas, METH_NOARGS, "Every int8 GEMM body this CPU runs."},
    {"set_int8_gemm_isa", py_set_int8_gemm_isa, METH_VARARGS,
     "Run int8_gemm with this body (None: none, as without VNNI); tests compare them."},
    {"moe_gemm", py_moe_gemm, METH_VARARGS,
     "moe_gemm(x (bf16, rows grouped by expert), packed, offsets (int64, num_experts + 1), out (bf16) (addresses), "
     "num_experts, x_stride, out_stride, k, cols, num_threads, bias (fp32 [panels * 32] address, 0: none), "
     "bias_expert_stride=0 (floats between experts' biases; 0: one bias, a dense linear's)): each expert's rows x its "
     "packed weight (+ its bias) (moe_gemm.h)"},
    {"moe_gemm_isa", py_moe_gemm_isa, METH_NOARGS,
     "The MoE GEMM body in use (avx512_bf16, or portable when set), None where the CPU has no AVX512-BF16."},
    {"supported_moe_gemm_isas", py_supported_moe_gemm_isas, METH_NOARGS, "Every MoE GEMM body this CPU runs."},
    {"set_moe_gemm_isa", py_set_moe_gemm_isa, METH_VARARGS,
     "Run moe_gemm with this body (None: none, as without AVX512-BF16); tests compare them."},
    {"decoder_stack", py_decoder_stack, METH_VARARGS,
     "decoder_stack(plan (int64), floats (float64), embedded, delta, residual, scratch (addresses), scratch_elements, "
     "positions (int64), slot_mapping (int64), cu_seqlens_q, context_lens, block_tables (int32) (addresses), "
     "block_table_stride, num_rows, num_seqs, num_threads): a bf16 Llama-family decoder stack's step (decoder_stack.h)"},
    {"decoder_stack_scratch", py_decoder_stack_scratch, METH_VARARGS,
     "decoder_stack_scratch(plan (address)): the scratch elements decoder_stack needs per token row"},
    {"isa", py_isa, METH_NOARGS, "The instruction set the kernels run (the widest this CPU has, unless set_isa chose)."},
    {"supported_isas", py_supported_isas, METH_NOARGS, "Every instruction set this CPU runs, widest first."},
    {"set_isa", py_set_isa, METH_VARARGS, "Run the kernels with this instruction set (tests compare them)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef MODULE = {PyModuleDef_HEAD_INIT, "_cpu_ops", "Native CPU kernels (see cpu_ops.c).", -1, METHODS};

PyMODINIT_FUNC PyInit__cpu_ops(void)
{
    for (int i = 0; i < NUM_ISAS; i++) {
        if (!ISAS[i].test_only && isa_supported(&ISAS[i])) {
            selected_isa = i;
            break;
        }
    }
    for (int i = 0; i < NUM_INT8_GEMMS; i++) {
        if (!INT8_GEMMS[i].test_only && int8_gemm_supported(&INT8_GEMMS[i])) {
            selected_int8_gemm = i;
            break;
        }
    }
    for (int i = 0; i < NUM_MOE_GEMMS; i++) {
        if (!MOE_GEMMS[i].test_only && moe_gemm_supported(&MOE_GEMMS[i])) {
            selected_moe_gemm = i;
            break;
        }
    }
    return PyModule_Create(&MODULE);
}
