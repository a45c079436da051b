/* Vector helpers for one instruction set, written with GCC vector extensions (see cpu_ops.c): the
 * includer defines VEC_BYTES (4, 16, 32 or 64) and ISA(name), and sets the matching target pragma.
 * `a += b * c` on these types becomes an FMA where the ISA has one (-ffp-contract=fast); code that must
 * round each product separately, as torch does, passes the product through ROUNDED first.
 */

#define W (VEC_BYTES / 4)
#define vf ISA(vf)
#define vfu ISA(vfu)
#define vi ISA(vi)
#define vu ISA(vu)
#define vh ISA(vh)

/* Whether one vf is one x86 register under the includer's target pragma (GCC defines __AVX2__ and
 * __AVX512F__ inside `#pragma GCC target`); the portable 64-byte body (vec512) is not, and takes the
 * generic spellings below. */
#if defined(__x86_64__) && (VEC_BYTES == 16 || (VEC_BYTES == 32 && defined(__AVX2__)) || (VEC_BYTES == 64 && defined(__AVX512F__)))
#define X86_REGISTER 1
#else
#define X86_REGISTER 0
#endif

typedef float vf __attribute__((vector_size(VEC_BYTES)));
typedef float vfu __attribute__((vector_size(VEC_BYTES), aligned(4), may_alias));
typedef int32_t vi __attribute__((vector_size(VEC_BYTES)));
typedef uint32_t vu __attribute__((vector_size(VEC_BYTES)));
typedef uint16_t vh __attribute__((vector_size(VEC_BYTES / 2), aligned(2), may_alias));

static inline vf ISA(load)(const float *p) { return *(const vfu *)p; }
static inline void ISA(store)(float *p, vf v) { *(vfu *)p = v; }
/* One broadcast instruction: generic spellings compile to an add (`(vf){0} + x`, kept for x = -0) or to
 * lane-by-lane inserts under a target pragma, so x86 widths use the intrinsic. */
static inline vf ISA(splat)(float x)
{
#if X86_REGISTER && VEC_BYTES == 64
    return (vf)_mm512_set1_ps(x);
#elif X86_REGISTER && VEC_BYTES == 32
    return (vf)_mm256_set1_ps(x);
#elif X86_REGISTER && VEC_BYTES == 16
    return (vf)_mm_set1_ps(x);
#else
    vf v;
    for (int i = 0; i < W; i++)
        v[i] = x;
    return v;
#endif
}

/* W bf16 values widened to fp32 (a bf16 is the top half of an fp32). x86 widths use the widening-load
 * intrinsic: GCC lowers __builtin_convertvector under a target pragma to half-width pieces plus inserts
 * (7 instructions for 16 values, where 3 do; no gain measurable on its own in the kernels that use it). */
static inline vf ISA(load_bf16)(const uint16_t *p)
{
#if X86_REGISTER && VEC_BYTES == 64
    return (vf)_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
#elif X86_REGISTER && VEC_BYTES == 32
    return (vf)_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
#else
    vu widened = __builtin_convertvector(*(const vh *)p, vu) << 16;
    return (vf)widened;
#endif
}

static inline float ISA(hsum)(vf v)
{
    float sum = 0.0f;
    for (int i = 0; i < W; i++)
        sum += v[i];
    return sum;
}

/* The horizontal sums of eight vectors, in order. */
static inline void ISA(hsum8)(vf a0, vf a1, vf a2, vf a3, vf a4, vf a5, vf a6, vf a7, float *out)
{
#if X86_REGISTER && VEC_BYTES == 64
    __m256 h[8];
    vf in[8] = {a0, a1, a2, a3, a4, a5, a6, a7};
    for (int i = 0; i < 8; i++)
        h[i] = _mm256_add_ps(_mm512_castps512_ps256((__m512)in[i]),
                             _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd((__m512)in[i]), 1)));
#define HSUM8_AVX2 1
#elif X86_REGISTER && VEC_BYTES == 32
    __m256 h[8] = {(__m256)a0, (__m256)a1, (__m256)a2, (__m256)a3, (__m256)a4, (__m256)a5, (__m256)a6, (__m256)a7};
