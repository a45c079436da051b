/* The elementwise ops of a layer for one instruction set (included by cpu_ops.c after vec_isa.h):
 * RMSNorm with the residual add fused (Llama's, or Gemma's offset weight), rotary embedding, SiLU(gate) * up
 * (or GELU-tanh(gate) * up), and a mixture-of-experts
 * layer's combine (the KV store is a plain copy, in cpu_ops.c). Each rounds where torch rounds (every op's result to the model dtype,
 * products not fused into sums), so fp32 results equal transformers' bit for bit except where a
 * reduction's order or exp's last bit differs (the norm's mean of squares, SiLU; GELU-tanh's tanh by a few ulp).
 *
 * Rows are tokens; a row's elements are contiguous, rows may be strided (views of a fused projection).
 * Row lengths are multiples of W (the dispatcher picks a narrower ISA otherwise).
 */

static inline vf ISA(load_any)(const void *p, size_t i, int is_bf16)
{
    return is_bf16 ? ISA(load_bf16)((const uint16_t *)p + i) : ISA(load)((const float *)p + i);
}

static inline void ISA(store_any)(void *p, size_t i, vf x, int is_bf16)
{
    if (is_bf16)
        ISA(store_bf16)((uint16_t *)p + i, x);
    else
        ISA(store)((float *)p + i, x);
}

/* Row t: sum = x + residual (rounded to the dtype) is stored into residual_out when given; out =
 * weight * dtype(sum * rsqrt(mean(sum^2) + eps)), as transformers' LlamaRMSNorm computes it. */
static void ISA(rms_norm_rows)(const norm_args *a, int64_t first, int64_t last)
{
    const int n = a->hidden, is_bf16 = a->dtype == DTYPE_BF16;
    for (int64_t t = first; t < last; t++) {
        const char *x = (const char *)a->x + (size_t)t * a->x_stride * a->element;
        const char *res = a->residual ? (const char *)a->residual + (size_t)t * a->residual_stride * a->element : NULL;
        char *sum = a->residual ? (char *)a->residual_out + (size_t)t * n * a->element : NULL;
        char *out = (char *)a->out + (size_t)t * a->out_stride * a->element;
        vf squares = {0};
        for (int i = 0; i < n; i += W) {
            vf v = ISA(load_any)(x, i, is_bf16);
            if (res) {
                v = v + ISA(load_any)(res, i, is_bf16);
                if (is_bf16)
                    v = ISA(round_bf16)(v);
                ISA(store_any)(sum, i, v, is_bf16);
            }
            squares += v * v;
        }
        float inv_rms = 1.0f / sqrtf(ISA(hsum)(squares) / (float)n + a->eps);
        const void *src = res ? (const void *)sum : (const void *)x;
        for (int i = 0; i < n; i += W) {
            vf normed = ROUNDED(ISA(load_any)(src, i, is_bf16) * inv_rms);
            vf weight = ISA(load_any)(a->weight, i, is_bf16);
            if (a->offset_weight) { /* Gemma: fp32 normed * fp32 (1 + weight), rounded once to the dtype */
                ISA(store_any)(out, i, ROUNDED(normed * (weight + 1.0f)), is_bf16);
                continue;
            }
            if (is_bf16)
                normed = ISA(round_bf16)(normed);
            ISA(store_any)(out, i, weight * normed, is_bf16);
        }
    }
}

/* Rotate-half rotary embedding of `num_heads` heads of head_dim, src row -> dst row:
 * first half: x1 * cos - x2 * sin; second half: x2 * cos + x1 * sin (each product rounded). */
static void ISA(rotate_heads)(const char *src, char *dst, int num_heads, int head_dim, const float *cos_sin,
                              int is_bf16, size_t element)
{
    const int half = head_dim / 2;
    for (int h = 0; h < num_heads; h++) {
        const char *head = src + (size_t)h * head_dim * element;
        char *out = dst + (size_t)h * head_dim * element;
        for (int i = 0; i < half; i += W) {
            vf c = ISA(load)(cos_sin + i), s = ISA(load)(cos_sin + half + i);
            if (is_bf16) {
                c = ISA(round_bf16)(c);
                s = ISA(round_bf16)(s);
            }
            vf x1 = ISA(load_any)(head, i, is_bf16), x2 = ISA(load_any)(head, half + i, is_bf16);
            vf a1 = ROUNDED(x1 * c), b1 = ROUNDED(x2 * s), a2 = ROUNDED(x2 * c), b2 = ROUNDED(x1 * s);
            if (is_bf16) {
                a1 = ISA(round_bf16)(a1); b1 = ISA(round_bf16)(b1);
                a2 = ISA(round_bf16)(a2); b2 = ISA(round_bf16)(b2);
            }
            ISA(store_any)(out, i, a1 - b1, is_bf16);
            ISA(store_any)(out, half + i, a2 + b2, is_bf16);
        }
    }
}

static void ISA(rotary_rows)(const rotary_args *a, int64_t first, int64_t last)
{
    const int is_bf16 = a->dtype == DTYPE_BF16;
    for (int64_t t = first; t < last; t++) {
        const float *cos_sin = a->cos_sin + (size_t)a->positions[t] * a->head_dim;
        ISA(rotate_heads)((const char *)a->query + (size_t)t * a->q_stride * a->element,
                          (char *)a->query_out + (size_t)t * a->num_q_heads * a->head_dim * a->element,
                          a->num_q_heads, a->head_dim, cos_sin, is_bf16, a->element);
        ISA(rotate_heads)((const char *)a->key + (size_t)t * a->k_stride * a->element,
                          (char *)a->key_out + (size_t)t * a->num_kv_heads * a->head_dim * a->element,
                          a->num_kv_heads, a->head_dim, cos_sin, is_bf16, a->element);
    }
}

