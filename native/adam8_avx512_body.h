/*
 * The AVX-512 8-bit Adam kernel's body, included by adam8_avx512.c (AVX-512F: the moments' map
 * values through gathers) and adam8_avx512vbmi.c (OFF_A8_VBMI: through byte permutes, 64 at a
 * time), each after its own target pragma. Sixteen lanes of exactly adam8_scalar.c's
 * operations: the nearest code is found with one gather from the code table
 * (adam8_internal.h) and one add instead of a binary search; the block's absmax is a
 * max, which is exact in any order. A short last vector runs the same lanes over zero-padded
 * copies, so no result depends on where the work was split. Either variant gives the same bits.
 */
#ifndef OFF_A8_VBMI
#error "define OFF_A8_VBMI (0 or 1) before including adam8_avx512_body.h"
#endif
#include <float.h>
#include <immintrin.h>

#include "adam8_internal.h"
#include "simd_avx512.h"

/*
 * The bf16 master's sixteen stochastically rounded values at element index `index`, as
 * off__f32_to_bf16_sr(x, off__sr_bits(key, index + lane)), returned as the 32-bit sums whose
 * high halves are the bf16 bits. kb is mix32(key ^ khi) broadcast, computed once per block for
 * the high index word khi: where all sixteen indices share it (all but one group in 2^28) the
 * hash starts from kb, and its last xor-shift and the mask to 16 bits are one vpternlogd.
 */
INLINE __m512i bf16_sr_hi(__m512 x, uint32_t key, unsigned long long index, __m512i kb,
                          uint32_t khi)
{
    uint32_t lo0 = (uint32_t)index;
    __m512i r;
    if ((uint32_t)(index >> 32) == khi && lo0 <= 0xfffffff0u) {
        __m512i t = _mm512_xor_si512(
            _mm512_add_epi32(_mm512_set1_epi32((int)lo0),
                             _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)),
            kb);
        t = _mm512_xor_si512(t, _mm512_srli_epi32(t, 16));
        t = _mm512_mullo_epi32(t, _mm512_set1_epi32(0x7feb352d));
        t = _mm512_xor_si512(t, _mm512_srli_epi32(t, 15));
        t = _mm512_mullo_epi32(t, _mm512_set1_epi32((int)0x846ca68bu));
        r = _mm512_ternarylogic_epi32(t, _mm512_srli_epi32(t, 16), _mm512_set1_epi32(0xffff), 0x28);
    } else {
        r = _mm512_and_si512(sr_bits(key, index), _mm512_set1_epi32(0xffff));
    }
    __m512i u = _mm512_castps_si512(x);
    __m512i h = _mm512_add_epi32(u, r);
    /* NaN: (bits >> 16) | 0x40, a quiet NaN */
    return _mm512_mask_or_epi32(h, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), u,
                                _mm512_set1_epi32(0x00400000));
}

/* The high halves of sixteen 32-bit lanes as sixteen 16-bit values. */
INLINE __m256i high_halves(__m512i h)
{
#if OFF_A8_VBMI /* one vpermw (AVX-512 BW) instead of a shift and a two-uop vpmovdw */
    const __m512i odd = _mm512_set_epi16(
        0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
        31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
    return _mm512_castsi512_si256(_mm512_permutexvar_epi16(odd, h));
#else
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(h, 16));
#endif
}

/* The map values of sixteen codes, through a gather. */
INLINE __m512 lookup16(const float *map, const uint8_t *codes)
{
    __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)codes));
    return _mm512_i32gather_ps(c, map, 4);
}

#if OFF_A8_VBMI
/*
 * The map values of 64 codes without a gather (gathers cost ~20 cycles each here, half the
 * kernel's time): each of a value's four bytes is looked up in its own 256-byte plane of the
 * map with two 128-entry byte permutes (vpermi2b) and a blend on the code's top bit, and the four
 * byte planes are interleaved back into floats. The in-lane unpacks leave element 16L + 4k + i
 * of the planes in lane L of output k, so the codes are first permuted to make that element
 * 16k + 4L + i: the outputs come out in order. Exact: the same table bits as the gather.
 */
