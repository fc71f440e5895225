/*
 * AVX2 + FMA + F16C 8-bit Adam: eight lanes of exactly adam8_scalar.c's operations, built
 * like adam8_avx512.c (gathers from the map and the code table; see there). A short last
 * vector runs the same lanes over zero-padded copies.
 */
#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#pragma GCC optimize("fp-contract=off")
#include <float.h>
#include <immintrin.h>

#include "adam8_internal.h"
#include "simd_avx2.h"

/* off__f32_to_bf16_sr with off__sr_bits(key, index + lane) for the eight lanes. */
INLINE __m128i to_bf16_sr(__m256 x, uint32_t key, unsigned long long index)
{
    return bf16_sr(x, sr_bits(key, index));
}

INLINE __m256 dequant(const float *map, const uint8_t *codes, __m256 scale)
{
    __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)codes));
    return _mm256_mul_ps(_mm256_i32gather_ps(map, c, 4), scale);
}

/* The nearest codes of eight values (off__qcode_add lane by lane: one gather from code[] and
 * one add, the code in byte 2 of each lane), as eight bytes. */
INLINE long long qcode8(int map, const uint32_t *tab, __m256 x)
{
    __m256i u = _mm256_castps_si256(x), a;
    if (map == OFF_QMAP_UNSIGNED) { /* a negative x (its bits < 0 as an int) codes as +0 */
        a = _mm256_max_epi32(u, _mm256_set1_epi32(0x34000000));
        a = _mm256_min_epi32(a, _mm256_set1_epi32(0x3f800000));
    } else {
        a = _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff));
        a = _mm256_min_epu32(_mm256_max_epu32(a, _mm256_set1_epi32(0x34000000)),
                             _mm256_set1_epi32(0x3f800000));
        /* |x| clamped with x's sign, then complemented where negative */
        a = _mm256_or_si256(a, _mm256_and_si256(u, _mm256_set1_epi32((int)0x80000000u)));
        a = _mm256_xor_si256(a, _mm256_srai_epi32(a, 31));
    }
    __m256i r = _mm256_add_epi32(_mm256_i32gather_epi32((const int *)tab, _mm256_srli_epi32(a, 16), 4), a);
    r = _mm256_shuffle_epi8(r, _mm256_setr_epi8(2, 6, 10, 14, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                                2, 6, 10, 14, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1));
    __m128i w = _mm_unpacklo_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    return _mm_cvtsi128_si64(w);
}

INLINE __m256 masked_load(const float *x, long long k)
{
    float t[8] = {0};
    memcpy(t, x, (size_t)k * 4);
    return _mm256_loadu_ps(t);
}

/* Running absmax and non-finite lanes of x (exact in any order: max); padding lanes are 0. */
INLINE void track(__m256 x, __m256 *amax, __m256 *bad)
{
    __m256 a = _mm256_and_ps(x, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)));
    *bad = _mm256_or_ps(*bad, _mm256_cmp_ps(a, _mm256_set1_ps(FLT_MAX), _CMP_NLE_UQ));
    *amax = _mm256_max_ps(*amax, a);
}

/* A block's stored scale from its tracked absmax (NaN when poisoned, 0 when flushed), and in
 * *inv the factor its values are multiplied by before the search; as off__quant_scalar. */
