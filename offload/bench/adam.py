"""``offload bench adam``: CPU Adam parameters/s against torch and the memory roofline.

One run, side by side, over the same preallocated and warmed buffers: ours at each SIMD level
the CPU runs, ``torch.optim.AdamW(foreach=True)``, ``torch.optim.AdamW(fused=True)`` where the
build has it, and the roofline — a native loop with Adam's streams, bytes and dtype conversions per parameter
(fp32 param/exp_avg/exp_avg_sq read and written, the gradient read, the low-precision copy
written) and next to no arithmetic, prefetched like our kernels. Each repeat times every side once, in a rotating order
(the memory bus drifts over minutes); rates are medians over repeats, and the ratios
(``roofline_fraction``, ``speedup_vs_torch_fused``) are medians of the per-repeat ratios.

With ``state="8bit"`` (``--state 8bit``, optionally ``--master bf16``) ours is the block-wise
8-bit kernel (``offload.optim.quantized``) and its ``gbps`` counts its own bytes: the gradient,
the master (4 or 2 B) and both 1-byte moments read and written, the out copy, and the two
absmax scales per block read and written. With ``state="bf16"`` or ``master="bf16"`` ours is
the 16-bit-state kernel (``adam_step`` on bf16 buffers; stochastic rounding), counting 2 B per
bf16 moment or master element read and written. ``roofline_fraction`` is then its GB/s over the
roofline loop's GB/s (the memory bandwidth measured with Adam's stream mix), and the fp32
kernel runs beside it on the roofline's buffers (``speedup_vs_fp32_kernel``, in parameters/s).
The torch sides are not timed for 8-bit state (a different algorithm).

The torch sides do what a torch user must for the same result: with bf16/fp16 gradients they
first copy them into an fp32 ``.grad``, and with an out dtype they copy the updated parameters
into a preallocated bf16/fp16 tensor after the step. ``gbps`` is the useful traffic
(``bytes_per_param`` x params/s) for every side, so sides compare directly.
"""

from __future__ import annotations

import re
import statistics
import time

import torch

from .. import native
from ..errors import ConfigError, OffloadError
from ..optim.kernel import adam_step
from ..optim.quantized import BLOCK_SIZE, adam_step_8bit, blocks
from .common import write_json

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_COUNT_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([kKmMgGbB]?)\s*$")
_COUNT_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "b": 10**9}
HPARAMS = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)


class MemoryShortError(OffloadError, MemoryError):
    """The benchmark's buffers would not fit in the memory available now."""


def parse_count(value, field: str = "params") -> int:
    """A parameter count: an int or ``"200M"``, ``"1.5G"``, ``"30k"`` (decimal units)."""
    if isinstance(value, int) and not isinstance(value, bool):
        count = value
    else:
        m = _COUNT_RE.match(str(value))
        if not m:
            raise ConfigError(field, value, "expected a count such as 200000000, '200M' or '1.5G'")
        count = int(float(m.group(1)) * _COUNT_UNITS[m.group(2).lower()])
    if count < 1:
        raise ConfigError(field, value, "must be at least 1")
    return count


def bytes_per_param(grad_dtype: str, out_dtype: str, state: str = "fp32",
                    master: str = "fp32") -> float:
    """Bytes Adam must move per parameter: the master and both moments read and written, grad
    read, out written. A moment element is 4 B (fp32), 2 B (bf16), or 1 B plus its share of one
    fp32 scale per block of 256 (8-bit: 4/256 B)."""
    grad = DTYPES[grad_dtype].itemsize
    out = 0 if out_dtype == "none" else DTYPES[out_dtype].itemsize
    moment = 1 + 4 / BLOCK_SIZE if state == "8bit" else DTYPES[state].itemsize
    return 2 * DTYPES[master].itemsize + 2 * 2 * moment + grad + out


