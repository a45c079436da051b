/* bf16 pair dot products for one 64-byte instruction set (included by cpu_ops.c after vec_isa.h, for the
 * attention bodies that define BF16_PAIRS): a vb holds 2W bf16, W consecutive pairs, and
 *   pairs_dot(acc, a, b)[i] = acc[i] + a[2i + 1] * b[2i + 1] + a[2i] * b[2i]
 * (each bf16 product is exact in fp32; the two adds rounded in that order): AVX512-BF16's vdpbf16ps, 32 bf16
 * multiply-adds in one instruction with no widening, where the target has it (GCC defines __AVX512BF16__ under
 * the target pragma), else the same arithmetic in portable vectors (the tests' body on any CPU; unlike the
 * instruction it keeps denormals, which bf16 attention inputs do not reach).
 *
 * pairs_lo / pairs_hi interleave two vectors of 2W bf16 the way vpunpcklwd / vpunpckhwd do, within each 16-byte
 * lane: lane L of pairs_lo is (x[8L], y[8L], ..., x[8L + 3], y[8L + 3]), of pairs_hi the same from 8L + 4. A row
 * accumulated from them holds its 2W values in that order; pair_position says where value d of a block went.
 */

#if VEC_BYTES != 64
#error "bf16 pairs are written for 64-byte vectors"
#endif

#define vb ISA(vb)
typedef uint16_t vb __attribute__((vector_size(VEC_BYTES), aligned(2), may_alias));

#if X86_REGISTER && defined(__AVX512BF16__)
static inline vb ISA(pairs_load)(const uint16_t *p) { return (vb)_mm512_loadu_si512(p); }
static inline vf ISA(pairs_dot)(vf acc, vb a, vb b)
{
    return (vf)_mm512_dpbf16_ps((__m512)acc, (__m512bh)a, (__m512bh)b);
}
static inline vb ISA(pairs_lo)(vb x, vb y) { return (vb)_mm512_unpacklo_epi16((__m512i)x, (__m512i)y); }
static inline vb ISA(pairs_hi)(vb x, vb y) { return (vb)_mm512_unpackhi_epi16((__m512i)x, (__m512i)y); }
static inline vb ISA(pairs_splat)(const uint16_t *pair)
{
    uint32_t bits;
    memcpy(&bits, pair, 4);
    return (vb)_mm512_set1_epi32((int)bits);
}
#else
static inline vb ISA(pairs_load)(const uint16_t *p) { return *(const vb *)p; }
static inline float ISA(bf16_value)(uint16_t x)
{
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}
static inline vf ISA(pairs_dot)(vf acc, vb a, vb b)
{
    for (int i = 0; i < W; i++) {
        float sum = acc[i] + ISA(bf16_value)(a[2 * i + 1]) * ISA(bf16_value)(b[2 * i + 1]);
        acc[i] = sum + ISA(bf16_value)(a[2 * i]) * ISA(bf16_value)(b[2 * i]);
    }
    return acc;
}
static inline vb ISA(pairs_interleave)(vb x, vb y, int half)
{
    vb out;
    for (int lane = 0; lane < VEC_BYTES / 16; lane++)
        for (int i = 0; i < 4; i++) {
            out[8 * lane + 2 * i] = x[8 * lane + 4 * half + i];
            out[8 * lane + 2 * i + 1] = y[8 * lane + 4 * half + i];
        }
    return out;
}
static inline vb ISA(pairs_lo)(vb x, vb y) { return ISA(pairs_interleave)(x, y, 0); }
static inline vb ISA(pairs_hi)(vb x, vb y) { return ISA(pairs_interleave)(x, y, 1); }
static inline vb ISA(pairs_splat)(const uint16_t *pair)
{
    vb out;
    for (int i = 0; i < W; i++) {
        out[2 * i] = pair[0];
        out[2 * i + 1] = pair[1];
    }
    return out;
}
#endif

/* Where value d (0 <= d < 2W) of a block accumulated from pairs_lo (first W) and pairs_hi (next W) sits. */
static inline int ISA(pair_position)(int d)
{
    int lane = d / 8, within = d % 8;
    return (within < 4 ? 0 : W) + 4 * lane + within % 4;
}