INLINE float block_scale(__m256 amax, __m256 bad, float *inv)
{
    if (_mm256_movemask_ps(bad)) {
        *inv = 0.0f;
        return off__bits_f32(0x7fc00000u);
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
    float absmax = _mm_cvtss_f32(h);
    *inv = off__inv_scale(absmax);
    return *inv == 0.0f ? 0.0f : absmax;
}

INLINE void encode8(int map, const float *x, uint8_t *codes, __m256 inv)
{
    long long c = qcode8(map, off__qcode_tab(map), _mm256_mul_ps(_mm256_loadu_ps(x), inv));
    memcpy(codes, &c, 8);
}

/* The codes of n (<= one block) values of a block that is not poisoned. */
INLINE void encode(int map, const float *x, uint8_t *codes, long long n, float inv_s)
{
    __m256 inv = _mm256_set1_ps(inv_s);
    long long i = 0;
    for (; i + 8 <= n; i += 8)
        encode8(map, x + i, codes + i, inv);
    if (i < n) {
        long long c = qcode8(map, off__qcode_tab(map), _mm256_mul_ps(masked_load(x + i, n - i), inv));
        memcpy(codes + i, &c, (size_t)(n - i));
    }
}

/* off__quant_scalar: absmax over n (<= one block) values, then the codes. */
float off__quant_avx2(int map, const float *x, uint8_t *codes, long long n)
{
    __m256 amax = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
    for (long long i = 0; i < n; i += 8)
        track(n - i >= 8 ? _mm256_loadu_ps(x + i) : masked_load(x + i, n - i), &amax, &bad);
    float inv;
    float scale = block_scale(amax, bad, &inv);
    if (_mm256_movemask_ps(bad))
        memset(codes, off__qt.zero_code[map], (size_t)n);
    else if (map == OFF_QMAP_SIGNED)
        encode(OFF_QMAP_SIGNED, x, codes, n, inv);
    else
        encode(OFF_QMAP_UNSIGNED, x, codes, n, inv);
    return scale;
}

/* off__bound_moment lane by lane: the comparison for all eight, the square root only when a
 * lane is over (rare: the state rarely breaks the bound). sqrt(v) >= +0, so copysign is an or. */
INLINE __m256 bound_moment(__m256 m, __m256 v, float k, float k2)
{
    __m256 over = _mm256_cmp_ps(_mm256_mul_ps(m, m), _mm256_mul_ps(_mm256_set1_ps(k2), v), _CMP_GT_OQ);
    if (!_mm256_movemask_ps(over))
        return m;
    __m256 lim = _mm256_or_ps(_mm256_mul_ps(_mm256_set1_ps(k), _mm256_sqrt_ps(v)),
                              _mm256_and_ps(m, _mm256_set1_ps(-0.0f)));
    return _mm256_blendv_ps(m, lim, over);
}

/* Eight elements at i of these buffers (the slice's, or zero-padded copies at 0); their
 * updated moments go to mb/vb and the random bits use element index `index`. */
INLINE void step8(const off__adam8_consts *c, void *master, int master_dtype, const void *grad,
                  int grad_dtype, const uint8_t *mc, const uint8_t *vc, void *out, int out_dtype,
                  long long i, unsigned long long index, __m256 sm, __m256 sv, float *mb, float *vb,
                  __m256 *mo, __m256 *vo)
{
    const off__adam_consts *k = &c->a;
    __m256 g = grad_dtype == OFF_DTYPE_FP32
                   ? _mm256_loadu_ps((const float *)grad + i)
                   : widen(_mm_loadu_si128((const __m128i *)((const uint16_t *)grad + i)), grad_dtype);
    g = _mm256_mul_ps(g, _mm256_set1_ps(k->grad_scale));
    __m256 p = master_dtype == OFF_DTYPE_FP32
                   ? _mm256_loadu_ps((const float *)master + i)
                   : widen(_mm_loadu_si128((const __m128i *)((const uint16_t *)master + i)), OFF_DTYPE_BF16);
    if (k->mode == OFF__WD_DECOUPLED)
        p = _mm256_sub_ps(p, _mm256_mul_ps(_mm256_set1_ps(k->lr_wd), p));
    else if (k->mode == OFF__WD_L2)
        g = _mm256_add_ps(g, _mm256_mul_ps(_mm256_set1_ps(k->l2), p));
    __m256 m = dequant(off__qt.values[OFF_QMAP_SIGNED], mc + i, sm);
    __m256 v = dequant(off__qt.values[OFF_QMAP_UNSIGNED], vc + i, sv);
    m = bound_moment(m, v, c->m_bound, c->m_bound2);
    m = _mm256_add_ps(m, _mm256_mul_ps(_mm256_set1_ps(k->one_minus_beta1), _mm256_sub_ps(g, m)));
    v = _mm256_add_ps(v, _mm256_mul_ps(_mm256_set1_ps(k->one_minus_beta2),
                                       _mm256_sub_ps(_mm256_mul_ps(g, g), v)));
    __m256 denom = _mm256_add_ps(_mm256_sqrt_ps(v), _mm256_set1_ps(c->eps_bc2));
    p = _mm256_sub_ps(p, _mm256_div_ps(_mm256_mul_ps(_mm256_set1_ps(c->step_bc2), m), denom));
    _mm256_storeu_ps(mb, m);
    _mm256_storeu_ps(vb, v);
    *mo = m;
    *vo = v;
    __m128i h = _mm_setzero_si128();
    if (master_dtype == OFF_DTYPE_BF16) {
        h = to_bf16_sr(p, c->key, index);
        _mm_storeu_si128((__m128i *)((uint16_t *)master + i), h);
        p = widen(h, OFF_DTYPE_BF16);
    } else {
        _mm256_storeu_ps((float *)master + i, p);
    }
    if (out_dtype == OFF_DTYPE_FP32)
        _mm256_storeu_ps((float *)out + i, p);
    else if (out_dtype == OFF_DTYPE_BF16)
        _mm_storeu_si128((__m128i *)((uint16_t *)out + i), master_dtype == OFF_DTYPE_BF16 ? h : to_bf16(p));
    else if (out_dtype == OFF_DTYPE_FP16)
        _mm_storeu_si128((__m128i *)((uint16_t *)out + i),
                         _mm256_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

/* One pending block's requantisation, written while the next block updates (see
 * adam8_avx512.c). */
struct pending {
    long long len;                      /* elements, a multiple of 8; 0: none */
    const float *m, *v;
    uint8_t *mc, *vc;
    __m256 inv_m, inv_v;
    int enc_m, enc_v;                   /* 0 for a poisoned moment (codes already written) */
};

INLINE void encode_pending(const struct pending *q, long long j)
{
    if (q->enc_m)
        encode8(OFF_QMAP_SIGNED, q->m + j, q->mc + j, q->inv_m);
    if (q->enc_v)
        encode8(OFF_QMAP_UNSIGNED, q->v + j, q->vc + j, q->inv_v);
}

INLINE void run(const off__adam8_consts *cp, const off__adam8_io *iop, int master_dtype,
                int grad_dtype, int out_dtype, long long begin, long long end)
{
    /* local copies: stores through the buffers could alias *cp and *iop (see adam8_avx512_body.h) */
    const off__adam8_consts cl = *cp, *c = &cl;
    const off__adam8_io iol = *iop, *io = &iol;
    float mb[2][OFF_ADAM8_MAX_BLOCK], vb[2][OFF_ADAM8_MAX_BLOCK];
    size_t psz = master_dtype == OFF_DTYPE_FP32 ? 4 : 2, gsz = grad_dtype == OFF_DTYPE_FP32 ? 4 : 2;
    size_t osz = out_dtype == OFF_DTYPE_FP32 ? 4 : 2;
    struct pending prev = {0};
    int cur = 0;
    for (long long s = begin; s < end; s += c->block, cur ^= 1) {
        long long len = end - s < c->block ? end - s : c->block;
        long long blk = s / c->block;
        float *mcur = mb[cur], *vcur = vb[cur];
        __m256 sm = _mm256_set1_ps(io->m_absmax[blk]), sv = _mm256_set1_ps(io->v_absmax[blk]);
        __m256 am = _mm256_setzero_ps(), av = _mm256_setzero_ps(), m, v;
        __m256 bm = _mm256_setzero_ps(), bv = _mm256_setzero_ps();
        long long j = 0;
        for (; j + 8 <= len; j += 8) {
            long long i = s + j;
            if ((j & 63) == 0 && i + OFF_ADAM8_PREFETCH < end)
                off__adam8_prefetch64(io, psz, gsz, osz, out_dtype, i + OFF_ADAM8_PREFETCH);
            step8(c, io->master, master_dtype, io->grad, grad_dtype, io->m_codes, io->v_codes,
                  io->out, out_dtype, i, (unsigned long long)(io->index_base + i), sm, sv,
                  mcur + j, vcur + j, &m, &v);
            track(m, &am, &bm);
            track(v, &av, &bv);
            if (j < prev.len)
                encode_pending(&prev, j);
        }
        for (long long k = j; k < prev.len; k += 8)
            encode_pending(&prev, k);
        if (j < len) {
            long long i = s + j, k = len - j;
            float p[8] = {0}, g[8] = {0}, o[8] = {0};
            uint8_t mc[8] = {0}, vc[8] = {0};
            memcpy(p, (const char *)io->master + (size_t)i * psz, (size_t)k * psz);
            memcpy(g, (const char *)io->grad + (size_t)i * gsz, (size_t)k * gsz);
            memcpy(mc, io->m_codes + i, (size_t)k);
            memcpy(vc, io->v_codes + i, (size_t)k);
            step8(c, p, master_dtype, g, grad_dtype, mc, vc, o, out_dtype, 0,
                  (unsigned long long)(io->index_base + i), sm, sv, mcur + j, vcur + j, &m, &v);
            track(masked_load(mcur + j, k), &am, &bm);   /* live lanes only */
            track(masked_load(vcur + j, k), &av, &bv);
            memcpy((char *)io->master + (size_t)i * psz, p, (size_t)k * psz);
            if (out_dtype != OFF_DTYPE_NONE)
                memcpy((char *)io->out + (size_t)i * osz, o, (size_t)k * osz);
        }
        float inv_m, inv_v;
        io->m_absmax[blk] = block_scale(am, bm, &inv_m);
        io->v_absmax[blk] = block_scale(av, bv, &inv_v);
        int enc_m = !_mm256_movemask_ps(bm), enc_v = !_mm256_movemask_ps(bv);
        if (!enc_m)
            memset(io->m_codes + s, off__qt.zero_code[OFF_QMAP_SIGNED], (size_t)len);
        if (!enc_v)
            memset(io->v_codes + s, off__qt.zero_code[OFF_QMAP_UNSIGNED], (size_t)len);
        if (s + len < end) { /* a whole block with one after it: encode it during that one */
            prev = (struct pending){len, mcur, vcur, io->m_codes + s, io->v_codes + s,
                                    _mm256_set1_ps(inv_m), _mm256_set1_ps(inv_v), enc_m, enc_v};
        } else {
            if (enc_m)
                encode(OFF_QMAP_SIGNED, mcur, io->m_codes + s, len, inv_m);
            if (enc_v)
                encode(OFF_QMAP_UNSIGNED, vcur, io->v_codes + s, len, inv_v);
            prev.len = 0;
        }
    }
}

#define CASE(P, G, O) \
    if (io->master_dtype == P && io->grad_dtype == G && io->out_dtype == O) { \
        run(c, io, P, G, O, begin, end); \
        return; \
    }
#define CASES_OUT(P, G) \
    CASE(P, G, OFF_DTYPE_NONE) CASE(P, G, OFF_DTYPE_FP32) CASE(P, G, OFF_DTYPE_BF16) CASE(P, G, OFF_DTYPE_FP16)
#define CASES_GRAD(P) \
    CASES_OUT(P, OFF_DTYPE_FP32) CASES_OUT(P, OFF_DTYPE_BF16) CASES_OUT(P, OFF_DTYPE_FP16)

void off__adam8_avx2(const off__adam8_consts *c, const off__adam8_io *io, long long begin,
                     long long end)
{
    CASES_GRAD(OFF_DTYPE_FP32)
    CASES_GRAD(OFF_DTYPE_BF16)
}
#undef CASE

#pragma GCC pop_options
#endif
