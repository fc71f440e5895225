/*
 * Run-time choice of instruction set. The level is detected once at load with
 * __builtin_cpu_supports; callers may lower it (tests, OFFLOAD_SIMD) but never raise
 * it past what the CPU runs: asking for more is -ENOTSUP, not a silent fallback.
 */
#include <errno.h>
#include <stdatomic.h>
#include <unistd.h>

#include "common.h"

static int detected_level = -1;
static _Atomic int current_level = -1;
static _Atomic int default_threads = 0;

static int detect(void)
{
#if defined(__x86_64__)
    __builtin_cpu_init();
    int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")
               && __builtin_cpu_supports("f16c");
    if (avx2 && __builtin_cpu_supports("avx512f"))
        return OFF_SIMD_AVX512;
    if (avx2)
        return OFF_SIMD_AVX2;
#endif
    return OFF_SIMD_SCALAR;
}

__attribute__((constructor)) static void off_dispatch_init(void)
{
    detected_level = detect();
    atomic_store(&current_level, detected_level);
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    atomic_store(&default_threads, cpus > 0 ? (int)cpus : 1);
}

OFF_EXPORT int off_version(void)
{
    return OFF_VERSION_MAJOR * 10000 + OFF_VERSION_MINOR * 100 + OFF_VERSION_PATCH;
}

OFF_EXPORT int off_libaio_linked(void)
{
#ifdef OFF_HAVE_LIBAIO
    return 1;
#else
    return 0;
#endif
}

OFF_EXPORT int off_simd_supported(void) { return detected_level; }

OFF_EXPORT int off_simd_level(void) { return atomic_load(&current_level); }

int off__simd_current(void) { return atomic_load(&current_level); }

OFF_EXPORT int off_simd_set_level(int level)
{
    if (level < OFF_SIMD_SCALAR || level > OFF_SIMD_AVX512)
        return -EINVAL;
    if (level > detected_level)
        return -ENOTSUP;
    atomic_store(&current_level, level);
    return 0;
}

OFF_EXPORT const char *off_simd_name(int level)
{
    switch (level) {
    case OFF_SIMD_SCALAR: return "scalar";
    case OFF_SIMD_AVX2: return "avx2";
    case OFF_SIMD_AVX512: return "avx512";
    default: return NULL;
    }
}

OFF_EXPORT int off_default_threads(void) { return atomic_load(&default_threads); }

int off__threads_default(void) { return atomic_load(&default_threads); }

OFF_EXPORT int off_set_default_threads(int threads)
{
    if (threads < 1)
        return -EINVAL;
    atomic_store(&default_threads, threads);
    return 0;
}
