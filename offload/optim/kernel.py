"""The low-level CPU Adam call over raw chunk buffers, as the engine uses it.

Every argument is checked before the native call, so a bad one raises ``ConfigError`` (a
``ValueError``) naming it and nothing is modified. The update itself runs in native SIMD code
(``native/adam*.c``) with the GIL released; every instruction set and every thread count give
the same bits.
"""

from __future__ import annotations

import math

import torch

from .. import native
from ..errors import ConfigError

GRAD_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
OUT_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16"}
# bf16 state (moments and/or master) runs the 16-bit kernel, which may also write an fp32 copy
STATE_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16"}
OUT_DTYPES_16 = {torch.float32: "fp32", **OUT_DTYPES}


def _scalar(name: str, value) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ConfigError(name, tuple(value.shape), "must be a number or a one-element tensor")
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(name, value, "must be a number")
    return float(value)


def check_hparams(*, lr, beta1, beta2, eps, weight_decay) -> tuple[float, float, float, float, float]:
    """Validate Adam's scalars (the optimizers share this); return them as floats."""
    lr = _scalar("lr", lr)
    beta1 = _scalar("beta1", beta1)
    beta2 = _scalar("beta2", beta2)
    eps = _scalar("eps", eps)
    weight_decay = _scalar("weight_decay", weight_decay)
    if not (math.isfinite(lr) and lr >= 0.0):
        raise ConfigError("lr", lr, "must be a finite number >= 0")
    for name, beta in (("beta1", beta1), ("beta2", beta2)):
        if not 0.0 <= beta < 1.0:
            raise ConfigError(name, beta, "must be in [0, 1)")
    if not (math.isfinite(eps) and eps > 0.0):
        raise ConfigError("eps", eps, "must be a finite number > 0")
    if not (math.isfinite(weight_decay) and weight_decay >= 0.0):
        raise ConfigError("weight_decay", weight_decay, "must be a finite number >= 0")
    return lr, beta1, beta2, eps, weight_decay


def check_int(name: str, value, low: int) -> int:
    """An integer >= ``low`` (a one-element tensor or an integral float accepted)."""
    if isinstance(value, torch.Tensor):
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value) or value < low:
        raise ConfigError(name, value, f"must be an integer >= {low}")
    return int(value)


def check_seed(seed, index_base, n: int) -> tuple[int, int]:
    """The stochastic rounding's seed (64 bits) and the slice's element offset."""
    seed = check_int("seed", seed, 0)
    if seed > 2**64 - 1:
        raise ConfigError("seed", seed, "must fit in 64 bits")
    index_base = check_int("index_base", index_base, 0)
    if index_base + n > 2**63 - 1:
        raise ConfigError("index_base", index_base, f"index_base + numel ({n}) must stay below 2^63")
    return seed, index_base


def resolve_threads(threads) -> int:
    """``None`` -> 0 (the native default: physical cores); otherwise an int >= 1."""
    if threads is None:
        return 0
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ConfigError("threads", threads, "must be None (physical cores) or an int >= 1")
    return threads


def resolve_simd(simd) -> str | None:
    """``None`` -> the level in use; a name must be one this CPU runs."""
    if simd is None:
        return None
    native.check_simd_name(simd, "simd", native.simd_available())
    return simd


def _buffer(name: str, t, dtypes) -> None:
    if not isinstance(t, torch.Tensor):
        raise ConfigError(name, type(t).__name__, "must be a torch.Tensor")
    if t.layout != torch.strided:
        raise ConfigError(name, str(t.layout), "must be a dense (strided) tensor, not sparse")
    if t.device.type != "cpu":
        raise ConfigError(name, str(t.device), "must be a CPU tensor")
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d) for d in dtypes)
        raise ConfigError(name, str(t.dtype), f"dtype must be one of {allowed}")
    if not t.is_contiguous():
        raise ConfigError(name, f"strides {t.stride()}", "must be contiguous")
    if t.data_ptr() % t.element_size():
        raise ConfigError(name, hex(t.data_ptr()), f"must be aligned to {t.element_size()} bytes")


def _span(t: torch.Tensor) -> tuple[int, int]:
    start = t.data_ptr()
    return start, start + t.numel() * t.element_size()