def bytes_needed(params: int, grad_dtype: str, out_dtype: str, with_torch: bool = True,
                 state: str = "fp32", master: str = "fp32") -> int:
    """Memory the run allocates: the shared buffers plus torch's fp32 grad copy and the
    temporaries torch's foreach step allocates (about two parameter-sized fp32 tensors); for
    8-bit state, its own master and codes beside the roofline's fp32 buffers."""
    own = 12 + DTYPES[grad_dtype].itemsize + (0 if out_dtype == "none" else 2)
    extra = 0
    if state == "8bit":
        extra += DTYPES[master].itemsize + 2 + 1
    elif state == "bf16" or master == "bf16":
        extra += DTYPES[master].itemsize + 2 * DTYPES[state].itemsize
    elif with_torch:
        extra += 0 if grad_dtype == "fp32" else 4
        extra += 8
    return params * (own + extra)


def _check_memory(need: int) -> None:
    import psutil

    available = psutil.virtual_memory().available
    if need > 0.85 * available:
        raise MemoryShortError(
            f"the benchmark needs about {need / 1e9:.1f} GB but only {available / 1e9:.1f} GB "
            f"is available now (using at most 85% of it); pass a smaller --params")


def _median_rate(times: list[float], params: int) -> float:
    return params / statistics.median(times)


