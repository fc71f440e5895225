"""Run a multi-process benchmark's ranks on this machine (gloo over a free local port) and collect
what each rank wrote: the benchmarks' one way to start ranks without torchrun."""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile

from .workload import BenchStepError


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(run_rank, world: int, spec: dict, *, prefix: str) -> list[dict]:
    """Run ``run_rank(rank, world, port, spec, outdir)`` on ``world`` processes to completion; the
    JSON each wrote to ``outdir/rank{r}.json``, by rank. A rank's failure is a BenchStepError."""
    import torch.multiprocessing as mp

    outdir = tempfile.mkdtemp(prefix=prefix)
    try:
        try:
            mp.start_processes(run_rank, args=(world, free_port(), spec, outdir), nprocs=world,
                               join=True, start_method="spawn")
        except mp.ProcessRaisedException as exc:
            last = str(exc).strip().splitlines()[-1]
            raise BenchStepError(f"rank {exc.error_index} of {world} failed: {last}") from None
        except mp.ProcessExitedException as exc:
            raise BenchStepError(f"rank {exc.error_index} of {world} exited with code {exc.exit_code}") from None
        results = []
        for r in range(world):
            with open(os.path.join(outdir, f"rank{r}.json")) as fh:
                results.append(json.load(fh))
        return results
    finally:
        shutil.rmtree(outdir, ignore_errors=True)
