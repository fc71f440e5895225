/*
 * AVX2 conversions shared by the Adam kernels (adam_avx2.c, adam8_avx2.c): included after each
 * file's target pragma. to_bf16 is off__f32_to_bf16, eight at a time (round to nearest even, a NaN
 * stays a NaN); pack16 keeps the low 16 bits of eight 32-bit lanes, in order.
 */
#ifndef OFF_SIMD_AVX2_H
#define OFF_SIMD_AVX2_H

#include <immintrin.h>

#define INLINE static inline __attribute__((always_inline))

INLINE __m128i pack16(__m256i r)
{
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08));
}

INLINE __m128i to_bf16(__m256 x)
{
    __m256i u = _mm256_castps_si256(x);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    __m256i q = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    return pack16(_mm256_blendv_epi8(r, q, nan));
}

#endif
