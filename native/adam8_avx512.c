/*
 * AVX-512F 8-bit Adam: sixteen lanes of exactly adam8_scalar.c's operations. Codes are
 * dequantised with a gather from the 256-entry map; the nearest code is found with one gather
 * from the bucket table (adam8_internal.h) and one comparison instead of a binary search; the
 * block's absmax is a max, which is exact in any order. A short last vector runs the same
 * lanes over zero-padded copies, so no result depends on where the work was split.
 */
#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma,f16c")
#pragma GCC optimize("fp-contract=off")
#include <float.h>
#include <immintrin.h>

#include "adam8_internal.h"
#include "simd_avx512.h"

/* off__f32_to_bf16_sr with off__sr_bits(key, index + lane) for the sixteen lanes. */
INLINE __m256i to_bf16_sr(__m512 x, uint32_t key, unsigned long long index)
{
    return bf16_sr(x, sr_bits(key, index));
}

INLINE __m512 dequant(const float *map, const uint8_t *codes, __m512 scale)
{
    __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)codes));
    return _mm512_mul_ps(_mm512_i32gather_ps(c, map, 4), scale);
}

/* The nearest codes of sixteen values (off__qcode_bucket lane by lane). */
INLINE __m128i qcode16(int map, const uint32_t *tab, __m512 x)
{
    if (map == OFF_QMAP_UNSIGNED) {
        /* every unsigned midpoint is > 0: a negative x (or -0) has the code of +0 */
        __m512i a = _mm512_castps_si512(_mm512_max_ps(x, _mm512_setzero_ps()));
        __m512i b = _mm512_sub_epi32(_mm512_srli_epi32(a, 16), _mm512_set1_epi32((OFF_QB_E0 << 7) - 1));
        b = _mm512_min_epi32(_mm512_max_epi32(b, _mm512_setzero_si512()), _mm512_set1_epi32(OFF_QB_N - 1));
        __m512i e = _mm512_i32gather_epi32(b, tab, 4);
        __mmask16 up = _mm512_cmpgt_epi32_mask(_mm512_and_si512(a, _mm512_set1_epi32(0xffff)),
                                               _mm512_srli_epi32(e, 16));
        __m512i code = _mm512_and_si512(e, _mm512_set1_epi32(0xff));
        return _mm512_cvtepi32_epi8(_mm512_mask_add_epi32(code, up, code, _mm512_set1_epi32(1)));
    }
    __m512i u = _mm512_castps_si512(x);
    __m512i a = _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff));
    __mmask16 neg = _mm512_cmplt_epi32_mask(u, _mm512_setzero_si512());
    __m512i b = _mm512_sub_epi32(_mm512_srli_epi32(a, 16), _mm512_set1_epi32((OFF_QB_E0 << 7) - 1));
    b = _mm512_min_epi32(_mm512_max_epi32(b, _mm512_setzero_si512()), _mm512_set1_epi32(OFF_QB_N - 1));
    b = _mm512_mask_add_epi32(b, neg, b, _mm512_set1_epi32(OFF_QB_N));
    __m512i e = _mm512_i32gather_epi32(b, tab, 4);
    __m512i t = _mm512_srli_epi32(e, 16);
    __m512i xl = _mm512_and_si512(a, _mm512_set1_epi32(0xffff));
    __mmask16 up = (_mm512_cmpgt_epi32_mask(xl, t) & (__mmask16)~neg) | (_mm512_cmpgt_epi32_mask(t, xl) & neg);
    __m512i code = _mm512_and_si512(e, _mm512_set1_epi32(0xff));
    code = _mm512_mask_add_epi32(code, up, code, _mm512_set1_epi32(1));
    return _mm512_cvtepi32_epi8(code);
}

/* Running absmax and non-finite lanes of live lanes of x (exact in any order: max). */
INLINE void track(__m512 x, __mmask16 live, __m512 *amax, __mmask16 *bad)
{
    __m512 a = _mm512_abs_ps(x);
    *bad |= _mm512_mask_cmp_ps_mask(live, a, _mm512_set1_ps(FLT_MAX), _CMP_NLE_UQ);
    *amax = _mm512_mask_max_ps(*amax, live, *amax, a);
}

/* A block's stored scale from its tracked absmax (NaN when poisoned, 0 when flushed), and in
 * *inv the factor its values are multiplied by before the search; as off__quant_scalar. */
