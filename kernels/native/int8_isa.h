/* W8A8 int8 around the GEMM, for one instruction set (included by cpu_ops.c after vec_isa.h):
 *   quantize_rows  a row of fp32/bf16 activations -> int8 codes in one pass over the input after its absmax:
 *                  scale = max(absmax, 1e-12) / 127 (or a static scale), q = round-half-even(x / scale)
 *                  clamped to [-128, 127], stored as the byte q + offset (offset 128: the unsigned codes the
 *                  VNNI GEMM reads; 0: the signed int8 torch._int_mm reads)
 *   rescale_rows   an int32 product row -> ((float)acc * x_scale) * w_scale (+ bias), in fp32 or bf16
 * Every step is the fp32 operation quantization/int8.py's torch code does, in the same order (a true
 * division, not a multiply by the reciprocal; each product rounded, no FMA): the results equal it bit for bit.
 * Row lengths are multiples of W (the dispatcher picks a narrower ISA otherwise).
 */

/* round half to even of |v| < 2^22 (the clamped values): adding 1.5 * 2^23 leaves no fraction bits */
#define INT8_ROUNDER 12582912.0f

static void ISA(quantize_rows)(const quant_args *a, int64_t first, int64_t last)
{
    const int n = a->cols, is_bf16 = a->dtype == DTYPE_BF16;
    const vf lo = ISA(splat)(-128.0f), hi = ISA(splat)(127.0f), rounder = ISA(splat)(INT8_ROUNDER);
    typedef int8_t vbytes __attribute__((vector_size(W), aligned(1), may_alias));
    for (int64_t t = first; t < last; t++) {
        const char *x = (const char *)a->x + (size_t)t * a->x_stride * a->element;
        uint8_t *codes = a->codes + (size_t)t * a->codes_stride;
        float scale = a->static_scale;
        if (scale <= 0.0f) {
            vi largest = {0}; /* |x| as bits: for non-negative floats the integer order is the float order */
            for (int i = 0; i < n; i += W) {
                vi bits = (vi)ISA(load_any)(x, i, is_bf16) & 0x7fffffff;
                vi is_larger = bits > largest;
                largest = (bits & is_larger) | (largest & ~is_larger);
            }
            int32_t best = 0;
            for (int i = 0; i < W; i++)
                best = largest[i] > best ? largest[i] : best;
            float absmax;
            memcpy(&absmax, &best, 4);
            scale = (absmax > 1e-12f ? absmax : 1e-12f) / 127.0f;
            a->scales[t] = scale;
        }
        const vf divisor = ISA(splat)(scale);
        for (int i = 0; i < n; i += W) {
            vf v = ISA(load_any)(x, i, is_bf16) / divisor;
            vi is_low = v < lo, is_high = v > hi;
            v = (vf)(((vi)v & ~is_low) | ((vi)lo & is_low));
            v = (vf)(((vi)v & ~is_high) | ((vi)hi & is_high));
            v = ROUNDED(v + rounder) - rounder;
            *(vbytes *)(codes + i) = __builtin_convertvector(__builtin_convertvector(v, vi) + a->offset, vbytes);
        }
        memset(codes + n, a->offset, (size_t)(a->padded_cols - n)); /* past K: the code of zero */
    }
}

static void ISA(rescale_rows)(const rescale_args *a, int64_t first, int64_t last)
{
    const int n = a->cols, is_bf16 = a->out_dtype == DTYPE_BF16;
    typedef int32_t vi_unaligned __attribute__((vector_size(VEC_BYTES), aligned(4), may_alias));
    for (int64_t t = first; t < last; t++) {
        const int32_t *acc = a->acc + (size_t)t * a->acc_stride;
        char *out = (char *)a->out + (size_t)t * a->out_stride * (is_bf16 ? 2 : 4);
        const vf x_scale = ISA(splat)(a->x_scales[(size_t)t * a->x_scale_stride]);
        for (int i = 0; i < n; i += W) {
            vf v = ROUNDED(__builtin_convertvector(*(const vi_unaligned *)(acc + i), vf) * x_scale);
            v = ROUNDED(v * ISA(load)(a->w_scales + i));
            if (a->bias)
                v = v + ISA(load)(a->bias + i);
            ISA(store_any)(out, i, v, is_bf16);
        }
    }
}

#undef INT8_ROUNDER
