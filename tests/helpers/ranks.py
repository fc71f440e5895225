"""The test suite's one multi-process launcher: N ranks of a process group on this host.

``launch("tests.helpers.dp_worker:main", spec, world, tmp)`` starts ``world`` interpreters, each
running ``python -m tests.helpers.ranks TARGET SPEC RESULT`` with torchrun's variables (RANK,
WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and the repository root on
PYTHONPATH. Each rank calls ``TARGET(spec)`` (``module:function``, any picklable ``spec``) and
sets up its process group itself (the backend and timeout are the test's to choose); what it
returns comes back as ``RankResult.value``. A rank that raises prints ``RANK-ERROR Type: message``
(what tests read when a failure is the expected outcome) with its traceback and exits 1.

Processes, not threads: each rank is a separate interpreter as under torchrun. A run that does
not end within ``timeout_s`` is killed and reported as a hang (``returncode`` None: a test
failure, never a stuck suite).
"""

from __future__ import annotations

import importlib
import pickle
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .processes import python_env


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for MASTER_PORT)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RankResult:
    rank: int
    returncode: int | None      # None: killed after the timeout
    output: str                 # stdout and stderr together
    value: object = None        # what the target returned (None when it raised or was killed)


def launch(target: str, spec, world: int, tmp: Path, *, timeout_s: float = 240,
           env: dict | None = None) -> list[RankResult]:
    """Run ``target(spec)`` on ``world`` ranks; their results, by rank. ``env``: extra variables."""
    run = f"{time.monotonic_ns()}"
    spec_path = tmp / f"spec-{run}.pkl"
    spec_path.write_bytes(pickle.dumps(spec))
    port = free_port()
    procs = []
    for rank in range(world):
        e = python_env(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1", **(env or {}))
        log = open(tmp / f"rank{rank}-{run}.log", "w+")
        result = tmp / f"result-{run}.rank{rank}.pkl"
        procs.append((subprocess.Popen([sys.executable, "-m", __name__, target, str(spec_path), str(result)],
                                       env=e, stdout=log, stderr=subprocess.STDOUT), log, result))
    deadline = time.monotonic() + timeout_s
    results = []
    for rank, (proc, log, result) in enumerate(procs):
        try:
            code = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            code = None
        log.seek(0)
        value = pickle.loads(result.read_bytes()) if code == 0 and result.exists() else None
        results.append(RankResult(rank, code, log.read(), value))
        log.close()
        result.unlink(missing_ok=True)
    return results


def _run_rank(target: str, spec_path: str, result_path: str) -> None:
    module, _, function = target.partition(":")
    fn = getattr(importlib.import_module(module), function)
    try:
        value = fn(pickle.loads(Path(spec_path).read_bytes()))
    except Exception as exc:
        # What the test reads: the error this rank ended with, on one line (then the traceback).
        print(f"RANK-ERROR {type(exc).__name__}: {exc}", flush=True)
        raise
    Path(result_path).write_bytes(pickle.dumps(value))


if __name__ == "__main__":
    _run_rank(*sys.argv[1:4])