INLINE float block_scale(__m512 amax, __mmask16 bad, float *inv)
{
    if (bad) {
        *inv = 0.0f;
        return off__bits_f32(0x7fc00000u);
    }
    float absmax = _mm512_reduce_max_ps(amax);
    *inv = off__inv_scale(absmax);
    return *inv == 0.0f ? 0.0f : absmax;
}

INLINE void encode16(int map, const float *x, uint8_t *codes, __m512 inv)
{
    _mm_storeu_si128((__m128i *)codes, qcode16(map, off__qt.bucket[map], _mm512_mul_ps(_mm512_loadu_ps(x), inv)));
}

/* The codes of n (<= one block) values of a block that is not poisoned. */
INLINE void encode(int map, const float *x, uint8_t *codes, long long n, float inv_s)
{
    __m512 inv = _mm512_set1_ps(inv_s);
    long long i = 0;
    for (; i + 16 <= n; i += 16)
        encode16(map, x + i, codes + i, inv);
    if (i < n) {
        __mmask16 live = (__mmask16)((1u << (n - i)) - 1u);
        uint8_t c[16];
        _mm_storeu_si128((__m128i *)c, qcode16(map, off__qt.bucket[map], _mm512_mul_ps(_mm512_maskz_loadu_ps(live, x + i), inv)));
        memcpy(codes + i, c, (size_t)(n - i));
    }
}

/* off__quant_scalar: absmax over n (<= one block) values, then the codes. */
float off__quant_avx512(int map, const float *x, uint8_t *codes, long long n)
{
    __m512 amax = _mm512_setzero_ps();
    __mmask16 bad = 0;
    for (long long i = 0; i < n; i += 16) {
        __mmask16 live = n - i >= 16 ? 0xffff : (__mmask16)((1u << (n - i)) - 1u);
        track(_mm512_maskz_loadu_ps(live, x + i), live, &amax, &bad);
    }
    float inv;
    float scale = block_scale(amax, bad, &inv);
    if (bad)
        memset(codes, off__qt.zero_code[map], (size_t)n);
    else if (map == OFF_QMAP_SIGNED)
        encode(OFF_QMAP_SIGNED, x, codes, n, inv);
    else
        encode(OFF_QMAP_UNSIGNED, x, codes, n, inv);
    return scale;
}

/* Sixteen elements at i of these buffers (the slice's, or zero-padded copies at 0); their
 * updated moments go to mb/vb and the random bits use element index `index`. */
