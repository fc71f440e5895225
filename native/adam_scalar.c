/*
 * The reference Adam/AdamW step: one element at a time, torch.optim.AdamW's documented
 * algorithm, with every scalar already rounded to float by off__adam_consts. The SIMD
 * kernels do exactly these IEEE operations lane by lane (no FMA contraction anywhere), so
 * every level gives the same bits.
 *
 *   g      = grad * grad_scale                 (negated for maximize)
 *   AdamW: p = p - (lr*wd) * p     Adam: g = g + wd*p
 *   m      = m + (1 - beta1) * (g - m)         (torch: exp_avg.lerp_(g, 1 - beta1))
 *   v      = v + (1 - beta2) * (g*g - v)       (torch: mul_(beta2).addcmul_(g, g, 1 - beta2))
 *   denom  = sqrt(v) / sqrt(1 - beta2^t) + eps
 *   p      = p - (lr / (1 - beta1^t)) * m / denom
 *
 * Two forms differ from torch's fp32 code on purpose: torch multiplies by the float roundings
 * of 1 - lr*wd and of beta2, whose errors (up to ~1e-8 relative) compound every step into a
 * drift of ~1e-6 from the exact result after 100 steps; rounding only the small terms lr*wd
 * and 1 - beta2 keeps that drift out (same maths, closer to torch in float64).
 */
#include <math.h>

#include "adam_internal.h"

static float load_grad(const void *grad, int dtype, long long i)
{
    switch (dtype) {
    case OFF_DTYPE_BF16: return off__bf16_to_f32(((const uint16_t *)grad)[i]);
    case OFF_DTYPE_FP16: return off__f16_to_f32(((const uint16_t *)grad)[i]);
    default: return ((const float *)grad)[i];
    }
}

void off__adam_scalar(const off__adam_consts *c, float *param, const void *grad, int grad_dtype,
                      float *exp_avg, float *exp_avg_sq, void *out, int out_dtype, long long n)
{
    for (long long i = 0; i < n; i++) {
        float g = load_grad(grad, grad_dtype, i) * c->grad_scale;
        float p = param[i];
        if (c->mode == OFF__WD_DECOUPLED)
            p = p - c->lr_wd * p;
        else if (c->mode == OFF__WD_L2)
            g = g + c->l2 * p;
        float m = exp_avg[i];
        m = m + c->one_minus_beta1 * (g - m);
        float v = exp_avg_sq[i];
        /* An exp_avg_sq that overflowed to +inf stays +inf, as torch's beta2 * v + (1 - beta2) g^2
         * keeps it (that parameter stops moving); this form alone would give inf - inf = NaN. */
        v = v == INFINITY ? v + g * g : v + c->one_minus_beta2 * (g * g - v);
        float denom = sqrtf(v) / c->bc2_sqrt + c->eps;
        p = p - (c->step_size * m) / denom;
        param[i] = p;
        exp_avg[i] = m;
        exp_avg_sq[i] = v;
        if (out_dtype == OFF_DTYPE_BF16)
            ((uint16_t *)out)[i] = off__f32_to_bf16(p);
        else if (out_dtype == OFF_DTYPE_FP16)
            ((uint16_t *)out)[i] = off__f32_to_f16(p);
    }
}

/* The roofline loop: Adam's streams, bytes and dtype conversions with next to no arithmetic
 * (bounded drift, c stays >= 0: the buffers remain usable as Adam state afterwards). */
void off__probe_scalar(float *a, float *b, float *c, const void *d, int d_dtype, void *e,
                       int e_dtype, long long n)
{
    for (long long i = 0; i < n; i++) {
        float x = load_grad(d, d_dtype, i);
        float y = a[i] + x;
        a[i] = y;
        b[i] = b[i] + x;
        c[i] = c[i] + x * x;
        if (e_dtype == OFF_DTYPE_BF16)
            ((uint16_t *)e)[i] = off__f32_to_bf16(y);
        else if (e_dtype == OFF_DTYPE_FP16)
            ((uint16_t *)e)[i] = off__f32_to_f16(y);
    }
}
