"""fio as the reference for ``offload bench nvme``: the same file, block size, queue depth and
threads, O_DIRECT through the libaio engine, with huge-page buffers when the kernel has them.

Buffers matter on virtio disks: a 1 MiB request over 4 KiB pages needs more segments than
the queue takes and is split, so fio's default ``malloc`` buffers under-report the device.
``--iomem=shmhuge`` (hugetlb pages, needs ``vm.nr_hugepages``) is the honest limit; without
enough free huge pages fio runs with ``malloc`` and the report says so.
"""

from __future__ import annotations

import json
import shutil
import subprocess

HUGE_PAGE = 2 << 20


def available() -> bool:
    return shutil.which("fio") is not None


def free_hugepage_bytes() -> int:
    """Bytes of free hugetlb pages (``HugePages_Free`` x ``Hugepagesize``)."""
    info = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                info[key] = rest.split()
    except OSError:
        return 0
    try:
        return int(info["HugePages_Free"][0]) * int(info["Hugepagesize"][0]) * 1024
    except (KeyError, ValueError, IndexError):
        return 0


def iomem_for(block_size: int, queue_depth: int, threads: int) -> str:
    """``shmhuge`` when the free huge pages hold every job's buffers, else ``malloc``."""
    per_job = -(-(block_size * queue_depth + HUGE_PAGE) // HUGE_PAGE) * HUGE_PAGE
    return "shmhuge" if free_hugepage_bytes() >= per_job * threads else "malloc"


def hugepages_needed(block_size: int, queue_depth: int, threads: int) -> int:
    """``vm.nr_hugepages`` that lets fio use ``shmhuge`` for this configuration."""
    return threads * (-(-(block_size * queue_depth + HUGE_PAGE) // HUGE_PAGE))


def command(filename: str, rw: str, *, size: int, block_size: int, queue_depth: int, threads: int,
            iomem: str) -> list[str]:
    part = size // threads
    return ["fio", "--name=offload-bench", f"--filename={filename}", f"--rw={rw}",
            f"--size={part}", f"--offset_increment={part}", f"--numjobs={threads}",
            f"--bs={block_size}", f"--iodepth={queue_depth}", "--direct=1", "--ioengine=libaio",
            f"--iomem={iomem}", "--thread", "--group_reporting", "--fallocate=none",
            "--output-format=json"]


def run(filename: str, rw: str, *, size: int, block_size: int, queue_depth: int, threads: int,
        iomem: str) -> float:
    """GB/s (1e9 bytes per second) of one fio pass of ``rw`` ("read" or "write") over the file."""
    cmd = command(filename, rw, size=size, block_size=block_size, queue_depth=queue_depth,
                  threads=threads, iomem=iomem)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"fio failed ({done.returncode}): {done.stderr.strip()[-500:]}")
    text = done.stdout[done.stdout.index("{"):]     # fio may print notes before the JSON
    report = json.loads(text)
    job = report["jobs"][0]
    return job[rw]["bw_bytes"] / 1e9
