"""``torchrun --nproc-per-node 2 -m offload finetune`` (the README's command) refusing a
checkpoint (issue 26 review): a checkpoint directory whose extra.pt carries a pickled object
(checksums made to match, as someone who wrote it would) is refused by weights_only on every
rank; the run stops with ONE line from rank 0 (it printed the same line once per rank) and the
object's code never runs. A one-process checkpoint of one chunk resumed on two ranks leaves rank 1
without work: said in one note, not silently."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from offload.checkpoint import format as fmt
from tests.helpers.finetune_runs import env
from tests.helpers.processes import ROOT

pytestmark = pytest.mark.slow
ARGS = ["--preset", "tiny", "--dtype", "fp32", "--batch-tokens", "128", "--seq-len", "32",
        "--device-budget", "8M", "--cpu-budget", "6M", "--no-plan", "--seed", "0"]


class Planted:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.makedirs, (self.marker,))


def finetune(args: list[str], nproc: int) -> subprocess.CompletedProcess:
    launch = ["-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--standalone", "-m"] if nproc > 1 \
        else ["-m"]
    return subprocess.run([sys.executable, *launch, "offload", "finetune", *ARGS, *args], capture_output=True,
                          text=True, env=env(), timeout=300, cwd=ROOT)


def test_a_planted_pickle_stops_two_ranks_with_one_line(disk_tmp):
    nvme, ckpt, marker = disk_tmp / "nvme", disk_tmp / "ckpt", disk_tmp / "planted"
    nvme.mkdir()
    common = ["--nvme-path", str(nvme), "--checkpoint-dir", str(ckpt)]
    done = finetune(common + ["--steps", "2"], nproc=2)
    assert done.returncode == 0, done.stderr[-3000:]
    step = ckpt / "step-00000002"
    torch.save({"step": Planted(str(marker))}, step / "extra.pt")
    manifest = json.loads((step / "manifest.json").read_text())
    manifest.pop(fmt.MANIFEST_CRC)
    data = (step / "extra.pt").read_bytes()
    algo = manifest["checksum"]
    manifest["extra_file"] = {"file": "extra.pt", "bytes": len(data), algo: fmt.checksum_bytes(algo, data)}
    (step / "manifest.json").write_bytes(fmt.manifest_bytes(manifest))

    run = finetune(common + ["--steps", "4", "--resume"], nproc=2)
    assert run.returncode != 0
    assert not marker.exists()
    refusals = [line for line in run.stderr.splitlines() if "refused unread" in line]
    assert len(refusals) == 1, run.stderr[-3000:]
    assert "extra.pt" in refusals[0] and "Traceback" not in refusals[0]


def test_resuming_a_one_chunk_checkpoint_on_two_ranks_slices_it(disk_tmp):
    # One process with the default budgets lays the tiny preset out as one chunk; the checkpoint
    # keeps that layout, and on two ranks each keeps half of that chunk: no rank is idle (the
    # round-robin scheme said "rank(s) 1 own none" here).
    nvme, ckpt = disk_tmp / "nvme", disk_tmp / "ckpt"
    nvme.mkdir()
    common = ["--nvme-path", str(nvme), "--checkpoint-dir", str(ckpt)]
    defaults = [a for a in ARGS if a not in ("--device-budget", "8M", "--cpu-budget", "6M")]
    one = subprocess.run([sys.executable, "-m", "offload", "finetune", *defaults, *common, "--steps", "1"],
                         capture_output=True, text=True, env=env(), timeout=300, cwd=ROOT)
    assert one.returncode == 0 and "in 1 chunks" in one.stderr, one.stderr[-2000:]
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
                          "-m", "offload", "finetune", *defaults, *common, "--steps", "2", "--resume"],
                         capture_output=True, text=True, env=env(), timeout=300, cwd=ROOT)
    assert two.returncode == 0, two.stderr[-3000:]
    assert "in 1 chunks" in two.stderr and "own none" not in two.stderr, two.stderr[-3000:]
