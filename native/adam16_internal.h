/*
 * Internal to the Adam with 16-bit state (adam16*.c): bf16 moments and/or a bf16 master around
 * fp32 arithmetic. Per-call constants, the buffers of a call, and the kernel signature; the
 * random bits and the stochastic rounding are adam8's (adam8_internal.h), so a bf16 master gets
 * the same bits whichever kind of moments sits beside it. Not part of the public API.
 */
#ifndef OFF_ADAM16_INTERNAL_H
#define OFF_ADAM16_INTERNAL_H

#include "adam8_internal.h"

typedef struct off__adam16_consts {
    off__adam_consts a;
    float step_bc2;                     /* lr / (1 - beta1^t) * sqrt(1 - beta2^t) */
    float eps_bc2;                      /* eps * sqrt(1 - beta2^t) */
    uint32_t key;                       /* off__sr_key(seed, step): master (low 16), exp_avg (high 16) */
    uint32_t key_v;                     /* a second key for exp_avg_sq's bits */
} off__adam16_consts;

/* exp_avg_sq's key: one more mix of the call's key, so its bits are independent of the others. */
static inline uint32_t off__sr_key_v(uint32_t key) { return off__mix32(key ^ 0x5bd1e995u); }

typedef struct off__adam16_io {
    void *master;
    int master_dtype;                   /* FP32 or BF16 */
    const void *grad;
    int grad_dtype;                     /* FP32, BF16 or FP16 */
    void *m, *v;
    int moment_dtype;                   /* FP32 or BF16 */
    void *out;
    int out_dtype;                      /* NONE, FP32, BF16, FP16 */
    long long index_base;               /* element index of element 0 (random bits) */
} off__adam16_io;

/* Elements [begin, end) of the call's buffers (indexed from their starts). */
typedef void (*off__adam16_kernel)(const off__adam16_consts *c, const off__adam16_io *io,
                                   long long begin, long long end);

void off__adam16_scalar(const off__adam16_consts *c, const off__adam16_io *io, long long begin,
                        long long end);
#if defined(__x86_64__)
void off__adam16_avx2(const off__adam16_consts *c, const off__adam16_io *io, long long begin,
                      long long end);
void off__adam16_avx512(const off__adam16_consts *c, const off__adam16_io *io, long long begin,
                        long long end);
#endif

#endif
