/*
 * Internal to the 8-bit Adam (adam8*.c): the code tables, the per-call constants, the kernel
 * signature, and the scalar pieces (random bits, stochastic rounding, the table search) that
 * the SIMD kernels reproduce bit for bit. Not part of the public API.
 */
#ifndef OFF_ADAM8_INTERNAL_H
#define OFF_ADAM8_INTERNAL_H

#include <math.h>

#include "adam_internal.h"

#define OFF_ADAM8_MAX_BLOCK 4096
/* How far ahead (elements) the SIMD kernels prefetch each block's streams. */
#ifndef OFF_ADAM8_PREFETCH
#define OFF_ADAM8_PREFETCH 512
#endif

/*
 * The maps and what the SIMD search needs, built once at load by adam8.c:
 *   values[map][256]  ascending code values (value = values[code] * absmax)
 *   mid[map][255]     float midpoints between neighbours: the nearest code of x is the
 *                     number of midpoints below x (a tie goes to the lower code)
 *   bucket[map][2*NB] that count without a search. |x| is cut into buckets by its float bits
 *                     (exponent and top 7 mantissa bits); each bucket holds at most one
 *                     midpoint, so count = entry's base + one comparison of the low 16 bits.
 *                     Entry: base (bits 0-7) | that midpoint's low 16 bits (16-31). The second
 *                     half serves negative x, where the comparison is reversed. The SIMD
 *                     kernels read code[] below, built from these buckets.
 */
#define OFF_QB_E0 104                   /* buckets start at 2^(104-127) = 2^-23 */
#define OFF_QB_BINADES 23               /* 2^-23 .. 1; one more bucket for >= 1, one for < 2^-23 */
#define OFF_QB_N (OFF_QB_BINADES * 128 + 2)

/*
 * code[map][OFF_QC_N]: the same buckets arranged so that the code costs one add after the
 * lookup (adam8_avx512_body.h). |x| is clamped to [2^-23, 1] keeping its sign (no midpoint
 * lies outside), and a negative x's bits are complemented: u' = x's bits, or ~bits when x < 0.
 * Entry u'>>16 - OFF_QC_LO holds ((code base - (u'>>16)) << 16) + (0xffff - t) for a positive
 * x (t: the bucket's midpoint's low 16 bits, 0xffff when none) and the complemented form for
 * a negative one, so the code is byte 2 of entry + u': the carry out of the low half is the
 * comparison with the midpoint, and the high half of u' cancels the subtracted index.
 */
#define OFF_QC_LO 0x3400u               /* 2^-23's high half (OFF_QB_E0 << 7) */
#define OFF_QC_HI 0x4c00u               /* past ~(-2^-23)'s high half, 0x4bff */
#define OFF_QC_N (OFF_QC_HI - OFF_QC_LO)

typedef struct off__qtables {
    float values[2][256];
    float mid[2][255];
    uint32_t bucket[2][2 * OFF_QB_N];
    uint32_t code[2][OFF_QC_N];
    uint8_t zero_code[2];               /* the code of 0.0 */
    /* planes[map][b][code]: byte b of values[map][code] (the VBMI kernel's byte permutes) */
    uint8_t planes[2][4][256] __attribute__((aligned(64)));
} off__qtables;

extern off__qtables off__qt;

/* The bucket of |x| (bits a, sign cleared): 0 below 2^-23, OFF_QB_N - 1 at and above 1. */
static inline uint32_t off__qbucket(uint32_t a)
{
    if (a < ((uint32_t)OFF_QB_E0 << 23))
        return 0;
    uint32_t b = (a >> 16) - ((uint32_t)OFF_QB_E0 << 7) + 1;
    return b < OFF_QB_N - 1 ? b : OFF_QB_N - 1;
}

/* Per-call constants: the fp32 kernel's, plus the block and the stochastic-rounding key. */
typedef struct off__adam8_consts {
    off__adam_consts a;
    float step_bc2;                     /* lr / (1 - beta1^t) * sqrt(1 - beta2^t) */
    float eps_bc2;                      /* eps * sqrt(1 - beta2^t) */
    long long block;
    uint32_t key;                       /* hash of (seed, step) */
    float m_bound, m_bound2;            /* K and K^2 of off__bound_moment (+inf: no bound) */
} off__adam8_consts;

