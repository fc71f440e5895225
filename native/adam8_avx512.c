/*
 * AVX-512F 8-bit Adam (see adam8_avx512_body.h): the moments' map values through gathers. The
 * run-time choice prefers adam8_avx512vbmi.c where the CPU has AVX-512 VBMI; both give the
 * same bits.
 */
#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma,f16c")
#pragma GCC optimize("fp-contract=off")
#define OFF_A8_VBMI 0
#include "adam8_avx512_body.h"

/* off__quant_scalar: absmax over n (<= one block) values, then the codes. */
float off__quant_avx512(int map, const float *x, uint8_t *codes, long long n)
{
    __m512i amax = _mm512_setzero_si512();
    int bad;
    for (long long i = 0; i < n; i += 16) {
        __mmask16 live = n - i >= 16 ? 0xffff : (__mmask16)((1u << (n - i)) - 1u);
        track(_mm512_maskz_loadu_ps(live, x + i), live, &amax);
    }
    float inv;
    float scale = block_scale(amax, &bad, &inv);
    if (bad)
        memset(codes, off__qt.zero_code[map], (size_t)n);
    else if (map == OFF_QMAP_SIGNED)
        encode(OFF_QMAP_SIGNED, x, codes, n, inv);
    else
        encode(OFF_QMAP_UNSIGNED, x, codes, n, inv);
    return scale;
}

void off__adam8_avx512(const off__adam8_consts *c, const off__adam8_io *io, long long begin,
                       long long end)
{
    CASES_GRAD(OFF_DTYPE_FP32)
    CASES_GRAD(OFF_DTYPE_BF16)
}

#pragma GCC pop_options
#endif