INLINE void step16(const off__adam8_consts *c, void *master, int master_dtype, const void *grad,
                   int grad_dtype, const uint8_t *mc, const uint8_t *vc, void *out, int out_dtype,
                   long long i, unsigned long long index, __m512 sm, __m512 sv, float *mb, float *vb,
                   __m512 *mo, __m512 *vo)
{
    const off__adam_consts *k = &c->a;
    __m512 g = grad_dtype == OFF_DTYPE_FP32
                   ? _mm512_loadu_ps((const float *)grad + i)
                   : widen(_mm256_loadu_si256((const __m256i *)((const uint16_t *)grad + i)), grad_dtype);
    g = _mm512_mul_ps(g, _mm512_set1_ps(k->grad_scale));
    __m512 p = master_dtype == OFF_DTYPE_FP32
                   ? _mm512_loadu_ps((const float *)master + i)
                   : widen(_mm256_loadu_si256((const __m256i *)((const uint16_t *)master + i)), OFF_DTYPE_BF16);
    if (k->mode == OFF__WD_DECOUPLED)
        p = _mm512_sub_ps(p, _mm512_mul_ps(_mm512_set1_ps(k->lr_wd), p));
    else if (k->mode == OFF__WD_L2)
        g = _mm512_add_ps(g, _mm512_mul_ps(_mm512_set1_ps(k->l2), p));
    __m512 m = dequant(off__qt.values[OFF_QMAP_SIGNED], mc + i, sm);
    __m512 v = dequant(off__qt.values[OFF_QMAP_UNSIGNED], vc + i, sv);
    m = _mm512_add_ps(m, _mm512_mul_ps(_mm512_set1_ps(k->one_minus_beta1), _mm512_sub_ps(g, m)));
    v = _mm512_add_ps(v, _mm512_mul_ps(_mm512_set1_ps(k->one_minus_beta2),
                                       _mm512_sub_ps(_mm512_mul_ps(g, g), v)));
    __m512 denom = _mm512_add_ps(_mm512_sqrt_ps(v), _mm512_set1_ps(c->eps_bc2));
    p = _mm512_sub_ps(p, _mm512_div_ps(_mm512_mul_ps(_mm512_set1_ps(c->step_bc2), m), denom));
    _mm512_storeu_ps(mb, m);
    _mm512_storeu_ps(vb, v);
    *mo = m;
    *vo = v;
    __m256i h = _mm256_setzero_si256();
    if (master_dtype == OFF_DTYPE_BF16) {
        h = to_bf16_sr(p, c->key, index);
        _mm256_storeu_si256((__m256i *)((uint16_t *)master + i), h);
        p = widen(h, OFF_DTYPE_BF16);
    } else {
        _mm512_storeu_ps((float *)master + i, p);
    }
    if (out_dtype == OFF_DTYPE_FP32)
        _mm512_storeu_ps((float *)out + i, p);
    else if (out_dtype == OFF_DTYPE_BF16)
        _mm256_storeu_si256((__m256i *)((uint16_t *)out + i),
                            master_dtype == OFF_DTYPE_BF16 ? h : to_bf16(p));
    else if (out_dtype == OFF_DTYPE_FP16)
        _mm256_storeu_si256((__m256i *)((uint16_t *)out + i),
                            _mm512_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

/* Software prefetch of one block's streams `ahead` elements on (the hardware prefetcher alone
 * leaves the core waiting on seven streams). */
INLINE void prefetch_block(const off__adam8_io *io, size_t psz, size_t gsz, size_t osz, int out_dtype,
                           long long s, long long len)
{
    for (long long k = 0; k < len; k += 64) {
        const char *m = (const char *)io->master + (size_t)(s + k) * psz;
        const char *g = (const char *)io->grad + (size_t)(s + k) * gsz;
        for (size_t b = 0; b < 64 * psz; b += 64)
            _mm_prefetch(m + b, _MM_HINT_T0);
        for (size_t b = 0; b < 64 * gsz; b += 64)
            _mm_prefetch(g + b, _MM_HINT_T0);
        if (out_dtype != OFF_DTYPE_NONE) {
            const char *o = (const char *)io->out + (size_t)(s + k) * osz;
            for (size_t b = 0; b < 64 * osz; b += 64)
                _mm_prefetch(o + b, _MM_HINT_T0);
        }
        _mm_prefetch((const char *)(io->m_codes + s + k), _MM_HINT_T0);
        _mm_prefetch((const char *)(io->v_codes + s + k), _MM_HINT_T0);
    }
}

/* One pending block's requantisation: its codes are written while the next block updates, so
 * the latencies of the two (the block's absmax, the searches; the divisions) overlap. */
struct pending {
    long long len;                      /* elements, a multiple of 16; 0: none */
    const float *m, *v;                 /* its updated moments */
    uint8_t *mc, *vc;
    __m512 inv_m, inv_v;
    int enc_m, enc_v;                   /* 0 for a poisoned moment (codes already written) */
};

INLINE void encode_pending(const struct pending *q, long long j)
{
    if (q->enc_m)
        encode16(OFF_QMAP_SIGNED, q->m + j, q->mc + j, q->inv_m);
    if (q->enc_v)
        encode16(OFF_QMAP_UNSIGNED, q->v + j, q->vc + j, q->inv_v);
}

INLINE void run(const off__adam8_consts *c, const off__adam8_io *io, int master_dtype,
                int grad_dtype, int out_dtype, long long begin, long long end)
{
    float mb[2][OFF_ADAM8_MAX_BLOCK], vb[2][OFF_ADAM8_MAX_BLOCK];
    size_t psz = master_dtype == OFF_DTYPE_FP32 ? 4 : 2, gsz = grad_dtype == OFF_DTYPE_FP32 ? 4 : 2;
    size_t osz = out_dtype == OFF_DTYPE_FP32 ? 4 : 2;
    struct pending prev = {0};
    int cur = 0;
    for (long long s = begin; s < end; s += c->block, cur ^= 1) {
        long long len = end - s < c->block ? end - s : c->block;
        long long blk = s / c->block;
        float *mcur = mb[cur], *vcur = vb[cur];
        __m512 sm = _mm512_set1_ps(io->m_absmax[blk]), sv = _mm512_set1_ps(io->v_absmax[blk]);
        long long ahead = s + OFF_ADAM8_PREFETCH;
        if (ahead < end)
            prefetch_block(io, psz, gsz, osz, out_dtype, ahead,
                           end - ahead < c->block ? end - ahead : c->block);
        __m512 am = _mm512_setzero_ps(), av = _mm512_setzero_ps(), m, v;
        __mmask16 bm = 0, bv = 0;
        long long j = 0;
        for (; j + 16 <= len; j += 16) {
            long long i = s + j;
            step16(c, io->master, master_dtype, io->grad, grad_dtype, io->m_codes, io->v_codes,
                   io->out, out_dtype, i, (unsigned long long)(io->index_base + i), sm, sv,
                   mcur + j, vcur + j, &m, &v);
            track(m, 0xffff, &am, &bm);
            track(v, 0xffff, &av, &bv);
            if (j < prev.len)
                encode_pending(&prev, j);
        }
        for (long long k = j; k < prev.len; k += 16)
            encode_pending(&prev, k);
        if (j < len) {
            long long i = s + j, k = len - j;
            float p[16] = {0}, g[16] = {0}, o[16] = {0};
            uint8_t mc[16] = {0}, vc[16] = {0};
            memcpy(p, (const char *)io->master + (size_t)i * psz, (size_t)k * psz);
            memcpy(g, (const char *)io->grad + (size_t)i * gsz, (size_t)k * gsz);
            memcpy(mc, io->m_codes + i, (size_t)k);
            memcpy(vc, io->v_codes + i, (size_t)k);
            step16(c, p, master_dtype, g, grad_dtype, mc, vc, o, out_dtype, 0,
                   (unsigned long long)(io->index_base + i), sm, sv, mcur + j, vcur + j, &m, &v);
            __mmask16 live = (__mmask16)((1u << k) - 1u);
            track(m, live, &am, &bm);
            track(v, live, &av, &bv);
            memcpy((char *)io->master + (size_t)i * psz, p, (size_t)k * psz);
            if (out_dtype != OFF_DTYPE_NONE)
                memcpy((char *)io->out + (size_t)i * osz, o, (size_t)k * osz);
        }
        float inv_m, inv_v;
        io->m_absmax[blk] = block_scale(am, bm, &inv_m);
        io->v_absmax[blk] = block_scale(av, bv, &inv_v);
        if (bm)
            memset(io->m_codes + s, off__qt.zero_code[OFF_QMAP_SIGNED], (size_t)len);
        if (bv)
            memset(io->v_codes + s, off__qt.zero_code[OFF_QMAP_UNSIGNED], (size_t)len);
        if (s + len < end) { /* a whole block with one after it: encode it during that one */
            prev = (struct pending){len, mcur, vcur, io->m_codes + s, io->v_codes + s,
                                    _mm512_set1_ps(inv_m), _mm512_set1_ps(inv_v), !bm, !bv};
        } else {
            if (!bm)
                encode(OFF_QMAP_SIGNED, mcur, io->m_codes + s, len, inv_m);
            if (!bv)
                encode(OFF_QMAP_UNSIGNED, vcur, io->v_codes + s, len, inv_v);
            prev.len = 0;
        }
    }
}

/* One specialised loop per (master, grad, out) dtype: the branches above fold away. */
#define CASE(P, G, O) \
    if (io->master_dtype == P && io->grad_dtype == G && io->out_dtype == O) { \
        run(c, io, P, G, O, begin, end); \
        return; \
    }
#define CASES_OUT(P, G) \
    CASE(P, G, OFF_DTYPE_NONE) CASE(P, G, OFF_DTYPE_FP32) CASE(P, G, OFF_DTYPE_BF16) CASE(P, G, OFF_DTYPE_FP16)
#define CASES_GRAD(P) \
    CASES_OUT(P, OFF_DTYPE_FP32) CASES_OUT(P, OFF_DTYPE_BF16) CASES_OUT(P, OFF_DTYPE_FP16)

void off__adam8_avx512(const off__adam8_consts *c, const off__adam8_io *io, long long begin,
                       long long end)
{
    CASES_GRAD(OFF_DTYPE_FP32)
    CASES_GRAD(OFF_DTYPE_BF16)
}
#undef CASE

#pragma GCC pop_options
#endif