/* K (and K^2, each rounded once from double) of off__bound_moment for these betas. */
void off__adam8_moment_bound(const off_adam_hparams *hp, float *k, float *k2);

/*
 * A dequantised exp_avg held to |m| <= K sqrt(v), K = (1-beta1) / sqrt((1-beta2)(1-beta1^2/beta2)):
 * Adam's exact moments never exceed it (Cauchy-Schwarz over their histories from zero; one step
 * keeps it), but the two moments are quantised apart, and an exp_avg_sq that rounds to 0 under a
 * nonzero exp_avg (a value below the map's smallest, 3.25e-7 of its block's largest) made the
 * update m / eps: a parameter moved by tens at lr 1e-2. Where m^2 > K^2 v, m becomes
 * copysign(K sqrt(v), m); a NaN on either side leaves m as it is (the poison stays in its block).
 * The SIMD kernels do the same comparisons and operations lane by lane.
 */
static inline float off__bound_moment(float m, float v, float k, float k2)
{
    if (m * m > k2 * v)
        return copysignf(k * sqrtf(v), m);
    return m;
}

/* lr/(1-beta1^t)*sqrt(1-beta2^t) and eps*sqrt(1-beta2^t) (adam8.c; the bf16 kernels too). */
void off__adam_fold_bc2(const off_adam_hparams *hp, float *step_bc2, float *eps_bc2);

/* The buffers of one call; kernels index them from the slice's start. */
typedef struct off__adam8_io {
    void *master;
    int master_dtype;                   /* FP32 or BF16 */
    const void *grad;
    int grad_dtype;
    uint8_t *m_codes;
    float *m_absmax;
    uint8_t *v_codes;
    float *v_absmax;
    void *out;
    int out_dtype;                      /* NONE, FP32, BF16, FP16 */
    long long index_base;               /* element index of the slice's start (random bits) */
} off__adam8_io;

/* Blocks [begin, end) of elements (begin a block boundary, end a boundary or n). */
typedef void (*off__adam8_kernel)(const off__adam8_consts *c, const off__adam8_io *io,
                                  long long begin, long long end);
/* Quantise x[0, n) (one block at most) into codes; returns the block's scale. */
typedef float (*off__quant_kernel)(int map, const float *x, uint8_t *codes, long long n);

void off__adam8_scalar(const off__adam8_consts *c, const off__adam8_io *io, long long begin,
                       long long end);
float off__quant_scalar(int map, const float *x, uint8_t *codes, long long n);
#if defined(__x86_64__)
void off__adam8_avx2(const off__adam8_consts *c, const off__adam8_io *io, long long begin,
                     long long end);
float off__quant_avx2(int map, const float *x, uint8_t *codes, long long n);
void off__adam8_avx512(const off__adam8_consts *c, const off__adam8_io *io, long long begin,
                       long long end);
void off__adam8_avx512vbmi(const off__adam8_consts *c, const off__adam8_io *io, long long begin,
                           long long end);
float off__quant_avx512(int map, const float *x, uint8_t *codes, long long n);
#endif

#if defined(__x86_64__)
#include <xmmintrin.h>

/* Software prefetch of 64 elements' lines of every stream at element s, for the SIMD kernels
 * (the hardware prefetcher alone leaves the core waiting on seven streams). Called every 64
 * elements rather than once a block: a block's forty-odd prefetches in one burst filled the
 * line fill buffers and stalled the loads behind them. psz, gsz, osz: bytes per element of the
 * master, the gradient and the out copy. */
static inline __attribute__((always_inline)) void
off__adam8_prefetch64(const off__adam8_io *io, size_t psz, size_t gsz, size_t osz, int out_dtype,
                      long long s)
{
    const char *m = (const char *)io->master + (size_t)s * psz;
    const char *g = (const char *)io->grad + (size_t)s * gsz;
    for (size_t b = 0; b < 64 * psz; b += 64)
        _mm_prefetch(m + b, _MM_HINT_T0);
    for (size_t b = 0; b < 64 * gsz; b += 64)
        _mm_prefetch(g + b, _MM_HINT_T0);
    if (out_dtype != OFF_DTYPE_NONE) {
        const char *o = (const char *)io->out + (size_t)s * osz;
        for (size_t b = 0; b < 64 * osz; b += 64)
            _mm_prefetch(o + b, _MM_HINT_T0);
    }
    _mm_prefetch((const char *)(io->m_codes + s), _MM_HINT_T0);
    _mm_prefetch((const char *)(io->v_codes + s), _MM_HINT_T0);
}
#endif

