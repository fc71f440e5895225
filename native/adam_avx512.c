/*
 * AVX-512F Adam: sixteen lanes of exactly the scalar kernel's operations (see adam_scalar.c;
 * no FMA contraction, so the bits match it). The tail uses masked loads and stores for the
 * fp32 streams; AVX-512F has no 16-bit masks, so 16-bit streams go through a zero-padded copy.
 */
#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma,f16c")
#pragma GCC optimize("fp-contract=off")
#include <immintrin.h>
#include <math.h>

#include "adam_internal.h"
#include "simd_avx512.h"

INLINE __m256i narrow(__m512 p, int dtype)
{
    if (dtype == OFF_DTYPE_BF16)
        return to_bf16(p);
    return _mm512_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

/* The update on sixteen lanes; loads and stores are the caller's (full or masked). */
INLINE void math16(const off__adam_consts *c, __m512 g, __m512 *pp, __m512 *mp, __m512 *vp)
{
    g = _mm512_mul_ps(g, _mm512_set1_ps(c->grad_scale));
    __m512 p = *pp;
    if (c->mode == OFF__WD_DECOUPLED)
        p = _mm512_sub_ps(p, _mm512_mul_ps(_mm512_set1_ps(c->lr_wd), p));
    else if (c->mode == OFF__WD_L2)
        g = _mm512_add_ps(g, _mm512_mul_ps(_mm512_set1_ps(c->l2), p));
    __m512 m = *mp;
    m = _mm512_add_ps(m, _mm512_mul_ps(_mm512_set1_ps(c->one_minus_beta1), _mm512_sub_ps(g, m)));
    __m512 v0 = *vp, gg = _mm512_mul_ps(g, g);
    __m512 v = _mm512_add_ps(v0, _mm512_mul_ps(_mm512_set1_ps(c->one_minus_beta2), _mm512_sub_ps(gg, v0)));
    /* +inf stays +inf (adam_scalar.c) */
    v = _mm512_mask_add_ps(v, _mm512_cmp_ps_mask(v0, _mm512_set1_ps(INFINITY), _CMP_EQ_OQ), v0, gg);
    __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(v), _mm512_set1_ps(c->bc2_sqrt)),
                                 _mm512_set1_ps(c->eps));
    p = _mm512_sub_ps(p, _mm512_div_ps(_mm512_mul_ps(_mm512_set1_ps(c->step_size), m), denom));
    *pp = p;
    *mp = m;
    *vp = v;
}

INLINE void step16(const off__adam_consts *c, float *param, const void *grad, int grad_dtype,
                   float *exp_avg, float *exp_avg_sq, void *out, int out_dtype, long long i)
{
    __m512 g = grad_dtype == OFF_DTYPE_FP32
                   ? _mm512_loadu_ps((const float *)grad + i)
                   : widen(_mm256_loadu_si256((const __m256i *)((const uint16_t *)grad + i)), grad_dtype);
    __m512 p = _mm512_loadu_ps(param + i);
    __m512 m = _mm512_loadu_ps(exp_avg + i);
    __m512 v = _mm512_loadu_ps(exp_avg_sq + i);
    math16(c, g, &p, &m, &v);
    _mm512_storeu_ps(param + i, p);
    _mm512_storeu_ps(exp_avg + i, m);
    _mm512_storeu_ps(exp_avg_sq + i, v);
    if (out_dtype != OFF_DTYPE_NONE)
        _mm256_storeu_si256((__m256i *)((uint16_t *)out + i), narrow(p, out_dtype));
}

