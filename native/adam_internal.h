/*
 * Internal to the CPU Adam (adam*.c): the per-call constants every kernel reads, the
 * kernel signature, and the scalar dtype conversions that the SIMD kernels reproduce bit
 * for bit. Not part of the public API (cffi never reads this file).
 */
#ifndef OFF_ADAM_INTERNAL_H
#define OFF_ADAM_INTERNAL_H

#include <stdint.h>
#include <string.h>
#if defined(__x86_64__)
#include <xmmintrin.h>
#endif

#include "common.h"

/*
 * Scalars derived once per call, in double as torch derives them from Python floats, then
 * rounded to float once: the kernels only ever see these.
 */
typedef struct off__adam_consts {
    float grad_scale;      /* applied to every gradient first (negated for maximize) */
    float lr_wd;           /* AdamW: param -= (lr*wd) * param */
    float l2;              /* Adam: grad += wd*param */
    float one_minus_beta1; /* exp_avg.lerp_(grad, 1 - beta1) */
    float one_minus_beta2; /* exp_avg_sq.lerp_(grad*grad, 1 - beta2) */
    float bc2_sqrt;        /* sqrt(1 - beta2^step) */
    float eps;
    float step_size;       /* lr / (1 - beta1^step) */
    int mode;              /* OFF__WD_NONE, OFF__WD_DECOUPLED or OFF__WD_L2 */
} off__adam_consts;

enum { OFF__WD_NONE = 0, OFF__WD_DECOUPLED = 1, OFF__WD_L2 = 2 };

/* Software prefetch distance of the SIMD loops, in elements (2 KiB of each fp32 stream):
 * with 4-5 streams per core the hardware prefetcher alone left ~20% of the bandwidth unused
 * here, for Adam and for the roofline loop alike (both prefetch the same way). */
#define OFF__PREFETCH 512

#if defined(__x86_64__)
/* The SIMD loops' prefetch, one 64-byte line ahead on each stream per 16 elements (the 16-bit
 * gradient every 32): fp32 streams a, b, c and the gradient g of gsz bytes per element. Every
 * x86-64 has SSE's prefetch, so this needs no target pragma and inlines into each level's loop. */
static inline __attribute__((always_inline)) void
off__prefetch_streams(const float *a, const void *g, size_t gsz, const float *b, const float *c,
                      long long i)
{
    _mm_prefetch((const char *)(a + i + OFF__PREFETCH), _MM_HINT_T0);
    _mm_prefetch((const char *)(b + i + OFF__PREFETCH), _MM_HINT_T0);
    _mm_prefetch((const char *)(c + i + OFF__PREFETCH), _MM_HINT_T0);
    if (gsz == 4 || (i & 31) == 0)
        _mm_prefetch((const char *)g + (size_t)(i + OFF__PREFETCH) * gsz, _MM_HINT_T0);
}
#endif

/* One kernel over [0, n) of already-offset buffers; every level gives the same bits. */
typedef void (*off__adam_kernel)(const off__adam_consts *c, float *param, const void *grad,
                                 int grad_dtype, float *exp_avg, float *exp_avg_sq, void *out,
                                 int out_dtype, long long n);

/* Memory probe over [0, n): a, b, c read and written (fp32), d read (d_dtype, like the
 * gradient), e written (e_dtype, like the low-precision copy; OFF_DTYPE_NONE for none). */
typedef void (*off__probe_kernel)(float *a, float *b, float *c, const void *d, int d_dtype,
                                  void *e, int e_dtype, long long n);

void off__adam_scalar(const off__adam_consts *c, float *param, const void *grad, int grad_dtype,
                      float *exp_avg, float *exp_avg_sq, void *out, int out_dtype, long long n);
void off__probe_scalar(float *a, float *b, float *c, const void *d, int d_dtype, void *e,
                       int e_dtype, long long n);
#if defined(__x86_64__)
void off__adam_avx2(const off__adam_consts *c, float *param, const void *grad, int grad_dtype,
                    float *exp_avg, float *exp_avg_sq, void *out, int out_dtype, long long n);
void off__probe_avx2(float *a, float *b, float *c, const void *d, int d_dtype, void *e,
                     int e_dtype, long long n);
