"""The 8-bit Adam kernel (``offload.optim.quantized``): the maps against bitsandbytes'
formula, the nearest-code search, the scalar kernel bit for bit against the plain-torch
reference of the block-wise scheme, every SIMD level bit for bit against scalar, splits and
threads, non-finite gradients, the stochastically rounded bf16 master, and argument checks.
Training quality and the benchmark: test_adam8bit_training.py."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from offload import native
from offload.errors import ConfigError, NativeError
from offload.optim import quantized as q

LEVELS = [pytest.param(level, marks=pytest.mark.skipif(
    level not in native.simd_available(), reason=f"this CPU lacks {level}"))
    for level in native.SIMD_LEVELS]
SIMD = [p for p in LEVELS if p.values[0] != "scalar"]
GRADS = [torch.float32, torch.bfloat16, torch.float16]
OUTS = [None, torch.float32, torch.bfloat16, torch.float16]
MASTERS = [torch.float32, torch.bfloat16]
HP = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8)


def bits_equal(a, b) -> bool:
    """Same bits, NaN compared as NaN (payloads differ between torch's paths and ours)."""
    if a is None or b is None:
        return a is None and b is None
    if not a.is_floating_point():
        return torch.equal(a, b)
    na, nb = torch.isnan(a.float()), torch.isnan(b.float())
    ints = {8: torch.int64, 4: torch.int32, 2: torch.int16}[a.element_size()]
    return torch.equal(na, nb) and torch.equal(a.view(ints)[~na], b.view(ints)[~nb])


def make_state(n, *, master=torch.float32, block=256, seed=0, special=False):
    """Master and quantised moments as a few steps of training would leave them."""
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=g)
    m = torch.randn(n, generator=g) * 10.0 ** torch.randint(-6, 1, (n,), generator=g)
    v = torch.rand(n, generator=g) * 10.0 ** torch.randint(-12, -2, (n,), generator=g)
    if special and n:
        idx = torch.randint(0, n, (max(1, n // 8),), generator=g)
        p[idx[::2]] = 0.0
        m[idx[1::3]] = 0.0
        v[idx[::3]] = 0.0
    mc, ma = q.quantize(m, True, block)
    vc, va = q.quantize(v, False, block)
    return [p.to(master), mc, ma, vc, va]


def grads_for(n, steps, dtype, seed=1, special=False):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        x = torch.randn(n, generator=g) * 10.0 ** torch.randint(-4, 1, (n,), generator=g)
        if special and n:
            pick = torch.randint(0, n, (max(1, n // 6),), generator=g)
            choices = torch.tensor([0.0, -0.0, 1e30, -1e30, 1e-30, 1e-40, 3e38])
            x[pick] = choices[torch.randint(0, len(choices), (len(pick),), generator=g)]
        out.append(x.to(dtype))
    return out


def run(state, grads, *, simd=None, out_dtype=None, threads=1, block=256, seed=7, index_base=0,
        reference=False, **kw):
    s = [t.clone() for t in state]
    hp = {**HP, "weight_decay": 0.01, **kw}
    out = None if out_dtype is None else torch.empty(s[0].numel(), dtype=out_dtype)
    for t, g in enumerate(grads, start=1):
        if reference:
            *s, out = q.reference_adam_step_8bit(s[0], g, *s[1:], step=t, out_dtype=out_dtype,
                                                 block_size=block, seed=seed,
                                                 index_base=index_base, **hp)
        else:
            q.adam_step_8bit(s[0], g, *s[1:], step=t, out=out, simd=simd, threads=threads,
                             block_size=block, seed=seed, index_base=index_base, **hp)
    return s + [out]


def same_run(a, b) -> bool:
    return all(bits_equal(x, y) for x, y in zip(a, b))


# ---- the maps and the nearest-code search ------------------------------------------------

def dynamic_map(signed: bool) -> torch.Tensor:
    """bitsandbytes' create_dynamic_map(signed, 7, 8), in float64."""
    data = []
    for i in range(7):
        f = 2**i if signed else 2 ** (i + 1)
        b = torch.linspace(0.1, 1, f + 1, dtype=torch.float64)
        means = ((b[:-1] + b[1:]) / 2 * 10.0 ** (i - 6)).tolist()
        data += means + ([-x for x in means] if signed else [])
    return torch.tensor(sorted(data + [0.0, 1.0]), dtype=torch.float64)


@pytest.mark.parametrize("signed", [True, False])
def test_maps_are_bitsandbytes_dynamic_maps(signed):
    ours = q.qmap(signed)
    want = dynamic_map(signed)
    assert ours.numel() == 256 and bool((ours[1:] > ours[:-1]).all())
    assert torch.allclose(ours.double(), want, rtol=2 * 2.0**-24, atol=0)
    assert ours[-1] == 1.0 and (ours == 0).sum() == 1
    assert (ours.min() > -1.0) if signed else (ours.min() == 0.0)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("signed", [True, False])
def test_nearest_code_at_and_around_every_midpoint(level, signed):
    values = q.qmap(signed)
    mid = ((values[:-1].double() + values[1:].double()) * 0.5).float()
    near = mid.view(torch.int32)[:, None] + torch.arange(-3, 4, dtype=torch.int32)[None, :]
    xs = torch.cat([near.reshape(-1).view(torch.float32), values, torch.rand(20_000) * 2 - 1,
                    torch.tensor([0.0, -0.0, 1e-30, -1e-30, 2.0**-23, 1.0, -0.99])])
    if not signed:
        xs = xs.abs()
    # one 1.0 per block keeps absmax at 1, so the codes are those of xs themselves
    block = 256
    xs = torch.cat([torch.cat([c, torch.ones(1)]) for c in xs.split(block - 1)])
    codes, absmax = q.quantize(xs, signed, block, simd=level)
    assert bool((absmax == 1.0).all())
    ref_codes, _ = q.reference_quantize(xs, signed, block)
    assert torch.equal(codes, ref_codes)
    # nearest in float64, a tie (x exactly on a rounded midpoint) allowed either way
    err = (xs.double() - values.double()[codes.long()]).abs()
    best = (xs.double()[:, None] - values.double()[None, :]).abs().min(dim=1).values
    on_mid = torch.isin(xs, mid)
    assert bool(((err <= best) | on_mid).all())


def float_range(lo_bits: int, hi_bits: int, step: int = 1) -> torch.Tensor:
    """The floats whose bits are lo_bits, lo_bits + step, ... below hi_bits, both signs."""
    pos = torch.arange(lo_bits, hi_bits, step, dtype=torch.int32).view(torch.float32)
    return torch.cat([pos, -pos])


@pytest.mark.parametrize("level", SIMD)
@pytest.mark.parametrize("signed", [True, False])
def test_code_finder_equals_the_search_over_whole_float_ranges(level, signed):
    # Every float of [2^-4, 2^-3) (the map changes decade at 0.1 there), within 2^11 ulps of
    # every midpoint, within 32 ulps of every bucket edge (the finders index by the top 16
    # bits), within 2^12 ulps of the clamps (2^-23, and 1.0 from below); a stride through all the rest
    # below 2^-22, the small values the clamp sends to one bucket. (Every float with
    # |x| <= 1.0625 was checked once off-line, both maps: 2^31 each, no difference.)
    one = 0x3F800000
    values = q.qmap(signed)
    mid = ((values[:-1].double() + values[1:].double()) * 0.5).float().view(torch.int32)
    mid = mid[mid > 0]
    near_mid = (mid[:, None] + torch.arange(-2048, 2049, dtype=torch.int32)).reshape(-1)
    edges = torch.arange(0x3400, 0x3F81, dtype=torch.int32) << 16
    near_edge = (edges[:, None] + torch.arange(-32, 32, dtype=torch.int32)).reshape(-1)
    xs = torch.cat([float_range(0x3D800000, 0x3E000000),
                    torch.cat([near_mid, near_edge]).view(torch.float32),
                    -torch.cat([near_mid, near_edge]).view(torch.float32),
                    float_range(0x34000000 - 4096, 0x34000000 + 4096),
                    float_range(one - 4096, one + 1), float_range(0, 0x34800000, 4099)])
    xs = xs[xs.abs() <= 1.0]
    if not signed:  # the unsigned map's finder sends every negative x to the code of +0
        xs = torch.cat([xs.abs(), -xs.abs()[::97]])
    block = 4096
    rows = xs[: xs.numel() // (block - 1) * (block - 1)].view(-1, block - 1)
    xs = torch.cat([rows, torch.ones(rows.shape[0], 1)], dim=1).reshape(-1)  # absmax 1: x * 1
    codes, absmax = q.quantize(xs, signed, block, simd=level)
    assert bool((absmax == 1.0).all())
    assert torch.equal(codes, q.reference_quantize(xs, signed, block)[0])


# ---- scalar against the plain-torch reference (every bit) --------------------------------

@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 1100), block=st.sampled_from([64, 128, 256, 320]),
       master=st.sampled_from(MASTERS), grad=st.sampled_from(GRADS), out=st.sampled_from(OUTS),
       decoupled=st.booleans(), wd=st.sampled_from([0.0, 0.05]), maximize=st.booleans(),
       scale=st.sampled_from([1.0, 0.125, 3.0]), special=st.booleans(),
       index_base=st.integers(0, 2**40), seed=st.integers(0, 2**64 - 1))
def test_scalar_kernel_equals_torch_reference(n, block, master, grad, out, decoupled, wd, maximize,
                                              scale, special, index_base, seed):
    state = make_state(n, master=master, block=block, seed=n, special=special)
    grads = grads_for(n, 3, grad, seed=n + 1, special=special)
    kw = dict(out_dtype=out, block=block, seed=seed, index_base=index_base, decoupled=decoupled,
              weight_decay=wd, maximize=maximize, grad_scale=scale)
    assert same_run(run(state, grads, simd="scalar", **kw), run(state, grads, reference=True, **kw))


# ---- every SIMD level against scalar (every bit) ----------------------------------------

@pytest.mark.parametrize("level", SIMD)
@pytest.mark.parametrize("n", [1, 15, 16, 17, 63, 64, 255, 256, 257, 1000])
@pytest.mark.parametrize("master", MASTERS)
def test_level_equals_scalar_at_edge_sizes(level, n, master):
    for grad in GRADS:
        for out in OUTS:
            state = make_state(n, master=master, seed=n)
            grads = grads_for(n, 2, grad, seed=n + 1)
            assert same_run(run(state, grads, simd=level, out_dtype=out),
                            run(state, grads, simd="scalar", out_dtype=out)), (grad, out)


@pytest.mark.parametrize("level", SIMD)
@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, 1500), offset=st.integers(0, 17), block=st.sampled_from([64, 256, 4096]),
       master=st.sampled_from(MASTERS), grad=st.sampled_from(GRADS), out=st.sampled_from(OUTS),
       decoupled=st.booleans(), special=st.booleans(), index_base=st.integers(0, 2**33))
def test_level_equals_scalar_hypothesis(level, n, offset, block, master, grad, out, decoupled,
                                        special, index_base):
    # an element offset starts every buffer unaligned to the vector width
    full, nb = make_state(n + offset, master=master, block=block, seed=n), q.blocks(n, block)
    state = [full[0][offset:], full[1][offset:], full[2][:nb].clone(), full[3][offset:], full[4][:nb].clone()]
    grads = [g[offset:] for g in grads_for(n + offset, 2, grad, seed=n + 1, special=special)]
    kw = dict(out_dtype=out, block=block, index_base=index_base, decoupled=decoupled)
    assert same_run(run(state, grads, simd=level, **kw), run(state, grads, simd="scalar", **kw))


@pytest.mark.parametrize("level", SIMD)
@pytest.mark.parametrize("index_base", [2**32 - 256, 2**32 - 300, 2**32 - 7, 2**33 - 1000])
def test_bf16_master_bits_across_a_2_to_32_index_boundary(level, index_base):
    # the SIMD kernels hash each block from its index's high word: the word changing inside a
    # block, inside a group of 16 lanes or at a block edge must give the scalar kernel's bits
    n = 2048
    state = make_state(n, master=torch.bfloat16, seed=5)
    grads = grads_for(n, 2, torch.float32, seed=6)
    kw = dict(index_base=index_base, out_dtype=torch.bfloat16)
    assert same_run(run(state, grads, simd=level, **kw), run(state, grads, simd="scalar", **kw))


@pytest.mark.parametrize("level", LEVELS)
def test_threads_and_slices_never_change_a_bit(level):
    n, block = 300_000 + 77, 256
    state = make_state(n, master=torch.bfloat16, seed=3)
    grads = grads_for(n, 2, torch.bfloat16, seed=4)
    ref = run(state, grads, simd=level, threads=1, out_dtype=torch.float16)
    for threads in (2, 3, 7):
        assert same_run(run(state, grads, simd=level, threads=threads, out_dtype=torch.float16), ref)
    # two chunk slices cut at a block boundary, each told its offset, give the whole's bits
    cut = 512 * block
    halves = []
    for lo, hi in ((0, cut), (cut, n)):
        part = [state[0][lo:hi], state[1][lo:hi], state[2][lo // block:-(-hi // block)],
                state[3][lo:hi], state[4][lo // block:-(-hi // block)]]
        halves.append(run(part, [g[lo:hi] for g in grads], simd=level, index_base=lo,
                          out_dtype=torch.float16))
    for i in range(6):
        assert bits_equal(torch.cat([halves[0][i], halves[1][i]]), ref[i]), i


# ---- what non-finite gradients and zeros do ---------------------------------------------

@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_gradient_poisons_its_block_only(level, bad):
    n = 1024  # four blocks of 256; element 300 lies in block 1
    state = make_state(n, seed=5)
    g1, g2 = grads_for(n, 2, torch.float32, seed=6)
    g1[300] = bad
    s1 = run(state, [g1], simd=level)
    assert torch.isnan(s1[0][300]) and bool(torch.isfinite(s1[0][:300]).all())
    assert bool(torch.isfinite(s1[0][301:]).all())
    assert torch.isnan(s1[2][1]) and bool(torch.isfinite(s1[2][[0, 2, 3]]).all())
    assert torch.isnan(s1[4][1]) and bool(torch.isfinite(s1[4][[0, 2, 3]]).all())
    # the next step reads the whole block's moments as NaN: all its parameters turn NaN
    q.adam_step_8bit(s1[0], g2, *s1[1:5], step=2, weight_decay=0.01, simd=level, **HP)
    assert bool(torch.isnan(s1[0][256:512]).all())
    assert bool(torch.isfinite(s1[0][:256]).all()) and bool(torch.isfinite(s1[0][512:]).all())


@pytest.mark.parametrize("level", LEVELS)
def test_zero_gradients_and_zero_state_stay_zero(level):
    n = 700
    p = torch.randn(n)
    mc = torch.full((n,), 127, dtype=torch.uint8)   # the signed map's code of 0
    vc = torch.zeros(n, dtype=torch.uint8)
    ma, va = torch.ones(q.blocks(n)), torch.ones(q.blocks(n))
    before = p.clone()
    q.adam_step_8bit(p, torch.zeros(n), mc, ma, vc, va, step=1, weight_decay=0.0, simd=level, **HP)
    assert torch.equal(p, before)
    assert bool((mc == 127).all()) and bool((vc == 0).all())
    assert bool((ma == 0).all()) and bool((va == 0).all())


def test_quantize_dequantize_round_trip_error_is_half_a_step():
    x = torch.randn(10_000) * 10.0 ** torch.randint(-5, 2, (10_000,))
    for signed, vals in ((True, x), (False, x.abs())):
        codes, absmax = q.quantize(vals, signed)
        back = q.dequantize(codes, absmax, signed)
        assert torch.equal(back, q.reference_dequantize(codes, absmax, signed))
        table = q.qmap(signed).double()
        gap = (table[1:] - table[:-1]).max().item()
        scale = absmax.repeat_interleave(256)[:vals.numel()].double()
        # (+1e-6: the signed map's end, -0.99296874, is a rounding past half a step from -1)
        assert bool(((back.double() - vals.double()).abs() <= (gap / 2 + 1e-6) * scale).all())


# ---- the stochastically rounded bf16 master ---------------------------------------------

def test_stochastic_rounding_is_unbiased_and_deterministic():
    n = 200_000
    lo = torch.tensor(1.0, dtype=torch.bfloat16)
    ulp = 2.0**-7
    x = torch.full((n,), 1.0 + 0.3 * ulp)             # 30% of the way to the next bf16
    key = q.sr_key(11, 5)
    r = q.reference_bf16_sr(x, key, 0).float()
    up = (r > lo.float()).double().mean().item()
    assert abs(up - 0.3) < 4 * math.sqrt(0.3 * 0.7 / n)
    assert torch.equal(q.reference_bf16_sr(x, key, 0).view(torch.int16), r.bfloat16().view(torch.int16))
    assert not torch.equal(q.reference_bf16_sr(x, q.sr_key(12, 5), 0), r.bfloat16())


def test_bf16_master_moves_by_updates_far_below_its_ulp():
    # lr 1e-5 moves a parameter near 1 by ~1e-5 a step, 1/800 of a bf16 ulp: round-to-nearest
    # never moves it; stochastic rounding moves it by the right amount on average
    n, steps = 4096, 50
    state = [torch.ones(n, dtype=torch.bfloat16), torch.full((n,), 127, dtype=torch.uint8),
             torch.zeros(q.blocks(n)), torch.zeros(n, dtype=torch.uint8), torch.zeros(q.blocks(n))]
    grads = [torch.ones(n)] * steps
    s = run(state, grads, lr=1e-5, weight_decay=0.0)
    drift = (1.0 - s[0].float()).mean().item()
    assert drift == pytest.approx(steps * 1e-5, rel=0.25)


# ---- argument checks ------------------------------------------------------------------

def _bad_calls():
    n = 300

    def base(**over):
        s = make_state(n)
        args = dict(param=s[0], grad=torch.randn(n), exp_avg=s[1], exp_avg_absmax=s[2],
                    exp_avg_sq=s[3], exp_avg_sq_absmax=s[4], step=1, weight_decay=0.0, **HP)
        args.update(over)
        return args
    mis = torch.frombuffer(bytearray(n * 4 + 1), dtype=torch.float32, offset=1, count=n)
    return {
        "param": [base(param=torch.randn(n).double()), base(param=mis), base(param=torch.randn(n, 2)[:, 0])],
        "grad": [base(grad=torch.randn(n - 1)), base(grad=torch.randn(n).double())],
        "exp_avg": [base(exp_avg=torch.zeros(n, dtype=torch.int8)), base(exp_avg=torch.zeros(n + 1, dtype=torch.uint8))],
        "exp_avg_absmax": [base(exp_avg_absmax=torch.zeros(1))],      # 300 elements need 2 blocks
        "exp_avg_sq_absmax": [base(exp_avg_sq_absmax=torch.zeros(3))],
        "block_size": [base(block_size=100), base(block_size=8192), base(block_size=32)],
        "out": [base(out=torch.zeros(n, dtype=torch.float64))],
        "step": [base(step=0)],
        "seed": [base(seed=-1), base(seed=2**64)],
        "index_base": [base(index_base=-5), base(index_base=2**63 - 100)],
        "lr": [base(lr=float("nan"))],
        "grad_scale": [base(grad_scale=float("inf"))],
        "threads": [base(threads=0)],
        "simd": [base(simd="avx1024")],
    }


@pytest.mark.parametrize("field", list(_bad_calls()))
def test_bad_arguments_raise_naming_the_field_and_modify_nothing(field):
    for args in _bad_calls()[field]:
        before = {k: t.clone() for k, t in args.items() if isinstance(t, torch.Tensor)}
        with pytest.raises(ConfigError) as info:
            q.adam_step_8bit(**args)
        assert info.value.field == field
        for k, t in before.items():
            assert bits_equal(args[k], t), k


def test_overlapping_buffers_are_refused():
    s = make_state(256)
    with pytest.raises(ConfigError, match="overlap"):
        q.adam_step_8bit(s[0], s[0], *s[1:], step=1, weight_decay=0.0, **HP)


def test_native_refuses_a_bad_block_directly():
    ffi, lib = native.load()
    x = torch.zeros(64)
    codes = torch.zeros(64, dtype=torch.uint8)
    with pytest.raises(NativeError):
        native.blockwise_quantize_raw(map_name="signed", x=x.data_ptr(), codes=codes.data_ptr(),
                                      absmax=x.data_ptr(), block=48, n=64, threads=1)
    assert lib.off_qmap_values(5, ffi.new("float[]", 256)) < 0


# ---- the AVX-512 level's two variants (VBMI byte permutes, gathers) ---------------------

@pytest.fixture
def gathers_only():
    """The AVX-512 8-bit step through gathers, as on a CPU without VBMI; restored after."""
    before = native.adam8_vbmi()
    native.adam8_vbmi(False)
    yield
    native.adam8_vbmi(before)


@pytest.mark.skipif("avx512" not in native.simd_available(), reason="this CPU lacks avx512")
@pytest.mark.parametrize("n", [1, 17, 63, 64, 65, 255, 256, 257, 1000])
@pytest.mark.parametrize("master", MASTERS)
def test_avx512_gather_variant_equals_scalar(gathers_only, n, master):
    for grad in GRADS:
        for out in OUTS:
            state = make_state(n, master=master, seed=n, special=True)
            grads = grads_for(n, 2, grad, seed=n + 1, special=True)
            assert same_run(run(state, grads, simd="avx512", out_dtype=out),
                            run(state, grads, simd="scalar", out_dtype=out)), (grad, out)


def test_vbmi_switch_reports_and_refuses_what_the_cpu_lacks():
    has = native.adam8_vbmi()
    try:
        assert native.adam8_vbmi(False) is False
        if has:
            assert native.adam8_vbmi(True) is True
    finally:
        native.adam8_vbmi(has)


# ---- Adam's own bound on the quantised moments --------------------------------------------

@settings(max_examples=60, deadline=None)
@given(gs=st.lists(st.floats(-1e3, 1e3, allow_nan=False), min_size=1, max_size=60),
       betas=st.sampled_from([(0.9, 0.999), (0.9, 0.95), (0.8, 0.99), (0.0, 0.5), (0.5, 0.3)]))
def test_exact_adam_moments_keep_the_bound(gs, betas):
    """|m| <= K sqrt(v) holds for every history from zero (Cauchy-Schwarz): the bound the step
    holds the dequantised moments to never binds on exact moments."""
    b1, b2 = betas
    k, k2 = q.moment_bound(b1, b2)
    m = v = 0.0
    for g in gs:
        m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
        assert m * m <= k2 * v * (1 + 1e-12) + 1e-300
    assert math.isinf(q.moment_bound(0.9, 0.81)[0])      # beta1^2 >= beta2: no bound


@pytest.mark.parametrize("level", LEVELS)
def test_a_second_moment_rounded_to_zero_does_not_blow_up_the_update(level):
    """exp_avg_sq below the unsigned map's smallest value (3.25e-7 of its block's largest) reads
    back 0 while exp_avg keeps a code: the update was m / eps (the parameter moved by -42 at lr
    1e-2 on the second step, -70 on the third). Held to Adam's bound it stays an Adam step."""
    n = 256
    p = torch.zeros(n)
    m, ma = q.quantize(torch.zeros(n), True)
    v, va = q.quantize(torch.zeros(n), False)
    for step in (1, 2, 3):
        g = torch.zeros(n)
        g[0] = 1.0
        if step == 1:
            g[1] = 1e-4
        q.adam_step_8bit(p, g, m, ma, v, va, step=step, weight_decay=0.0, simd=level, **HP)
        # an exact Adam step moves a parameter by at most lr * K * sqrt(1 - b2^t) / (1 - b1^t)
        k = q.moment_bound(HP["beta1"], HP["beta2"])[0]
        assert p.abs().max() <= step * HP["lr"] * k * math.sqrt(1 - HP["beta2"] ** step) / (1 - HP["beta1"] ** step)


@pytest.mark.parametrize("level", SIMD)
@pytest.mark.parametrize("master", MASTERS)
def test_the_bound_gives_every_level_the_scalar_bits_where_it_binds(level, master):
    """Every exp_avg_sq code 0 (or tiny) under exp_avg codes across the map: the bound binds in
    most lanes, NaN and zero scales included."""
    n = 1000
    state = make_state(n, master=master, seed=3)
    state[3] = torch.randint(0, 3, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(4))
    state[4][::5] = 0.0
    state[2][1] = float("nan")
    grads = grads_for(n, 2, torch.float32, seed=5)
    got = run(state, grads, simd=level)
    assert same_run(got, run(state, grads, simd="scalar"))
    assert same_run(got, run(state, grads, reference=True))
