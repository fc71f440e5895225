/*
 * 8-bit Adam entry points: the code tables (built once at load), argument checks, the split
 * over adam.c's thread pool at block boundaries, and the dispatch to the chosen SIMD level.
 *
 * The maps live here, not in Python: codes on disk or in a checkpoint mean nothing without
 * the exact table that wrote them, so the library that reads and writes codes owns the one
 * table (Python reads it through off_qmap_values), and the SIMD search tables derived from it
 * are built beside it. They are computed from bitsandbytes' create_dynamic_map formula in
 * double with only + - * / (no libm), so every build on every machine gets the same floats.
 */
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdatomic.h>

#include "adam8_internal.h"

off__qtables off__qt;
static int tables_ok; /* every bucket holds at most one midpoint (the SIMD search's premise),
                       * and code[] agrees with the search around every midpoint */
static int vbmi_ok;   /* the CPU runs adam8_avx512vbmi.c */
static _Atomic int vbmi_on;

/*
 * create_dynamic_map(signed, max_exponent_bits=7, total_bits=8): for i = 0..6, the means of
 * consecutive points of linspace(0.1, 1, f_i + 1) scaled by 10^(i-6), with f_i = 2^i (signed:
 * mirrored to negative) or 2^(i+1) (unsigned); plus 0 and 1. Signed: 127 negative, 0, 128
 * positive values; unsigned: 0 and 255 positive. Ascending.
 */
static void build_map(int is_signed, float *out)
{
    static const double decade[7] = {1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0};
    int n = 0;
    for (int i = 0; i < 7; i++) {
        int f = is_signed ? 1 << i : 2 << i;
        for (int k = 0; k < f; k++) {
            double mean = 0.1 + 0.9 * (k + 0.5) / f;
            out[n++] = (float)(decade[i] * mean);
            if (is_signed)
                out[n++] = (float)(-decade[i] * mean);
        }
    }
    out[n++] = 0.0f;
    out[n++] = 1.0f;
    for (int i = 1; i < n; i++) { /* insertion sort: 256 values, once */
        float v = out[i];
        int j = i - 1;
        while (j >= 0 && out[j] > v) {
            out[j + 1] = out[j];
            j--;
        }
        out[j + 1] = v;
    }
}

static int count_below(const float *mid, float x)
{
    int c = 0;
    for (int k = 0; k < 255; k++)
        c += mid[k] < x;
    return c;
}

/* The bucket table of one map (see adam8_internal.h); 0 if a bucket held two midpoints. */
static int build_buckets(const float *mid, uint32_t *tab)
{
    for (uint32_t b = 0; b < OFF_QB_N; b++) {
        uint32_t start = b == 0 ? 0u : ((b - 1u) + ((uint32_t)OFF_QB_E0 << 7)) << 16;
        uint32_t end = b == 0 ? (uint32_t)OFF_QB_E0 << 23
                       : b == OFF_QB_N - 1 ? 0x7f800000u : start + 0x10000u;
        float s = off__bits_f32(start), e = off__bits_f32(end);
        int inside_pos = 0, inside_neg = 0;
        uint32_t tpos = 0xffffu, tneg = 0u; /* sentinels: the comparison never adds one */
        int above = 0;                      /* midpoints <= -end */
        for (int k = 0; k < 255; k++) {
            if (mid[k] >= s && mid[k] < e) {
                inside_pos++;
                tpos = off__f32_bits(mid[k]) & 0xffffu;
            }
            if (mid[k] > -e && mid[k] <= -s) {
                inside_neg++;
                tneg = off__f32_bits(-mid[k]) & 0xffffu;
            }
            above += mid[k] <= -e;
        }
        if (inside_pos > 1 || inside_neg > 1)
            return 0;
        tab[b] = (uint32_t)count_below(mid, s) | (tpos << 16);
        tab[OFF_QB_N + b] = (uint32_t)above | (tneg << 16);
    }
    return 1;
}

