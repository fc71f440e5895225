"""8-bit Adam state: the native fused step over raw chunk buffers, block-wise (de)quantisation,
and a plain-torch reference of the same scheme that the tests hold the kernels to (also the
reference of the bf16-moment step, ``offload.optim.adam_step`` with bf16 state: both share the
fp32 arithmetic and the stochastic rounding).

The scheme is Dettmers et al. 2022 ("8-bit Optimizers via Block-wise Quantization", as
bitsandbytes' AdamW8bit): ``exp_avg`` as codes of the signed dynamic map, ``exp_avg_sq`` of the
unsigned one, one fp32 absmax per block of ``block_size`` elements (value = map[code] * absmax).
The maps are built inside the native library (``native.qmap_values``), the one table that
writes and reads codes. ``block_size`` defaults to 256, bitsandbytes' and torchao's choice for
optimizer state: small enough that one outlier costs only its own 256 neighbours their
resolution, large enough that the scale adds 4/256 B per moment element (1.6%), and a block's
fp32 moments (2 KiB) stay in L1 between the update and the requantisation.

A bf16 master is rounded stochastically (not Kahan-compensated): the compensation would be a
second 2-byte buffer per parameter, i.e. as many bytes as the fp32 master it replaces, while
stochastic rounding keeps the master at 2 bytes and its expectation exact, so updates below
half a bf16 ulp still accumulate. The random bits hash (seed, step, element index): the same
bits on every instruction set, thread count and chunk split.

Adam's own bound: exact moments always keep |exp_avg| <= K sqrt(exp_avg_sq), K = (1-beta1) /
sqrt((1-beta2)(1-beta1^2/beta2)) (Cauchy-Schwarz over their histories from zero). Quantised apart,
they need not: an exp_avg_sq below its map's smallest value (3.25e-7 of its block's largest) reads
back 0 under a nonzero exp_avg, and the update became m / eps (a parameter moved by tens at lr
1e-2). The step clamps the dequantised exp_avg to the bound first (``bound_moment``); exact
Adam's moments are never changed by it.

Non-finite values: a NaN or infinity in a block's updated moment (from a NaN/inf gradient)
stores a NaN scale for that block, so all of its moments read back NaN on the next step and the
poison spreads to the block rather than vanishing; that step's parameter update is NaN only where
the gradient was. Engines skip such steps before calling (loss-scale overflow checks).
"""

from __future__ import annotations

import math

import torch

from .. import native
from ..errors import ConfigError
from .kernel import (GRAD_DTYPES, check_hparams, check_int, check_seed, resolve_simd,
                     resolve_threads)

BLOCK_SIZE = 256
MAX_BLOCK_SIZE = 4096
MASTER_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16"}
OUT_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
_MASK32 = 0xFFFFFFFF


def check_block_size(block_size) -> int:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or not (
            64 <= block_size <= MAX_BLOCK_SIZE and block_size % 64 == 0):
        raise ConfigError("block_size", block_size, f"must be a multiple of 64 in [64, {MAX_BLOCK_SIZE}]")
    return block_size


