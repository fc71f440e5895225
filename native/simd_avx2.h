/*
 * AVX2 conversions shared by the Adam kernels (adam_avx2.c, adam8_avx2.c, adam16_avx2.c): included
 * after each file's target pragma. to_bf16 is off__f32_to_bf16, eight at a time (round to nearest
 * even, a NaN stays a NaN); pack16 keeps the low 16 bits of eight 32-bit lanes, in order; widen is
 * bf16/fp16 -> fp32; sr_bits and bf16_sr are off__sr_bits and off__f32_to_bf16_sr eight lanes at a
 * time (compiled only where adam8_internal.h came first).
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

INLINE __m256 widen(__m128i h, int dtype)
{
    if (dtype == OFF_DTYPE_BF16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    return _mm256_cvtph_ps(h);
}

#ifdef OFF_ADAM8_INTERNAL_H
INLINE __m256i mix32(__m256i x)
{
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32(0x7feb352d));
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32((int)0x846ca68bu));
    return _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
}

/* off__sr_bits(key, index + lane) for the eight lanes (all 32 bits). */
INLINE __m256i sr_bits(uint32_t key, unsigned long long index)
{
    uint32_t lo0 = (uint32_t)index, hi0 = (uint32_t)(index >> 32);
    __m256i lo = _mm256_add_epi32(_mm256_set1_epi32((int)lo0), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    /* unsigned lo < lo0, through the sign flip AVX2's signed compare needs */
    __m256i flip = _mm256_set1_epi32((int)0x80000000u);
    __m256i carry = _mm256_cmpgt_epi32(_mm256_xor_si256(_mm256_set1_epi32((int)lo0), flip),
                                       _mm256_xor_si256(lo, flip));
    __m256i k = _mm256_blendv_epi8(_mm256_set1_epi32((int)off__mix32(key ^ hi0)),
                                   _mm256_set1_epi32((int)off__mix32(key ^ (hi0 + 1u))), carry);
    return mix32(_mm256_xor_si256(lo, k));
}

/* off__f32_to_bf16_sr(x, r) lane by lane: only the low 16 bits of r are used. */
INLINE __m128i bf16_sr(__m256 x, __m256i r)
{
    __m256i u = _mm256_castps_si256(x);
    __m256i h = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_and_si256(r, _mm256_set1_epi32(0xffff))), 16);
    __m256i q = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    return pack16(_mm256_blendv_epi8(h, q, nan));
}
#endif

#endif
