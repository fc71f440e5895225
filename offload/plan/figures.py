"""The box's figures for a plan: each one given, read from a saved ``offload bench ... --json``
file, measured here (``probes``, kept in the measurement cache: ``cache``), or assumed — and where
it came from. ``hardware_for`` is the library call (the trainer's); ``gather_hardware`` reads the
same figures from ``offload plan``'s flags.

Any of ``nvme_capacity``, ``nvme_gbps`` or ``gpu_tflops`` given means "describe another box": then
nothing is measured, the figures not given take the stated assumptions below, and the ones
without an honest default (the RAM, a compute rate, the NVMe GB/s when it has NVMe space) are
required — all that are missing named in one error. Otherwise each figure not given is measured:
free space on the NVMe paths, NVMe GB/s (``offload.bench.nvme.measure``), CPU Adam params/s
(``offload.bench.adam.measure``), available RAM, and with a GPU its free memory, a bf16 matmul and
a pinned copy; without one, a CPU matmul probe. ``gpu_mem`` given on a box without a GPU plans for
this box with that GPU added: its compute rate is assumed from ``ASSUMED_GPU_TFLOPS`` (by memory
size) and its PCIe from ``ASSUMED_PCIE_GBPS``, each said in a note, unless given.

Messages name the way to give a figure in the command that is running (``flags``: figure name ->
that command's flag, ``PLAN_FLAGS`` for ``offload plan``); a figure the command cannot take is not
offered (a read-only NVMe path under the trainer is "not writable", not "give --nvme-gbps").
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from collections.abc import Mapping
from pathlib import Path

from ..config import read_json_object
from ..errors import ConfigError, OffloadError
from ..tiers.nvme import nvme_capacity
from . import probes
from .cache import MeasurementCache, path_key
from .defaults import BATCH_TOKENS
from .flags import default_seq_len, model_shape, positive_flag, size_flag
from .inputs import Hardware
from .model import resolve_model

ASSUMED_PCIE_GBPS = 25.0          # PCIe Gen4 x16 with pinned buffers, each way
ASSUMED_NET_GBPS = 25.0           # a 200 Gb/s NIC per GPU between boxes: NCCL's bus GB/s a rank
ASSUMED_ADAM_PARAMS_PER_S = 4e9   # a fused CPU AdamW on a server socket (~110 GB/s at 28 B/param)
ASSUMED_GPU_TFLOPS = ((16 << 30, 50.0),     # up to 16 GiB: T4, V100-16G class
                      (24 << 30, 100.0),    # up to 24 GiB: L4, A10, RTX 4090 class
                      (48 << 30, 150.0),    # up to 48 GiB: A100-40G, A6000, L40S class
                      (80 << 30, 250.0),    # up to 80 GiB: A100-80G class (an H100 does more: give it)
                      (None, 400.0))        # larger: H100/H200 class
"""Achieved dense bf16 matmul TFLOPS assumed for a GPU of at most that much memory, when a GPU is
described by its memory only and there is none here to measure: a conservative figure of its
class, about 60-70% of the datasheet's. Give ``--gpu-tflops`` (``offload bench step`` measures it)."""

FIGURES = ("gpu_mem", "gpu_tflops", "cpu_mem", "cpu_gflops", "pcie_gbps", "nvme_capacity", "nvme_gbps",
           "nvme_write_gbps", "nvme_bench", "adam_params_per_s", "adam_bench", "net_gbps")
"""The machine figures: ``hardware_for``'s keywords and, dashed, ``offload plan``'s flags."""
PLAN_FLAGS = {name: "--" + name.replace("_", "-") for name in (*FIGURES, "no_cache")}
"""``offload plan``'s flag for each figure, and for ``cache=False``."""
_RATES = ("nvme_gbps", "nvme_write_gbps", "gpu_tflops", "cpu_gflops", "pcie_gbps", "adam_params_per_s", "net_gbps")


def assumed_gpu_tflops(gpu_mem: int) -> float:
    """``ASSUMED_GPU_TFLOPS``' figure for a GPU of ``gpu_mem`` bytes."""
    return next(t for limit, t in ASSUMED_GPU_TFLOPS if limit is None or gpu_mem <= limit)