INLINE void lookup64(const uint8_t (*planes)[256], __m512i c, __m512 out[4])
{
    const __m512i order = _mm512_set_epi8(
        63, 62, 61, 60, 47, 46, 45, 44, 31, 30, 29, 28, 15, 14, 13, 12,
        59, 58, 57, 56, 43, 42, 41, 40, 27, 26, 25, 24, 11, 10, 9, 8,
        55, 54, 53, 52, 39, 38, 37, 36, 23, 22, 21, 20, 7, 6, 5, 4,
        51, 50, 49, 48, 35, 34, 33, 32, 19, 18, 17, 16, 3, 2, 1, 0);
    c = _mm512_permutexvar_epi8(order, c);
    __mmask64 high = _mm512_movepi8_mask(c);
    __m512i b[4];
    for (int k = 0; k < 4; k++) {
        const __m512i *t = (const __m512i *)planes[k];
        __m512i lo = _mm512_permutex2var_epi8(_mm512_load_si512(t), c, _mm512_load_si512(t + 1));
        __m512i hi = _mm512_permutex2var_epi8(_mm512_load_si512(t + 2), c, _mm512_load_si512(t + 3));
        b[k] = _mm512_mask_blend_epi8(high, lo, hi);
    }
    __m512i l01 = _mm512_unpacklo_epi8(b[0], b[1]), h01 = _mm512_unpackhi_epi8(b[0], b[1]);
    __m512i l23 = _mm512_unpacklo_epi8(b[2], b[3]), h23 = _mm512_unpackhi_epi8(b[2], b[3]);
    out[0] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(l01, l23));
    out[1] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(l01, l23));
    out[2] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(h01, h23));
    out[3] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(h01, h23));
}
#endif

/* The nearest codes of sixteen values: off__qcode_add lane by lane, one gather from code[]
 * (adam8_internal.h) and one add; tab is the map's code[] less OFF_QC_LO entries, so the
 * clamped bits' high half indexes it directly. Only the lower clamp is applied: the values
 * searched are x * (1/absmax) with |x| <= absmax, and absmax * RN(1/absmax) <= 1 + 2^-24
 * rounds to at most 1 + 2^-23, whose high half 0x3f80 is 1.0's: the same entry, and its low
 * half never carries (that bucket holds no midpoint), so the upper clamp never changes a code. */
INLINE __m128i qcode16(int map, const uint32_t *tab, __m512 x)
{
    __m512i u = _mm512_castps_si512(x), a;
    if (map == OFF_QMAP_UNSIGNED) { /* a negative x (its bits < 0 as an int) codes as +0 */
        a = _mm512_max_epi32(u, _mm512_set1_epi32(0x34000000));
    } else {
#if OFF_A8_VBMI
        /* sign(x) * max(|x|, 2^-23) in one vrangeps: imm bits 1:0 = 11 (larger magnitude), bits
         * 3:2 = 00 (the sign of the first source, x; 01 would take the selected value's, so an x
         * below 2^-23, -0.0 too, would come out positive) */
        a = _mm512_castps_si512(_mm512_range_ps(x, _mm512_set1_ps(0x1p-23f), 0x3));
#else
        a = _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff));
        a = _mm512_max_epu32(a, _mm512_set1_epi32(0x34000000));
        /* |x| clamped with x's sign */
        a = _mm512_ternarylogic_epi32(a, u, _mm512_set1_epi32((int)0x80000000u), 0xf8);
#endif
        a = _mm512_xor_si512(a, _mm512_srai_epi32(a, 31)); /* complemented where negative */
    }
    __m512i r = _mm512_add_epi32(_mm512_i32gather_epi32(_mm512_srli_epi32(a, 16), tab, 4), a);