/* lowbias32 (Wellons' hash prospector): a bijective 32-bit mix, two multiplies. */
static inline uint32_t off__mix32(uint32_t x)
{
    x ^= x >> 16;
    x *= 0x7feb352du;
    x ^= x >> 15;
    x *= 0x846ca68bu;
    x ^= x >> 16;
    return x;
}

/* The per-call key from (seed, step); element i then draws mix32(lo32(i) ^ mix32(key ^ hi32(i))):
 * counter-based, so no state, and the same bits whatever the split or the instruction set. */
static inline uint32_t off__sr_key(unsigned long long seed, long long step)
{
    uint32_t k = off__mix32((uint32_t)(seed >> 32) ^ 0x9e3779b9u);
    k = off__mix32(k ^ (uint32_t)seed);
    k = off__mix32(k ^ (uint32_t)((unsigned long long)step >> 32));
    return off__mix32(k ^ (uint32_t)step);
}

static inline uint32_t off__sr_bits(uint32_t key, unsigned long long index)
{
    return off__mix32((uint32_t)index ^ off__mix32(key ^ (uint32_t)(index >> 32)));
}

/* fp32 -> bf16 rounding up with probability (dropped bits) / 2^16: unbiased, so updates far
 * below half a bf16 ulp still move the master on average. NaN stays a quiet NaN; infinities
 * stay infinite. */
static inline uint16_t off__f32_to_bf16_sr(float f, uint32_t r)
{
    uint32_t u = off__f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((u >> 16) | 0x0040u);
    return (uint16_t)((u + (r & 0xffffu)) >> 16);
}

/* Store an updated parameter in the scalar kernels: the master (fp32 as is, bf16 rounded up with
 * the random bits r, see off__f32_to_bf16_sr) and the out copy of the value the master now holds. */
static inline void off__store_param_scalar(void *master, int master_dtype, void *out, int out_dtype,
                                           long long i, float p, uint32_t r)
{
    float q = p;
    uint16_t h = 0;
    if (master_dtype == OFF_DTYPE_BF16) {
        h = off__f32_to_bf16_sr(p, r);
        ((uint16_t *)master)[i] = h;
        q = off__bf16_to_f32(h);
    } else {
        ((float *)master)[i] = p;
    }
    switch (out_dtype) {
    case OFF_DTYPE_FP32: ((float *)out)[i] = q; break;
    case OFF_DTYPE_BF16:
        ((uint16_t *)out)[i] = master_dtype == OFF_DTYPE_BF16 ? h : off__f32_to_bf16(q);
        break;
    case OFF_DTYPE_FP16: ((uint16_t *)out)[i] = off__f32_to_f16(q); break;
    default: break;
    }
}

/* The scale to divide a block by: 1/absmax, or 0 for a block that is all zeros or whose
 * absmax is below FLT_MIN (1/absmax would overflow): that block is stored as zeros. */
static inline float off__inv_scale(float absmax)
{
    return absmax >= 0x1p-126f ? 1.0f / absmax : 0.0f;
}

/* code[map] less OFF_QC_LO entries, so that the clamped bits' high half indexes it directly
 * (the SIMD gathers; never read below OFF_QC_LO: the clamp keeps every index at or above). */
static inline const uint32_t *off__qcode_tab(int map)
{
    return (const uint32_t *)((uintptr_t)off__qt.code[map] - OFF_QC_LO * sizeof(uint32_t));
}

/* The nearest code through code[] (what the SIMD kernels compute lane by lane). */
static inline uint8_t off__qcode_add(int map, float x)
{
    uint32_t u = off__f32_bits(x), a = u & 0x7fffffffu;
    a = a < 0x34000000u ? 0x34000000u : a > 0x3f800000u ? 0x3f800000u : a;
    if (map == OFF_QMAP_UNSIGNED && (u >> 31))
        a = 0x34000000u;                /* unsigned: every midpoint is > 0, x < 0 codes as +0 */
    else if (u >> 31)
        a = ~(a | 0x80000000u);
    return (uint8_t)((off__qt.code[map][(a >> 16) - OFF_QC_LO] + a) >> 16);
}

#endif
