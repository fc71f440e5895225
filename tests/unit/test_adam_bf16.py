"""Adam with bf16 state (``offload.optim.adam_step`` with bf16 moments and/or a bf16 master):
the scalar kernel bit for bit against the plain-torch reference, every SIMD level bit for bit
against scalar, splits and threads, non-finite values, the stochastic rounding of the moments
(why not nearest), the master's bits shared with the 8-bit kernel, one step against
torch.optim.AdamW, 200 steps of training, and argument checks."""

from __future__ import annotations

import functools
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from offload import native
from offload.errors import ConfigError, NativeError
from offload.optim import adam_step
from offload.optim import quantized as q

from tests.helpers.small_regression import loss as _loss, problem as _problem

LEVELS = [pytest.param(level, marks=pytest.mark.skipif(
    level not in native.simd_available(), reason=f"this CPU lacks {level}"))
    for level in native.SIMD_LEVELS]
SIMD = [p for p in LEVELS if p.values[0] != "scalar"]
GRADS = [torch.float32, torch.bfloat16, torch.float16]
OUTS = [None, torch.float32, torch.bfloat16, torch.float16]
# (master, moments): every combination with some bf16 state
KINDS = [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16),
         (torch.bfloat16, torch.float32)]
HP = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8)
SPECIAL = torch.tensor([0.0, -0.0, 1e30, -1e30, 1e-30, 1e-40, 3e38, -3e38, float("nan"),
                        float("inf"), -float("inf")])


def bits_equal(a, b) -> bool:
    """Same bits, NaN compared as NaN (payloads differ between torch's paths and ours)."""
    if a is None or b is None:
        return a is None and b is None
    na, nb = torch.isnan(a.float()), torch.isnan(b.float())
    ints = {8: torch.int64, 4: torch.int32, 2: torch.int16}[a.element_size()]
    return a.dtype == b.dtype and torch.equal(na, nb) and torch.equal(a.view(ints)[~na], b.view(ints)[~nb])