#if OFF_A8_VBMI
    const __m512i byte2 = _mm512_set_epi8(
        0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
        0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
        0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
        62, 58, 54, 50, 46, 42, 38, 34, 30, 26, 22, 18, 14, 10, 6, 2);
    return _mm512_castsi512_si128(_mm512_permutexvar_epi8(byte2, r));
#else
    return _mm512_cvtepi32_epi8(_mm512_srli_epi32(r, 16));
#endif
}

/* Running max of the live lanes' |x| bits: for floats of one sign the integer order is the
 * float order, and every non-finite |x| (inf 0x7f800000, NaN above) is above every finite one,
 * so one integer max tracks both the absmax and whether a lane was non-finite (two uops, where
 * a float max and a separate non-finite compare took four). */
INLINE void track(__m512 x, __mmask16 live, __m512i *amax)
{
    __m512i a = _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(0x7fffffff));
    *amax = _mm512_mask_max_epu32(*amax, live, *amax, a);
}

/* A block's stored scale from its tracked |x| bits (NaN when poisoned, 0 when flushed), and in
 * *inv the factor its values are multiplied by before the search; as off__quant_scalar.
 * *bad: whether a value was non-finite (poisoned). */
INLINE float block_scale(__m512i amax, int *bad, float *inv)
{
    uint32_t top = _mm512_reduce_max_epu32(amax);
    *bad = top > 0x7f7fffffu;
    if (*bad) {
        *inv = 0.0f;
        return off__bits_f32(0x7fc00000u);
    }
    float absmax = off__bits_f32(top);
    *inv = off__inv_scale(absmax);
    return *inv == 0.0f ? 0.0f : absmax;
}

INLINE void encode16(int map, const float *x, uint8_t *codes, __m512 inv)
{
    _mm_storeu_si128((__m128i *)codes, qcode16(map, off__qcode_tab(map), _mm512_mul_ps(_mm512_loadu_ps(x), inv)));
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
        _mm_storeu_si128((__m128i *)c, qcode16(map, off__qcode_tab(map), _mm512_mul_ps(_mm512_maskz_loadu_ps(live, x + i), inv)));
        memcpy(codes + i, c, (size_t)(n - i));
    }
}

/* off__bound_moment lane by lane: the comparison for all sixteen, the square root only when a
 * lane is over (rare: the state rarely breaks the bound). sqrt(v) >= +0, so copysign is an or. */
INLINE __m512 bound_moment(__m512 m, __m512 v, float k, float k2)
{
    __mmask16 over = _mm512_cmp_ps_mask(_mm512_mul_ps(m, m), _mm512_mul_ps(_mm512_set1_ps(k2), v), _CMP_GT_OQ);
    if (!over)
        return m;
    __m512i sign = _mm512_and_si512(_mm512_castps_si512(m), _mm512_set1_epi32((int)0x80000000u));
    __m512 lim = _mm512_castsi512_ps(_mm512_or_si512(
        _mm512_castps_si512(_mm512_mul_ps(_mm512_set1_ps(k), _mm512_sqrt_ps(v))), sign));
    return _mm512_mask_mov_ps(m, over, lim);
}

/* Sixteen elements at i of these buffers (the slice's, or zero-padded copies at 0), whose
 * moments' map values are mq/vq (times the block's scales sm/sv); their updated moments go to
 * mb/vb and the random bits use element index `index`. */
