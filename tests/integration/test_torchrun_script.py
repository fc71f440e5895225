"""scripts/finetune_100b.py under ``torchrun --nproc-per-node 2`` on the CPU (gloo): each rank takes
half of every global batch, so two ranks train as one process with the same flags does (same losses,
fp32); rank 0 alone prints and logs; a bad flag, or a failure on one rank only, ends every rank with
one line from rank 0 and a nonzero exit, never a hang."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.finetune_runs import SCRIPT, env
from tests.helpers.hf_models import save_tiny
from tests.helpers.processes import ROOT

pytestmark = pytest.mark.slow
# 4 sequences of 32 tokens a step (2 a rank); small budgets give the tiny model several chunks,
# so both ranks own some.
ARGS = ["--preset", "tiny", "--dtype", "fp32", "--batch-tokens", "128", "--seq-len", "32",
        "--device-budget", "8M", "--cpu-budget", "6M", "--no-plan", "--seed", "0", "--warmup", "2"]
STEPS = 10


def made(args: list[str]) -> list[str]:
    """``args`` with each --nvme-path directory created (the trainer refuses a missing one; a
    ``{rank}`` template's directories are the trainer's to make)."""
    for flag, value in zip(args, args[1:]):
        if flag == "--nvme-path" and "{" not in value:
            Path(value).mkdir(parents=True, exist_ok=True)
    return args


def torchrun(args: list[str], nproc: int = 2, timeout: float = 240) -> subprocess.CompletedProcess:
    made(args)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--standalone",
           str(SCRIPT), *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env(), timeout=timeout, cwd=ROOT)


def ours(stderr: str) -> list[str]:
    """The script's own lines (torchrun adds its banner and, on failure, its report)."""
    return [line for line in stderr.splitlines() if line.startswith(("finetune", "[", "summary", "  "))
            and "torch/distributed" not in line]


def losses(log: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in log.read_text().splitlines()]


def test_two_ranks_train_as_one_process_with_one_log(disk_tmp):
    log2, log1 = disk_tmp / "two.jsonl", disk_tmp / "one.jsonl"
    done = torchrun(ARGS + ["--steps", str(STEPS), "--nvme-path", str(disk_tmp / "nvme"), "--json-log", str(log2)])
    assert done.returncode == 0, done.stderr[-3000:]
    lines = ours(done.stderr)
    # one log: rank 0's header, progress, summary; nothing from rank 1
    assert sum(line.startswith("finetune: llama-tiny") for line in lines) == 1, lines
    assert "over 2 ranks (2 each)" in lines[0]
    assert sum(f"step {STEPS}/{STEPS}" in line for line in lines) == 1
    assert sum(line == "summary" for line in lines) == 1
    assert "rank 1" not in done.stderr and "Traceback" not in done.stderr
    two = losses(log2)
    assert len(two) == STEPS                                   # rank 0 alone writes the JSON log
    assert sum(two[-3:]) < sum(two[:3]), two
    # each rank had swap files of its own (a path without {rank}: a rank<N> subdirectory each)
    assert {p.name for p in (disk_tmp / "nvme").iterdir()} == {"rank0", "rank1"}

    # The same flags in one process see the same global batches: the same losses.
    alone = single(ARGS + ["--steps", str(STEPS), "--nvme-path", str(disk_tmp / "nvme1"), "--json-log", str(log1)])
    assert alone.returncode == 0, alone.stderr[-3000:]
    one = losses(log1)
    for a, b in zip(one, two):
        assert abs(a - b) <= 1e-4 * abs(a), (one, two)


@pytest.mark.parametrize("extra, message", [
    (["--micro-batches", "3"], "finetune: error: --micro-batches=3: must divide each rank's 2 sequences"),
    (["--batch-tokens", "96"], "finetune: error: --batch-tokens=96: is global: its 3 sequences"),
    (["--steps", "x"], "error: argument --steps: invalid int value: 'x'"),
])
def test_a_bad_flag_is_one_line_from_rank_0(disk_tmp, extra, message):
    done = torchrun(ARGS + ["--steps", "2", "--nvme-path", str(disk_tmp / "nvme"), *extra], timeout=120)
    assert done.returncode != 0
    errors = [line for line in done.stderr.splitlines() if "error" in line and "finetune" in line
              and "torch/distributed" not in line and "FAILED" not in line]
    assert errors == [next(line for line in errors if message in line)], done.stderr[-3000:]
    assert 'finetune_100b.py", line' not in done.stderr         # no traceback from the script


