"""The planner's measurements on this box: NVMe bandwidth and CPU Adam throughput (through the
``offload bench`` commands' ``measure``), the GPU's matmul rate and PCIe bandwidth, and a CPU
compute probe; and reading a figure out of a bench result (``bench_number``).

A probe that cannot run raises ``OffloadError`` saying why (``figures`` adds how to give the figure
instead, in the running command's terms).
"""

from __future__ import annotations

import os
import time

from ..bench.common import seconds_per_call
from ..errors import OffloadError

NVME_PROBE_BYTES = 256 << 20
ADAM_PROBE_PARAMS = 20_000_000


def bench_number(data: dict, key: str, where: str) -> float:
    """A positive ``key`` of a bench result: at the top, else under ``results.offload`` (ours, not
    the baseline's), else the first one found breadth-first."""
    def ok(d):
        return isinstance(d, dict) and isinstance(d.get(key), (int, float)) and d[key] > 0

    results = data.get("results")
    ours = results.get("offload") if isinstance(results, dict) else None
    queue = [data, ours]
    while queue:
        d = queue.pop(0)
        if ok(d):
            return float(d[key])
        if isinstance(d, dict):
            queue.extend(v for v in d.values() if isinstance(v, dict))
    raise OffloadError(f"no positive {key!r} found in {where}")


def measure_nvme(paths: list[str]) -> tuple[float, float]:
    """Aggregate read/write GB/s: one small run per distinct filesystem, summed (striping)."""
    try:
        from ..bench.nvme import measure
        seen, read, write = set(), 0.0, 0.0
        for p in paths:
            dev = os.stat(p).st_dev
            if dev in seen:
                continue
            seen.add(dev)
            r = measure(p, size=NVME_PROBE_BYTES, block_size=1 << 20, queue_depth=32, threads=1, repeats=1)
            read += bench_number(r, "read_gbps", "offload.bench.nvme.measure()")
            write += bench_number(r, "write_gbps", "offload.bench.nvme.measure()")
        return read, write
    except Exception as exc:  # a missing or failing bench: say so, ask for the figure
        raise OffloadError(f"could not measure NVMe bandwidth ({type(exc).__name__}: {exc})") from exc


def measure_adam(dtype: str) -> float:
    """CPU Adam parameters/s (``offload.bench.adam.measure``, ours only) with ``dtype`` gradients."""
    try:
        import inspect

        from ..bench.adam import measure
        extra = {"with_torch": False} if "with_torch" in inspect.signature(measure).parameters else {}
        r = measure(params=ADAM_PROBE_PARAMS, threads=None, grad_dtype=dtype,
                    out_dtype="none" if dtype == "fp32" else dtype, repeats=3, **extra)
        return bench_number(r, "params_per_s", "offload.bench.adam.measure()")
    except Exception as exc:  # a missing or failing bench: say so, ask for the figure
        raise OffloadError(f"could not measure CPU Adam ({type(exc).__name__}: {exc})") from exc


def cuda_or_none():
    """``torch.cuda`` when there is a GPU to probe, else None."""
    try:
        import torch
    except ImportError:
        return None
    return torch.cuda if torch.cuda.is_available() else None


def _median_time(fn, min_s: float = 1.5, min_calls: int = 5) -> float:
    """Median seconds per call of ``fn`` after a warm-up call, over at least ``min_s`` and ``min_calls``.

    A median of many calls, like a training run's median step: on a shared box one call that
    lands on a busy (or an idle) moment does not set the rate.
    """
    fn()
    times, t_end = [], time.perf_counter() + min_s
    while len(times) < min_calls or time.perf_counter() < t_end:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def gpu_tflops(cuda, dtype: str) -> float:
    """The GPU's matmul rate in the run's compute dtype (fp32 runs at TF32 or full fp32 speed, as
    ``torch.backends.cuda.matmul.allow_tf32`` says: a 10x difference on Hopper)."""
    import torch

    tdtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=tdtype)
    b = torch.randn(n, n, device="cuda", dtype=tdtype)
    return 2 * n**3 / seconds_per_call(lambda: torch.mm(a, b), sync=cuda.synchronize) / 1e12


def pcie_gbps(cuda) -> float:
    """min(H2D, D2H) of a 256 MiB copy, GB/s, from host memory pinned the way the engine pins its
    CPU tier (mmap + cudaHostRegister)."""
    from ..bench import pcie

    rates = pcie.measure()
    return min(rates["h2d_gbps"], rates["d2h_gbps"])


def probe_cpu_gflops(model: str, dtype: str, seq_len: int | None,
                     batch_tokens: int | None) -> tuple[float, str]:
    """Achieved CPU GFLOPS for this model: forward + backward of one of its decoder layers at up
    to 4096 tokens when a layer is small enough to build here (it counts the norms, RoPE, SiLU and
    attention that a bare matmul leaves out, which matter on small models), else a matmul of the
    model's MLP shape capped at 4096 (a CPU-only 100B plan only needs the order of magnitude).

    The backward is seeded with a dense gradient, as a loss gives it (``out.sum().backward()``
    seeds an expanded, stride-0 one, which sends the matmuls down other kernels), and the rate is
    the median call over ~1.5 s. The planner adds the checkpoint recompute (x4/3) itself."""
    import torch

    from ..models.llama import (LlamaDecoderLayer, get_preset, layer_matmul_params,
                               layer_param_count, rope_tables)

    cfg = get_preset(model) if isinstance(model, str) else model
    tdtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    tokens = min(batch_tokens or 4096, 4096)
    seq = min(seq_len or cfg.max_seq_len, tokens)
    tokens = tokens // seq * seq
    if layer_param_count(cfg) * 4 <= 256 << 20:
        layer = LlamaDecoderLayer(cfg).to(tdtype)
        x = torch.randn(tokens // seq, seq, cfg.hidden_size, dtype=tdtype, requires_grad=True)
        grad = torch.randn_like(x) * 1e-3
        cos, sin = rope_tables(cfg, seq, "cpu", tdtype)
        flops = (6 * layer_matmul_params(cfg) + 12 * cfg.hidden_size * seq) * tokens

        def call():
            layer(x, cos, sin).backward(grad)
            layer.zero_grad(set_to_none=True)
            x.grad = None

        return flops / _median_time(call) / 1e9, "one decoder layer, fwd + bwd"
    m, k, n = min(tokens, 2048), min(cfg.hidden_size, 4096), min(cfg.intermediate_size, 4096)
    a, b = torch.randn(m, k, dtype=tdtype), torch.randn(k, n, dtype=tdtype)
    return 2 * m * k * n / _median_time(lambda: torch.mm(a, b), min_s=0.5) / 1e9, f"{m}x{k}x{n} matmul"
