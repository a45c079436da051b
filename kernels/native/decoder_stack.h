/* A plain Llama-family or Gemma 3 model's decoder layers, one step of them, in one call (kernels/cpu_decoder_stack.py
 * builds the plan and decides when a step may take it), included by cpu_ops.c after the kernels it chains (their
 * launch_* helpers and store_kv_rows, the ones the bindings call):
 *
 *   per layer:  normed, residual = rms_norm(delta + residual)      (layer 0: rms_norm(embedded), residual = embedded)
 *               qkv = normed x W_qkv (+ b)       moe_gemm's body, one expert (bf16), or W8A8: int8 codes per token
 *                                                  and the int8 GEMM with its scales (int8_isa.h, int8_gemm.h)
 *               q, k = rms_norm per head (Qwen3's q/k norms, where the plan has them)
 *               q, k = rotary(q, k); K/V rows into their cache slots
 *               attn = paged attention(q, the layer's cache)          run_attention
 *               delta = attn x W_o
 *               normed, residual = rms_norm(delta + residual)
 *               delta = silu(normed x W_gate) * (normed x W_up) x W_down
 *
 * Gemma 3 (STACK_GEMMA): every norm Gemma's (scaled by 1 + weight in fp32), q/k norms always, each layer's window,
 * RoPE cache and attention scale its own, and two more norms a layer:
 *               attn = norm(attn x W_o)                               post_attention_layernorm, no residual
 *               normed, residual = norm(attn + residual)              pre_feedforward_layernorm
 *               delta = norm(gelu_tanh(normed x W_gate) * (normed x W_up) x W_down)   post_feedforward_layernorm
 *
 * The same kernels, arguments and thread counts as the layer-by-layer path (kernels/cpu_*.py's wrappers), so the
 * results are the same bits; what it saves is the host's part of a small step: about a dozen Python calls a layer,
 * each checking its tensors, allocating its output and crossing into C (measured on Zen 4, bf16, the 512x8 model,
 * one thread: a batch-1 decode step 3.78 -> 1.82 ms).
 *
 * The plan: an int64 header (STACK_*), then LAYER_FIELDS int64 per layer (addresses of the norms' weights, of the
 * layer's fp32 cos/sin cache and of its K and V caches; its sliding window, 0 for none; its q and k norms' weights, 0
 * without; Gemma's pre- and post-feedforward norms' weights, 0 for Llama; then its four linears, q/k/v, o, gate/up,
 * down, LINEAR_FIELDS each: a panel-packed bf16 weight (moe_gemm.h's layout, one expert), or an int8 one packed for
 * int8_gemm.h with its column correction, scales and fp32 bias, its K in fours and its static activation scale's
 * address, 0 for scales per token), and LAYER_FLOATS doubles per layer (the two norms' eps, the softmax scale, the q
 * and k norms' eps, Gemma's two more norms' eps).
 * Everything is bf16 but the cos/sin cache; the scratch holds stack_scratch_per_row(plan) elements per token row
 * (decoder_stack_scratch tells the caller).
 */

enum { STACK_HIDDEN, STACK_Q_HEADS, STACK_KV_HEADS, STACK_HEAD_DIM, STACK_INTERMEDIATE, STACK_PAGE_SIZE,
       STACK_K_BLOCK_STRIDE, STACK_K_TOKEN_STRIDE, STACK_V_BLOCK_STRIDE, STACK_V_TOKEN_STRIDE, STACK_NUM_LAYERS,
       STACK_QK_NORM, STACK_MAX_CODES, STACK_GEMMA, STACK_HEADER };
/* STACK_MAX_CODES: an int8 linear's widest codes row, or 0; STACK_GEMMA: 1 for Gemma 3's layers, 0 for Llama's */
enum { LINEAR_KIND, LINEAR_WEIGHT, LINEAR_CORRECTION, LINEAR_SCALES, LINEAR_BIAS, LINEAR_K4, LINEAR_STATIC_SCALE,
       LINEAR_FIELDS };
