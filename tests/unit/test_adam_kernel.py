"""The native CPU Adam kernel through ``offload.optim.adam_step``: every SIMD level against
the scalar reference (bits) and against torch's AdamW/Adam in float64, the fused bf16/fp16
copy against ``.to(dtype)``, thread-count independence, and argument checking."""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from offload import native
from offload.errors import ConfigError
from offload.optim import adam_step
from tests.helpers.processes import python_env

LEVELS = [pytest.param(level, marks=pytest.mark.skipif(
    level not in native.simd_available(), reason=f"this CPU lacks {level}"))
    for level in native.SIMD_LEVELS]
SIZES = [0, 1, 7, 8, 9, 15, 16, 17, 63, 64, 65]
GRAD_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
OUT_DTYPES = [None, torch.bfloat16, torch.float16]
HP = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8)


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance in units in the last place between two fp32 tensors (NaN == NaN)."""
    def ordered(t):
        i = t.contiguous().view(torch.int32).to(torch.int64)
        return torch.where(i < 0, -(i & 0x7FFFFFFF), i)
    both_nan = torch.isnan(a) & torch.isnan(b)
    d = (ordered(a) - ordered(b)).abs()
    d[both_nan] = 0
    return int(d.max()) if d.numel() else 0


def make(n: int, grad_dtype=torch.float32, seed=0, out_dtype=None):
    g = torch.Generator().manual_seed(seed)
    param = torch.randn(n, generator=g)
    exp_avg = torch.randn(n, generator=g) * 1e-2
    exp_avg_sq = torch.rand(n, generator=g) * 1e-3
    grad = torch.randn(n, generator=g).to(grad_dtype)
    out = None if out_dtype is None else torch.zeros(n, dtype=out_dtype)
    return param, grad, exp_avg, exp_avg_sq, out


def grads_for(n: int, steps: int, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g).to(dtype) for _ in range(steps)]


def run_ours(param, grads, *, simd=None, threads=1, decoupled=True, weight_decay=0.0,
             grad_scale=1.0, lr_at=lambda t: HP["lr"], out_dtype=None, maximize=False):
    p = param.clone()
    m = torch.zeros_like(p)
    v = torch.zeros_like(p)
    out = None if out_dtype is None else torch.empty(p.numel(), dtype=out_dtype)
    for t, g in enumerate(grads, start=1):
        adam_step(p, g, m, v, lr=lr_at(t), beta1=HP["beta1"], beta2=HP["beta2"], eps=HP["eps"],
                  weight_decay=weight_decay, step=t, decoupled=decoupled, grad_scale=grad_scale,
                  maximize=maximize, out=out, threads=threads, simd=simd)
    return p, m, v, out


def run_torch64(param, grads, *, decoupled=True, weight_decay=0.0, grad_scale=1.0,
                lr_at=lambda t: HP["lr"], maximize=False):
    p = torch.nn.Parameter(param.double())
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    opt = cls([p], lr=lr_at(1), betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"],
              weight_decay=weight_decay, maximize=maximize, foreach=False)
    for t, g in enumerate(grads, start=1):
        opt.param_groups[0]["lr"] = lr_at(t)
        p.grad = g.double() * grad_scale
        opt.step()
    st_ = opt.state[p]
    return p.detach(), st_["exp_avg"], st_["exp_avg_sq"]


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """Normwise relative error ||ours - ref|| / ||ref|| (2-norm)."""
    scale = ref.norm().item()
    return (ours.double() - ref).norm().item() / scale if scale else 0.0


def max_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return (ours.double() - ref).abs().max().item()


def run_torch32(param, grads, *, decoupled=True, weight_decay=0.0, lr_at=lambda t: HP["lr"]):
    p = torch.nn.Parameter(param.clone())
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    opt = cls([p], lr=lr_at(1), betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"],
              weight_decay=weight_decay)
    for t, g in enumerate(grads, start=1):
        opt.param_groups[0]["lr"] = lr_at(t)
        p.grad = g.float()
        opt.step()
    return p.detach(), opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"]


def cosine(t: int) -> float:
    return 1e-2 * 0.5 * (1 + math.cos(math.pi * t / 100))


# ---- against torch in float64 ---------------------------------------------------------

@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES)
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam"])
def test_matches_torch_float64_after_100_steps(level, grad_dtype, weight_decay, decoupled):
    n = 257
    param = torch.randn(n, generator=torch.Generator().manual_seed(3))
    grads = grads_for(n, 100, grad_dtype)
    p, m, v, _ = run_ours(param, grads, simd=level, decoupled=decoupled,
                          weight_decay=weight_decay, lr_at=cosine)
    rp, rm, rv = run_torch64(param, grads, decoupled=decoupled, weight_decay=weight_decay,
                             lr_at=cosine)
    assert rel_err(p, rp) < 1e-6
    assert rel_err(m, rm) < 1e-6
    assert rel_err(v, rv) < 1e-6
    # elementwise, no further from float64 than torch's own fp32 AdamW/Adam (plus 2 ulp of
    # the largest value: both round every step, the rounding errors differ element by element)
    tp, tm, tv = run_torch32(param, grads, decoupled=decoupled, weight_decay=weight_decay,
                             lr_at=cosine)
    for ours, theirs, ref in ((p, tp, rp), (m, tm, rm), (v, tv, rv)):
        slack = 2 * torch.finfo(torch.float32).eps * ref.abs().max().item()
        assert max_err(ours, ref) <= max_err(theirs, ref) + slack


@pytest.mark.parametrize("level", LEVELS)
def test_grad_scale_and_maximize_match_torch(level):
    n = 100
    param = torch.randn(n, generator=torch.Generator().manual_seed(4))
    grads = grads_for(n, 30, torch.float32)
    for maximize in (False, True):
        p, m, v, _ = run_ours(param, grads, simd=level, weight_decay=0.01, grad_scale=0.125,
                              maximize=maximize)
        rp, rm, rv = run_torch64(param, grads, weight_decay=0.01, grad_scale=0.125,
                                 maximize=maximize)
        assert rel_err(p, rp) < 1e-6 and rel_err(m, rm) < 1e-6 and rel_err(v, rv) < 1e-6


# ---- every level against the scalar reference -------------------------------------------

def _check_against_scalar(level, n, grad_dtype, out_dtype, decoupled, weight_decay, offset=0,
                          steps=10):
    # an element offset makes the buffers start unaligned to the vector width
    param = torch.randn(n + offset, generator=torch.Generator().manual_seed(n))[offset:]
    grads = [g[offset:] for g in grads_for(n + offset, steps, grad_dtype, seed=n + 1)]
    ref = run_ours(param, grads, simd="scalar", decoupled=decoupled, weight_decay=weight_decay,
                   out_dtype=out_dtype, lr_at=cosine)
    got = run_ours(param, grads, simd=level, decoupled=decoupled, weight_decay=weight_decay,
                   out_dtype=out_dtype, lr_at=cosine)
    for a, b in zip(got[:3], ref[:3]):
        assert ulp_distance(a, b) <= 2
    if out_dtype is not None:
        assert torch.equal(got[3].view(torch.int16), ref[3].view(torch.int16))


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES)
def test_level_matches_scalar_at_edge_sizes(level, n, grad_dtype):
    for out_dtype in OUT_DTYPES:
        for decoupled, wd in ((True, 0.0), (True, 0.1), (False, 0.1)):
            _check_against_scalar(level, n, grad_dtype, out_dtype, decoupled, wd, steps=3)


@pytest.mark.parametrize("level", [p for p in LEVELS if p.values[0] != "scalar"])
@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, 300), offset=st.integers(0, 17), grad=st.sampled_from(GRAD_DTYPES),
       out=st.sampled_from(OUT_DTYPES), decoupled=st.booleans(), wd=st.sampled_from([0.0, 0.05]))
def test_level_matches_scalar_hypothesis(level, n, offset, grad, out, decoupled, wd):
    _check_against_scalar(level, n, grad, out, decoupled, wd, offset=offset, steps=4)


# ---- the fused low-precision copy -------------------------------------------------------

def _edge_values() -> torch.Tensor:
    bits = [0x00000000, 0x80000000, 0x7F800000, 0xFF800000,     # zeros, infinities
            0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFBFFFFF, 0x7FA00000,  # NaNs, payloads
            0x00000001, 0x807FFFFF, 0x00800000,                 # fp32 subnormals, min normal
            0x3F808000, 0x3F818000, 0x3F807FFF, 0x3F808001,     # bf16 ties (even/odd) and near
            0x7F7F8000, 0x7F7FFFFF, 0xFF7F8000,                 # bf16 overflow by rounding
            0x477FE000, 0x477FEFFF, 0x477FF000, 0x47800000,     # fp16 max, tie to inf, inf
            0x38800000, 0x387FE000, 0x33000000, 0x33000001,     # fp16 min normal, subnormals
            0x33800000, 0x33C00000, 0x34400000, 0x3A001000,     # fp16 subnormal ties
            0x3F801000, 0x3F803000, 0x3F800FFF, 0xBF803000]     # fp16 ties near 1
    rng = np.random.default_rng(0)
    random_bits = rng.integers(0, 2**32, size=5000, dtype=np.uint64).astype(np.uint32)
    # values in fp16's range with random low bits hit its rounding cases often
    near = (rng.integers(0x33000000, 0x47800000, size=5000, dtype=np.uint64)).astype(np.uint32)
    arr = np.concatenate([np.array(bits, dtype=np.uint32), random_bits, near])
    return torch.from_numpy(arr.view(np.float32).copy())


def _same_low_precision(got: torch.Tensor, want: torch.Tensor) -> None:
    nan_got, nan_want = torch.isnan(got), torch.isnan(want)
    assert torch.equal(nan_got, nan_want)
    # NaN encodings differ even inside torch (vector vs scalar paths); NaN-ness is the contract
    assert torch.equal(got.view(torch.int16)[~nan_got], want.view(torch.int16)[~nan_want])


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_fused_copy_equals_to_dtype_on_edge_values(level, out_dtype):
    # lr = 0 and no decay leave every parameter as it was (p - 0), so out = convert(p)
    values = _edge_values()
    p = values.clone()
    g = torch.zeros_like(p)
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    out = torch.empty(p.numel(), dtype=out_dtype)
    adam_step(p, g, m, v, lr=0.0, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1,
              out=out, simd=level)
    assert torch.equal(p.view(torch.int32)[~torch.isnan(values)],
                       values.view(torch.int32)[~torch.isnan(values)])
    _same_low_precision(out, values.to(out_dtype))


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES)
def test_fused_copy_equals_master_after_training(level, out_dtype, grad_dtype):
    n = 1000
    param = torch.randn(n, generator=torch.Generator().manual_seed(5))
    p, _, _, out = run_ours(param, grads_for(n, 20, grad_dtype), simd=level, weight_decay=0.01,
                            out_dtype=out_dtype)
    assert torch.equal(out.view(torch.int16), p.to(out_dtype).view(torch.int16))


# ---- threads ----------------------------------------------------------------------------

@pytest.mark.parametrize("level", LEVELS)
def test_thread_count_never_changes_a_bit(level):
    n = 300_001  # large enough that every thread count below gets work of its own
    param = torch.randn(n, generator=torch.Generator().manual_seed(6))
    grads = grads_for(n, 3, torch.bfloat16)
    ref = run_ours(param, grads, simd=level, threads=1, weight_decay=0.01, out_dtype=torch.float16)
    for threads in (2, 3, 7):
        got = run_ours(param, grads, simd=level, threads=threads, weight_decay=0.01,
                       out_dtype=torch.float16)
        for a, b in zip(got, ref):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_default_threads_is_physical_cores():
    _, lib = native.load()
    assert lib.off_default_threads() == native.physical_cores()


# ---- bad input raises and modifies nothing ----------------------------------------------

def _bad_calls():
    def base(**over):
        p, g, m, v, out = make(33, out_dtype=torch.bfloat16)
        args = dict(param=p, grad=g, exp_avg=m, exp_avg_sq=v, out=out, lr=1e-3, beta1=0.9,
                    beta2=0.999, eps=1e-8, weight_decay=0.0, step=1)
        args.update(over)
        return args
    p, g, m, v, out = make(33)
    wide = torch.randn(33, 2)
    mis = torch.frombuffer(bytearray(33 * 4 + 1), dtype=torch.float32, offset=1, count=33)
    return {
        "param": [base(param=wide[:, 0]), base(param=p.double()), base(param=mis),
                  base(param=torch.empty(33, device="meta")), base(param=[1.0] * 33)],
        "grad": [base(grad=g[:32]), base(grad=g.double()), base(grad=g.to_sparse()),
                 base(grad=wide[:, 1])],
        "exp_avg": [base(exp_avg=m[:30]), base(exp_avg=m.half())],
        "exp_avg_sq": [base(exp_avg_sq=torch.zeros(34))],
        "out": [base(out=torch.zeros(33)), base(out=torch.zeros(32, dtype=torch.bfloat16))],
        "lr": [base(lr=-1e-3), base(lr=float("nan")), base(lr=torch.tensor([1.0, 2.0]))],
        "beta1": [base(beta1=1.0), base(beta1=-0.1)],
        "beta2": [base(beta2=1.5)],
        "eps": [base(eps=0.0), base(eps=-1.0)],
        "weight_decay": [base(weight_decay=-0.1)],
        "step": [base(step=0), base(step=1.5)],
        "grad_scale": [base(grad_scale=float("inf"))],
        "threads": [base(threads=0), base(threads=-2)],
        "simd": [base(simd="avx1024")],
    }


@pytest.mark.parametrize("field", list(_bad_calls()))
def test_bad_arguments_raise_and_modify_nothing(field):
    for args in _bad_calls()[field]:
        tensors = {k: t.clone() for k, t in args.items()
                   if isinstance(t, torch.Tensor) and t.device.type == "cpu" and not t.is_sparse}
        param, grad, m, v = args.pop("param"), args.pop("grad"), args.pop("exp_avg"), args.pop("exp_avg_sq")
        with pytest.raises(ConfigError) as info:
            adam_step(param, grad, m, v, **args)
        assert info.value.field == field
        assert isinstance(info.value, ValueError)
        for name, before in tensors.items():
            now = {"param": param, "grad": grad, "exp_avg": m, "exp_avg_sq": v}.get(name, args.get(name))
            assert torch.equal(now, before), name


def test_overlapping_buffers_are_refused():
    p, g, m, v, _ = make(64)
    with pytest.raises(ConfigError, match="overlap"):
        adam_step(p, g, p, v, step=1, weight_decay=0.0, **HP)


def test_native_refuses_bad_arguments_directly():
    ffi, lib = native.load()
    hp = ffi.new("off_adam_hparams *", {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8,
                                        "weight_decay": 0.0, "grad_scale": 1.0, "step": 1})
    buf = ffi.new("float[]", 8)
    import errno
    assert lib.off_adam_step_level(7, hp, buf, buf, 1, buf, buf, ffi.NULL, 0, 8, 1) == -errno.EINVAL
    assert lib.off_adam_step(hp, buf, buf, 9, buf, buf, ffi.NULL, 0, 8, 1) == -errno.EINVAL
    assert lib.off_adam_step(hp, ffi.NULL, buf, 1, buf, buf, ffi.NULL, 0, 8, 1) == -errno.EINVAL
    hp.step = 0
    assert lib.off_adam_step(hp, buf, buf, 1, buf, buf, ffi.NULL, 0, 8, 1) == -errno.EINVAL


# ---- OFFLOAD_SIMD ----------------------------------------------------------------------

def _simd_in_subprocess(value: str) -> subprocess.CompletedProcess:
    code = ("from offload import native\n"
            "from offload.errors import ConfigError\n"
            "try:\n    print(native.simd_level())\n"
            "except ConfigError as e:\n    print('ConfigError', e.field)\n")
    return subprocess.run([sys.executable, "-c", code], env=python_env(OFFLOAD_SIMD=value), capture_output=True, text=True,
                          timeout=60)


@pytest.mark.slow
def test_offload_simd_lowers_the_level():
    done = _simd_in_subprocess("scalar")
    assert done.stdout.strip() == "scalar", done.stderr


@pytest.mark.slow
@pytest.mark.parametrize("value", ["avx1024", "avx512"])
def test_offload_simd_above_supported_is_an_error(value):
    if value in native.simd_available():
        pytest.skip(f"this CPU runs {value}")
    done = _simd_in_subprocess(value)
    assert done.stdout.strip() == "ConfigError OFFLOAD_SIMD", done.stderr


def test_simd_above_supported_per_call_is_an_error(monkeypatch):
    monkeypatch.setattr(native, "simd_available", lambda: ["scalar"])
    p, g, m, v, _ = make(8)
    with pytest.raises(ConfigError) as info:
        adam_step(p, g, m, v, step=1, weight_decay=0.0, simd="avx2", **HP)
    assert info.value.field == "simd"


# ---- the benchmark's JSON (a smoke test of its shape, not a timing) ---------------------

def test_bench_measure_returns_the_documented_schema():
    from offload.bench.adam import measure, parse_count

    assert parse_count("200M") == 200_000_000 and parse_count("1.5k") == 1500
    report = measure(params=50_000, threads=2, grad_dtype="bf16", out_dtype="bf16", repeats=1,
                     levels=["scalar"])
    assert {"params", "threads", "simd", "grad_dtype", "out_dtype", "bytes_per_param", "results",
            "roofline_fraction"} <= report.keys()
    assert report["bytes_per_param"] == 28 and report["simd"] == "scalar"
    for side in ("offload", "torch_foreach", "roofline"):
        assert report["results"][side]["params_per_s"] > 0
        assert report["results"][side]["gbps"] > 0
    with pytest.raises(ConfigError):
        measure(params="lots")


@pytest.mark.parametrize("d_dtype,e_dtype", [("fp32", "none"), ("bf16", "bf16"), ("fp16", "fp16")])
def test_roofline_probe_same_at_every_level_and_checks_arguments(d_dtype, e_dtype):
    n = 1000
    d = torch.randn(n).to(DTYPE := {"fp32": torch.float32, "bf16": torch.bfloat16,
                                    "fp16": torch.float16}[d_dtype])
    results = []
    for level in native.simd_available():
        a, b, c = torch.ones(n), torch.zeros(n), torch.zeros(n)
        e = torch.zeros(n, dtype=torch.float16 if e_dtype == "fp16" else torch.bfloat16)
        native.stream_probe_raw(a=a.data_ptr(), b=b.data_ptr(), c=c.data_ptr(), d=d.data_ptr(),
                                d_dtype=d_dtype, e=e.data_ptr(), e_dtype=e_dtype, n=n, threads=2,
                                level=level)
        results.append((a, b, c, e))
        assert torch.equal(b, d.float()) and bool((c >= 0).all())
    for other in results[1:]:
        for x, y in zip(other, results[0]):
            assert torch.equal(x, y)
    ffi, lib = native.load()
    import errno
    buf = ffi.new("float[]", 8)
    assert lib.off_stream_probe(buf, buf, buf, buf, 9, ffi.NULL, 0, 8, 1) == -errno.EINVAL
