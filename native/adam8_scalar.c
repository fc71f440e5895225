/*
 * The reference 8-bit Adam step, one element at a time: block-wise dynamic quantization as in
 * Dettmers et al. 2022 ("8-bit Optimizers via Block-wise Quantization", Algorithm 1 with
 * bitsandbytes' AdamW8bit maps), around the fp32 kernel's update (adam_scalar.c) with the
 * denominator's bias correction folded into two constants (one division per element fewer):
 *   p = p - (lr/(1-beta1^t) * sqrt(1-beta2^t)) * m / (sqrt(v) + eps * sqrt(1-beta2^t))
 *
 *   for each block of B elements:
 *     m = signed_map[m_code] * m_absmax            dequantise
 *     v = unsigned_map[v_code] * v_absmax
 *     m = clamp(m, -K sqrt(v), K sqrt(v))            Adam's own bound (off__bound_moment)
 *     (m, v, p) = the Adam/AdamW step               on every element of the block
 *     m_absmax = max |m|,  v_absmax = max |v|       new scale per block
 *     m_code = nearest(signed_map, m / m_absmax)    requantise (x * (1/absmax), rounded once)
 *     v_code = nearest(unsigned_map, v / v_absmax)
 *
 * With a bf16 master, p is rounded to bf16 stochastically from its fp32 result. The SIMD
 * kernels do the same IEEE operations lane by lane and find the same nearest codes (through a
 * bucket table instead of this binary search), so every level gives the same bits.
 */
#pragma GCC optimize("fp-contract=off")
#include <float.h>
#include <math.h>

#include "adam8_internal.h"

/* The nearest code of x: the number of midpoints below x (a tie goes to the lower code). */
static uint8_t nearest_code(const float *mid, float x)
{
    int lo = 0, hi = 255;
    while (lo < hi) {
        int k = (lo + hi) / 2;
        if (mid[k] < x)
            lo = k + 1;
        else
            hi = k;
    }
    return (uint8_t)lo;
}

float off__quant_scalar(int map, const float *x, uint8_t *codes, long long n)
{
    float absmax = 0.0f;
    int finite = 1;
    for (long long i = 0; i < n; i++) {
        float a = fabsf(x[i]);
        if (!(a <= FLT_MAX))
            finite = 0;
        else if (a > absmax)
            absmax = a;
    }
    if (!finite) { /* the NaN scale carries the poison into every later step */
        memset(codes, off__qt.zero_code[map], (size_t)n);
        return off__bits_f32(0x7fc00000u);
    }
    float inv = off__inv_scale(absmax);
    for (long long i = 0; i < n; i++)
        codes[i] = nearest_code(off__qt.mid[map], x[i] * inv);
    return inv == 0.0f ? 0.0f : absmax;
}

static float load_grad(const void *grad, int dtype, long long i)
{
    switch (dtype) {
    case OFF_DTYPE_BF16: return off__bf16_to_f32(((const uint16_t *)grad)[i]);
    case OFF_DTYPE_FP16: return off__f16_to_f32(((const uint16_t *)grad)[i]);
    default: return ((const float *)grad)[i];
    }
}

/* Store the updated parameter: the master (fp32 as is, bf16 stochastically rounded) and the
 * out copy of the value the master now holds. */
static void store_param(const off__adam8_consts *c, const off__adam8_io *io, long long i, float p)
{
    uint32_t r = io->master_dtype == OFF_DTYPE_BF16
                     ? off__sr_bits(c->key, (unsigned long long)(io->index_base + i)) : 0;
    off__store_param_scalar(io->master, io->master_dtype, io->out, io->out_dtype, i, p, r);
}

void off__adam8_scalar(const off__adam8_consts *c, const off__adam8_io *io, long long begin,
                       long long end)
{
    const off__adam_consts *k = &c->a;
    const float *smap = off__qt.values[OFF_QMAP_SIGNED], *umap = off__qt.values[OFF_QMAP_UNSIGNED];
    float mb[OFF_ADAM8_MAX_BLOCK], vb[OFF_ADAM8_MAX_BLOCK];
    for (long long s = begin; s < end; s += c->block) {
        long long len = end - s < c->block ? end - s : c->block;
        long long blk = s / c->block;
        float m_absmax = io->m_absmax[blk], v_absmax = io->v_absmax[blk];
        for (long long j = 0; j < len; j++) {
            long long i = s + j;
            float g = load_grad(io->grad, io->grad_dtype, i) * k->grad_scale;
            float p = io->master_dtype == OFF_DTYPE_BF16
                          ? off__bf16_to_f32(((const uint16_t *)io->master)[i])
                          : ((const float *)io->master)[i];
            if (k->mode == OFF__WD_DECOUPLED)
                p = p - k->lr_wd * p;
            else if (k->mode == OFF__WD_L2)
                g = g + k->l2 * p;
            float m = smap[io->m_codes[i]] * m_absmax;
            float v = umap[io->v_codes[i]] * v_absmax;
            m = off__bound_moment(m, v, c->m_bound, c->m_bound2);
            m = m + k->one_minus_beta1 * (g - m);
            v = v + k->one_minus_beta2 * (g * g - v);
            float denom = sqrtf(v) + c->eps_bc2;
            p = p - (c->step_bc2 * m) / denom;
            store_param(c, io, i, p);
            mb[j] = m;
            vb[j] = v;
        }
        io->m_absmax[blk] = off__quant_scalar(OFF_QMAP_SIGNED, mb, io->m_codes + s, len);
        io->v_absmax[blk] = off__quant_scalar(OFF_QMAP_UNSIGNED, vb, io->v_codes + s, len);
    }
}
