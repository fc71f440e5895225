/*
 * CPU Adam entry points: argument checks, the per-call constants, the split over a small
 * persistent thread pool, and the dispatch to the kernel of the chosen SIMD level.
 *
 * Every element's update is independent and every level computes the same IEEE operations,
 * so the split (at multiples of 64 elements) and the thread count never change a bit of the
 * result. Nothing is modified unless every argument is valid.
 */
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>

#include "adam_internal.h"

#define OFF_ADAM_MAX_THREADS 256
/* Below this many elements per thread, waking another thread costs more than it saves. */
#define OFF_ADAM_MIN_PER_THREAD 32768LL
#define OFF_ADAM_SPLIT 64LL

/* ---- a small persistent pool: the engine calls us once per chunk --------------------- */


static struct {
    pthread_mutex_t call; /* one job at a time */
    pthread_mutex_t mu;
    pthread_cond_t go;
    pthread_cond_t done;
    int started;          /* worker threads alive (indexes 1..started) */
    unsigned long gen;    /* bumped for each job */
    int count;            /* tasks in the current job; the caller runs task 0 */
    int remaining;        /* worker tasks not yet finished */
    off__task_fn fn;
    void *arg;
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER,
          PTHREAD_COND_INITIALIZER, 0, 0, 0, 0, NULL, NULL};

static pthread_once_t pool_once = PTHREAD_ONCE_INIT;

/* A forked child has none of the parent's workers: start again from an empty pool. */
static void pool_after_fork(void)
{
    pthread_mutex_init(&pool.call, NULL);
    pthread_mutex_init(&pool.mu, NULL);
    pthread_cond_init(&pool.go, NULL);
    pthread_cond_init(&pool.done, NULL);
    pool.started = 0;
    pool.count = 0;
    pool.remaining = 0;
}

static void pool_init_once(void) { pthread_atfork(NULL, NULL, pool_after_fork); }

static void *worker_main(void *p)
{
    int index = (int)((intptr_t)p >> 32);
    unsigned long seen = (unsigned long)((intptr_t)p & 0xffffffff);
    pthread_mutex_lock(&pool.mu);
    for (;;) {
        while (pool.gen == seen)
            pthread_cond_wait(&pool.go, &pool.mu);
        seen = pool.gen;
        if (index >= pool.count)
            continue;
        off__task_fn fn = pool.fn;
        void *arg = pool.arg;
        int count = pool.count;
        pthread_mutex_unlock(&pool.mu);
        fn(arg, index, count);
        pthread_mutex_lock(&pool.mu);
        if (--pool.remaining == 0)
            pthread_cond_signal(&pool.done);
    }
    return NULL;
}

/* Start workers until `want` exist; returns how many do (fewer if the system refuses). */
static int pool_grow(int want)
{
    while (pool.started < want) {
        pthread_attr_t attr;
        pthread_t tid;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        pthread_attr_setstacksize(&attr, 256 * 1024);
        int index = pool.started + 1;
        intptr_t packed = ((intptr_t)index << 32) | (intptr_t)(pool.gen & 0xffffffff);
        int rc = pthread_create(&tid, &attr, worker_main, (void *)packed);
        pthread_attr_destroy(&attr);
        if (rc != 0)
            break;
        pool.started++;
    }
    return pool.started;
}

void off__pool_run(off__task_fn fn, void *arg, int count)
{
    if (count <= 1) {
        fn(arg, 0, 1);
        return;
    }
    pthread_once(&pool_once, pool_init_once);
    pthread_mutex_lock(&pool.call);
    pthread_mutex_lock(&pool.mu);
    int workers = pool_grow(count - 1);
    if (workers < count - 1)
        count = workers + 1; /* fewer threads, same bits */
    pool.fn = fn;
    pool.arg = arg;
    pool.count = count;
    pool.remaining = count - 1;
    pool.gen = (pool.gen + 1) & 0xffffffff;
    pthread_cond_broadcast(&pool.go);
    pthread_mutex_unlock(&pool.mu);
    fn(arg, 0, count);
    pthread_mutex_lock(&pool.mu);
    while (pool.remaining > 0)
        pthread_cond_wait(&pool.done, &pool.mu);
    pthread_mutex_unlock(&pool.mu);
    pthread_mutex_unlock(&pool.call);
}

/* Task `index` of `count` over n elements: equal ranges rounded to multiples of 64. */
static void split(long long n, int index, int count, long long *begin, long long *end)
{
    long long per = (n + count - 1) / count;
    per = (per + OFF_ADAM_SPLIT - 1) / OFF_ADAM_SPLIT * OFF_ADAM_SPLIT;
    long long b = per * index, e = b + per;
    *begin = b < n ? b : n;
    *end = e < n ? e : n;
}