def measure(params: int = 200_000_000, threads: int | None = None, grad_dtype: str = "fp32",
            out_dtype: str = "none", repeats: int = 5, levels: list[str] | None = None,
            with_torch: bool = True, state: str = "fp32", master: str = "fp32") -> dict:
    """Run the benchmark and return the JSON dict (see the module doc and ``offload bench adam``).

    ``params``: parameters per step. ``threads``: native and torch threads (None: physical
    cores). ``levels``: SIMD levels to time (None: every level this CPU runs). ``with_torch``:
    time the torch sides too (the planner may skip them; only for all-fp32 state). ``state``:
    "fp32", "bf16" or "8bit" moments; ``master``: "fp32" or "bf16".
    """
    params = parse_count(params)
    if grad_dtype not in DTYPES:
        raise ConfigError("grad_dtype", grad_dtype, "must be fp32, bf16 or fp16")
    if out_dtype not in ("none", "bf16", "fp16"):
        raise ConfigError("out_dtype", out_dtype, "must be none, bf16 or fp16")
    if state not in ("fp32", "bf16", "8bit"):
        raise ConfigError("state", state, "must be fp32, bf16 or 8bit")
    if master not in ("fp32", "bf16"):
        raise ConfigError("master", master, "must be fp32 or bf16")
    compressed = state != "fp32" or master != "fp32"
    with_torch = with_torch and not compressed
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ConfigError("repeats", repeats, "must be an int >= 1")
    if threads is None:
        threads = native.physical_cores()
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ConfigError("threads", threads, "must be an int >= 1")
    available = native.simd_available()
    if levels is None:
        # the compressed-state scalar kernels are the bit-for-bit references (the 8-bit one a
        # binary search per moment, ~40x slower), not contenders: timed only when asked or when
        # they are all the CPU runs
        levels = list(reversed(available[1:] if compressed and len(available) > 1 else available))
    else:
        levels = list(levels)
    for level in levels:
        if level not in available:
            raise ConfigError("levels", level, f"this CPU runs {', '.join(available)}")
    _check_memory(bytes_needed(params, grad_dtype, out_dtype, with_torch, state, master))

    gen = torch.Generator().manual_seed(0)
    param = torch.randn(params, generator=gen)
    grad = (torch.randn(params, generator=gen) * 1e-3).to(DTYPES[grad_dtype])
    exp_avg = torch.zeros(params)
    exp_avg_sq = torch.zeros(params)
    out = None if out_dtype == "none" else torch.empty(params, dtype=DTYPES[out_dtype])
    step = [0]

    def ours(level):
        def run():
            step[0] += 1
            adam_step(param, grad, exp_avg, exp_avg_sq, step=step[0], out=out, threads=threads,
                      simd=level, **HPARAMS)
        return run

    def roofline():
        native.stream_probe_raw(a=param.data_ptr(), b=exp_avg.data_ptr(), c=exp_avg_sq.data_ptr(),
                                d=grad.data_ptr(), d_dtype=grad_dtype,
                                e=out.data_ptr() if out is not None else 0, e_dtype=out_dtype,
                                n=params, threads=threads)

    if state == "8bit":
        master_buf = param.to(DTYPES[master])
        codes_m = torch.full((params,), 127, dtype=torch.uint8)   # the signed map's zero
        codes_v = torch.zeros(params, dtype=torch.uint8)
        absmax_m, absmax_v = torch.zeros(blocks(params)), torch.zeros(blocks(params))

        def ours8(level):
            def run():
                step[0] += 1
                adam_step_8bit(master_buf, grad, codes_m, absmax_m, codes_v, absmax_v,
                               step=step[0], out=out, threads=threads, simd=level, **HPARAMS)
            return run
        sides = {f"offload_{level}": ours8(level) for level in levels}
    elif compressed:
        master16 = param.to(DTYPES[master])
        m16, v16 = torch.zeros(params, dtype=DTYPES[state]), torch.zeros(params, dtype=DTYPES[state])

        def ours16(level):
            def run():
                step[0] += 1
                adam_step(master16, grad, m16, v16, step=step[0], out=out, threads=threads,
                          simd=level, **HPARAMS)
            return run
        sides = {f"offload_{level}": ours16(level) for level in levels}
    else:
        sides = {f"offload_{level}": ours(level) for level in levels}
    if compressed:
        sides["fp32_kernel"] = ours(native.simd_level() if native.simd_level() in levels else levels[0])
    sides["roofline"] = roofline
    old_threads = torch.get_num_threads()
    torch_sides = {}
    if with_torch:
        torch.set_num_threads(threads)
        torch_param = torch.nn.Parameter(param, requires_grad=True)
        torch_param.grad = grad if grad_dtype == "fp32" else torch.empty(params)

        def torch_side(**kw):
            opt = torch.optim.AdamW([torch_param], lr=HPARAMS["lr"],
                                    betas=(HPARAMS["beta1"], HPARAMS["beta2"]),
                                    eps=HPARAMS["eps"], weight_decay=HPARAMS["weight_decay"], **kw)
            torch_state = opt.state[torch_param]  # share our moments: no extra memory, same values
            torch_state["step"] = torch.tensor(0.0)
            torch_state["exp_avg"] = exp_avg
            torch_state["exp_avg_sq"] = exp_avg_sq

            def run():
                if grad_dtype != "fp32":
                    torch_param.grad.copy_(grad)
                opt.step()
                if out is not None:
                    out.copy_(param)
            return run

        torch_sides["torch_foreach"] = torch_side(foreach=True)
        try:
            fused = torch_side(fused=True)
            fused()  # builds without the CPU fused kernel fail here
            torch_sides["torch_fused"] = fused
        except (RuntimeError, NotImplementedError):
            pass
        sides.update(torch_sides)
    try:
        for run in sides.values():  # warm: touch every page, start the thread pools
            run()
        times = {name: [] for name in sides}
        names = list(sides)
        for r in range(repeats):
            order = names[r % len(names):] + names[:r % len(names)]
            for name in order:
                t0 = time.perf_counter()
                sides[name]()
                times[name].append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(old_threads)

    bpp = bytes_per_param(grad_dtype, out_dtype, state, master)
    bpp_fp32 = bytes_per_param(grad_dtype, out_dtype)
    results = {}
    for name, ts in times.items():
        rate = _median_rate(ts, params)
        own = bpp if name.startswith("offload_") else bpp_fp32
        results[name] = {"params_per_s": rate, "gbps": rate * own / 1e9,
                         "seconds": [round(t, 6) for t in ts]}
    level = native.simd_level() if native.simd_level() in levels else levels[0]
    results["offload"] = dict(results[f"offload_{level}"])
    if with_torch and "torch_fused" not in results:
        results["torch_fused"] = None
    ours_t = times[f"offload_{level}"]

    def paired(other: str) -> float:
        # ratios within one repeat (sides timed back to back) shrug off the bus's drift
        return statistics.median(o / t for o, t in zip(times[other], ours_t))

    report = {
        "params": params, "threads": threads, "simd": level, "grad_dtype": grad_dtype,
        "out_dtype": out_dtype, "state": state, "master": master, "bytes_per_param": bpp,
        "roofline_bytes_per_param": bpp_fp32, "repeats": repeats, "results": results,
        # our bytes/s over the roofline loop's bytes/s, repeat by repeat
        "roofline_fraction": paired("roofline") * bpp / bpp_fp32,
    }
    if "fp32_kernel" in times:
        report["speedup_vs_fp32_kernel"] = paired("fp32_kernel")
    if "torch_fused" in times:
        report["speedup_vs_torch_fused"] = paired("torch_fused")
    return report


