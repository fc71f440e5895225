/*
 * The reference Adam step with 16-bit state, one element at a time: the moments and the master
 * are widened to fp32, updated exactly as adam8_scalar.c updates its dequantised moments
 *   m = m + (1 - beta1) * (g - m),  v = v + (1 - beta2) * (g*g - v)
 *   p = p - (lr/(1-beta1^t) * sqrt(1-beta2^t)) * m / (sqrt(v) + eps * sqrt(1-beta2^t))
 * and every bf16 among them is stored by stochastic rounding (adam8_internal.h), not to nearest.
 *
 * Why stochastic for the moments too: exp_avg_sq moves by (1 - beta2) = 1e-3 of itself per step
 * when the gradient is small, below half a bf16 ulp (2^-9 relative), so round-to-nearest (what
 * a torch bf16 state tensor's copy_ does, and torchao's plain bf16 state) freezes it and it can
 * then only grow: the denominator stays at its largest past value and the effective step shrinks.
 * Stochastic rounding keeps every moment's expectation on the fp32 recurrence, at the cost of
 * noise of at most one bf16 ulp per step. The update itself uses the fp32 moments before
 * rounding (the rounding is storage, not arithmetic).
 *
 * The bits: the master rounds with the low 16 bits of off__sr_bits(key, index), exactly as the
 * 8-bit kernel's master; exp_avg with the high 16 bits of that same word (a lowbias32 output's
 * halves are independent); exp_avg_sq with the low 16 bits of off__sr_bits(key_v, index).
 */
#pragma GCC optimize("fp-contract=off")
#include <math.h>

#include "adam16_internal.h"

static float load(const void *buf, int dtype, long long i)
{
    switch (dtype) {
    case OFF_DTYPE_BF16: return off__bf16_to_f32(((const uint16_t *)buf)[i]);
    case OFF_DTYPE_FP16: return off__f16_to_f32(((const uint16_t *)buf)[i]);
    default: return ((const float *)buf)[i];
    }
}

static void store_moment(void *buf, int dtype, long long i, float x, uint32_t r)
{
    if (dtype == OFF_DTYPE_BF16)
        ((uint16_t *)buf)[i] = off__f32_to_bf16_sr(x, r);
    else
        ((float *)buf)[i] = x;
}

void off__adam16_scalar(const off__adam16_consts *c, const off__adam16_io *io, long long begin,
                        long long end)
{
    const off__adam_consts *k = &c->a;
    for (long long i = begin; i < end; i++) {
        float g = load(io->grad, io->grad_dtype, i) * k->grad_scale;
        float p = load(io->master, io->master_dtype, i);
        if (k->mode == OFF__WD_DECOUPLED)
            p = p - k->lr_wd * p;
        else if (k->mode == OFF__WD_L2)
            g = g + k->l2 * p;
        float m = load(io->m, io->moment_dtype, i);
        float v = load(io->v, io->moment_dtype, i);
        m = m + k->one_minus_beta1 * (g - m);
        v = v == INFINITY ? v + g * g : v + k->one_minus_beta2 * (g * g - v);   /* +inf stays (adam_scalar.c) */
        float denom = sqrtf(v) + c->eps_bc2;
        p = p - (c->step_bc2 * m) / denom;

        unsigned long long index = (unsigned long long)(io->index_base + i);
        uint32_t r = off__sr_bits(c->key, index);
        store_moment(io->m, io->moment_dtype, i, m, r >> 16);
        if (io->moment_dtype == OFF_DTYPE_BF16)
            store_moment(io->v, io->moment_dtype, i, v, off__sr_bits(c->key_v, index));
        else
            store_moment(io->v, io->moment_dtype, i, v, 0);
        off__store_param_scalar(io->master, io->master_dtype, io->out, io->out_dtype, i, p, r);
    }
}
