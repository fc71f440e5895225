/*
 * Adam with 16-bit state (bf16 moments and/or a bf16 master): argument checks, the per-call
 * constants, the split over adam.c's thread pool, and the dispatch to the chosen SIMD level.
 * Each element's update and random bits depend only on its own index, so the split (multiples
 * of 64 elements, for whole cache lines) never changes a bit. Nothing is modified unless every
 * argument is valid.
 */
#include <errno.h>
#include <limits.h>

#include "adam16_internal.h"

#define OFF_ADAM16_SPLIT 64LL

static const off__adam16_kernel kernels[] = {
    [OFF_SIMD_SCALAR] = off__adam16_scalar,
#if defined(__x86_64__)
    [OFF_SIMD_AVX2] = off__adam16_avx2,
    [OFF_SIMD_AVX512] = off__adam16_avx512,
#else
    [OFF_SIMD_AVX2] = off__adam16_scalar,
    [OFF_SIMD_AVX512] = off__adam16_scalar,
#endif
};

static int misaligned(const void *p, uintptr_t align) { return ((uintptr_t)p & (align - 1)) != 0; }

static size_t dtype_size(int dtype) { return dtype == OFF_DTYPE_FP32 ? 4 : 2; }

struct adam16_job {
    off__adam16_kernel kernel;
    off__adam16_consts c;
    off__adam16_io io;
    long long n;
};

static void adam16_task(void *arg, int index, int count)
{
    const struct adam16_job *j = arg;
    long long per = (j->n + count - 1) / count;
    per = (per + OFF_ADAM16_SPLIT - 1) / OFF_ADAM16_SPLIT * OFF_ADAM16_SPLIT;
    long long b = per * index, e = b + per;
    if (e > j->n)
        e = j->n;
    if (e > b)
        j->kernel(&j->c, &j->io, b, e);
}

OFF_EXPORT int off_adam16_step_level(int level, const off_adam_hparams *hp, void *master,
                                     int master_dtype, const void *grad, int grad_dtype,
                                     void *exp_avg, void *exp_avg_sq, int moment_dtype, void *out,
                                     int out_dtype, long long n, unsigned long long seed,
                                     long long index_base, int threads)
{
    int rc = off__check_level(level);
    if (rc < 0)
        return rc;
    if (hp == NULL || n < 0 || index_base < 0 || index_base > LLONG_MAX - n)
        return -EINVAL;
    if (master_dtype != OFF_DTYPE_FP32 && master_dtype != OFF_DTYPE_BF16)
        return -EINVAL;
    if (moment_dtype != OFF_DTYPE_FP32 && moment_dtype != OFF_DTYPE_BF16)
        return -EINVAL;
    if (master_dtype == OFF_DTYPE_FP32 && moment_dtype == OFF_DTYPE_FP32)
        return -EINVAL; /* all-fp32 state is off_adam_step's (its own formula and bits) */
    if (grad_dtype != OFF_DTYPE_FP32 && grad_dtype != OFF_DTYPE_BF16 && grad_dtype != OFF_DTYPE_FP16)
        return -EINVAL;
    if (out_dtype < OFF_DTYPE_NONE || out_dtype > OFF_DTYPE_FP16)
        return -EINVAL;
    struct adam16_job job;
    rc = off__adam_make_consts(hp, &job.c.a);
    if (rc < 0)
        return rc;
    if (n == 0)
        return 0;
    if (!master || !grad || !exp_avg || !exp_avg_sq || (out_dtype != OFF_DTYPE_NONE && !out))
        return -EINVAL;
    if (misaligned(master, dtype_size(master_dtype)) || misaligned(grad, dtype_size(grad_dtype))
        || misaligned(exp_avg, dtype_size(moment_dtype))
        || misaligned(exp_avg_sq, dtype_size(moment_dtype))
        || (out_dtype != OFF_DTYPE_NONE && misaligned(out, dtype_size(out_dtype))))
        return -EINVAL;
    job.kernel = kernels[level];
    off__adam_fold_bc2(hp, &job.c.step_bc2, &job.c.eps_bc2);
    job.c.key = off__sr_key(seed, hp->step);
    job.c.key_v = off__sr_key_v(job.c.key);
    job.io = (off__adam16_io){master, master_dtype, grad, grad_dtype, exp_avg, exp_avg_sq,
                              moment_dtype, out_dtype == OFF_DTYPE_NONE ? NULL : out, out_dtype,
                              index_base};
    job.n = n;
    off__pool_run(adam16_task, &job, off__thread_count(n, threads));
    return 0;
}

OFF_EXPORT int off_adam16_step(const off_adam_hparams *hp, void *master, int master_dtype,
                               const void *grad, int grad_dtype, void *exp_avg, void *exp_avg_sq,
                               int moment_dtype, void *out, int out_dtype, long long n,
                               unsigned long long seed, long long index_base, int threads)
{
    return off_adam16_step_level(off__simd_current(), hp, master, master_dtype, grad, grad_dtype,
                                 exp_avg, exp_avg_sq, moment_dtype, out, out_dtype, n, seed,
                                 index_base, threads);
}