void off__adam_avx512(const off__adam_consts *c, float *param, const void *grad, int grad_dtype,
                      float *exp_avg, float *exp_avg_sq, void *out, int out_dtype, long long n);
void off__probe_avx512(float *a, float *b, float *c, const void *d, int d_dtype, void *e,
                       int e_dtype, long long n);
#endif

/* Shared with the 8-bit kernels (adam8*.c): adam.c's persistent thread pool (task `index` of
 * `count`; the caller runs task 0), its thread-count rule, level check and constants. */
typedef void (*off__task_fn)(void *arg, int index, int count);
void off__pool_run(off__task_fn fn, void *arg, int count);
int off__thread_count(long long n, int threads);
int off__check_level(int level);
int off__adam_make_consts(const off_adam_hparams *hp, off__adam_consts *c);

static inline uint32_t off__f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static inline float off__bits_f32(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline float off__bf16_to_f32(uint16_t h) { return off__bits_f32((uint32_t)h << 16); }

/* Round to nearest even; a NaN stays a NaN (quiet, sign and top payload kept) instead of
 * carrying into the exponent and becoming an infinity. */
static inline uint16_t off__f32_to_bf16(float f)
{
    uint32_t u = off__f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((u >> 16) | 0x0040u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* IEEE half -> float, exact (what F16C's vcvtph2ps gives, signalling NaNs quieted). */
static inline float off__f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu;
    if (exp == 0x1f)
        return off__bits_f32(sign | 0x7f800000u | (man << 13) | (man ? 0x00400000u : 0u));
    if (exp == 0) {
        if (man == 0)
            return off__bits_f32(sign);
        /* subnormal: man * 2^-24, exact in float */
        float v = (float)man * 0x1p-24f;
        return off__bits_f32(sign | off__f32_bits(v));
    }
    return off__bits_f32(sign | ((exp + 112u) << 23) | (man << 13));
}

/* float -> IEEE half, round to nearest even (what F16C's vcvtps2ph with imm 0 gives: NaN
 * quiet with its top payload kept, overflow to infinity, subnormals rounded). */
static inline uint16_t off__f32_to_f16(float f)
{
    uint32_t u = off__f32_bits(f);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u)
        return (uint16_t)(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
    if (a >= 0x477ff000u) /* >= 65520 rounds to infinity (and infinity stays) */
        return (uint16_t)(sign | 0x7c00u);
    if (a >= 0x38800000u) { /* normal half */
        uint32_t h = a - 0x38000000u;
        h = (h + 0x0fffu + ((h >> 13) & 1u)) >> 13;
        return (uint16_t)(sign | h);
    }
    if (a <= 0x33000000u) /* <= 2^-25: ties to even at zero */
        return sign;
    uint32_t e = a >> 23;
    uint32_t m = (a & 0x7fffffu) | 0x800000u;
    uint32_t s = 126u - e; /* 14..24 */
    uint32_t r = m >> s;
    uint32_t rem = m & ((1u << s) - 1u);
    uint32_t half = 1u << (s - 1u);
    if (rem > half || (rem == half && (r & 1u)))
        r++;
    return (uint16_t)(sign | r);
}

/* Every (gradient dtype, output dtype) pair the kernels specialise a loop for: each SIMD file
 * expands X(G, O) into "if (grad == G && out == O) { specialised loop; return; }", so the
 * dtype branches fold away inside the loop. */
#define OFF_FOR_EACH_DTYPE_PAIR(X) \
    X(OFF_DTYPE_FP32, OFF_DTYPE_NONE) X(OFF_DTYPE_FP32, OFF_DTYPE_BF16) X(OFF_DTYPE_FP32, OFF_DTYPE_FP16) \
    X(OFF_DTYPE_BF16, OFF_DTYPE_NONE) X(OFF_DTYPE_BF16, OFF_DTYPE_BF16) X(OFF_DTYPE_BF16, OFF_DTYPE_FP16) \
    X(OFF_DTYPE_FP16, OFF_DTYPE_NONE) X(OFF_DTYPE_FP16, OFF_DTYPE_BF16) X(OFF_DTYPE_FP16, OFF_DTYPE_FP16)

#endif
