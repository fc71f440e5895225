/*
 * AVX-512 VBMI 8-bit Adam (see adam8_avx512_body.h): the moments' map values through byte
 * permutes, 64 codes at a time, instead of gathers (~1.4x faster where gathers are slow). Chosen
 * at run time over adam8_avx512.c when the CPU has AVX-512 BW, DQ (vrangeps) and VBMI; the same
 * bits.
 */
#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vbmi,avx2,fma,f16c")
#pragma GCC optimize("fp-contract=off")
#define OFF_A8_VBMI 1
#include "adam8_avx512_body.h"

void off__adam8_avx512vbmi(const off__adam8_consts *c, const off__adam8_io *io, long long begin,
                           long long end)
{
    CASES_GRAD(OFF_DTYPE_FP32)
    CASES_GRAD(OFF_DTYPE_BF16)
}

#pragma GCC pop_options
#endif
