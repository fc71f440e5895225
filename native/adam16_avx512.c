/*
 * AVX-512F Adam with 16-bit state: sixteen lanes of exactly adam16_scalar.c's operations (no
 * FMA contraction; the random bits from the element index, as there). A short last vector runs
 * the same lanes over zero-padded copies, so no result depends on where the work was split.
 */
#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma,f16c")
#pragma GCC optimize("fp-contract=off")
#include <immintrin.h>
#include <math.h>

#include "adam16_internal.h"
#include "simd_avx512.h"

INLINE __m512 load16(const void *buf, int dtype, long long i)
{
    if (dtype == OFF_DTYPE_FP32)
        return _mm512_loadu_ps((const float *)buf + i);
    return widen(_mm256_loadu_si256((const __m256i *)((const uint16_t *)buf + i)), dtype);
}

INLINE void store_bf16(void *buf, long long i, __m256i h)
{
    _mm256_storeu_si256((__m256i *)((uint16_t *)buf + i), h);
}

/* Sixteen elements at i of these buffers (the call's, or zero-padded copies at 0); `index` is
 * the element index of lane 0 (the random bits). */
INLINE void step16(const off__adam16_consts *c, void *master, int master_dtype, const void *grad,
                   int grad_dtype, void *mb, void *vb, int moment_dtype, void *out, int out_dtype,
                   long long i, unsigned long long index)
{
    const off__adam_consts *k = &c->a;
    __m512 g = _mm512_mul_ps(load16(grad, grad_dtype, i), _mm512_set1_ps(k->grad_scale));
    __m512 p = load16(master, master_dtype, i);
    if (k->mode == OFF__WD_DECOUPLED)
        p = _mm512_sub_ps(p, _mm512_mul_ps(_mm512_set1_ps(k->lr_wd), p));
    else if (k->mode == OFF__WD_L2)
        g = _mm512_add_ps(g, _mm512_mul_ps(_mm512_set1_ps(k->l2), p));
    __m512 m = load16(mb, moment_dtype, i);
    __m512 v0 = load16(vb, moment_dtype, i), gg = _mm512_mul_ps(g, g);
    m = _mm512_add_ps(m, _mm512_mul_ps(_mm512_set1_ps(k->one_minus_beta1), _mm512_sub_ps(g, m)));
    __m512 v = _mm512_add_ps(v0, _mm512_mul_ps(_mm512_set1_ps(k->one_minus_beta2), _mm512_sub_ps(gg, v0)));
    /* +inf stays +inf (adam_scalar.c) */
    v = _mm512_mask_add_ps(v, _mm512_cmp_ps_mask(v0, _mm512_set1_ps(INFINITY), _CMP_EQ_OQ), v0, gg);
    __m512 denom = _mm512_add_ps(_mm512_sqrt_ps(v), _mm512_set1_ps(c->eps_bc2));
    p = _mm512_sub_ps(p, _mm512_div_ps(_mm512_mul_ps(_mm512_set1_ps(c->step_bc2), m), denom));

    __m512i r = sr_bits(c->key, index);
    if (moment_dtype == OFF_DTYPE_BF16) {
        store_bf16(mb, i, bf16_sr(m, _mm512_srli_epi32(r, 16)));
        store_bf16(vb, i, bf16_sr(v, sr_bits(c->key_v, index)));
    } else {
        _mm512_storeu_ps((float *)mb + i, m);
        _mm512_storeu_ps((float *)vb + i, v);
    }
    __m256i h = _mm256_setzero_si256();
    if (master_dtype == OFF_DTYPE_BF16) {
        h = bf16_sr(p, r);
        store_bf16(master, i, h);
        p = widen(h, OFF_DTYPE_BF16);
    } else {
        _mm512_storeu_ps((float *)master + i, p);
    }
    if (out_dtype == OFF_DTYPE_FP32)
        _mm512_storeu_ps((float *)out + i, p);
    else if (out_dtype == OFF_DTYPE_BF16)
        store_bf16(out, i, master_dtype == OFF_DTYPE_BF16 ? h : to_bf16(p));
    else if (out_dtype == OFF_DTYPE_FP16)
        store_bf16(out, i, _mm512_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

/* One 64-byte line of a stream of sz-byte elements, OFF__PREFETCH elements ahead, each time the
 * loop (16 elements a turn) enters a new line of it. */
INLINE void prefetch(const void *buf, size_t sz, long long i)
{
    if (sz == 4 || (i & 31) == 0)
        _mm_prefetch((const char *)buf + (size_t)(i + OFF__PREFETCH) * sz, _MM_HINT_T0);
}

INLINE void run(const off__adam16_consts *c, const off__adam16_io *io, int master_dtype,
                int grad_dtype, int moment_dtype, int out_dtype, long long begin, long long end)
{
    size_t psz = master_dtype == OFF_DTYPE_FP32 ? 4 : 2, gsz = grad_dtype == OFF_DTYPE_FP32 ? 4 : 2;
    size_t msz = moment_dtype == OFF_DTYPE_FP32 ? 4 : 2, osz = out_dtype == OFF_DTYPE_FP32 ? 4 : 2;
    long long i = begin;
    for (; i + 16 <= end; i += 16) {
        prefetch(io->master, psz, i);
        prefetch(io->grad, gsz, i);
        prefetch(io->m, msz, i);
        prefetch(io->v, msz, i);
        step16(c, io->master, master_dtype, io->grad, grad_dtype, io->m, io->v, moment_dtype,
               io->out, out_dtype, i, (unsigned long long)(io->index_base + i));
    }
    long long k = end - i;
    if (k == 0)
        return;
    float p[16] = {0}, g[16] = {0}, m[16] = {0}, v[16] = {0}, o[16] = {0};
    memcpy(p, (const char *)io->master + (size_t)i * psz, (size_t)k * psz);
    memcpy(g, (const char *)io->grad + (size_t)i * gsz, (size_t)k * gsz);
    memcpy(m, (const char *)io->m + (size_t)i * msz, (size_t)k * msz);
    memcpy(v, (const char *)io->v + (size_t)i * msz, (size_t)k * msz);
    step16(c, p, master_dtype, g, grad_dtype, m, v, moment_dtype, o, out_dtype, 0,
           (unsigned long long)(io->index_base + i));
    memcpy((char *)io->master + (size_t)i * psz, p, (size_t)k * psz);
    memcpy((char *)io->m + (size_t)i * msz, m, (size_t)k * msz);
    memcpy((char *)io->v + (size_t)i * msz, v, (size_t)k * msz);
    if (out_dtype != OFF_DTYPE_NONE)
        memcpy((char *)io->out + (size_t)i * osz, o, (size_t)k * osz);
}

/* One specialised loop per (master, moments, grad, out) dtype: the branches above fold away. */
#define CASE(P, M, G, O) \
    if (io->master_dtype == P && io->moment_dtype == M && io->grad_dtype == G && io->out_dtype == O) { \
        run(c, io, P, G, M, O, begin, end); \
        return; \
    }
#define CASES_OUT(P, M, G) \
    CASE(P, M, G, OFF_DTYPE_NONE) CASE(P, M, G, OFF_DTYPE_FP32) CASE(P, M, G, OFF_DTYPE_BF16) \
    CASE(P, M, G, OFF_DTYPE_FP16)
#define CASES_GRAD(P, M) \
    CASES_OUT(P, M, OFF_DTYPE_FP32) CASES_OUT(P, M, OFF_DTYPE_BF16) CASES_OUT(P, M, OFF_DTYPE_FP16)

void off__adam16_avx512(const off__adam16_consts *c, const off__adam16_io *io, long long begin,
                        long long end)
{
    CASES_GRAD(OFF_DTYPE_FP32, OFF_DTYPE_BF16)
    CASES_GRAD(OFF_DTYPE_BF16, OFF_DTYPE_BF16)
    CASES_GRAD(OFF_DTYPE_BF16, OFF_DTYPE_FP32)
}
#undef CASE

#pragma GCC pop_options
#endif