enum { LINEAR_PANELS = 0, LINEAR_INT8 = 1 };
enum { LAYER_INPUT_NORM, LAYER_POST_NORM, LAYER_COS_SIN, LAYER_K_CACHE, LAYER_V_CACHE, LAYER_WINDOW, LAYER_Q_NORM,
       LAYER_K_NORM, LAYER_PRE_FF_NORM, LAYER_POST_FF_NORM, LAYER_QKV, LAYER_O = LAYER_QKV + LINEAR_FIELDS,
       LAYER_GATE_UP = LAYER_O + LINEAR_FIELDS, LAYER_DOWN = LAYER_GATE_UP + LINEAR_FIELDS,
       LAYER_FIELDS = LAYER_DOWN + LINEAR_FIELDS };
enum { LAYER_INPUT_EPS, LAYER_POST_EPS, LAYER_SCALE, LAYER_Q_EPS, LAYER_K_EPS, LAYER_PRE_FF_EPS, LAYER_POST_FF_EPS,
       LAYER_FLOATS };

typedef struct {
    const int64_t *plan;
    const double *floats;
    const uint16_t *embedded;       /* [rows][hidden]: the embeddings, layer 0's input and residual */
    uint16_t *delta, *residual;     /* [rows][hidden] out: the last layer's output and the running sum before it */
    uint16_t *scratch;              /* [rows][stack_scratch_per_row(plan)] */
    const int64_t *positions, *slots;
    const int32_t *cu_seqlens_q, *context_lens, *block_tables;
    int64_t block_table_stride, rows;
    int num_seqs;
} stack_args;

static int64_t stack_qkv_width(const int64_t *h)
{
    return (h[STACK_Q_HEADS] + 2 * h[STACK_KV_HEADS]) * h[STACK_HEAD_DIM];
}

/* bf16 elements per row before the int8 codes: normed, qkv, rotated q and k, attention output, gate/up, activation,
 * normed q and k, and (Gemma) a row of hidden for o's and down's outputs before their norms */
static int64_t stack_bf16_per_row(const int64_t *h)
{
    int64_t q = h[STACK_Q_HEADS] * h[STACK_HEAD_DIM], k = h[STACK_KV_HEADS] * h[STACK_HEAD_DIM];
    return h[STACK_HIDDEN] + stack_qkv_width(h) + q + k + q + 3 * h[STACK_INTERMEDIATE] + q + k
           + (h[STACK_GEMMA] ? h[STACK_HIDDEN] : 0);
}

/* scratch elements (bf16) per row: the bf16 rows, then (int8 linears) a scale per row and the codes, with room to
 * align them to 64 bytes */
static int64_t stack_scratch_per_row(const int64_t *h)
{
    int64_t int8_bytes = h[STACK_MAX_CODES] > 0 ? 4 + h[STACK_MAX_CODES] : 0;
    return stack_bf16_per_row(h) + (int8_bytes + 1) / 2 + (h[STACK_MAX_CODES] > 0 ? 64 : 0);
}

typedef struct {
    float *scales;   /* [rows]: the activations' scales per token */
    uint8_t *codes;  /* [rows][STACK_MAX_CODES] */
} int8_scratch;

/* out[rows][cols] = x[rows][k] x the linear's weight (bf16 out): the panel GEMM as moe_gemm with one expert holding
 * every row, or W8A8 as kernels/cpu_int8.py's packed_product (codes q + 128 per token, then the GEMM) */
static void stack_linear(const int64_t *linear, const uint16_t *x, int64_t rows, int64_t k, int64_t cols,
                         uint16_t *out, const int8_scratch *i8, int num_threads)
{
    if (linear[LINEAR_KIND] == LINEAR_PANELS) {
        static const int32_t only_expert[1] = {0};
        int64_t offsets[2] = {0, rows};
        moe_args m = {x, (const uint16_t *)(uintptr_t)linear[LINEAR_WEIGHT], offsets, only_expert, out, k, cols,
                      (int)k, (int)cols, (int)((cols + MOE_PANEL - 1) / MOE_PANEL),
                      (const float *)(uintptr_t)linear[LINEAR_BIAS]};
        launch_moe_gemm(&m, 1, num_threads);
        return;
    }
    const int k4 = (int)linear[LINEAR_K4];
    const float *static_scale = (const float *)(uintptr_t)linear[LINEAR_STATIC_SCALE];
    quant_args q = {x, i8->codes, i8->scales, k, 4 * (int64_t)k4, static_scale ? *static_scale : 0.0f, (int)k, 4 * k4,
                    128, DTYPE_BF16, 2};
    launch_quantize_int8(&q, rows, num_threads);
    gemm_args g = {i8->codes, (const int8_t *)(uintptr_t)linear[LINEAR_WEIGHT],
                   (const int32_t *)(uintptr_t)linear[LINEAR_CORRECTION], static_scale ? static_scale : i8->scales,
                   (const float *)(uintptr_t)linear[LINEAR_SCALES], (const float *)(uintptr_t)linear[LINEAR_BIAS], out,
                   rows, 4 * (int64_t)k4, static_scale ? 0 : 1, cols, (int)cols, k4, OUT_BF16};
    launch_int8_gemm(&g, num_threads);
}