/* code[] of one map from its bucket table (see adam8_internal.h); unused entries stay 0. */
static void build_code_table(const uint32_t *bucket, uint32_t *code)
{
    for (uint32_t hi = OFF_QC_LO; hi <= 0x3f80u; hi++) { /* x > 0: bucket of hi */
        uint32_t e = bucket[off__qbucket(hi << 16)];
        code[hi - OFF_QC_LO] = (((e & 0xffu) - hi) << 16) + (0xffffu - (e >> 16));
        /* x < 0 with |x|'s high half hi: u' = ~bits, whose high half is 0x7fff - hi; the
         * code is base + (t > low half of |x|) = base + carry(t + (0xffff - low half)) */
        uint32_t n = bucket[OFF_QB_N + off__qbucket(hi << 16)], hn = 0x7fffu - hi;
        code[hn - OFF_QC_LO] = (((n & 0xffu) - hn) << 16) + (n >> 16);
    }
}

/* Whether code[] gives count_below's code at, and one float either side of, every midpoint
 * and both clamps (the tests check whole float ranges; this keeps a table that a change of
 * the maps broke from ever giving a wrong code: check_level8 then refuses the SIMD levels). */
static int code_table_ok(int map)
{
    const float *mid = off__qt.mid[map];
    for (int k = -2; k < 255; k++) {
        float m = k == -2 ? 0x1p-23f : k == -1 ? 1.0f : mid[k];
        for (int d = -1; d <= 1; d++) {
            float x = off__bits_f32(off__f32_bits(m) + (uint32_t)d);
            for (int s = 0; s < 2; s++, x = -x)
                if (off__qcode_add(map, x) != (map == OFF_QMAP_UNSIGNED && x <= 0.0f
                                                   ? count_below(mid, 0.0f) : count_below(mid, x)))
                    return 0;
        }
    }
    return 1;
}

__attribute__((constructor)) static void off_adam8_init(void)
{
    int ok = 1;
    for (int map = 0; map < 2; map++) {
        float *v = off__qt.values[map];
        build_map(map == OFF_QMAP_SIGNED, v);
        for (int k = 0; k < 255; k++)
            off__qt.mid[map][k] = (float)(((double)v[k] + (double)v[k + 1]) * 0.5);
        for (int k = 0; k < 256; k++) {
            if (v[k] == 0.0f)
                off__qt.zero_code[map] = (uint8_t)k;
            for (int b = 0; b < 4; b++)
                off__qt.planes[map][b][k] = (uint8_t)(off__f32_bits(v[k]) >> (8 * b));
        }
        ok &= build_buckets(off__qt.mid[map], off__qt.bucket[map]);
        build_code_table(off__qt.bucket[map], off__qt.code[map]);
        ok &= code_table_ok(map);
    }
    tables_ok = ok;
#if defined(__x86_64__)
    __builtin_cpu_init();
    vbmi_ok = __builtin_cpu_supports("avx512vbmi") && __builtin_cpu_supports("avx512bw")
              && __builtin_cpu_supports("avx512dq");
    atomic_store(&vbmi_on, vbmi_ok);
#endif
}

/* Whether the AVX-512 level runs the VBMI variant (the same bits; tests turn it off to check
 * the gather variant on a CPU that has both): 0, or -ENOTSUP to turn on where the CPU lacks it. */
OFF_EXPORT int off_adam8_set_vbmi(int on)
{
    if (on && !vbmi_ok)
        return -ENOTSUP;
    atomic_store(&vbmi_on, on ? 1 : 0);
    return 0;
}

OFF_EXPORT int off_adam8_vbmi(void) { return atomic_load(&vbmi_on); }

OFF_EXPORT int off_qmap_values(int map, float *out)
{
    if ((map != OFF_QMAP_SIGNED && map != OFF_QMAP_UNSIGNED) || out == NULL)
        return -EINVAL;
    memcpy(out, off__qt.values[map], sizeof off__qt.values[map]);
    return 0;
}

/* sqrt(v)/sqrt(bc2) + eps = (sqrt(v) + eps*sqrt(bc2)) / sqrt(bc2): the same maths with one
 * division per element fewer (the compressed-state kernels are bound by their arithmetic, not
 * their bytes). In double from the Python floats, rounded once, as every constant. */
