"""``torchrun --nproc-per-node 2 -m offload finetune --preset tiny --pp 2 --schedule 1f1b`` (issue 28):
two pipeline stages train with the loss falling and one log (rank 0's, the last stage's loss
brought to it); its checkpoint resumes in one process (--pp 1) taking the steps the pipeline run
took (and two stages again exactly), and a one-process checkpoint resumes under --pp 2 (resharded by layer; the tied preset's
head untied from its embedding); a bad combination is one line from rank 0."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.finetune_runs import env
from tests.helpers.processes import ROOT

pytestmark = pytest.mark.slow
# 8 sequences of 32 tokens a step, 2 micro-batches; budgets below the state: chunks spill to NVMe
ARGS = ["--preset", "tiny", "--dtype", "fp32", "--batch-tokens", "256", "--seq-len", "32", "--device-budget", "8M",
        "--cpu-budget", "6M", "--no-plan", "--seed", "0", "--warmup", "2", "--micro-batches", "2"]
STEPS, SAVE_AT = 8, 4


def finetune(args: list[str], nproc: int = 1, timeout: float = 240) -> subprocess.CompletedProcess:
    for flag, value in zip(args, args[1:]):
        if flag == "--nvme-path":
            Path(value).mkdir(parents=True, exist_ok=True)
    launcher = ["-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--standalone"] if nproc > 1 else []
    return subprocess.run([sys.executable, *launcher, "-m", "offload", "finetune", *args], capture_output=True,
                          text=True, env=env(), timeout=timeout, cwd=ROOT)


def losses(log: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in log.read_text().splitlines()]


def run_args(tmp: Path, name: str, steps: int, *extra: str) -> list[str]:
    return [*ARGS, "--steps", str(steps), "--nvme-path", str(tmp / f"nvme-{name}"), "--json-log",
            str(tmp / f"{name}.jsonl"), *extra]


def test_two_stages_train_and_their_checkpoint_resumes_in_one_process(disk_tmp):
    ckpt = disk_tmp / "ckpt"
    done = finetune(run_args(disk_tmp, "pp2", STEPS, "--pp", "2", "--schedule", "1f1b", "--checkpoint-dir", str(ckpt),
                             "--checkpoint-every", str(SAVE_AT), "--keep-checkpoints", "3"), nproc=2)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "2 pipeline ranks (2 stages) x 1 data-parallel ranks, --schedule 1f1b" in done.stderr
    assert sum(f"step {STEPS}/{STEPS}" in line for line in done.stderr.splitlines()) == 1   # rank 0 alone
    assert "Traceback" not in done.stderr
    two = losses(disk_tmp / "pp2.jsonl")
    assert len(two) == STEPS and sum(two[-3:]) < sum(two[:3]) - 0.5, two
    saved = ckpt / f"step-{SAVE_AT:08d}"
    manifest = json.loads((saved / "pipeline.json").read_text())
    assert manifest["pp"] == 2 and [s["dir"] for s in manifest["stages"]] == ["stage-000", "stage-001"]
    assert "lm_head.weight" in manifest["stages"][1]["names"].values()

    (ckpt / "latest").write_text(saved.name + "\n")          # resume the middle one
    one = finetune(run_args(disk_tmp, "pp1", STEPS, "--checkpoint-dir", str(ckpt), "--resume"))
    assert one.returncode == 0, one.stderr[-3000:]
    assert "resharded by layer" in one.stderr and f"resumed from {saved} at step {SAVE_AT}" in one.stderr
    resumed = losses(disk_tmp / "pp1.jsonl")
    # the same steps: only the summation order of a few float sums differs
    assert len(resumed) == STEPS - SAVE_AT
    for a, b in zip(resumed, two[SAVE_AT:]):
        assert abs(a - b) <= 1e-5 * abs(b), (resumed, two)

    # the same cut again: each stage loads its own engine checkpoint, the steps are the same ones
    (ckpt / "latest").write_text(saved.name + "\n")
    again = finetune(run_args(disk_tmp, "again", STEPS, "--pp", "2", "--checkpoint-dir", str(ckpt), "--resume"),
                     nproc=2)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resharded" not in again.stderr and f"resumed from {saved} at step {SAVE_AT}" in again.stderr
    assert losses(disk_tmp / "again.jsonl") == two[SAVE_AT:]


def test_a_one_process_checkpoint_resumes_in_two_stages(disk_tmp):
    ckpt = disk_tmp / "ckpt"
    one = finetune(run_args(disk_tmp, "pp1", SAVE_AT + 1, "--checkpoint-dir", str(ckpt),
                            "--checkpoint-every", str(SAVE_AT)))
    assert one.returncode == 0, one.stderr[-3000:]
    (ckpt / "latest").write_text(f"step-{SAVE_AT:08d}\n")
    two = finetune(run_args(disk_tmp, "pp2", SAVE_AT + 2, "--pp", "2", "--checkpoint-dir", str(ckpt), "--resume"),
                   nproc=2)
    assert two.returncode == 0, two.stderr[-3000:]
    assert "resharded by layer" in two.stderr
    # the first resumed step runs the saved weights (the head a copy of the tied embedding): the
    # one-process run's loss of that step
    first = losses(disk_tmp / "pp2.jsonl")[0]
    want = losses(disk_tmp / "pp1.jsonl")[SAVE_AT]
    assert abs(first - want) <= 1e-5 * abs(want), (first, want)


def test_a_bad_pipeline_combination_is_one_line_from_rank_0(disk_tmp):
    done = finetune(run_args(disk_tmp, "bad", 2, "--pp", "2", "--micro-batches", "1"), nproc=2)
    assert done.returncode != 0
    errors = [line for line in done.stderr.splitlines() if ": error" in line and line.startswith(("offload", "finetune"))]
    assert errors == ["offload: error: --micro-batches=1: must be >= the 2 stages under --schedule 1f1b"], \
        done.stderr[-2000:]
    assert "(rank 1)" not in done.stderr      # rank 0 speaks for both (torchrun adds its own report)