def make_state(n, master, moments, *, seed=0, special=False):
    """Master and moments as a few steps of training would leave them; with ``special``, some
    zeros and huge, tiny, subnormal and non-finite values among them."""
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=g)
    m = torch.randn(n, generator=g) * 10.0 ** torch.randint(-6, 1, (n,), generator=g)
    v = torch.rand(n, generator=g) * 10.0 ** torch.randint(-12, -2, (n,), generator=g)
    if special and n:
        for t in (p, m):
            pick = torch.randint(0, n, (max(1, n // 8),), generator=g)
            t[pick] = SPECIAL[torch.randint(0, len(SPECIAL), (len(pick),), generator=g)]
        pick = torch.randint(0, n, (max(1, n // 8),), generator=g)
        v[pick] = SPECIAL[torch.randint(0, len(SPECIAL), (len(pick),), generator=g)].abs()
    return [p.to(master), m.to(moments), v.to(moments)]


def grads_for(n, steps, dtype, seed=1, special=False):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        x = torch.randn(n, generator=g) * 10.0 ** torch.randint(-4, 1, (n,), generator=g)
        if special and n:
            pick = torch.randint(0, n, (max(1, n // 6),), generator=g)
            x[pick] = SPECIAL[torch.randint(0, len(SPECIAL), (len(pick),), generator=g)]
        out.append(x.to(dtype))
    return out


def run(state, grads, *, simd=None, out_dtype=None, threads=1, seed=7, index_base=0,
        reference=False, **kw):
    s = [t.clone() for t in state]
    hp = {**HP, "weight_decay": 0.01, **kw}
    out = None if out_dtype is None else torch.empty(s[0].numel(), dtype=out_dtype)
    for t, g in enumerate(grads, start=1):
        if reference:
            *s, out = q.reference_adam_step_bf16(*s[:1], g, *s[1:], step=t, out_dtype=out_dtype,
                                                 seed=seed, index_base=index_base, **hp)
        else:
            adam_step(s[0], g, s[1], s[2], step=t, out=out, simd=simd, threads=threads,
                      seed=seed, index_base=index_base, **hp)
    return s + [out]


def same_run(a, b) -> bool:
    return all(bits_equal(x, y) for x, y in zip(a, b))


# ---- scalar against the plain-torch reference (every bit) --------------------------------

@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 700), kind=st.sampled_from(KINDS), grad=st.sampled_from(GRADS),
       out=st.sampled_from(OUTS), decoupled=st.booleans(), wd=st.sampled_from([0.0, 0.05]),
       maximize=st.booleans(), scale=st.sampled_from([1.0, 0.125, 3.0]), special=st.booleans(),
       index_base=st.integers(0, 2**40), seed=st.integers(0, 2**64 - 1))
def test_scalar_kernel_equals_torch_reference(n, kind, grad, out, decoupled, wd, maximize, scale,
                                              special, index_base, seed):
    state = make_state(n, *kind, seed=n, special=special)
    grads = grads_for(n, 3, grad, seed=n + 1, special=special)
    kw = dict(out_dtype=out, seed=seed, index_base=index_base, decoupled=decoupled,
              weight_decay=wd, maximize=maximize, grad_scale=scale)
    assert same_run(run(state, grads, simd="scalar", **kw), run(state, grads, reference=True, **kw))


# ---- every SIMD level against scalar (every bit) ----------------------------------------

@pytest.mark.parametrize("level", SIMD)
@pytest.mark.parametrize("kind", KINDS)
def test_level_equals_scalar_at_edge_sizes(level, kind):
    for n in (1, 7, 8, 9, 15, 16, 17, 31, 33, 64, 100):
        for grad in GRADS:
            for out in OUTS:
                state = make_state(n, *kind, seed=n, special=True)
                grads = grads_for(n, 2, grad, seed=n + 1, special=True)
                assert same_run(run(state, grads, simd=level, out_dtype=out),
                                run(state, grads, simd="scalar", out_dtype=out)), (n, grad, out)


@pytest.mark.parametrize("level", SIMD)
@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, 1500), offset=st.integers(0, 17), kind=st.sampled_from(KINDS),
       grad=st.sampled_from(GRADS), out=st.sampled_from(OUTS), decoupled=st.booleans(),
       special=st.booleans(), index_base=st.integers(0, 2**33))
def test_level_equals_scalar_hypothesis(level, n, offset, kind, grad, out, decoupled, special,
                                        index_base):
    # an element offset starts every buffer unaligned to the vector width; an index_base near
    # 2^32 makes the hash's high word change inside a vector
    full = make_state(n + offset, *kind, seed=n, special=special)
    state = [t[offset:] for t in full]
    grads = [g[offset:] for g in grads_for(n + offset, 2, grad, seed=n + 1, special=special)]
    kw = dict(out_dtype=out, index_base=index_base, decoupled=decoupled)
    assert same_run(run(state, grads, simd=level, **kw), run(state, grads, simd="scalar", **kw))


@pytest.mark.parametrize("level", LEVELS)
def test_threads_and_slices_never_change_a_bit(level):
    n = 200_000 + 77
    state = make_state(n, torch.bfloat16, torch.bfloat16, seed=3)
    grads = grads_for(n, 2, torch.bfloat16, seed=4)
    ref = run(state, grads, simd=level, threads=1, out_dtype=torch.float16)
    for threads in (2, 3, 7):
        assert same_run(run(state, grads, simd=level, threads=threads, out_dtype=torch.float16), ref)
    # two slices cut anywhere (not even at a vector boundary), each told its offset
    cut = 70_001
    halves = [run([t[lo:hi] for t in state], [g[lo:hi] for g in grads], simd=level,
                  index_base=lo, out_dtype=torch.float16) for lo, hi in ((0, cut), (cut, n))]
    for i in range(4):
        assert bits_equal(torch.cat([halves[0][i], halves[1][i]]), ref[i]), i


# ---- the master's bits are the 8-bit kernel's -----------------------------------------

@pytest.mark.parametrize("level", LEVELS)
def test_bf16_master_rounds_with_the_8bit_kernels_bits(level):
    # same update inputs: 8-bit moments that dequantise exactly to the bf16 moments given here
    n = 1000
    p = torch.randn(n).bfloat16()
    mc, ma = q.quantize(torch.randn(n) * 1e-3, True)
    vc, va = q.quantize(torch.rand(n) * 1e-6, False)
    m, v = q.dequantize(mc, ma, True), q.dequantize(vc, va, False)
    # The 8-bit step first holds exp_avg to Adam's bound (it binds on these random moments).
    m = q.bound_moment(m, v, HP["beta1"], HP["beta2"])
    g = torch.randn(n) * 1e-2
    kw = dict(step=4, weight_decay=0.01, seed=99, index_base=12345, simd=level, **HP)
    p8, p16 = p.clone(), p.clone()
    q.adam_step_8bit(p8, g, mc, ma, vc, va, **kw)
    adam_step(p16, g, m, v, **kw)
    assert bits_equal(p8, p16)


# ---- stochastic rounding of the moments: why not nearest --------------------------------

@pytest.mark.parametrize("level", LEVELS)
def test_moments_decay_on_average_where_nearest_rounding_freezes_them(level):
    """With zero gradients v decays by beta2 = 0.999 a step: 1e-3 of itself, below half a bf16
    ulp (2^-9), so a bf16 tensor rounded to nearest (torch's copy_) never moves; stochastic
    rounding follows 0.999^t on average. Tolerance: each step adds rounding noise of std at most
    half an ulp (2^-9 near 1) and the recurrence only damps it, so after T steps one element is
    off by at most 2^-9 * sqrt(T) in std; the mean over n elements by that / sqrt(n); 6 sigma."""
    n, steps = 4096, 200
    rne = torch.ones(n, dtype=torch.bfloat16)
    for _ in range(steps):
        rne = (rne.float() * 0.999).bfloat16()
    assert bool((rne == 1.0).all())  # nearest rounding is stuck
    p = torch.zeros(n)
    m, v = torch.ones(n, dtype=torch.bfloat16), torch.ones(n, dtype=torch.bfloat16)
    for t in range(1, steps + 1):
        adam_step(p, torch.zeros(n), m, v, step=t, weight_decay=0.0, simd=level, seed=1, **HP)
    tol = 6 * 2.0**-9 * math.sqrt(steps) / math.sqrt(n)
    assert v.float().mean().item() == pytest.approx(0.999**steps, abs=tol)
    assert m.float().mean().item() == pytest.approx(0.9**steps, abs=tol)


# ---- against torch.optim.AdamW ----------------------------------------------------------

@pytest.mark.parametrize("level", LEVELS)
def test_one_step_matches_torch_adamw_within_the_roundings(level):
    """From zero moments, one step. The update uses the fp32 moments before rounding, so the
    parameter differs from torch's only in the order of float operations: the update's (folded
    bias correction: at most 8 roundings, 8 * 2^-24 of it) and the decay's (torch multiplies by
    the float of 1 - lr*wd, we subtract (lr*wd)*p; with the final subtraction at most 6 roundings
    of |p|, 6 * 2^-24 of it). The stored moments are stochastic roundings of torch's exact
    products: less than one bf16 ulp (at most 2^-7 relative) away."""
    n = 5000
    p0 = torch.randn(n)
    g = torch.randn(n) * 10.0 ** torch.randint(-4, 1, (n,))
    w = torch.nn.Parameter(p0.clone())
    w.grad = g.clone()
    torch.optim.AdamW([w], betas=(HP["beta1"], HP["beta2"]), lr=HP["lr"], eps=HP["eps"],
                      weight_decay=0.01).step()
    p, m, v = p0.clone(), torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)
    adam_step(p, g, m, v, step=1, weight_decay=0.01, simd=level, **HP)
    want_m, want_v = (1 - HP["beta1"]) * g, (1 - HP["beta2"]) * g * g
    update = (p0 * (1 - HP["lr"] * 0.01) - w.detach()).abs()
    assert bool(((p - w.detach()).abs() <= (update * 8 + p0.abs() * 6) * 2.0**-24).all())
    assert bool(((m.float() - want_m).abs() < want_m.abs() * 2.0**-7 * (1 + 1e-6)).all())
    assert bool(((v.float() - want_v).abs() < want_v.abs() * 2.0**-7 * (1 + 1e-6)).all())


@functools.lru_cache(maxsize=None)
def _losses(lr, master=None, moments=None, steps=200):
    # one torch thread: this tiny model runs ~15x slower when its threads fight for 2 busy cores
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train(lr, master, moments, steps)
    finally:
        torch.set_num_threads(old)


def _train(lr, master, moments, steps):
    X, y, init = _problem()
    losses = []
    if master is None:  # torch.optim.AdamW itself
        w = torch.nn.Parameter(init.clone())
        opt = torch.optim.AdamW([w], lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
        for _ in range(steps):
            opt.zero_grad()
            loss = _loss(w, X, y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses
    w = init.clone().to(master)
    m, v = torch.zeros(init.numel(), dtype=moments), torch.zeros(init.numel(), dtype=moments)
    for t in range(1, steps + 1):
        wf = w.float().requires_grad_(True)
        loss = _loss(wf, X, y)
        (g,) = torch.autograd.grad(loss, wf)
        adam_step(w, g, m, v, lr=lr, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=t)
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("kind", KINDS)
def test_200_steps_track_torch_adamw_within_a_5_percent_lr_band(kind):
    """The tolerance: a stochastically rounded moment's stored error has std at most half a bf16
    ulp (2^-8 relative) times sqrt(1 / (1 - beta^2)) once the recurrence is stationary: 4.4%
    for v (beta2 = 0.999), so 2.2% on sqrt(v), and 0.45% for m; the update's per-element noise
    is thus ~2.3% (unbiased), and two of those std, 5%, bound it as an lr change would. As in
    test_adam8bit_training.py: after a 20-step warm-up the loss's mean distance from AdamW's
    L(lr) is at most the mean of band(t) = max |L(lr * (1 -+ 0.05)) - L(lr)|, and the final loss
    lies within the final band."""
    lr = 1e-2
    ref, low, high = _losses(lr), _losses(lr * 0.95), _losses(lr * 1.05)
    ours = _losses(lr, *kind)
    assert ref[-1] < 0.1 * ref[0]
    band = [max(abs(lo - r), abs(hi - r)) for lo, hi, r in zip(low, high, ref)]
    dist = [abs(o - r) for o, r in zip(ours, ref)]
    assert sum(dist[20:]) <= sum(band[20:]), (sum(dist[20:]), sum(band[20:]))
    assert dist[-1] <= band[-1], (ours[-1], ref[-1], band[-1])


# ---- non-finite values stay where they are ---------------------------------------------

@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_gradient_stays_in_its_element(level, bad):
    n = 100
    p, m, v = make_state(n, torch.bfloat16, torch.bfloat16, seed=5)
    g = torch.randn(n) * 1e-3
    g[37] = bad
    adam_step(p, g, m, v, step=1, weight_decay=0.0, simd=level, **HP)
    assert torch.isnan(p[37]) and not torch.isfinite(v[37])
    keep = torch.arange(n) != 37
    for t in (p, m, v):
        assert bool(torch.isfinite(t[keep]).all())


# ---- argument checks ------------------------------------------------------------------

def _bad_calls():
    n = 300

    def base(**over):
        p, m, v = make_state(n, torch.bfloat16, torch.bfloat16)
        args = dict(param=p, grad=torch.randn(n), exp_avg=m, exp_avg_sq=v, step=1,
                    weight_decay=0.0, **HP)
        args.update(over)
        return args
    return {
        "param": [base(param=torch.randn(n).half())],
        "exp_avg": [base(exp_avg=torch.zeros(n).half())],
        "exp_avg_sq": [base(exp_avg_sq=torch.zeros(n)), base(exp_avg_sq=torch.zeros(n + 1).bfloat16())],
        "out": [base(out=torch.zeros(n, dtype=torch.float64)),
                base(param=torch.randn(n), exp_avg=torch.zeros(n), exp_avg_sq=torch.zeros(n),
                     out=torch.zeros(n))],   # an fp32 copy only where some state is bf16
        "seed": [base(seed=-1), base(seed=2**64)],
        "index_base": [base(index_base=-5), base(index_base=2**63 - 100)],
        "step": [base(step=0)],
    }


@pytest.mark.parametrize("field", list(_bad_calls()))
def test_bad_arguments_raise_naming_the_field_and_modify_nothing(field):
    for args in _bad_calls()[field]:
        before = {k: t.clone() for k, t in args.items() if isinstance(t, torch.Tensor)}
        with pytest.raises(ConfigError) as info:
            adam_step(**args)
        assert info.value.field == field
        for k, t in before.items():
            assert bits_equal(args[k], t), k


def test_overlapping_buffers_are_refused():
    p, m, v = make_state(256, torch.bfloat16, torch.bfloat16)
    with pytest.raises(ConfigError, match="overlap"):
        adam_step(p, torch.randn(256), p, v, step=1, weight_decay=0.0, **HP)


def test_native_refuses_all_fp32_state_and_bad_dtypes():
    x = torch.zeros(64)
    kw = dict(grad=x.data_ptr(), grad_dtype="fp32", exp_avg=x.data_ptr(), exp_avg_sq=x.data_ptr(),
              out=0, out_dtype="none", n=64, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
              weight_decay=0.0, grad_scale=1.0, step=1, decoupled=True, maximize=False, seed=0,
              index_base=0, threads=1, level=None)
    for master, moments in (("fp32", "fp32"), ("fp16", "bf16"), ("bf16", "fp16")):
        with pytest.raises(NativeError):
            native.adam16_step_raw(master=torch.zeros(64).data_ptr(), master_dtype=master,
                                   moment_dtype=moments, **kw)


# ---- the benchmark's JSON for bf16 state (its shape, not a timing) ----------------------

@pytest.mark.parametrize("state,master,bpp", [("bf16", "fp32", 20), ("bf16", "bf16", 16),
                                              ("fp32", "bf16", 24)])
def test_bench_bf16_counts_its_own_bytes(state, master, bpp):
    from offload.bench.adam import measure

    report = measure(params=20_000, threads=2, grad_dtype="bf16", out_dtype="bf16", repeats=1,
                     levels=["scalar"], state=state, master=master)
    assert report["state"] == state and report["master"] == master
    assert report["bytes_per_param"] == bpp and report["roofline_bytes_per_param"] == 28
    res = report["results"]
    assert {"offload_scalar", "fp32_kernel", "roofline"} <= res.keys() and "torch_fused" not in res
    assert res["offload"]["gbps"] == pytest.approx(res["offload"]["params_per_s"] * bpp / 1e9)
    assert report["roofline_fraction"] > 0 and report["speedup_vs_fp32_kernel"] > 0