void off__adam_fold_bc2(const off_adam_hparams *hp, float *step_bc2, float *eps_bc2)
{
    double bc2_sqrt = sqrt(1.0 - pow(hp->beta2, (double)hp->step));
    *step_bc2 = (float)(hp->lr / (1.0 - pow(hp->beta1, (double)hp->step)) * bc2_sqrt);
    *eps_bc2 = (float)(hp->eps * bc2_sqrt);
}

void off__adam8_moment_bound(const off_adam_hparams *hp, float *k, float *k2)
{
    double b1 = hp->beta1, b2 = hp->beta2;
    if (b2 <= b1 * b1) {        /* the bound's series diverges: none */
        *k = *k2 = INFINITY;
        return;
    }
    double kd = (1.0 - b1) / sqrt((1.0 - b2) * (1.0 - b1 * b1 / b2));
    *k = (float)kd;
    *k2 = (float)(kd * kd);
}

static const struct {
    off__adam8_kernel adam;
    off__quant_kernel quant;
} kernels[] = {
    [OFF_SIMD_SCALAR] = {off__adam8_scalar, off__quant_scalar},
#if defined(__x86_64__)
    [OFF_SIMD_AVX2] = {off__adam8_avx2, off__quant_avx2},
    [OFF_SIMD_AVX512] = {off__adam8_avx512, off__quant_avx512},
#else
    [OFF_SIMD_AVX2] = {off__adam8_scalar, off__quant_scalar},
    [OFF_SIMD_AVX512] = {off__adam8_scalar, off__quant_scalar},
#endif
};

static int check_level8(int level)
{
    int rc = off__check_level(level);
    if (rc == 0 && level != OFF_SIMD_SCALAR && !tables_ok)
        return -ENOTSUP; /* never a wrong answer: only the scalar search is left */
    return rc;
}

static int misaligned(const void *p, uintptr_t align) { return ((uintptr_t)p & (align - 1)) != 0; }

static int bad_block(long long block)
{
    return block < 64 || block > OFF_ADAM8_MAX_BLOCK || block % 64 != 0;
}

/* Task `index` of `count`: whole blocks, as evenly as they go. */
static void split_blocks(long long n, long long block, int index, int count, long long *b,
                         long long *e)
{
    long long blocks = (n + block - 1) / block;
    long long per = (blocks + count - 1) / count;
    long long lo = per * index * block, hi = per * (index + 1) * block;
    *b = lo < n ? lo : n;
    *e = hi < n ? hi : n;
}

struct adam8_job {
    off__adam8_kernel kernel;
    off__adam8_consts c;
    off__adam8_io io;
    long long n;
};

static void adam8_task(void *arg, int index, int count)
{
    const struct adam8_job *j = arg;
    long long b, e;
    split_blocks(j->n, j->c.block, index, count, &b, &e);
    if (e > b)
        j->kernel(&j->c, &j->io, b, e);
}

