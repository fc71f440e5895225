/*
 * AVX-512F conversions shared by the Adam kernels (adam_avx512.c, adam8_avx512.c): included after
 * each file's target pragma, so they compile for its instruction set. to_bf16 is off__f32_to_bf16,
 * sixteen at a time (round to nearest even, a NaN stays a NaN).
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

#endif
