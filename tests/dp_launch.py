"""Launch N real processes of a gloo process group on this host and collect what they left.

Processes, not threads: each rank is a separate interpreter as under torchrun. A run that
does not end within ``timeout_s`` is killed and reported as a hang (a test failure, never a
stuck suite).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RankResult:
    rank: int
    returncode: int | None      # None: killed after the timeout
    output: str


def launch(script: Path, spec: dict, world: int, tmp: Path, *, timeout_s: float = 240,
           env: dict | None = None) -> list[RankResult]:
    spec_path = tmp / f"spec-{time.monotonic_ns()}.json"
    spec_path.write_text(json.dumps(spec))
    port = free_port()
    procs = []
    for rank in range(world):
        e = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                 LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                 OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        e.update(env or {})
        log = open(tmp / f"rank{rank}-{port}.log", "w+")
        procs.append((subprocess.Popen([sys.executable, str(script), str(spec_path)], env=e,
                                       stdout=log, stderr=subprocess.STDOUT), log))
    deadline = time.monotonic() + timeout_s
    results = []
    for rank, (proc, log) in enumerate(procs):
        try:
            code = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            code = None
        log.seek(0)
        results.append(RankResult(rank, code, log.read()))
        log.close()
    return results