OFF_EXPORT int off_adam8_step_level(int level, const off_adam_hparams *hp, void *master,
                                    int master_dtype, const void *grad, int grad_dtype,
                                    const off_adam8_state *st, void *out, int out_dtype,
                                    long long n, unsigned long long seed, long long index_base,
                                    int threads)
{
    int rc = check_level8(level);
    if (rc < 0)
        return rc;
    if (hp == NULL || st == NULL || n < 0 || index_base < 0 || index_base > LLONG_MAX - n
        || bad_block(st->block))
        return -EINVAL;
    if (master_dtype != OFF_DTYPE_FP32 && master_dtype != OFF_DTYPE_BF16)
        return -EINVAL;
    if (grad_dtype != OFF_DTYPE_FP32 && grad_dtype != OFF_DTYPE_BF16 && grad_dtype != OFF_DTYPE_FP16)
        return -EINVAL;
    if (out_dtype < OFF_DTYPE_NONE || out_dtype > OFF_DTYPE_FP16)
        return -EINVAL;
    struct adam8_job job;
    rc = off__adam_make_consts(hp, &job.c.a);
    if (rc < 0)
        return rc;
    if (n == 0)
        return 0;
    if (!master || !grad || !st->exp_avg || !st->exp_avg_sq || !st->exp_avg_absmax
        || !st->exp_avg_sq_absmax || (out_dtype != OFF_DTYPE_NONE && !out))
        return -EINVAL;
    if (misaligned(master, master_dtype == OFF_DTYPE_FP32 ? 4 : 2)
        || misaligned(grad, grad_dtype == OFF_DTYPE_FP32 ? 4 : 2)
        || misaligned(st->exp_avg_absmax, 4) || misaligned(st->exp_avg_sq_absmax, 4)
        || (out_dtype != OFF_DTYPE_NONE && misaligned(out, out_dtype == OFF_DTYPE_FP32 ? 4 : 2)))
        return -EINVAL;
    job.kernel = kernels[level].adam;
#if defined(__x86_64__)
    if (level == OFF_SIMD_AVX512 && atomic_load(&vbmi_on))
        job.kernel = off__adam8_avx512vbmi;
#endif
    off__adam_fold_bc2(hp, &job.c.step_bc2, &job.c.eps_bc2);
    off__adam8_moment_bound(hp, &job.c.m_bound, &job.c.m_bound2);
    job.c.block = st->block;
    job.c.key = off__sr_key(seed, hp->step);
    job.io = (off__adam8_io){master, master_dtype, grad, grad_dtype, st->exp_avg,
                             st->exp_avg_absmax, st->exp_avg_sq, st->exp_avg_sq_absmax,
                             out_dtype == OFF_DTYPE_NONE ? NULL : out, out_dtype, index_base};
    job.n = n;
    off__pool_run(adam8_task, &job, off__thread_count(n, threads));
    return 0;
}

OFF_EXPORT int off_adam8_step(const off_adam_hparams *hp, void *master, int master_dtype,
                              const void *grad, int grad_dtype, const off_adam8_state *st,
                              void *out, int out_dtype, long long n, unsigned long long seed,
                              long long index_base, int threads)
{
    return off_adam8_step_level(off__simd_current(), hp, master, master_dtype, grad, grad_dtype,
                                st, out, out_dtype, n, seed, index_base, threads);
}

/* ---- standalone quantise / dequantise (loading and exporting fp32 state) -------------- */

struct quant_job {
    off__quant_kernel kernel;
    int map;
    const float *x;
    uint8_t *codes;
    float *absmax;
    long long block, n;
};

static void quant_task(void *arg, int index, int count)
{
    const struct quant_job *j = arg;
    long long b, e;
    split_blocks(j->n, j->block, index, count, &b, &e);
    for (long long s = b; s < e; s += j->block) {
        long long len = e - s < j->block ? e - s : j->block;
        j->absmax[s / j->block] = j->kernel(j->map, j->x + s, j->codes + s, len);
    }
}

/* The arguments of (de)quantize: -EINVAL when bad, 0 when there is nothing to do, else 1. */
static int check_quant_args(int map, const float *x, const unsigned char *codes, const float *absmax,
                            long long block, long long n)
{
    if ((map != OFF_QMAP_SIGNED && map != OFF_QMAP_UNSIGNED) || n < 0 || bad_block(block))
        return -EINVAL;
    if (n == 0)
        return 0;
    if (!x || !codes || !absmax || misaligned(x, 4) || misaligned(absmax, 4))
        return -EINVAL;
    return 1;
}

OFF_EXPORT int off_blockwise_quantize(int level, int map, const float *x, unsigned char *codes,
                                      float *absmax, long long block, long long n, int threads)
{
    if (level == -1)
        level = off__simd_current();
    int rc = check_level8(level);
    if (rc < 0)
        return rc;
    rc = check_quant_args(map, x, codes, absmax, block, n);
    if (rc <= 0)
        return rc;
    struct quant_job job = {kernels[level].quant, map, x, codes, absmax, block, n};
    off__pool_run(quant_task, &job, off__thread_count(n, threads));
    return 0;
}

OFF_EXPORT int off_blockwise_dequantize(int map, const unsigned char *codes, const float *absmax,
                                        long long block, float *x, long long n)
{
    int rc = check_quant_args(map, x, codes, absmax, block, n);
    if (rc <= 0)
        return rc;
    const float *v = off__qt.values[map];
    for (long long i = 0; i < n; i++)
        x[i] = v[codes[i]] * absmax[i / block];
    return 0;
}