def hardware_for(nvme_paths: list[str], *, model="1b", dtype: str = "bf16", seq_len: int | None = None,
                 batch_tokens: int | None = None, cache: bool = True, flags: Mapping[str, str] | None = None,
                 **figures) -> tuple[Hardware, dict, list[str]]:
    """The box's figures for planning ``model`` (a preset name or a ``LlamaConfig``: shapes the CPU
    compute probe) in ``dtype``: ``figures`` (``FIGURES``' names; sizes in bytes or "80G") override
    what would be measured on the ``nvme_paths`` directories and this box. Returns the ``Hardware``,
    where each figure came from ("given", "measured (...)", "assumed (...)", a bench FILE) and notes.

    ``cache``: read measurements made earlier on this box (and its NVMe filesystems) instead of
    measuring again, and keep new ones; False measures everything again (and keeps the results).
    ``flags``: how the running command takes each figure, for messages (default: none of them, the
    figures then named by keyword where one is required)."""
    unknown = sorted(set(figures) - set(FIGURES))
    if unknown:
        raise TypeError(f"hardware_for() got unknown figures: {', '.join(unknown)}")
    f = dict.fromkeys(FIGURES) | figures
    flags = {} if flags is None else flags
    for name in _RATES:
        positive_flag(f[name], flags.get(name, name))
    gather = _Gather(nvme_paths=[str(p) for p in nvme_paths], model=model, dtype=dtype, seq_len=seq_len,
                     batch_tokens=batch_tokens, flags=flags, cache=MeasurementCache(enabled=cache))
    return gather.hardware(f)