INLINE void step16(const off__adam8_consts *c, void *master, int master_dtype, const void *grad,
                   int grad_dtype, __m512 mq, __m512 vq, void *out, int out_dtype,
                   long long i, unsigned long long index, __m512i kb, uint32_t khi, __m512 sm,
                   __m512 sv, float *mb, float *vb,
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
    __m512 m = _mm512_mul_ps(mq, sm);
    __m512 v = _mm512_mul_ps(vq, sv);
    m = bound_moment(m, v, c->m_bound, c->m_bound2);
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
        h = high_halves(bf16_sr_hi(p, c->key, index, kb, khi));
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

INLINE void run(const off__adam8_consts *cp, const off__adam8_io *iop, int master_dtype,
                int grad_dtype, int out_dtype, long long begin, long long end)
{
    /* Local copies: stores through the buffers could alias *cp and *iop as far as the compiler
     * knows, which made it reload every constant and pointer after each store. */
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
        __m512 sm = _mm512_set1_ps(io->m_absmax[blk]), sv = _mm512_set1_ps(io->v_absmax[blk]);
        uint32_t khi = (uint32_t)((unsigned long long)(io->index_base + s) >> 32);
        __m512i kb = _mm512_set1_epi32((int)off__mix32(c->key ^ khi));
#if !OFF_A8_VBMI /* the VBMI loop prefetches as it goes */
        for (long long k = s + OFF_ADAM8_PREFETCH; k < end && k < s + OFF_ADAM8_PREFETCH + len; k += 64)
            off__adam8_prefetch64(io, psz, gsz, osz, out_dtype, k);
#endif
        __m512i am = _mm512_setzero_si512(), av = _mm512_setzero_si512();
        __m512 m, v;
        int bm, bv;
        long long j = 0;
#if OFF_A8_VBMI
        for (; j + 64 <= len; j += 64) {
            __m512 mq[4], vq[4];
            if (s + j + OFF_ADAM8_PREFETCH < end)
                off__adam8_prefetch64(io, psz, gsz, osz, out_dtype, s + j + OFF_ADAM8_PREFETCH);
            lookup64(off__qt.planes[OFF_QMAP_SIGNED], _mm512_loadu_si512(io->m_codes + s + j), mq);
            lookup64(off__qt.planes[OFF_QMAP_UNSIGNED], _mm512_loadu_si512(io->v_codes + s + j), vq);
            for (int u = 0; u < 4; u++) {
                long long i = s + j + 16 * u;
                step16(c, io->master, master_dtype, io->grad, grad_dtype, mq[u], vq[u], io->out,
                       out_dtype, i, (unsigned long long)(io->index_base + i), kb, khi, sm, sv,
                       mcur + j + 16 * u, vcur + j + 16 * u, &m, &v);
                track(m, 0xffff, &am);
                track(v, 0xffff, &av);
                if (j + 16 * u < prev.len)
                    encode_pending(&prev, j + 16 * u);
            }
        }
#endif
        for (; j + 16 <= len; j += 16) {
            long long i = s + j;
            step16(c, io->master, master_dtype, io->grad, grad_dtype,
                   lookup16(off__qt.values[OFF_QMAP_SIGNED], io->m_codes + i),
                   lookup16(off__qt.values[OFF_QMAP_UNSIGNED], io->v_codes + i), io->out, out_dtype,
                   i, (unsigned long long)(io->index_base + i), kb, khi, sm, sv, mcur + j, vcur + j, &m, &v);
            track(m, 0xffff, &am);
            track(v, 0xffff, &av);
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
            step16(c, p, master_dtype, g, grad_dtype, lookup16(off__qt.values[OFF_QMAP_SIGNED], mc),
                   lookup16(off__qt.values[OFF_QMAP_UNSIGNED], vc), o, out_dtype, 0,
                   (unsigned long long)(io->index_base + i), kb, khi, sm, sv, mcur + j, vcur + j, &m, &v);
            __mmask16 live = (__mmask16)((1u << k) - 1u);
            track(m, live, &am);
            track(v, live, &av);
            memcpy((char *)io->master + (size_t)i * psz, p, (size_t)k * psz);
            if (out_dtype != OFF_DTYPE_NONE)
                memcpy((char *)io->out + (size_t)i * osz, o, (size_t)k * osz);
        }
        float inv_m, inv_v;
        io->m_absmax[blk] = block_scale(am, &bm, &inv_m);
        io->v_absmax[blk] = block_scale(av, &bv, &inv_v);
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
