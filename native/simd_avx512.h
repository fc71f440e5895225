/*
 * AVX-512F conversions shared by the Adam kernels (adam_avx512.c, adam8_avx512.c,
 * adam16_avx512.c): included after each file's target pragma, so they compile for its instruction
 * set. to_bf16 is off__f32_to_bf16, sixteen at a time (round to nearest even, a NaN stays a NaN).
 * The stochastic-rounding pieces (sr_bits, bf16_sr: off__sr_bits and off__f32_to_bf16_sr of
 * adam8_internal.h) compile only where that header came first.
 */
#ifndef OFF_SIMD_AVX512_H
#define OFF_SIMD_AVX512_H

#include <immintrin.h>

#define INLINE static inline __attribute__((always_inline))

INLINE __m512 widen(__m256i h, int dtype)
{
    if (dtype == OFF_DTYPE_BF16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
}

INLINE __m256i to_bf16(__m512 x)
{
    __m512i u = _mm512_castps_si512(x);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(r);
}

#ifdef OFF_ADAM8_INTERNAL_H
INLINE __m512i mix32(__m512i x)
{
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
    x = _mm512_mullo_epi32(x, _mm512_set1_epi32(0x7feb352d));
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
    x = _mm512_mullo_epi32(x, _mm512_set1_epi32((int)0x846ca68bu));
    return _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
}

/* off__sr_bits(key, index + lane) for the sixteen lanes (all 32 bits). */
INLINE __m512i sr_bits(uint32_t key, unsigned long long index)
{
    uint32_t lo0 = (uint32_t)index, hi0 = (uint32_t)(index >> 32);
    __m512i lo = _mm512_add_epi32(_mm512_set1_epi32((int)lo0),
                                  _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    __mmask16 carry = _mm512_cmplt_epu32_mask(lo, _mm512_set1_epi32((int)lo0));
    __m512i k = _mm512_mask_blend_epi32(carry, _mm512_set1_epi32((int)off__mix32(key ^ hi0)),
                                        _mm512_set1_epi32((int)off__mix32(key ^ (hi0 + 1u))));
    return mix32(_mm512_xor_si512(lo, k));
}

/* off__f32_to_bf16_sr(x, r) lane by lane: only the low 16 bits of r are used. */
INLINE __m256i bf16_sr(__m512 x, __m512i r)
{
    __m512i u = _mm512_castps_si512(x);
    __m512i h = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_and_si512(r, _mm512_set1_epi32(0xffff))), 16);
    __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    h = _mm512_mask_or_epi32(h, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(h);
}
#endif

#endif