/* GELU's tanh approximation, 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), in torch's order of operations
 * (gelu(approximate="tanh")); tanh(u) = sign(u) (1 - e) / (1 + e) with e = exp(-2 |u|) <= 1, which keeps the
 * relative error of tanh within a few ulp for every u (no 1 - 2 / (exp(2u) + 1) cancellation) and saturates. */
static inline vf ISA(gelu_tanh)(vf x)
{
    vf cube = ROUNDED(ROUNDED(x * x) * x);
    vf inner = ROUNDED(0.7978845608028654f * ROUNDED(x + ROUNDED(0.044715f * cube)));
    vi sign = (vi)inner & (vi)ISA(splat)(-0.0f);
    vf magnitude = (vf)((vi)inner ^ sign);
    vf e = ISA(vexp)(-2.0f * magnitude);
    vf tanh_inner = (vf)((vi)((1.0f - e) / (1.0f + e)) | sign);
    return ROUNDED(ROUNDED(0.5f * x) * (1.0f + tanh_inner));
}

/* One elementwise op's result as torch leaves it: rounded to the dtype (bf16), or to fp32 without fusing it into the
 * next op. */
static inline vf ISA(op_result)(vf v, int is_bf16)
{
    v = ROUNDED(v);
    return is_bf16 ? ISA(round_bf16)(v) : v;
}

/* gpt-oss's clamped SwiGLU (transformers' GptOssExperts._apply_gate), each of torch's separate ops rounded to the
 * dtype as torch rounds it: g = min(gate, limit), u = clamp(up, -limit, limit), then (u + 1) * (g * sigmoid(g *
 * alpha)), the sigmoid as 1 / (1 + exp(-x)). The last product is rounded by the caller's store. */
static inline vf ISA(clamped_swiglu)(vf gate, vf up, float alpha, float limit, int is_bf16)
{
    const vf minus_limit = ISA(splat)(-limit);
    vf g = -ISA(larger)(-gate, minus_limit);
    vf u = -ISA(larger)(-ISA(larger)(up, minus_limit), minus_limit);
    vf scaled = ISA(op_result)(g * alpha, is_bf16);
    vf sigmoid = ISA(op_result)(1.0f / (ISA(vexp)(-scaled) + 1.0f), is_bf16);
    vf glu = ISA(op_result)(g * sigmoid, is_bf16);
    return ISA(op_result)(u + 1.0f, is_bf16) * glu;
}

/* out[t] = act(gate[t]) * up[t], gate and up the two halves of row t of x; act SiLU or GELU-tanh, rounded to the
 * dtype before the product, as torch computes an activation and then multiplies; or gpt-oss's clamped SwiGLU of
 * the two halves. */
static void ISA(silu_and_mul_rows)(const silu_args *a, int64_t first, int64_t last)
{
    const int n = a->width, is_bf16 = a->dtype == DTYPE_BF16, is_gelu = a->activation == ACT_GELU_TANH;
    const int is_clamped = a->activation == ACT_CLAMPED_SWIGLU;
    for (int64_t t = first; t < last; t++) {
        const char *x = (const char *)a->x + (size_t)t * a->x_stride * a->element;
        const char *up = x + (size_t)n * a->element;
        char *out = (char *)a->out + (size_t)t * a->out_stride * a->element;
        for (int i = 0; i < n; i += W) {
            vf g = ISA(load_any)(x, i, is_bf16);
            if (is_clamped) {
                vf product = ISA(clamped_swiglu)(g, ISA(load_any)(up, i, is_bf16), a->alpha, a->limit, is_bf16);
                ISA(store_any)(out, i, product, is_bf16);
                continue;
            }
            vf act = is_gelu ? ISA(gelu_tanh)(g) : g / (ISA(vexp)(-g) + 1.0f);
            if (is_bf16)
                act = ISA(round_bf16)(act);
            ISA(store_any)(out, i, act * ISA(load_any)(up, i, is_bf16), is_bf16);
        }
    }
}

/* out[t] = sum over token t's top_k rows of weight * row, in fp32, rounded once to the dtype: the rows are added
 * in the order they sit among the grouped rows (by expert), each product rounded before its add, as
 * kernels/moe_ref.combine_grouped_rows' index_add_ sums them, so fp32 results equal it bit for bit. Tokens are
 * independent (no two threads write one row), unlike index_add_, which torch runs on one thread. */
static void ISA(moe_combine_rows)(const combine_args *a, int64_t first, int64_t last)
{
    const int n = a->hidden, k = a->top_k, is_bf16 = a->dtype == DTYPE_BF16;
    int64_t position[MAX_COMBINE_TOP_K];
    float weight[MAX_COMBINE_TOP_K];
    for (int64_t t = first; t < last; t++) {
        for (int j = 0; j < k; j++) { /* insertion sort by position: k is small */
            int64_t p = a->positions[t * k + j];
            float w = a->weights[t * k + j];
            int i = j;
            for (; i > 0 && position[i - 1] > p; i--) {
                position[i] = position[i - 1];
                weight[i] = weight[i - 1];
            }
            position[i] = p;
            weight[i] = w;
        }
        char *out = (char *)a->out + (size_t)t * a->out_stride * a->element;
        for (int i = 0; i < n; i += W) {
            vf acc = ISA(splat)(0.0f); /* +0, as index_add_ adds into zeros */
            for (int j = 0; j < k; j++) {
                const char *row = (const char *)a->rows + (size_t)position[j] * a->rows_stride * a->element;
                acc = acc + ROUNDED(ISA(load_any)(row, i, is_bf16) * weight[j]);
            }
            ISA(store_any)(out, i, acc, is_bf16);
        }
    }
}
