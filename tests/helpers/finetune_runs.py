"""``scripts/finetune_100b.py`` driven from outside, as a user runs it: the command line, the
environment, its JSON log, and its checkpoints compared byte for byte.

Shared by the script's integration tests and the soak (``benchmarks/soak.py``, which kills and
resumes the same runs). ``TRAIN_ARGS`` is the tiny preset with budgets below its state, so
chunks spill to NVMe, and small enough batches that every step is quick.

Every run has ``OMP_NUM_THREADS=1``: deterministic CPU kernels, and on a 2-core box torch's own
threads otherwise fight the engine's I/O and Adam threads (steps run ~30x slower).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from .processes import ROOT, python_env

SCRIPT = ROOT / "scripts" / "finetune_100b.py"
TRAIN_ARGS = ["--preset", "tiny", "--dtype", "fp32", "--batch-tokens", "64", "--seq-len", "32",
              "--device-budget", "6M", "--cpu-budget", "6M", "--no-plan", "--seed", "0"]
# The chunk files whose bytes a resumed run must reproduce.
COMPARED = ("param.bin", "master.bin", "exp_avg.bin", "exp_avg_sq.bin")
# torchrun's variables: a run started from a test is one process unless torchrun starts it.
RANK_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def env() -> dict:
    """The environment of a script run: this checkout first on PYTHONPATH, one OpenMP thread."""
    e = python_env(OMP_NUM_THREADS="1")
    for name in RANK_VARIABLES:
        e.pop(name, None)
    return e


def command(steps: int, nvme: Path, ckpt: Path, log: Path, *, resume: bool, extra: list[str] = ()) -> list[str]:
    """A ``TRAIN_ARGS`` run of ``steps`` steps with a checkpoint after every step (two kept);
    the NVMe directory ``nvme`` is created (the trainer refuses one that does not exist)."""
    Path(nvme).mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(SCRIPT), *TRAIN_ARGS, "--steps", str(steps), "--nvme-path", str(nvme),
           "--checkpoint-dir", str(ckpt), "--checkpoint-every", "1", "--keep-checkpoints", "2",
           "--json-log", str(log), *extra]
    return cmd + (["--resume"] if resume else [])


def logged_steps(log: Path) -> list[dict]:
    """Steps logged so far (a line cut short by a kill is left out)."""
    try:
        lines = log.read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def run_to_end(cmd: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    """Run ``cmd`` with ``env()``; raises RuntimeError (with its stderr's tail) unless it exits 0."""
    done = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode}:\n{done.stderr[-3000:]}")
    return done


def final_checkpoint(ckpt: Path) -> Path:
    """The checkpoint a resume from directory ``ckpt`` would load."""
    from offload.checkpoint import resolve_checkpoint

    return resolve_checkpoint(ckpt)


def compare(a: Path, b: Path) -> list[str]:
    """Differences between two checkpoints' state (chunk files byte for byte, step counts)."""
    diffs = []
    for name in COMPARED:
        fa, fb = a / name, b / name
        if fa.exists() != fb.exists():
            diffs.append(f"{name}: in one checkpoint only")
        elif fa.exists() and fa.read_bytes() != fb.read_bytes():
            diffs.append(f"{name}: bytes differ")
    ma, mb = (json.loads((p / "manifest.json").read_text()) for p in (a, b))
    for key in ("step", "engine_step_count", "adam_steps", "layout"):
        if ma[key] != mb[key]:
            diffs.append(f"manifest {key}: {ma[key]!r:.60} vs {mb[key]!r:.60}")
    for kind in ma["kinds"]:
        crcs = [[e and e.get(ma["checksum"]) for e in m["kinds"][kind]["chunks"]] for m in (ma, mb)]
        if crcs[0] != crcs[1]:
            diffs.append(f"{kind}: chunk checksums differ")
    return diffs
