"""The box's figures for ``offload plan``: each one given on the command line, read from a saved
``offload bench ... --json`` file, measured here (``probes``), or assumed — and where it came from.

Any of ``--nvme-capacity``, ``--nvme-gbps`` or ``--gpu-tflops`` means "describe another box": then
nothing is measured, figures not given take the stated assumptions below, and the ones without an
honest default (``--cpu-mem``, a compute rate) are required. Otherwise each figure not given is
measured: free space on the ``--nvme-path`` directories, NVMe GB/s (``offload.bench.nvme.measure``),
CPU Adam params/s (``offload.bench.adam.measure``), available RAM, and with a GPU its free memory, a
bf16 matmul and a pinned copy; without one, a CPU matmul probe.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..config import read_json_object
from ..errors import ConfigError, OffloadError
from ..tiers.nvme import nvme_capacity
from . import probes
from .flags import model_shape, positive_flag, size_flag
from .inputs import Hardware

ASSUMED_PCIE_GBPS = 25.0          # PCIe Gen4 x16 with pinned buffers, each way
ASSUMED_ADAM_PARAMS_PER_S = 4e9   # a fused CPU AdamW on a server socket (~110 GB/s at 28 B/param)


def gather_hardware(args: argparse.Namespace) -> tuple[Hardware, dict, list[str]]:
    """The box's figures, where each came from ("given", "measured", "assumed", "FILE"), and notes."""
    describe = any(v is not None for v in (args.nvme_capacity, args.nvme_gbps, args.gpu_tflops))
    src: dict[str, str] = {}
    notes: list[str] = []
    for flag in ("nvme_gbps", "nvme_write_gbps", "gpu_tflops", "cpu_gflops", "pcie_gbps",
                 "adam_params_per_s"):
        positive_flag(getattr(args, flag), "--" + flag.replace("_", "-"))

    # GPU: memory, compute, PCIe
    gpu_mem = size_flag(args.gpu_mem, "--gpu-mem")
    cuda = None if describe else probes.cuda_or_none()
    if gpu_mem is not None:
        src["gpu_mem"] = "given"
    elif cuda is not None:
        gpu_mem, src["gpu_mem"] = cuda.mem_get_info()[0], "measured (free)"
    if gpu_mem is not None:
        if args.gpu_tflops is not None:
            tflops, src["compute_tflops"] = args.gpu_tflops, "given"
        elif cuda is not None:
            tflops, src["compute_tflops"] = probes.gpu_tflops(cuda, args.dtype), f"measured ({args.dtype} matmul)"
        else:
            raise _missing("--gpu-tflops", "with --gpu-mem when there is no GPU here to probe")
    elif args.gpu_tflops is not None:
        raise _missing("--gpu-mem", "with --gpu-tflops (how much memory has that GPU?)")
    elif args.cpu_gflops is not None:
        tflops, src["compute_tflops"] = args.cpu_gflops / 1000.0, "given (--cpu-gflops)"
    elif describe:
        raise _missing("--cpu-gflops", "to describe a CPU-only box (or --gpu-mem and --gpu-tflops)")
    else:
        gflops, how = probes.probe_cpu_gflops(model_shape(args), args.dtype, args.seq_len, args.batch_tokens)
        tflops, src["compute_tflops"] = gflops / 1000.0, f"measured ({how})"
    pcie = args.pcie_gbps
    if pcie is not None:
        src["pcie_gbps"] = "given"
    elif gpu_mem is None:
        pcie, src["pcie_gbps"] = 0.0, "no GPU"
    elif cuda is not None:
        pcie, src["pcie_gbps"] = probes.pcie_gbps(cuda), "measured (pinned copy)"
    else:
        pcie, src["pcie_gbps"] = ASSUMED_PCIE_GBPS, "assumed (PCIe Gen4 x16)"

    # RAM
    cpu_mem = size_flag(args.cpu_mem, "--cpu-mem")
    if cpu_mem is not None:
        src["cpu_mem"] = "given"
    elif describe:
        raise _missing("--cpu-mem", "to describe another box")
    else:
        import psutil
        cpu_mem, src["cpu_mem"] = psutil.virtual_memory().available, "measured (available)"

    # NVMe: space and bandwidth
    paths = [str(p) for p in args.nvme_path]
    where = ", ".join(paths) if paths else "the NVMe paths"
    capacity = size_flag(args.nvme_capacity, "--nvme-capacity")
    if capacity is not None:
        src["nvme_capacity"] = "given"
    elif paths:
        for p in paths:
            if not Path(p).is_dir():
                why = "is not a directory" if Path(p).exists() else "does not exist here"
                raise ConfigError("--nvme-path", p, why + (" (give --nvme-capacity)" if describe else ""))
        capacity, src["nvme_capacity"] = nvme_capacity(paths), "measured (free space)"
    else:
        capacity, src["nvme_capacity"], where = 0, "no --nvme-path", "no NVMe path"
    read = write = 0.0
    if args.nvme_gbps is not None:
        read = args.nvme_gbps
        write = args.nvme_write_gbps or read
        src["nvme_gbps"] = "given"
    elif args.nvme_bench:
        bench = read_json_object(args.nvme_bench, "--nvme-bench")
        read = probes.bench_number(bench, "read_gbps", args.nvme_bench)
        write = probes.bench_number(bench, "write_gbps", args.nvme_bench)
        src["nvme_gbps"] = args.nvme_bench
    elif capacity > 0:
        if describe or not paths:
            raise _missing("--nvme-gbps", "for the NVMe tier of the box described (its GB/s)")
        read, write = probes.measure_nvme(paths)
        src["nvme_gbps"] = "measured (offload.bench.nvme)"
    if args.nvme_write_gbps is not None:
        write = args.nvme_write_gbps

    # CPU Adam
    if args.adam_params_per_s is not None:
        adam, src["adam_params_per_s"] = args.adam_params_per_s, "given"
    elif args.adam_bench:
        bench = read_json_object(args.adam_bench, "--adam-bench")
        adam = probes.bench_number(bench, "params_per_s", args.adam_bench)
        src["adam_params_per_s"] = args.adam_bench
    elif describe:
        adam, src["adam_params_per_s"] = ASSUMED_ADAM_PARAMS_PER_S, "assumed (server socket)"
    else:
        adam, src["adam_params_per_s"] = probes.measure_adam(args.dtype), "measured (offload.bench.adam)"

    hw = Hardware(gpu_mem=gpu_mem, cpu_mem=cpu_mem, nvme_capacity=capacity, nvme_read_gbps=read,
                  nvme_write_gbps=write, pcie_gbps=pcie, compute_tflops=tflops,
                  adam_params_per_s=adam, nvme_where=where)
    return hw, src, notes


def _missing(flag: str, why: str) -> OffloadError:
    return OffloadError(f"{flag} is needed {why}")