/* Llama's RMSNorm, or Gemma's (offset_weight) */
static void stack_norm(const uint16_t *x, const uint16_t *residual, uint16_t *residual_out, uint16_t *out,
                       int64_t weight, double eps, int64_t rows, int64_t hidden, int offset_weight, int num_threads)
{
    norm_args n = {x, (const void *)(uintptr_t)weight, residual, residual_out, out, hidden, hidden, hidden,
                   (int)hidden, DTYPE_BF16, 2, (float)eps, offset_weight};
    launch_rms_norm(&n, rows, num_threads);
}

/* Per-head RMSNorm (Qwen3's and Gemma's q/k norms): each token's `heads` rows of head_dim, token_stride apart in
 * the source, into contiguous rows; the same arithmetic per row as rms_norm over the heads copied out first */
typedef struct {
    norm_args n;
    int64_t token_stride;
    int heads;
} head_norm_args;

static void stack_head_norm_tokens(const head_norm_args *a, int64_t first, int64_t last)
{
    const isa_entry *isa = isa_for(a->n.hidden);
    for (int64_t t = first; t < last; t++) {
        norm_args n = a->n;
        n.x = (const uint16_t *)a->n.x + t * a->token_stride;
        n.out = (uint16_t *)a->n.out + t * a->heads * a->n.hidden;
        isa->rms_norm(&n, 0, a->heads);
    }
}

static void stack_head_norm(const uint16_t *x, int64_t token_stride, int heads, uint16_t *out, int64_t weight,
                            double eps, int64_t rows, int64_t head_dim, int offset_weight, int num_threads)
{
    head_norm_args a = {{x, (const void *)(uintptr_t)weight, NULL, NULL, out, head_dim, 0, head_dim, (int)head_dim,
                         DTYPE_BF16, 2, (float)eps, offset_weight}, token_stride, heads};
    run_rows((rows_fn)stack_head_norm_tokens, &a, rows, heads * head_dim, num_threads);
}