int off__thread_count(long long n, int threads)
{
    if (threads <= 0)
        threads = off__threads_default();
    if (threads > OFF_ADAM_MAX_THREADS)
        threads = OFF_ADAM_MAX_THREADS;
    long long useful = (n + OFF_ADAM_MIN_PER_THREAD - 1) / OFF_ADAM_MIN_PER_THREAD;
    if (useful < threads)
        threads = (int)(useful > 0 ? useful : 1);
    return threads;
}

/* ---- Adam --------------------------------------------------------------------------- */

/* The kernels of each level, indexed by enum off_simd. */
static const struct {
    off__adam_kernel adam;
    off__probe_kernel probe;
} kernels[] = {
    [OFF_SIMD_SCALAR] = {off__adam_scalar, off__probe_scalar},
#if defined(__x86_64__)
    [OFF_SIMD_AVX2] = {off__adam_avx2, off__probe_avx2},
    [OFF_SIMD_AVX512] = {off__adam_avx512, off__probe_avx512},
#else
    [OFF_SIMD_AVX2] = {off__adam_scalar, off__probe_scalar},
    [OFF_SIMD_AVX512] = {off__adam_scalar, off__probe_scalar},
#endif
};

int off__check_level(int level)
{
    if (level < OFF_SIMD_SCALAR || level > OFF_SIMD_AVX512)
        return -EINVAL;
    if (level > off_simd_supported())
        return -ENOTSUP;
    return 0;
}

static int misaligned(const void *p, uintptr_t align) { return ((uintptr_t)p & (align - 1)) != 0; }

/* The constants as torch derives them: in double from the Python floats, rounded once. */
int off__adam_make_consts(const off_adam_hparams *hp, off__adam_consts *c)
{
    if (!(isfinite(hp->lr) && hp->lr >= 0.0))
        return -EINVAL;
    if (!(hp->beta1 >= 0.0 && hp->beta1 < 1.0 && hp->beta2 >= 0.0 && hp->beta2 < 1.0))
        return -EINVAL;
    if (!(isfinite(hp->eps) && hp->eps > 0.0))
        return -EINVAL;
    if (!(isfinite(hp->weight_decay) && hp->weight_decay >= 0.0))
        return -EINVAL;
    if (!isfinite(hp->grad_scale) || hp->step < 1)
        return -EINVAL;
    double t = (double)hp->step;
    double bc1 = 1.0 - pow(hp->beta1, t);
    double bc2 = 1.0 - pow(hp->beta2, t);
    c->grad_scale = (float)(hp->maximize ? -hp->grad_scale : hp->grad_scale);
    c->mode = hp->weight_decay == 0.0 ? OFF__WD_NONE : hp->decoupled ? OFF__WD_DECOUPLED : OFF__WD_L2;
    c->lr_wd = (float)(hp->lr * hp->weight_decay);
    c->l2 = (float)hp->weight_decay;
    c->one_minus_beta1 = (float)(1.0 - hp->beta1);
    c->one_minus_beta2 = (float)(1.0 - hp->beta2);
    c->bc2_sqrt = (float)sqrt(bc2);
    c->eps = (float)hp->eps;
    c->step_size = (float)(hp->lr / bc1);
    return 0;
}

struct adam_job {
    off__adam_kernel kernel;
    off__adam_consts c;
    float *param;
    const void *grad;
    int grad_dtype;
    float *exp_avg;
    float *exp_avg_sq;
    void *out;
    int out_dtype;
    long long n;
};

static void adam_task(void *arg, int index, int count)
{
    const struct adam_job *j = arg;
    long long b, e;
    split(j->n, index, count, &b, &e);
    if (e <= b)
        return;
    size_t gsz = j->grad_dtype == OFF_DTYPE_FP32 ? 4 : 2;
    j->kernel(&j->c, j->param + b, (const char *)j->grad + (size_t)b * gsz, j->grad_dtype,
              j->exp_avg + b, j->exp_avg_sq + b,
              j->out ? (void *)((uint16_t *)j->out + b) : NULL, j->out_dtype, e - b);
}