INLINE void run(const off__adam_consts *c, float *param, const void *grad, int grad_dtype,
                float *exp_avg, float *exp_avg_sq, void *out, int out_dtype, long long n)
{
    long long i = 0;
    size_t gsz = grad_dtype == OFF_DTYPE_FP32 ? 4 : 2;
    for (; i + 16 <= n; i += 16) {
        off__prefetch_streams(param, grad, gsz, exp_avg, exp_avg_sq, i);
        step16(c, param, grad, grad_dtype, exp_avg, exp_avg_sq, out, out_dtype, i);
    }
    long long k = n - i;
    if (k == 0)
        return;
    __mmask16 mask = (__mmask16)((1u << k) - 1u);
    __m512 g;
    if (grad_dtype == OFF_DTYPE_FP32) {
        g = _mm512_maskz_loadu_ps(mask, (const float *)grad + i);
    } else {
        uint16_t h[16] = {0};
        memcpy(h, (const uint16_t *)grad + i, (size_t)k * 2);
        g = widen(_mm256_loadu_si256((const __m256i *)h), grad_dtype);
    }
    __m512 p = _mm512_maskz_loadu_ps(mask, param + i);
    __m512 m = _mm512_maskz_loadu_ps(mask, exp_avg + i);
    __m512 v = _mm512_maskz_loadu_ps(mask, exp_avg_sq + i);
    math16(c, g, &p, &m, &v);
    _mm512_mask_storeu_ps(param + i, mask, p);
    _mm512_mask_storeu_ps(exp_avg + i, mask, m);
    _mm512_mask_storeu_ps(exp_avg_sq + i, mask, v);
    if (out_dtype != OFF_DTYPE_NONE) {
        uint16_t o[16];
        _mm256_storeu_si256((__m256i *)o, narrow(p, out_dtype));
        memcpy((uint16_t *)out + i, o, (size_t)k * 2);
    }
}

#define CASE(G, O) \
    if (grad_dtype == G && out_dtype == O) { \
        run(c, param, grad, G, exp_avg, exp_avg_sq, out, O, n); \
        return; \
    }

void off__adam_avx512(const off__adam_consts *c, float *param, const void *grad, int grad_dtype,
                      float *exp_avg, float *exp_avg_sq, void *out, int out_dtype, long long n)
{
    OFF_FOR_EACH_DTYPE_PAIR(CASE)
}
#undef CASE

INLINE void probe16(float *a, float *b, float *c, const void *d, int d_dtype, void *e, int e_dtype,
                    long long i)
{
    __m512 x = d_dtype == OFF_DTYPE_FP32
                   ? _mm512_loadu_ps((const float *)d + i)
                   : widen(_mm256_loadu_si256((const __m256i *)((const uint16_t *)d + i)), d_dtype);
    __m512 y = _mm512_add_ps(_mm512_loadu_ps(a + i), x);
    _mm512_storeu_ps(a + i, y);
    _mm512_storeu_ps(b + i, _mm512_add_ps(_mm512_loadu_ps(b + i), x));
    _mm512_storeu_ps(c + i, _mm512_add_ps(_mm512_loadu_ps(c + i), _mm512_mul_ps(x, x)));
    if (e_dtype != OFF_DTYPE_NONE)
        _mm256_storeu_si256((__m256i *)((uint16_t *)e + i), narrow(y, e_dtype));
}

INLINE void probe_run(float *a, float *b, float *c, const void *d, int d_dtype, void *e,
                      int e_dtype, long long n)
{
    long long i = 0;
    size_t dsz = d_dtype == OFF_DTYPE_FP32 ? 4 : 2;
    for (; i + 16 <= n; i += 16) {
        off__prefetch_streams(a, d, dsz, b, c, i);
        probe16(a, b, c, d, d_dtype, e, e_dtype, i);
    }
    off__probe_scalar(a + i, b + i, c + i, (const char *)d + (size_t)i * dsz, d_dtype,
                      e ? (char *)e + (size_t)i * 2 : e, e_dtype, n - i);
}

#define CASE(G, O) \
    if (d_dtype == G && e_dtype == O) { \
        probe_run(a, b, c, d, G, e, O, n); \
        return; \
    }

void off__probe_avx512(float *a, float *b, float *c, const void *d, int d_dtype, void *e,
                       int e_dtype, long long n)
{
    OFF_FOR_EACH_DTYPE_PAIR(CASE)
}
#undef CASE

#pragma GCC pop_options
#endif