def gather_hardware(args: argparse.Namespace) -> tuple[Hardware, dict, list[str]]:
    """``hardware_for`` with ``offload plan``'s flags."""
    figures = {name: getattr(args, name) for name in FIGURES}
    world = getattr(args, "world", None) or 1
    seq_len = args.seq_len or default_seq_len(args, (args.batch_tokens or BATCH_TOKENS) // world)
    return hardware_for(args.nvme_path, model=model_shape(args), dtype=args.dtype, seq_len=seq_len,
                        batch_tokens=args.batch_tokens, cache=not getattr(args, "no_cache", False),
                        flags=PLAN_FLAGS, **figures)


@dataclasses.dataclass
class _Gather:
    """One gathering of figures: what is measured where, the sources and notes it builds up, and
    the figures a described box lacks (raised together at the end)."""

    nvme_paths: list[str]
    model: object
    dtype: str
    seq_len: int | None
    batch_tokens: int | None
    flags: Mapping[str, str]
    cache: MeasurementCache
    src: dict = dataclasses.field(default_factory=dict)
    notes: list = dataclasses.field(default_factory=list)
    missing: list = dataclasses.field(default_factory=list)

    def give(self, *names: str) -> str:
        """"give --a or --b" for the figures the running command takes as flags ("" for none)."""
        named = [self.flags[n] + (" FILE" if n.endswith("_bench") else "") for n in names if n in self.flags]
        return "give " + " or ".join(named) if named else ""

    def flag(self, name: str) -> str:
        """How the running command takes figure ``name`` (its flag, else the keyword)."""
        return self.flags.get(name, name)

    def need(self, what: str, why: str) -> None:
        """A figure the described box lacks (named with the others when all have been looked at)."""
        self.missing.append(f"{what} ({why})")

    def measured(self, name: str, how: str, key: dict, probe, count: int = 1):
        """``probe()``'s value (a rate, or a list of ``count`` rates), or the one kept from an earlier run
        on this box under ``key``."""
        value = self.cache.measure(name, key, probe, valid=lambda v: _rates(v, count))
        self.source(name, how)
        return value

    def source(self, name: str, how: str) -> None:
        self.src[name] = f"measured ({how})" + (", cached" if name in self.cache.hits else "")

    def hardware(self, f: dict) -> tuple[Hardware, dict, list[str]]:
        describe = any(f[n] is not None for n in ("nvme_capacity", "nvme_gbps", "gpu_tflops"))
        gpu_mem, tflops, pcie = self._gpu(f, describe)
        cpu_mem = self._ram(f, describe)
        capacity, read, write, where = self._nvme(f, describe)
        adam = self._adam(f, describe)
        # Not measured here: one box cannot see the links between boxes.
        net, self.src["net_gbps"] = ((f["net_gbps"], "given") if f["net_gbps"] is not None else
                                     (ASSUMED_NET_GBPS, "assumed (a 200 Gb/s NIC per GPU)"))
        if self.missing:
            raise OffloadError("to describe another box, give " + "; ".join(self.missing))
        if self.cache.hits:
            again = f"; {self.flags['no_cache']} measures again" if "no_cache" in self.flags else ""
            self.notes.append(f"{', '.join(self.cache.hits)}: measured on this box before, read from "
                              f"{self.cache.path}{again}")
        hw = Hardware(gpu_mem=gpu_mem, cpu_mem=cpu_mem, nvme_capacity=capacity, nvme_read_gbps=read,
                      nvme_write_gbps=write, pcie_gbps=pcie, net_gbps=net, compute_tflops=tflops,
                      adam_params_per_s=adam, nvme_where=where)
        return hw, self.src, self.notes

    def _gpu(self, f: dict, describe: bool) -> tuple[int | None, float, float]:
        """GPU memory, the compute rate (GPU, else CPU) and PCIe GB/s."""
        src, dtype = self.src, self.dtype
        gpu_mem = size_flag(f["gpu_mem"], self.flag("gpu_mem"))
        cuda = None if describe else probes.cuda_or_none()
        if gpu_mem is not None:
            src["gpu_mem"] = "given"
        elif cuda is not None:
            gpu_mem, src["gpu_mem"] = cuda.mem_get_info()[0], "measured (free)"
        tflops = 1.0          # stands in while a described box's missing figures are gathered
        if gpu_mem is not None:
            if f["gpu_tflops"] is not None:
                tflops, src["compute_tflops"] = f["gpu_tflops"], "given"
            elif cuda is not None:
                import torch
                key = {"dtype": dtype, "tf32": bool(torch.backends.cuda.matmul.allow_tf32)}
                tflops = self.measured("compute_tflops", f"{dtype} matmul", key, lambda: probes.gpu_tflops(cuda, dtype))
            elif describe:
                self.need(self.flag("gpu_tflops"), "the GPU's achieved matmul rate")
            else:
                tflops = assumed_gpu_tflops(gpu_mem)
                src["compute_tflops"] = "assumed (by GPU memory; no GPU here)"
                self.notes.append(f"no GPU here: assuming {tflops:g} TFLOPS for a GPU of {gpu_mem / 2**30:.0f} GiB"
                                  + (f" ({self.give('gpu_tflops')} for yours)" if self.give("gpu_tflops") else ""))
        elif f["gpu_tflops"] is not None:
            self.need(self.flag("gpu_mem"), "the memory of that GPU")
        elif f["cpu_gflops"] is not None:
            tflops, src["compute_tflops"] = f["cpu_gflops"] / 1000.0, "given (cpu_gflops)"
        elif describe:
            self.need(f"{self.flag('gpu_mem')} and {self.flag('gpu_tflops')}, or {self.flag('cpu_gflops')}",
                      "its compute: a GPU's memory and matmul rate, or a CPU-only box's rate")
        else:
            key = {"model": _shape_key(self.model), "dtype": dtype, "seq_len": self.seq_len,
                   "batch_tokens": self.batch_tokens}
            gflops, how = self.cache.measure("compute_tflops", key, lambda: list(probes.probe_cpu_gflops(
                self.model, dtype, self.seq_len, self.batch_tokens)),
                valid=lambda v: isinstance(v, list) and len(v) == 2 and _rates(v[0], 1) and isinstance(v[1], str))
            tflops = gflops / 1000.0
            self.source("compute_tflops", how)
        if f["pcie_gbps"] is not None:
            pcie, src["pcie_gbps"] = f["pcie_gbps"], "given"
        elif gpu_mem is None:
            pcie, src["pcie_gbps"] = 0.0, "no GPU"
        elif cuda is not None:
            pcie = self.measured("pcie_gbps", "pinned copy", {}, lambda: probes.pcie_gbps(cuda))
        else:
            pcie, src["pcie_gbps"] = ASSUMED_PCIE_GBPS, "assumed (PCIe Gen4 x16)"
        return gpu_mem, tflops, pcie

    def _ram(self, f: dict, describe: bool) -> int:
        cpu_mem = size_flag(f["cpu_mem"], self.flag("cpu_mem"))
        if cpu_mem is not None:
            self.src["cpu_mem"] = "given"
            return cpu_mem
        if describe:
            self.need(self.flag("cpu_mem"), "the RAM for the run")
            return 1
        import psutil
        self.src["cpu_mem"] = "measured (available)"
        return psutil.virtual_memory().available

    def _nvme(self, f: dict, describe: bool) -> tuple[int, float, float, str]:
        """Free space, read and write GB/s, and where (for messages)."""
        paths, src = self.nvme_paths, self.src
        where = ", ".join(paths) if paths else "the NVMe paths"
        capacity = size_flag(f["nvme_capacity"], self.flag("nvme_capacity"))
        if capacity is not None:
            src["nvme_capacity"] = "given"
        elif paths:
            for p in paths:
                if not Path(p).is_dir():
                    why = "is not a directory" if Path(p).exists() else "does not exist here"
                    hint = self.give("nvme_capacity") if describe else ""
                    raise ConfigError("--nvme-path", p, why + (f" ({hint})" if hint else ""))
            capacity, src["nvme_capacity"] = nvme_capacity(paths), "measured (free space)"
        else:
            capacity, src["nvme_capacity"], where = 0, "no --nvme-path", "no NVMe path"
        read = write = 0.0
        if f["nvme_gbps"] is not None:
            read = f["nvme_gbps"]
            write = f["nvme_write_gbps"] or read
            src["nvme_gbps"] = "given"
        elif f["nvme_bench"]:
            bench = read_json_object(f["nvme_bench"], self.flag("nvme_bench"))
            read = probes.bench_number(bench, "read_gbps", f["nvme_bench"])
            write = probes.bench_number(bench, "write_gbps", f["nvme_bench"])
            src["nvme_gbps"] = f["nvme_bench"]
        elif capacity > 0:
            if describe or not paths:
                self.need(self.give("nvme_gbps", "nvme_bench").removeprefix("give ") or "nvme_gbps",
                          "the GB/s of its NVMe drives")
            else:
                read, write = self._measure_nvme(paths)
        if f["nvme_write_gbps"] is not None:
            write = f["nvme_write_gbps"]
        return capacity, read, write, where

    def _measure_nvme(self, paths: list[str]) -> tuple[float, float]:
        """Read/write GB/s of the NVMe paths, cached by their filesystems (the probe writes there)."""
        for p in paths:
            if not os.access(p, os.W_OK | os.X_OK):
                hint = self.give("nvme_gbps", "nvme_bench")
                raise ConfigError("--nvme-path", p, "is not writable: the NVMe tier keeps its files there, and its "
                                  "bandwidth is measured by writing there"
                                  + (f" (to plan without measuring it, {hint})" if hint else ""))
        filesystems = sorted({tuple(sorted(path_key(p).items())) for p in paths})
        key = {"filesystems": [dict(fs) for fs in filesystems], "probe_bytes": probes.NVME_PROBE_BYTES}
        try:
            read, write = self.measured("nvme_gbps", "offload.bench.nvme", key,
                                        lambda: list(probes.measure_nvme(paths)), count=2)
        except OffloadError as exc:
            hint = self.give("nvme_gbps", "nvme_bench")
            raise OffloadError(f"{exc}" + (f"; {hint}" if hint else "")) from exc
        return read, write

    def _adam(self, f: dict, describe: bool) -> float:
        src = self.src
        if f["adam_params_per_s"] is not None:
            src["adam_params_per_s"] = "given"
            return f["adam_params_per_s"]
        if f["adam_bench"]:
            bench = read_json_object(f["adam_bench"], self.flag("adam_bench"))
            src["adam_params_per_s"] = f["adam_bench"]
            return probes.bench_number(bench, "params_per_s", f["adam_bench"])
        if describe:
            src["adam_params_per_s"] = "assumed (server socket)"
            return ASSUMED_ADAM_PARAMS_PER_S
        key = {"dtype": self.dtype, "params": probes.ADAM_PROBE_PARAMS}
        try:
            return self.measured("adam_params_per_s", "offload.bench.adam", key,
                                 lambda: probes.measure_adam(self.dtype))
        except OffloadError as exc:
            hint = self.give("adam_params_per_s", "adam_bench")
            raise OffloadError(f"{exc}" + (f"; {hint}" if hint else "")) from exc


def _rates(value, count: int) -> bool:
    """``value`` is a rate > 0 (``count`` 1) or a list of ``count`` of them."""
    values = value if count > 1 and isinstance(value, list) and len(value) == count else [value]
    return len(values) == count and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                        and math.isfinite(v) and v > 0 for v in values)


def _shape_key(model) -> dict:
    """The model's shape, what the CPU probe's result depends on ("7b", "llama-7b" and its config
    are one key)."""
    return dataclasses.asdict(resolve_model(model)[1])