static int run_decoder_stack(const stack_args *s, int num_threads)
{
    const int64_t *h = s->plan;
    const int64_t hidden = h[STACK_HIDDEN], nq = h[STACK_Q_HEADS], nkv = h[STACK_KV_HEADS], d = h[STACK_HEAD_DIM];
    const int64_t inter = h[STACK_INTERMEDIATE], qkv_width = stack_qkv_width(h), rows = s->rows;
    uint16_t *normed = s->scratch, *qkv = normed + rows * hidden, *q_rot = qkv + rows * qkv_width;
    uint16_t *k_rot = q_rot + rows * nq * d, *attn = k_rot + rows * nkv * d, *gate_up = attn + rows * nq * d;
    uint16_t *act = gate_up + rows * 2 * inter, *q_normed = act + rows * inter, *k_normed = q_normed + rows * nq * d;
    uint16_t *unnormed = k_normed + rows * nkv * d; /* Gemma: o's and down's outputs before their norms */
    const int gemma = (int)h[STACK_GEMMA];
    uintptr_t int8_area = ((uintptr_t)(s->scratch + rows * stack_bf16_per_row(h)) + 63) & ~(uintptr_t)63;
    const uintptr_t codes_area = int8_area + (((uintptr_t)rows * 4 + 63) & ~(uintptr_t)63);
    const int8_scratch i8 = {(float *)int8_area, (uint8_t *)codes_area};
    for (int64_t layer = 0; layer < h[STACK_NUM_LAYERS]; layer++) {
        const int64_t *l = h + STACK_HEADER + layer * LAYER_FIELDS;
        const double *f = s->floats + layer * LAYER_FLOATS;
        const uint16_t *running = layer == 0 ? s->embedded : s->residual;
        if (layer == 0)
            stack_norm(s->embedded, NULL, NULL, normed, l[LAYER_INPUT_NORM], f[LAYER_INPUT_EPS], rows, hidden, gemma,
                       num_threads);
        else
            stack_norm(s->delta, running, s->residual, normed, l[LAYER_INPUT_NORM], f[LAYER_INPUT_EPS], rows, hidden,
                       gemma, num_threads);
        stack_linear(l + LAYER_QKV, normed, rows, hidden, qkv_width, qkv, &i8, num_threads);
        const uint16_t *q = qkv, *k = qkv + nq * d;
        int64_t q_stride = qkv_width, k_stride = qkv_width;
        if (h[STACK_QK_NORM]) { /* per head, before rotary */
            stack_head_norm(q, qkv_width, (int)nq, q_normed, l[LAYER_Q_NORM], f[LAYER_Q_EPS], rows, d, gemma,
                            num_threads);
            stack_head_norm(k, qkv_width, (int)nkv, k_normed, l[LAYER_K_NORM], f[LAYER_K_EPS], rows, d, gemma,
                            num_threads);
            q = q_normed, k = k_normed, q_stride = nq * d, k_stride = nkv * d;
        }
        rotary_args r = {q, k, q_rot, k_rot, s->positions, (const float *)(uintptr_t)l[LAYER_COS_SIN], q_stride,
                         k_stride, (int)nq, (int)nkv, (int)d, DTYPE_BF16, 2};
        launch_rotary(&r, rows, num_threads);
        char *k_cache = (char *)(uintptr_t)l[LAYER_K_CACHE], *v_cache = (char *)(uintptr_t)l[LAYER_V_CACHE];
        const size_t row_bytes = (size_t)(nkv * d) * 2;
        store_kv_rows((const char *)k_rot, (const char *)(qkv + (nq + nkv) * d), k_cache, v_cache, s->slots, rows,
                      (int64_t)row_bytes, qkv_width * 2, h[STACK_K_BLOCK_STRIDE] * 2, h[STACK_K_TOKEN_STRIDE] * 2,
                      h[STACK_V_BLOCK_STRIDE] * 2, h[STACK_V_TOKEN_STRIDE] * 2, (int)h[STACK_PAGE_SIZE], row_bytes);
        attn_args a = {q_rot, k_cache, v_cache, attn, s->cu_seqlens_q, s->context_lens, s->block_tables, (int)nq,
                       (int)nkv, (int)d, (int)h[STACK_PAGE_SIZE], DTYPE_BF16, (int)l[LAYER_WINDOW], nq * d, nq * d,
                       h[STACK_K_BLOCK_STRIDE], h[STACK_K_TOKEN_STRIDE], h[STACK_V_BLOCK_STRIDE],
                       h[STACK_V_TOKEN_STRIDE], s->block_table_stride, (float)f[LAYER_SCALE]};
        if (run_attention(&a, s->num_seqs, num_threads) != 0)
            return -1;
        if (gemma) { /* o's output normed on its own, then added to the residual and normed again */
            stack_linear(l + LAYER_O, attn, rows, nq * d, hidden, unnormed, &i8, num_threads);
            stack_norm(unnormed, NULL, NULL, s->delta, l[LAYER_POST_NORM], f[LAYER_POST_EPS], rows, hidden, 1,
                       num_threads);
            stack_norm(s->delta, running, s->residual, normed, l[LAYER_PRE_FF_NORM], f[LAYER_PRE_FF_EPS], rows,
                       hidden, 1, num_threads);
        } else {
            stack_linear(l + LAYER_O, attn, rows, nq * d, hidden, s->delta, &i8, num_threads);
            stack_norm(s->delta, running, s->residual, normed, l[LAYER_POST_NORM], f[LAYER_POST_EPS], rows, hidden, 0,
                       num_threads);
        }
        stack_linear(l + LAYER_GATE_UP, normed, rows, hidden, 2 * inter, gate_up, &i8, num_threads);
        silu_args g = {gate_up, act, 2 * inter, inter, (int)inter, DTYPE_BF16, 2, gemma ? ACT_GELU_TANH : ACT_SILU};
        launch_silu_and_mul(&g, rows, num_threads);
        if (gemma) {
            stack_linear(l + LAYER_DOWN, act, rows, inter, hidden, unnormed, &i8, num_threads);
            stack_norm(unnormed, NULL, NULL, s->delta, l[LAYER_POST_FF_NORM], f[LAYER_POST_FF_EPS], rows, hidden, 1,
                       num_threads);
        } else {
            stack_linear(l + LAYER_DOWN, act, rows, inter, hidden, s->delta, &i8, num_threads);
        }
    }
    return 0;
}

