/*
 * AVX2 + FMA + F16C Adam: eight lanes of exactly the scalar kernel's operations (see
 * adam_scalar.c; no FMA contraction, so the bits match it). The tail (< 8 elements) runs the
 * same vector code over a zero-padded copy, so a result never depends on where the work was
 * split between threads.
 */
#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#pragma GCC optimize("fp-contract=off")
#include <immintrin.h>
#include <math.h>

#include "adam_internal.h"
#include "simd_avx2.h"

INLINE __m256 load_grad(const void *grad, int dtype, long long i)
{
    if (dtype == OFF_DTYPE_BF16) {
        __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)grad + i));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    if (dtype == OFF_DTYPE_FP16)
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)grad + i)));
    return _mm256_loadu_ps((const float *)grad + i);
}

INLINE void step8(const off__adam_consts *c, float *param, const void *grad, int grad_dtype,
                  float *exp_avg, float *exp_avg_sq, void *out, int out_dtype, long long i)
{
    __m256 g = _mm256_mul_ps(load_grad(grad, grad_dtype, i), _mm256_set1_ps(c->grad_scale));
    __m256 p = _mm256_loadu_ps(param + i);
    if (c->mode == OFF__WD_DECOUPLED)
        p = _mm256_sub_ps(p, _mm256_mul_ps(_mm256_set1_ps(c->lr_wd), p));
    else if (c->mode == OFF__WD_L2)
        g = _mm256_add_ps(g, _mm256_mul_ps(_mm256_set1_ps(c->l2), p));
    __m256 m = _mm256_loadu_ps(exp_avg + i);
    m = _mm256_add_ps(m, _mm256_mul_ps(_mm256_set1_ps(c->one_minus_beta1), _mm256_sub_ps(g, m)));
    __m256 v0 = _mm256_loadu_ps(exp_avg_sq + i), gg = _mm256_mul_ps(g, g);
    __m256 v = _mm256_add_ps(v0, _mm256_mul_ps(_mm256_set1_ps(c->one_minus_beta2), _mm256_sub_ps(gg, v0)));
    /* +inf stays +inf (adam_scalar.c) */
    v = _mm256_blendv_ps(v, _mm256_add_ps(v0, gg), _mm256_cmp_ps(v0, _mm256_set1_ps(INFINITY), _CMP_EQ_OQ));
    __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(v), _mm256_set1_ps(c->bc2_sqrt)),
                                 _mm256_set1_ps(c->eps));
    p = _mm256_sub_ps(p, _mm256_div_ps(_mm256_mul_ps(_mm256_set1_ps(c->step_size), m), denom));
    _mm256_storeu_ps(param + i, p);
    _mm256_storeu_ps(exp_avg + i, m);
    _mm256_storeu_ps(exp_avg_sq + i, v);
    if (out_dtype == OFF_DTYPE_BF16)
        _mm_storeu_si128((__m128i *)((uint16_t *)out + i), to_bf16(p));
    else if (out_dtype == OFF_DTYPE_FP16)
        _mm_storeu_si128((__m128i *)((uint16_t *)out + i),
                         _mm256_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

INLINE void run(const off__adam_consts *c, float *param, const void *grad, int grad_dtype,
                float *exp_avg, float *exp_avg_sq, void *out, int out_dtype, long long n)
{
    long long i = 0;
    size_t gsz = grad_dtype == OFF_DTYPE_FP32 ? 4 : 2;
    for (; i + 16 <= n; i += 16) {
        off__prefetch_streams(param, grad, gsz, exp_avg, exp_avg_sq, i);
        step8(c, param, grad, grad_dtype, exp_avg, exp_avg_sq, out, out_dtype, i);
        step8(c, param, grad, grad_dtype, exp_avg, exp_avg_sq, out, out_dtype, i + 8);
    }
    for (; i + 8 <= n; i += 8)
        step8(c, param, grad, grad_dtype, exp_avg, exp_avg_sq, out, out_dtype, i);
    long long k = n - i;
    if (k == 0)
        return;
    /* tail: the same lanes over a zero-padded copy (padding lanes compute harmless values) */
    float p[8] = {0}, m[8] = {0}, v[8] = {0};
    uint32_t g[8] = {0};
    uint16_t o[8] = {0};
    memcpy(p, param + i, (size_t)k * 4);
    memcpy(m, exp_avg + i, (size_t)k * 4);
    memcpy(v, exp_avg_sq + i, (size_t)k * 4);
    memcpy(g, (const char *)grad + (size_t)i * gsz, (size_t)k * gsz);
    step8(c, p, g, grad_dtype, m, v, o, out_dtype, 0);
    memcpy(param + i, p, (size_t)k * 4);
    memcpy(exp_avg + i, m, (size_t)k * 4);
    memcpy(exp_avg_sq + i, v, (size_t)k * 4);
    if (out_dtype != OFF_DTYPE_NONE)
        memcpy((uint16_t *)out + i, o, (size_t)k * 2);
}

/* One specialised loop per (grad dtype, out dtype): the branches above fold away. */
#define CASE(G, O) \
    if (grad_dtype == G && out_dtype == O) { \
        run(c, param, grad, G, exp_avg, exp_avg_sq, out, O, n); \
        return; \
    }

void off__adam_avx2(const off__adam_consts *c, float *param, const void *grad, int grad_dtype,
                    float *exp_avg, float *exp_avg_sq, void *out, int out_dtype, long long n)
{
    OFF_FOR_EACH_DTYPE_PAIR(CASE)
}
#undef CASE

INLINE void probe8(float *a, float *b, float *c, const void *d, int d_dtype, void *e, int e_dtype,
                   long long i)
{
    __m256 x = load_grad(d, d_dtype, i);
    __m256 y = _mm256_add_ps(_mm256_loadu_ps(a + i), x);
    _mm256_storeu_ps(a + i, y);
    _mm256_storeu_ps(b + i, _mm256_add_ps(_mm256_loadu_ps(b + i), x));
    _mm256_storeu_ps(c + i, _mm256_add_ps(_mm256_loadu_ps(c + i), _mm256_mul_ps(x, x)));
    if (e_dtype == OFF_DTYPE_BF16)
        _mm_storeu_si128((__m128i *)((uint16_t *)e + i), to_bf16(y));
    else if (e_dtype == OFF_DTYPE_FP16)
        _mm_storeu_si128((__m128i *)((uint16_t *)e + i),
                         _mm256_cvtps_ph(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

INLINE void probe_run(float *a, float *b, float *c, const void *d, int d_dtype, void *e,
                      int e_dtype, long long n)
{
    long long i = 0;
    size_t dsz = d_dtype == OFF_DTYPE_FP32 ? 4 : 2;
    for (; i + 16 <= n; i += 16) {
        off__prefetch_streams(a, d, dsz, b, c, i);
        probe8(a, b, c, d, d_dtype, e, e_dtype, i);
        probe8(a, b, c, d, d_dtype, e, e_dtype, i + 8);
    }
    for (; i + 8 <= n; i += 8)
        probe8(a, b, c, d, d_dtype, e, e_dtype, i);
    off__probe_scalar(a + i, b + i, c + i, (const char *)d + (size_t)i * dsz, d_dtype,
                      e ? (char *)e + (size_t)i * 2 : e, e_dtype, n - i);
}

#define CASE(G, O) \
    if (d_dtype == G && e_dtype == O) { \
        probe_run(a, b, c, d, G, e, O, n); \
        return; \
    }

void off__probe_avx2(float *a, float *b, float *c, const void *d, int d_dtype, void *e,
                     int e_dtype, long long n)
{
    OFF_FOR_EACH_DTYPE_PAIR(CASE)
}
#undef CASE

#pragma GCC pop_options
#endif