def add_arguments(parser) -> None:
    parser.add_argument("--params", default="200M",
                        help="parameters per step: 200M, 1.5G or a plain count (default 200M)")
    parser.add_argument("--threads", type=int, default=None,
                        help="threads for ours and torch (default: physical cores)")
    parser.add_argument("--grad-dtype", choices=("fp32", "bf16", "fp16"), default="fp32")
    parser.add_argument("--out-dtype", choices=("none", "bf16", "fp16"), default="none",
                        help="also write the updated parameters in this dtype (default none)")
    parser.add_argument("--state", choices=("fp32", "bf16", "8bit"), default="fp32",
                        help="Adam moments: fp32, bf16 (stochastic rounding) or block-wise 8-bit "
                             "(default fp32)")
    parser.add_argument("--master", choices=("fp32", "bf16"), default="fp32",
                        help="master weights (bf16: stochastic rounding)")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats per side (median)")
    parser.add_argument("--simd", action="append", choices=native.SIMD_LEVELS, default=None,
                        help="time only this SIMD level (repeatable; default: every level the CPU runs)")
    parser.add_argument("--json", metavar="FILE", default=None, help="also write the JSON here")


def run(args) -> int:
    report = measure(params=parse_count(args.params), threads=args.threads,
                     grad_dtype=args.grad_dtype, out_dtype=args.out_dtype, repeats=args.repeats,
                     levels=args.simd, state=args.state, master=args.master)
    res = report["results"]
    roof = res["roofline"]["gbps"]
    print(f"CPU Adam: {report['params']:,} params, {report['threads']} threads, state "
          f"{report['state']}, master {report['master']}, grad {report['grad_dtype']}, out "
          f"{report['out_dtype']}, {report['bytes_per_param']:.2f} B/param (roofline loop "
          f"{report['roofline_bytes_per_param']} B/param), median of {report['repeats']}")
    print(f"{'side':<18}{'Gparams/s':>10}{'GB/s':>8}{'of roofline':>13}")
    for name, r in res.items():
        if name == "offload" or r is None:
            continue
        print(f"{name:<18}{r['params_per_s'] / 1e9:>10.3f}{r['gbps']:>8.1f}"
              f"{r['gbps'] / roof:>13.2f}")
    line = f"offload ({report['simd']}): {report['roofline_fraction']:.2f} of roofline (GB/s)"
    if "speedup_vs_fp32_kernel" in report:
        line += f", {report['speedup_vs_fp32_kernel']:.2f}x the fp32 kernel's params/s"
    if "speedup_vs_torch_fused" in report:
        line += f", {report['speedup_vs_torch_fused']:.2f}x torch fused"
    print(line)
    write_json(args.json, report)
    return 0