OFF_EXPORT int off_adam_step_level(int level, const off_adam_hparams *hp, float *param,
                                   const void *grad, int grad_dtype, float *exp_avg,
                                   float *exp_avg_sq, void *out, int out_dtype, long long n,
                                   int threads)
{
    int rc = off__check_level(level);
    if (rc < 0)
        return rc;
    if (hp == NULL || n < 0)
        return -EINVAL;
    if (grad_dtype != OFF_DTYPE_FP32 && grad_dtype != OFF_DTYPE_BF16 && grad_dtype != OFF_DTYPE_FP16)
        return -EINVAL;
    if (out_dtype != OFF_DTYPE_NONE && out_dtype != OFF_DTYPE_BF16 && out_dtype != OFF_DTYPE_FP16)
        return -EINVAL;
    struct adam_job job;
    rc = off__adam_make_consts(hp, &job.c);
    if (rc < 0)
        return rc;
    if (n == 0)
        return 0;
    if (!param || !grad || !exp_avg || !exp_avg_sq || (out_dtype != OFF_DTYPE_NONE && !out))
        return -EINVAL;
    if (misaligned(param, 4) || misaligned(exp_avg, 4) || misaligned(exp_avg_sq, 4)
        || misaligned(grad, grad_dtype == OFF_DTYPE_FP32 ? 4 : 2)
        || (out_dtype != OFF_DTYPE_NONE && misaligned(out, 2)))
        return -EINVAL;
    job.kernel = kernels[level].adam;
    job.param = param;
    job.grad = grad;
    job.grad_dtype = grad_dtype;
    job.exp_avg = exp_avg;
    job.exp_avg_sq = exp_avg_sq;
    job.out = out_dtype == OFF_DTYPE_NONE ? NULL : out;
    job.out_dtype = out_dtype;
    job.n = n;
    off__pool_run(adam_task, &job, off__thread_count(n, threads));
    return 0;
}

OFF_EXPORT int off_adam_step(const off_adam_hparams *hp, float *param, const void *grad,
                             int grad_dtype, float *exp_avg, float *exp_avg_sq, void *out,
                             int out_dtype, long long n, int threads)
{
    return off_adam_step_level(off__simd_current(), hp, param, grad, grad_dtype, exp_avg,
                               exp_avg_sq, out, out_dtype, n, threads);
}

/* ---- the roofline probe ------------------------------------------------------------- */

struct probe_job {
    off__probe_kernel kernel;
    float *a, *b, *c;
    const void *d;
    int d_dtype;
    void *e;
    int e_dtype;
    long long n;
};

static void probe_task(void *arg, int index, int count)
{
    const struct probe_job *j = arg;
    long long b, e;
    split(j->n, index, count, &b, &e);
    if (e <= b)
        return;
    size_t dsz = j->d_dtype == OFF_DTYPE_FP32 ? 4 : 2;
    j->kernel(j->a + b, j->b + b, j->c + b, (const char *)j->d + (size_t)b * dsz, j->d_dtype,
              j->e ? (void *)((uint16_t *)j->e + b) : NULL, j->e_dtype, e - b);
}

OFF_EXPORT int off_stream_probe_level(int level, float *a, float *b, float *c, const void *d,
                                      int d_dtype, void *e, int e_dtype, long long n, int threads)
{
    int rc = off__check_level(level);
    if (rc < 0)
        return rc;
    if (n < 0)
        return -EINVAL;
    if (d_dtype != OFF_DTYPE_FP32 && d_dtype != OFF_DTYPE_BF16 && d_dtype != OFF_DTYPE_FP16)
        return -EINVAL;
    if (e_dtype != OFF_DTYPE_NONE && e_dtype != OFF_DTYPE_BF16 && e_dtype != OFF_DTYPE_FP16)
        return -EINVAL;
    if (n == 0)
        return 0;
    if (!a || !b || !c || !d || (e_dtype != OFF_DTYPE_NONE && !e))
        return -EINVAL;
    if (misaligned(a, 4) || misaligned(b, 4) || misaligned(c, 4)
        || misaligned(d, d_dtype == OFF_DTYPE_FP32 ? 4 : 2)
        || (e_dtype != OFF_DTYPE_NONE && misaligned(e, 2)))
        return -EINVAL;
    struct probe_job job = {kernels[level].probe, a, b, c, d, d_dtype,
                            e_dtype != OFF_DTYPE_NONE ? e : NULL, e_dtype, n};
    off__pool_run(probe_task, &job, off__thread_count(n, threads));
    return 0;
}

OFF_EXPORT int off_stream_probe(float *a, float *b, float *c, const void *d, int d_dtype, void *e,
                                int e_dtype, long long n, int threads)
{
    return off_stream_probe_level(off__simd_current(), a, b, c, d, d_dtype, e, e_dtype, n, threads);
}