static PyObject *py_decoder_stack(PyObject *self, PyObject *args)
{
    (void)self;
    unsigned long long plan, floats, embedded, delta, residual, scratch, positions, slots, cu_seqlens, context_lens;
    unsigned long long block_tables;
    long long scratch_elements;
    int num_threads;
    stack_args s;
    if (!PyArg_ParseTuple(args, "KKKKKKLKKKKKLLii", &plan, &floats, &embedded, &delta, &residual, &scratch,
                          &scratch_elements, &positions, &slots, &cu_seqlens, &context_lens, &block_tables,
                          &s.block_table_stride, &s.rows, &s.num_seqs, &num_threads))
        return NULL;
    s.plan = (const int64_t *)(uintptr_t)plan;
    const int64_t *h = s.plan;
    for (int64_t layer = 0; layer < h[STACK_NUM_LAYERS]; layer++)
        for (int i = 0; i < 4; i++) {
            const int64_t *linear = h + STACK_HEADER + layer * LAYER_FIELDS + LAYER_QKV + i * LINEAR_FIELDS;
            if ((linear[LINEAR_KIND] == LINEAR_PANELS ? selected_moe_gemm : selected_int8_gemm) < 0) {
                PyErr_SetString(PyExc_RuntimeError, "decoder_stack: a linear's GEMM body is not chosen on this CPU "
                                "(the panel GEMM needs AVX512-BF16, the int8 one VNNI)");
                return NULL;
            }
            if (linear[LINEAR_KIND] == LINEAR_INT8
                && (linear[LINEAR_K4] <= 0 || 4 * linear[LINEAR_K4] > h[STACK_MAX_CODES])) {
                PyErr_SetString(PyExc_ValueError,
                                "decoder_stack: an int8 linear's codes are wider than the plan's scratch");
                return NULL;
            }
        }
    if (s.rows <= 0 || s.num_seqs <= 0 || h[STACK_KV_HEADS] <= 0 || h[STACK_Q_HEADS] % h[STACK_KV_HEADS] != 0
        || h[STACK_Q_HEADS] / h[STACK_KV_HEADS] > MAX_ROWS || h[STACK_HEAD_DIM] <= 0
        || h[STACK_HEAD_DIM] > MAX_HEAD_DIM || h[STACK_HEAD_DIM] % 2 != 0 || h[STACK_PAGE_SIZE] <= 0
        || scratch_elements < s.rows * stack_scratch_per_row(h)) {
        PyErr_SetString(PyExc_ValueError, "decoder_stack: bad shapes, or a scratch smaller than the plan needs");
        return NULL;
    }
    s.floats = (const double *)(uintptr_t)floats;
    s.embedded = (const uint16_t *)(uintptr_t)embedded;
    s.delta = (uint16_t *)(uintptr_t)delta;
    s.residual = (uint16_t *)(uintptr_t)residual;
    s.scratch = (uint16_t *)(uintptr_t)scratch;
    s.positions = (const int64_t *)(uintptr_t)positions;
    s.slots = (const int64_t *)(uintptr_t)slots;
    s.cu_seqlens_q = (const int32_t *)(uintptr_t)cu_seqlens;
    s.context_lens = (const int32_t *)(uintptr_t)context_lens;
    s.block_tables = (const int32_t *)(uintptr_t)block_tables;
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = run_decoder_stack(&s, num_threads);
    Py_END_ALLOW_THREADS
    if (status != 0)
        return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *py_decoder_stack_scratch(PyObject *self, PyObject *args)
{
    (void)self;
    unsigned long long plan;
    if (!PyArg_ParseTuple(args, "K", &plan))
        return NULL;
    return PyLong_FromLongLong(stack_scratch_per_row((const int64_t *)(uintptr_t)plan));
}
