"""``offload bench nvme``: disk throughput through the engine, with fio beside it.

One file of ``--size`` bytes is written once (untimed: overwriting existing blocks is what
the engine does with its swap files, and it is much faster than first writes), then each
repeat writes and reads it through ``offload.aio.AsyncIO`` and through fio with the same
block size, queue depth and threads, alternating the two so drift on a shared disk hits both.
The figures are medians; the ratio is ours / fio. ``--sweep`` measures a grid and prints the
best configuration as an ``offload.AioConfig(...)`` snippet. The file is removed on exit,
also on Ctrl-C.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from ..config import AioConfig, parse_bytes
from ..errors import ConfigError, UnsupportedError
from ..units import format_bytes
from . import fio
from .common import scratch_dir, write_json

SWEEP_BLOCK_SIZES = (256 << 10, 1 << 20, 4 << 20)
SWEEP_QUEUE_DEPTHS = (1, 4, 16, 32, 64)
SWEEP_THREADS = (1, 2)
FILE_NAME = ".offload-bench-nvme-{pid}.dat"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--path", required=True, help="directory on the drive to measure")
    parser.add_argument("--size", default="2G", help="bytes to write and read (default 2G = 2 GiB)")
    parser.add_argument("--block-size", default="1M", help="bytes per request (default 1M)")
    parser.add_argument("--queue-depth", type=int, default=32, help="requests in flight (default 32)")
    parser.add_argument("--threads", type=int, default=1, help="AIO contexts / fio jobs (default 1)")
    parser.add_argument("--mode", choices=("read", "write", "both"), default="both")
    parser.add_argument("--repeats", type=int, default=3, help="passes per side; the median is reported")
    parser.add_argument("--backend", choices=("auto", "libaio", "threads"), default="auto")
    parser.add_argument("--no-fio", action="store_true", help="do not run fio beside the engine")
    parser.add_argument("--sweep", action="store_true",
                        help="measure block size x queue depth x threads and print the best AioConfig")
    parser.add_argument("--json", metavar="FILE",
                        help="write the result as JSON (with --sweep: the best configuration)")
    parser.add_argument("--plot", metavar="FILE.png",
                        help="with --sweep: GB/s against queue depth, one line per block size (matplotlib)")


# ---- measuring ------------------------------------------------------------------------------

class _Progress:
    """A one-line progress bar on stderr (one line per phase when stderr is not a terminal)."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.tty = sys.stderr.isatty()
        self._last = 0.0

    def update(self, label: str, done: int, total: int, gbps: float | None = None) -> None:
        if not self.enabled:
            return
        finished = done >= total
        now = time.monotonic()
        if not finished and (not self.tty or now - self._last < 0.1):
            return
        self._last = now
        width = 30
        fill = int(width * done / total) if total else width
        rate = f" {gbps:5.2f} GB/s" if gbps is not None else ""
        line = f"{label:<22} [{'#' * fill}{'.' * (width - fill)}] {100 * done // max(total, 1):3d}%{rate}"
        if self.tty:
            sys.stderr.write("\r" + line + ("\n" if finished else ""))
        elif finished:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()


def _engine_pass(io, ring, target, size: int, write: bool, label: str, progress: _Progress) -> float:
    """One timed pass over the whole file: GB/s. Calls cover the ring; all are started at once."""
    seg = ring.numel()
    start = time.perf_counter()
    op = io.write_from if write else io.read_into
    handles = [op(ring if off + seg <= size else ring[: size - off], target, off)
               for off in range(0, size, seg)]
    for i, h in enumerate(handles, 1):
        io.wait(h)
        elapsed = time.perf_counter() - start
        progress.update(label, i, len(handles), i * seg / elapsed / 1e9 if elapsed > 0 else None)
    return size / (time.perf_counter() - start) / 1e9