def adam_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
              exp_avg_sq: torch.Tensor, *, lr, beta1: float, beta2: float, eps: float,
              weight_decay: float, step: int, decoupled: bool = True, grad_scale: float = 1.0,
              maximize: bool = False, out: torch.Tensor | None = None, threads: int | None = None,
              simd: str | None = None, seed: int = 0, index_base: int = 0) -> None:
    """One Adam (``decoupled=False``) or AdamW step, in place, over flat CPU buffers.

    ``param`` (the master): fp32 or bf16. ``exp_avg``, ``exp_avg_sq``: both fp32 or both bf16
    (``numel`` elements each). ``grad``: fp32, bf16 or fp16, multiplied by ``grad_scale``
    (1/loss scale x clip coefficient) before use. ``step``: the step being taken (>= 1; bias
    correction). ``out``: optional buffer that receives the updated parameters in the same pass
    (bf16/fp16, rounded to nearest even; fp32 too when any state is bf16). ``threads``: worker
    threads (None: physical cores). ``simd``: force an instruction set (tests and benchmarks).
    Raises ``ConfigError`` naming the bad argument, before anything is modified.

    All-fp32 state is exact torch AdamW arithmetic. Any bf16 state runs the 16-bit kernel
    (``native/adam16*.c``): fp32 arithmetic (as the 8-bit kernel's: one division per element),
    every bf16 stored by stochastic rounding with bits hashed from ``seed``, ``step`` and
    ``index_base`` + element index (give each slice its offset in the whole state so a split
    never changes a bit; a bf16 master gets the bits the 8-bit kernel gives it).
    """
    _buffer("param", param, tuple(STATE_DTYPES))
    _buffer("grad", grad, tuple(GRAD_DTYPES))
    _buffer("exp_avg", exp_avg, tuple(STATE_DTYPES))
    _buffer("exp_avg_sq", exp_avg_sq, (exp_avg.dtype,))
    compressed = param.dtype != torch.float32 or exp_avg.dtype != torch.float32
    if out is not None:
        _buffer("out", out, tuple(OUT_DTYPES_16 if compressed else OUT_DTYPES))
    n = param.numel()
    named = {"grad": grad, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    if out is not None:
        named["out"] = out
    for name, t in named.items():
        if t.numel() != n:
            raise ConfigError(name, t.numel(), f"must have as many elements as param ({n})")
    written = {"param": param, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    if out is not None:
        written["out"] = out
    if n:
        spans = [(name, _span(t)) for name, t in written.items()] + [("grad", _span(grad))]
        for i, (a, (a0, a1)) in enumerate(spans):
            for b, (b0, b1) in spans[i + 1:]:
                if a0 < b1 and b0 < a1:
                    raise ConfigError(b, "overlapping memory", f"must not overlap {a}")
    lr, beta1, beta2, eps, weight_decay = check_hparams(
        lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay)
    grad_scale = _scalar("grad_scale", grad_scale)
    if not math.isfinite(grad_scale):
        raise ConfigError("grad_scale", grad_scale, "must be finite")
    if isinstance(step, torch.Tensor):
        step = step.item()
    if isinstance(step, bool) or not isinstance(step, (int, float)) or step != int(step) or step < 1:
        raise ConfigError("step", step, "must be an integer >= 1 (the step being taken)")
    seed, index_base = check_seed(seed, index_base, n)
    nthreads = resolve_threads(threads)
    level = resolve_simd(simd)
    if n == 0:
        return
    hp = dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
              grad_scale=grad_scale, step=int(step), decoupled=decoupled, maximize=maximize,
              threads=nthreads, level=level)
    if compressed:
        native.adam16_step_raw(
            master=param.data_ptr(), master_dtype=STATE_DTYPES[param.dtype], grad=grad.data_ptr(),
            grad_dtype=GRAD_DTYPES[grad.dtype], exp_avg=exp_avg.data_ptr(),
            exp_avg_sq=exp_avg_sq.data_ptr(), moment_dtype=STATE_DTYPES[exp_avg.dtype],
            out=out.data_ptr() if out is not None else 0,
            out_dtype=OUT_DTYPES_16[out.dtype] if out is not None else "none", n=n, seed=seed,
            index_base=index_base, **hp)
        return
    native.adam_step_raw(
        param=param.data_ptr(), grad=grad.data_ptr(), grad_dtype=GRAD_DTYPES[grad.dtype],
        exp_avg=exp_avg.data_ptr(), exp_avg_sq=exp_avg_sq.data_ptr(),
        out=out.data_ptr() if out is not None else 0,
        out_dtype=OUT_DTYPES[out.dtype] if out is not None else "none", n=n, **hp)