def test_a_failure_on_one_rank_stops_every_rank(disk_tmp):
    """Rank 1's NVMe directory cannot be created (a file is in the way): rank 0, which could go on,
    stops at the same point, and says what happened on rank 1."""
    (disk_tmp / "nvme1").write_text("a file, not a directory")
    done = torchrun(ARGS + ["--steps", "2", "--nvme-path", str(disk_tmp / "nvme{rank}")], timeout=120)
    assert done.returncode != 0
    errors = [line for line in done.stderr.splitlines() if line.startswith("finetune: error")]
    assert len(errors) == 1, done.stderr[-3000:]
    assert errors[0].startswith("finetune: error: rank 1: --nvme-path=") and "cannot be created" in errors[0]
    assert str(disk_tmp / "nvme1") in errors[0]
    assert 'finetune_100b.py", line' not in done.stderr


def single(args: list[str]) -> subprocess.CompletedProcess:
    made(args)
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env(),
                          timeout=240, cwd=ROOT)


def test_a_checkpoint_resumes_at_another_world_size(disk_tmp):
    """Saved by 2 ranks, resumed by 1 process; saved by 1, resumed by 2 ranks: the resumed steps
    are the ones the saving run went on to take (the checkpoint is resharded by chunk index)."""
    from offload.checkpoint import list_checkpoints

    def run(launch, tag: str, *extra: str) -> list[float]:
        log = disk_tmp / f"{tag}.jsonl"
        done = launch(ARGS + ["--steps", "8", "--nvme-path", str(disk_tmp / f"nvme-{tag}"),
                              "--json-log", str(log), *extra])
        assert done.returncode == 0, done.stderr[-3000:]
        return losses(log)

    def step4(tag: str) -> Path:
        """A checkpoint directory holding only the step-4 checkpoint of run ``tag``."""
        first = list_checkpoints(disk_tmp / f"ckpt-{tag}")[0]
        target = disk_tmp / f"from-{tag}"
        shutil.copytree(first, target / first.name)
        return target

    for saver, resumer, tag in ((torchrun, single, "two"), (single, torchrun, "one")):
        straight = run(saver, tag, "--checkpoint-dir", str(disk_tmp / f"ckpt-{tag}"), "--checkpoint-every", "4")
        resumed = run(resumer, tag + "-resumed", "--checkpoint-dir", str(step4(tag)), "--resume")
        assert len(straight) == 8 and len(resumed) == 4, (straight, resumed)
        for a, b in zip(straight[4:], resumed):
            assert abs(a - b) <= 1e-4 * abs(a), (tag, straight, resumed)


def test_two_ranks_write_the_model_one_process_would(disk_tmp):
    """--model DIR --output DIR under 2 ranks: one HF directory, with the weights one process with
    the same flags trains (to fp32 rounding: the gradients are averaged over two halves)."""
    transformers = pytest.importorskip("transformers")
    src = save_tiny(disk_tmp / "src", "llama")
    data = disk_tmp / "data.txt"
    data.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    args = ["--model", str(src), "--data", str(data), "--steps", "3", "--batch-tokens", "128", "--seq-len", "32",
            "--dtype", "fp32", "--device-budget", "1M", "--cpu-budget", "1M", "--no-plan", "--lr", "1e-2",
            "--warmup", "1", "--max-shard-size", "20KB", "--byte-tokens"]
    two = torchrun(args + ["--nvme-path", str(disk_tmp / "nvme2"), "--output", str(disk_tmp / "out2")])
    assert two.returncode == 0, two.stderr[-3000:]
    one = single(args + ["--nvme-path", str(disk_tmp / "nvme1"), "--output", str(disk_tmp / "out1")])
    assert one.returncode == 0, one.stderr[-3000:]
    load = lambda d: transformers.AutoModelForCausalLM.from_pretrained(str(d)).state_dict()  # noqa: E731
    mine, theirs = load(disk_tmp / "out2"), load(disk_tmp / "out1")
    assert mine.keys() == theirs.keys()
    for name, value in theirs.items():
        assert (mine[name] - value).abs().max() <= 1e-4 * max(1.0, value.abs().max().item()), name