def measure(path: str | os.PathLike, size: int | str = 2 << 30, block_size: int | str = 1 << 20,
            queue_depth: int = 32, threads: int = 1, repeats: int = 3, *, mode: str = "both",
            backend: str = "auto", with_fio: bool = True, progress: bool = False,
            _runs: dict | None = None) -> dict:
    """Write and read ``size`` bytes in directory ``path``; the result dict of ``--json``.

    ``{"path", "backend", "block_size", "queue_depth", "threads", "size", "read_gbps",
    "write_gbps", "fio": {"read_gbps", "write_gbps"} | None}``: medians over ``repeats`` in
    GB/s (1e9 bytes/s); a mode not measured is None; "fio" is None without fio on PATH (or
    with ``with_fio=False``). The benchmark file is removed before returning.
    """
    import torch

    from ..aio import AsyncIO, StripedFile, aligned_empty, free_bytes

    path = os.fspath(path)
    size = parse_bytes(size, "size")
    block_size = parse_bytes(block_size, "block_size")
    config = AioConfig(backend=backend, block_size=block_size, queue_depth=queue_depth, threads=threads)
    if mode not in ("read", "write", "both"):
        raise ConfigError("mode", mode, "must be 'read', 'write' or 'both'")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ConfigError("repeats", repeats, "must be an integer >= 1")
    if size < block_size * threads or size % (block_size * threads):
        raise ConfigError("size", size, f"must be a positive multiple of block size x threads "
                                        f"({block_size} x {threads} bytes)")
    if not os.path.isdir(path):
        raise ConfigError("path", path, "is not a directory")
    name = FILE_NAME.format(pid=os.getpid())
    have = os.path.getsize(os.path.join(path, name)) if os.path.exists(os.path.join(path, name)) else 0
    free = free_bytes(path)
    if size - have > free:
        raise ConfigError("size", size, f"larger than the free space in {path}: "
                                        f"{free} bytes free, {size} bytes needed")
    bar = _Progress(progress)
    runs: dict[str, list[float]] = {"write": [], "read": [], "fio_write": [], "fio_read": []}
    use_fio = with_fio and fio.available()
    iomem = fio.iomem_for(block_size, queue_depth, threads)
    target = StripedFile([path], name, size, stripe_unit=block_size)
    try:
        with AsyncIO(config, paths=[path]) as io:
            # fio's ring: queue_depth buffers of block_size per job; ours is the same bytes.
            ring = aligned_empty(block_size * queue_depth * threads, hugepage=True, populate=True)
            ring.copy_(torch.randint(0, 256, (ring.numel(),), dtype=torch.uint8))
            _engine_pass(io, ring, target, size, True, "preparing (first write)", bar)
            modes = ("write", "read") if mode == "both" else (mode,)
            for r in range(repeats):
                for m in modes:
                    sides = ("ours", "fio") if r % 2 == 0 else ("fio", "ours")
                    for side in sides:
                        if side == "ours":
                            runs[m].append(_engine_pass(io, ring, target, size, m == "write",
                                                        f"{m} ours {r + 1}/{repeats}", bar))
                        elif use_fio:
                            bar.update(f"{m} fio {r + 1}/{repeats}", 0, 1)
                            runs[f"fio_{m}"].append(fio.run(target.paths[0], m, size=size,
                                                            block_size=block_size, queue_depth=queue_depth,
                                                            threads=threads, iomem=iomem))
                            bar.update(f"{m} fio {r + 1}/{repeats}", 1, 1, runs[f"fio_{m}"][-1])
            backend_used = io.backend
    finally:
        target.remove()
    if _runs is not None:
        _runs.update(runs, iomem=iomem, backend_reason=io.backend_reason)

    def med(xs):
        return round(statistics.median(xs), 3) if xs else None

    return {
        "path": path, "backend": backend_used, "block_size": block_size, "queue_depth": queue_depth,
        "threads": threads, "size": size, "read_gbps": med(runs["read"]), "write_gbps": med(runs["write"]),
        "fio": {"read_gbps": med(runs["fio_read"]), "write_gbps": med(runs["fio_write"])} if use_fio else None,
    }


# ---- the command ------------------------------------------------------------------------------

def _ratio(a, b) -> str:
    return f"{a / b:.2f}" if a and b else "-"


def _num(x) -> str:
    return f"{x:.2f}" if x is not None else "-"


def _snippet(result: dict) -> str:
    return (f'offload.AioConfig(backend="{result["backend"]}", block_size={result["block_size"]}, '
            f'queue_depth={result["queue_depth"]}, threads={result["threads"]})')


def _score(result: dict) -> float:
    # Equal bytes each way: the harmonic mean is the rate of a read+write round trip.
    xs = [x for x in (result["read_gbps"], result["write_gbps"]) if x]
    return len(xs) / sum(1 / x for x in xs) if xs else 0.0


def _check_plot_possible(args) -> None:
    if not args.plot:
        return
    if not args.sweep:
        raise ConfigError("--plot", args.plot, "needs --sweep (it plots the grid against queue depth)")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UnsupportedError("--plot needs matplotlib, which is not installed: "
                               "pip install 'offload[plot]' (or pip install matplotlib)") from None