#define HSUM8_AVX2 1
#endif
#ifdef HSUM8_AVX2
    __m256 s01 = _mm256_hadd_ps(h[0], h[1]), s23 = _mm256_hadd_ps(h[2], h[3]);
    __m256 s45 = _mm256_hadd_ps(h[4], h[5]), s67 = _mm256_hadd_ps(h[6], h[7]);
    __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
    /* lanes: [0 1 2 3 | 0 1 2 3] partial sums of the low and high 128-bit halves */
    __m256 lo = _mm256_permute2f128_ps(s0123, s4567, 0x20), hi = _mm256_permute2f128_ps(s0123, s4567, 0x31);
    _mm256_storeu_ps(out, _mm256_add_ps(lo, hi));
#undef HSUM8_AVX2
#else
    vf in[8] = {a0, a1, a2, a3, a4, a5, a6, a7};
    for (int i = 0; i < 8; i++)
        out[i] = ISA(hsum)(in[i]);
#endif
}

/* The larger of a and b per lane, b where a is NaN or the two compare equal (-0 / +0): one instruction on AVX-512,
 * a compare and a select elsewhere. */
static inline vf ISA(larger)(vf a, vf b)
{
#if X86_REGISTER && VEC_BYTES == 64
    return (vf)_mm512_max_ps((__m512)a, (__m512)b);
#else
    vi is_greater = a > b;
    return (vf)(((vi)a & is_greater) | ((vi)b & ~is_greater));
#endif
}

/* exp(x), Cephes' polynomial: within 2 ulp of expf on [-87, 88]; clamped outside (no inf, no denormals). */
static inline vf ISA(vexp)(vf x)
{
#if X86_REGISTER && VEC_BYTES == 64
    /* The same steps in fewer AVX-512 instructions, bit for bit the same result for every number (and NaN for a
     * NaN, which min / max pass through as their second operand): the clamp, and floor in one rounding instruction. */
    x = (vf)_mm512_min_ps(_mm512_set1_ps(88.0f), _mm512_max_ps(_mm512_set1_ps(-87.0f), (__m512)x));
    vf fx = x * 1.44269504088896341f + 0.5f;
    vf floored = (vf)_mm512_roundscale_ps((__m512)fx, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    vi whole = __builtin_convertvector(floored, vi);
#else
    vi is_low = x < -87.0f, is_high = x > 88.0f;  /* lanes of -1 where true: bitwise selects (C has no vector ?:) */
    x = (vf)(((vi)x & ~is_low) | ((vi)ISA(splat)(-87.0f) & is_low));
    x = (vf)(((vi)x & ~is_high) | ((vi)ISA(splat)(88.0f) & is_high));
    vf fx = x * 1.44269504088896341f + 0.5f;
    vi whole = __builtin_convertvector(fx, vi);  /* truncates: floor below by one for negative fx */
    vf floored = __builtin_convertvector(whole, vf);
    vi is_above = floored > fx;  /* -1 where truncation rounded up */
    floored += __builtin_convertvector(is_above, vf);
    whole += is_above;
#endif
    x -= floored * 0.693359375f;
    x -= floored * -2.12194440e-4f;
    vf y = ISA(splat)(1.9875691500e-4f);
    y = y * x + 1.3981999507e-3f;
    y = y * x + 8.3334519073e-3f;
    y = y * x + 4.1665795894e-2f;
    y = y * x + 1.6666665459e-1f;
    y = y * x + 5.0000001201e-1f;
    y = y * (x * x) + x + 1.0f;
    vi pow2 = (whole + 127) << 23;
    return y * (vf)pow2;
}

/* Stop the compiler from fusing a multiply into the add that follows it: the value is rounded to
 * float here, as torch rounds every elementwise op's result. */
#if X86_REGISTER
#define ROUNDED(v) ({ __typeof__(v) rounded_ = (v); __asm__("" : "+x"(rounded_)); rounded_; })
#elif defined(__aarch64__) && VEC_BYTES == 16
#define ROUNDED(v) ({ __typeof__(v) rounded_ = (v); __asm__("" : "+w"(rounded_)); rounded_; })
#else
#define ROUNDED(v) ({ volatile __typeof__(v) rounded_ = (v); rounded_; })
#endif

static inline vf ISA(round_bf16)(vf x)
{
    /* round to nearest even at 16 bits (finite values; the kernels never make NaN from finite inputs) */
    vu bits = (vu)x;
    bits = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
    return (vf)bits;
}

static inline void ISA(store_bf16)(uint16_t *p, vf x)
{
    vu bits = (vu)x;
    bits = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    *(vh *)p = __builtin_convertvector(bits, vh);
}