def blocks(n: int, block_size: int = BLOCK_SIZE) -> int:
    """Scales a slice of ``n`` elements needs: one per block, the last one possibly short."""
    return -(-n // block_size)


def _tensor(name: str, t, dtypes, numel: int, what: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise ConfigError(name, type(t).__name__, "must be a torch.Tensor")
    if t.layout != torch.strided or t.device.type != "cpu":
        raise ConfigError(name, f"{t.layout} on {t.device}", "must be a dense CPU tensor")
    if t.dtype not in dtypes:
        raise ConfigError(name, str(t.dtype), f"dtype must be one of {', '.join(str(d) for d in dtypes)}")
    if not t.is_contiguous():
        raise ConfigError(name, f"strides {t.stride()}", "must be contiguous")
    if t.data_ptr() % t.element_size():
        raise ConfigError(name, hex(t.data_ptr()), f"must be aligned to {t.element_size()} bytes")
    if t.numel() != numel:
        raise ConfigError(name, t.numel(), f"must have {numel} elements ({what})")


def _no_overlap(written: dict, read: dict) -> None:
    spans = [(k, t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
             for k, t in [*written.items(), *read.items()] if t.numel()]
    for i, (a, a0, a1) in enumerate(spans[:len(written)]):
        for b, b0, b1 in spans[i + 1:]:
            if a0 < b1 and b0 < a1:
                raise ConfigError(b, "overlapping memory", f"must not overlap {a}")


def adam_step_8bit(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                   exp_avg_absmax: torch.Tensor, exp_avg_sq: torch.Tensor,
                   exp_avg_sq_absmax: torch.Tensor, *, lr, beta1: float, beta2: float, eps: float,
                   weight_decay: float, step: int, decoupled: bool = True, grad_scale: float = 1.0,
                   maximize: bool = False, out: torch.Tensor | None = None,
                   block_size: int = BLOCK_SIZE, seed: int = 0, index_base: int = 0,
                   threads: int | None = None, simd: str | None = None) -> None:
    """One Adam (``decoupled=False``) or AdamW step with 8-bit moments, in place, over flat
    CPU buffers of one chunk slice that starts at a block boundary.

    ``param``: the master, fp32 or bf16 (stochastic rounding seeded by ``seed``, ``step`` and
    ``index_base`` + element index; give each slice its offset in the whole state so a split
    never changes a bit). ``grad``: fp32/bf16/fp16, times ``grad_scale``. ``exp_avg`` /
    ``exp_avg_sq``: uint8 codes, ``numel`` each; ``*_absmax``: fp32, ``blocks(numel,
    block_size)`` each. ``out``: optional fp32/bf16/fp16 copy of the stored parameters.
    Hyper-parameters as ``offload.optim.adam_step``. Raises ``ConfigError`` naming the bad
    argument before anything is modified.
    """
    n = param.numel() if isinstance(param, torch.Tensor) else 0
    block_size = check_block_size(block_size)
    nb = blocks(n, block_size)
    _tensor("param", param, tuple(MASTER_DTYPES), n, "the master")
    _tensor("grad", grad, tuple(GRAD_DTYPES), n, "as many as param")
    _tensor("exp_avg", exp_avg, (torch.uint8,), n, "one code per parameter")
    _tensor("exp_avg_sq", exp_avg_sq, (torch.uint8,), n, "one code per parameter")
    for name, t in (("exp_avg_absmax", exp_avg_absmax), ("exp_avg_sq_absmax", exp_avg_sq_absmax)):
        _tensor(name, t, (torch.float32,), nb, f"one scale per block of {block_size}, the last may be short")
    if out is not None:
        _tensor("out", out, tuple(OUT_DTYPES), n, "as many as param")
    written = {"param": param, "exp_avg": exp_avg, "exp_avg_absmax": exp_avg_absmax,
               "exp_avg_sq": exp_avg_sq, "exp_avg_sq_absmax": exp_avg_sq_absmax}
    if out is not None:
        written["out"] = out
    _no_overlap(written, {"grad": grad})
    lr, beta1, beta2, eps, weight_decay = check_hparams(
        lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay)
    if isinstance(grad_scale, torch.Tensor):
        grad_scale = grad_scale.item()
    if isinstance(grad_scale, bool) or not isinstance(grad_scale, (int, float)) or not math.isfinite(grad_scale):
        raise ConfigError("grad_scale", grad_scale, "must be a finite number")
    step = check_int("step", step, 1)
    seed, index_base = check_seed(seed, index_base, n)
    nthreads = resolve_threads(threads)
    level = resolve_simd(simd)
    if n == 0:
        return
    native.adam8_step_raw(
        master=param.data_ptr(), master_dtype=MASTER_DTYPES[param.dtype], grad=grad.data_ptr(),
        grad_dtype=GRAD_DTYPES[grad.dtype], exp_avg=exp_avg.data_ptr(),
        exp_avg_absmax=exp_avg_absmax.data_ptr(), exp_avg_sq=exp_avg_sq.data_ptr(),
        exp_avg_sq_absmax=exp_avg_sq_absmax.data_ptr(), block=block_size,
        out=out.data_ptr() if out is not None else 0,
        out_dtype=OUT_DTYPES[out.dtype] if out is not None else "none", n=n, lr=lr, beta1=beta1,
        beta2=beta2, eps=eps, weight_decay=weight_decay, grad_scale=float(grad_scale), step=step,
        decoupled=decoupled, maximize=maximize, seed=seed, index_base=index_base,
        threads=nthreads, level=level)


def _map_name(signed: bool) -> str:
    return "signed" if signed else "unsigned"


def quantize(x: torch.Tensor, signed: bool, block_size: int = BLOCK_SIZE, *,
             threads: int | None = None, simd: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-wise quantise fp32 ``x`` (flattened): ``(codes uint8, absmax fp32)`` (exp_avg:
    ``signed=True``; exp_avg_sq: ``signed=False``). Loads fp32 state into 8-bit chunks."""
    block_size = check_block_size(block_size)
    if not isinstance(x, torch.Tensor):
        raise ConfigError("x", type(x).__name__, "must be a torch.Tensor")
    x = x.detach().reshape(-1).contiguous()
    _tensor("x", x, (torch.float32,), x.numel(), "fp32 values")
    codes = torch.empty(x.numel(), dtype=torch.uint8)
    absmax = torch.empty(blocks(x.numel(), block_size), dtype=torch.float32)
    nthreads, level = resolve_threads(threads), resolve_simd(simd)
    if x.numel():
        native.blockwise_quantize_raw(map_name=_map_name(signed), x=x.data_ptr(),
                                      codes=codes.data_ptr(), absmax=absmax.data_ptr(),
                                      block=block_size, n=x.numel(), threads=nthreads, level=level)
    return codes, absmax


def dequantize(codes: torch.Tensor, absmax: torch.Tensor, signed: bool,
               block_size: int = BLOCK_SIZE) -> torch.Tensor:
    """The fp32 values of block-wise ``codes`` (what ``state_dict`` hands to torch)."""
    block_size = check_block_size(block_size)
    n = codes.numel() if isinstance(codes, torch.Tensor) else 0
    _tensor("codes", codes, (torch.uint8,), n, "one code per value")
    _tensor("absmax", absmax, (torch.float32,), blocks(n, block_size), f"one per block of {block_size}")
    x = torch.empty(n, dtype=torch.float32)
    if n:
        native.blockwise_dequantize_raw(map_name=_map_name(signed), codes=codes.data_ptr(),
                                        absmax=absmax.data_ptr(), block=block_size,
                                        x=x.data_ptr(), n=n)
    return x


# ---- the reference: the scheme in plain torch, float32 op for op as adam8_scalar.c ----------

def qmap(signed: bool) -> torch.Tensor:
    return torch.tensor(native.qmap_values(_map_name(signed)), dtype=torch.float32)


def reference_quantize(x: torch.Tensor, signed: bool, block_size: int = BLOCK_SIZE):
    """``(codes, absmax)``: per block absmax = max |x| (NaN if any value is not finite, 0 below
    FLT_MIN), code = the number of map midpoints below x * (1 / absmax)."""
    values = qmap(signed)
    mid = ((values[:-1].double() + values[1:].double()) * 0.5).float()
    n = x.numel()
    nb = blocks(n, block_size)
    padded = torch.zeros(nb * block_size, dtype=torch.float32)
    padded[:n] = x.reshape(-1)
    rows = padded.view(nb, block_size)
    a = rows.abs()
    finite = a <= torch.finfo(torch.float32).max
    bad = ~finite.all(dim=1)
    absmax = torch.where(finite, a, torch.zeros(())).amax(dim=1)
    ok = absmax >= 2.0**-126
    inv = torch.where(ok, 1.0 / torch.where(ok, absmax, torch.ones(())), torch.zeros(()))
    codes = torch.bucketize(torch.where(bad[:, None], torch.zeros(()), rows * inv[:, None]), mid)
    codes[bad] = int((values == 0).nonzero()[0])
    absmax = torch.where(bad, torch.tensor(float("nan")), torch.where(ok, absmax, torch.zeros(())))
    return codes.reshape(-1)[:n].to(torch.uint8), absmax


def reference_dequantize(codes: torch.Tensor, absmax: torch.Tensor, signed: bool,
                         block_size: int = BLOCK_SIZE) -> torch.Tensor:
    scale = absmax.repeat_interleave(block_size)[:codes.numel()]
    return qmap(signed)[codes.long()] * scale


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """off__mix32 on int64 tensors holding uint32 (products split to stay below 2^63)."""
    def mul(x, c):
        return ((((x * (c >> 16)) & 0xFFFF) << 16) + x * (c & 0xFFFF)) & _MASK32
    x = x ^ (x >> 16)
    x = mul(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = mul(x, 0x846CA68B)
    return x ^ (x >> 16)


def sr_key(seed: int, step: int) -> int:
    """off__sr_key: the per-call key of the stochastic rounding."""
    def mix(v: int) -> int:
        return int(_mix32(torch.tensor([v & _MASK32]))[0])
    k = mix((seed >> 32) ^ 0x9E3779B9)
    k = mix(k ^ (seed & _MASK32))
    k = mix(k ^ ((step >> 32) & _MASK32))
    return mix(k ^ (step & _MASK32))


def sr_key_v(key: int) -> int:
    """off__sr_key_v: the key of exp_avg_sq's random bits in the bf16-moment kernel."""
    return int(_mix32(torch.tensor([(key ^ 0x5BD1E995) & _MASK32]))[0])


def reference_sr_bits(key: int, index_base: int, n: int) -> torch.Tensor:
    """off__sr_bits(key, index_base + i) for i < n, as int64 tensors holding uint32."""
    idx = torch.arange(n, dtype=torch.int64) + index_base
    return _mix32((idx & _MASK32) ^ _mix32((idx >> 32) ^ key))


def reference_round_sr(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16 rounding up with probability (dropped bits) / 2^16, from the low 16 bits of
    r; a NaN stays a quiet NaN."""
    x = x.reshape(-1)
    u = x.view(torch.int32).to(torch.int64) & _MASK32
    h = torch.where(torch.isnan(x), (u >> 16) | 0x40, (u + (r & 0xFFFF)) >> 16)
    return torch.where(h >= 0x8000, h - 0x10000, h).to(torch.int16).view(torch.bfloat16)


def reference_bf16_sr(p: torch.Tensor, key: int, index_base: int) -> torch.Tensor:
    """The master's stochastic rounding: the low 16 bits of the element's hash."""
    return reference_round_sr(p, reference_sr_bits(key, index_base, p.numel()))


def _f32(v: float) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.float32)


def moment_bound(beta1: float, beta2: float) -> tuple[float, float]:
    """``(K, K**2)`` of Adam's bound |m| <= K sqrt(v) (module doc), in double (the kernel's
    arithmetic; each is rounded to fp32 once where used); ``inf`` when beta1^2 >= beta2 (no bound)."""
    if beta2 <= beta1 * beta1:
        return math.inf, math.inf
    k = (1.0 - beta1) / math.sqrt((1.0 - beta2) * (1.0 - beta1 * beta1 / beta2))
    return k, k * k


def bound_moment(m: torch.Tensor, v: torch.Tensor, beta1: float, beta2: float) -> torch.Tensor:
    """fp32 ``m`` held to |m| <= K sqrt(v), as the native step does (``off__bound_moment``): where
    m^2 > K^2 v, copysign(K sqrt(v), m); a NaN on either side leaves m as it is."""
    k, k2 = moment_bound(beta1, beta2)
    over = m * m > _f32(k2) * v
    if not bool(over.any()):
        return m
    root = torch.sqrt(v.double()).float()     # correctly rounded, as the kernel's (reference_update)
    return torch.where(over, torch.copysign(_f32(k) * root, m), m)


def reference_update(p, g, m, v, *, lr, beta1, beta2, eps, weight_decay, step, decoupled,
                     grad_scale, maximize):
    """The fp32 arithmetic both compressed-state kernels share, op for op: ``(p, m, v)``."""
    g = g.float() * _f32(-grad_scale if maximize else grad_scale)
    p = p.float()
    if weight_decay != 0.0 and decoupled:
        p = p - _f32(lr * weight_decay) * p
    elif weight_decay != 0.0:
        g = g + _f32(weight_decay) * p
    m = m + _f32(1.0 - beta1) * (g - m)
    # an exp_avg_sq at +inf (g^2 overflowed) stays +inf, as torch's beta2 * v + ... keeps it
    v = torch.where(v == math.inf, v + g * g, v + _f32(1.0 - beta2) * (g * g - v))
    # the denominator's bias correction folded into two constants, as the kernels do
    bc2_sqrt = math.sqrt(1.0 - beta2 ** float(step))
    step_bc2 = lr / (1.0 - beta1 ** float(step)) * bc2_sqrt
    # sqrt in double, rounded once: torch's float32 sqrt (Sleef, 0.5001 ulp) is not always the
    # correctly rounded one IEEE (and the kernel) give; double then float is (53 >= 2*24 + 2)
    denom = torch.sqrt(v.double()).float() + _f32(eps * bc2_sqrt)
    return p - (_f32(step_bc2) * m) / denom, m, v


def _stored(p, master_dtype, out_dtype, r):
    """The master as stored (bf16: stochastically rounded with r) and the out copy."""
    if master_dtype == torch.bfloat16:
        master = reference_round_sr(p, r)
        p = master.float()
    else:
        master = p
    out = None
    if out_dtype is not None:
        out = master if out_dtype == master_dtype else p.to(out_dtype)
    return master, out


def reference_adam_step_8bit(param, grad, exp_avg, exp_avg_absmax, exp_avg_sq, exp_avg_sq_absmax, *,
                             lr, beta1, beta2, eps, weight_decay, step, decoupled=True,
                             grad_scale=1.0, maximize=False, out_dtype=None,
                             block_size=BLOCK_SIZE, seed=0, index_base=0):
    """The step of ``adam_step_8bit`` in torch, returning new tensors ``(param, exp_avg,
    exp_avg_absmax, exp_avg_sq, exp_avg_sq_absmax, out)``; the constants are derived in double
    and rounded once, as the kernel does."""
    m = reference_dequantize(exp_avg, exp_avg_absmax, True, block_size)
    v = reference_dequantize(exp_avg_sq, exp_avg_sq_absmax, False, block_size)
    m = bound_moment(m, v, beta1, beta2)
    p, m, v = reference_update(param, grad, m, v, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                               weight_decay=weight_decay, step=step, decoupled=decoupled,
                               grad_scale=grad_scale, maximize=maximize)
    r = reference_sr_bits(sr_key(seed, step), index_base, p.numel())
    master, out = _stored(p, param.dtype, out_dtype, r)
    mc, ma = reference_quantize(m, True, block_size)
    vc, va = reference_quantize(v, False, block_size)
    return master, mc, ma, vc, va, out


def reference_adam_step_bf16(param, grad, exp_avg, exp_avg_sq, *, lr, beta1, beta2, eps,
                             weight_decay, step, decoupled=True, grad_scale=1.0, maximize=False,
                             out_dtype=None, seed=0, index_base=0):
    """The step of ``offload.optim.adam_step`` with bf16 moments and/or a bf16 master, in torch:
    new tensors ``(param, exp_avg, exp_avg_sq, out)``. Every bf16 is stored by stochastic
    rounding: the master with the low 16 bits of the element's hash (as the 8-bit kernel's),
    exp_avg with its high 16 bits, exp_avg_sq with a second hash's low 16 bits."""
    p, m, v = reference_update(param, grad, exp_avg.float(), exp_avg_sq.float(), lr=lr,
                               beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                               step=step, decoupled=decoupled, grad_scale=grad_scale,
                               maximize=maximize)
    key = sr_key(seed, step)
    r = reference_sr_bits(key, index_base, p.numel())
    if exp_avg.dtype == torch.bfloat16:
        m = reference_round_sr(m, r >> 16)
        v = reference_round_sr(v, reference_sr_bits(sr_key_v(key), index_base, p.numel()))
    master, out = _stored(p, param.dtype, out_dtype, r)
    return master, m, v, out