def _plot(results: list[dict], filename: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = [m for m in ("write", "read") if results[0][f"{m}_gbps"] is not None]
    fig, axes = plt.subplots(1, len(modes), figsize=(6 * len(modes), 4), squeeze=False)
    for ax, m in zip(axes[0], modes):
        for bs in sorted({r["block_size"] for r in results}):
            for t in sorted({r["threads"] for r in results}):
                pts = sorted((r["queue_depth"], r[f"{m}_gbps"]) for r in results
                             if r["block_size"] == bs and r["threads"] == t)
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                        linestyle="-" if t == 1 else "--", label=f"{format_bytes(bs)}, {t} thread(s)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("queue depth")
        ax.set_ylabel("GB/s")
        ax.set_title(f"{m} ({results[0]['backend']}, {results[0]['path']})")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(filename, dpi=120)
    plt.close(fig)


def run(args) -> int:
    _check_plot_possible(args)
    size = parse_bytes(args.size, "--size")
    block_size = parse_bytes(args.block_size, "--block-size")
    with scratch_dir(args.path) as path:
        if args.sweep:
            return _run_sweep(args, path, size)
        return _run_one(args, path, size, block_size)


def _run_one(args, path: str, size: int, block_size: int) -> int:
    runs: dict = {}
    result = measure(path, size, block_size, args.queue_depth, args.threads, args.repeats,
                     mode=args.mode, backend=args.backend, with_fio=not args.no_fio, progress=True,
                     _runs=runs)
    print(f"offload bench nvme: {path}, {format_bytes(size)}, block {format_bytes(block_size)}, "
          f"queue depth {args.queue_depth}, threads {args.threads}")
    print(f"backend: {result['backend']} ({runs['backend_reason']})")
    f = result["fio"]
    print(f"{'':8}{'ours GB/s':>11}{'fio GB/s':>11}{'ours/fio':>10}")
    for m in ("write", "read"):
        ours = result[f"{m}_gbps"]
        if ours is None:
            continue
        theirs = f[f"{m}_gbps"] if f else None
        print(f"{m:8}{_num(ours):>11}{_num(theirs):>11}{_ratio(ours, theirs):>10}")
    print(f"median of {args.repeats} repeat(s), ours and fio alternating; runs (GB/s):")
    for m in ("write", "read"):
        if runs[m]:
            line = f"  {m:5} ours " + " ".join(f"{x:.2f}" for x in runs[m])
            if runs[f"fio_{m}"]:
                line += "  fio " + " ".join(f"{x:.2f}" for x in runs[f"fio_{m}"])
            print(line)
    if f is None:
        print("fio: not run (" + ("--no-fio" if args.no_fio else "fio is not on PATH") + ")")
    else:
        print(f"fio: --direct=1 --ioengine=libaio --iomem={runs['iomem']} on the same file")
        if runs["iomem"] != "shmhuge":
            need = fio.hugepages_needed(block_size, args.queue_depth, args.threads)
            print(f"note: fio used 4 KiB-page buffers (not enough free huge pages); its figure may be "
                  f"below the device's. For the honest limit: sysctl vm.nr_hugepages={need} (as root)")
    write_json(args.json, result)
    return 0


def _run_sweep(args, path: str, size: int) -> int:
    results = []
    grid = [(bs, qd, t) for t in SWEEP_THREADS for bs in SWEEP_BLOCK_SIZES for qd in SWEEP_QUEUE_DEPTHS
            if size % (bs * t) == 0]
    if not grid:
        raise ConfigError("--size", args.size, "too small for the sweep grid (needs a multiple of 8 MiB)")
    print(f"offload bench nvme --sweep: {path}, {format_bytes(size)}, {len(grid)} configurations, "
          f"median of {args.repeats}")
    header = f"{'block':>10}{'QD':>5}{'threads':>8}{'write GB/s':>12}{'read GB/s':>11}"
    print(header)
    for bs, qd, t in grid:
        r = measure(path, size, bs, qd, t, args.repeats, mode=args.mode, backend=args.backend,
                    with_fio=False, progress=True)
        results.append(r)
        print(f"{format_bytes(bs):>10}{qd:>5}{t:>8}{_num(r['write_gbps']):>12}{_num(r['read_gbps']):>11}",
              flush=True)
    best = max(results, key=_score)
    print(f"best ({'harmonic mean of read and write' if args.mode == 'both' else args.mode}): "
          f"write {_num(best['write_gbps'])} GB/s, read {_num(best['read_gbps'])} GB/s")
    print(_snippet(best))
    write_json(args.json, best)
    if args.plot:
        _plot(results, args.plot)
        print(f"plot: {args.plot}")
    return 0
