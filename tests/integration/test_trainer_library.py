"""The trainer as a library and as ``offload finetune``: a TOML file gives the same run as the
flags; a ``Trainer`` subclass with its own loss trains with it; ``--resume`` before any checkpoint
starts fresh, and a checkpoint resumes under other budgets (the model is built with the chunk size
it was written with); a preset run writes ``--output`` (in ``--output-dtype``); ``--tensorboard``
gets the step figures.
Each run is the tiny preset on the CPU with budgets below its state (NVMe forced)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import finetune_runs as runs
from tests.helpers.processes import ROOT

pytestmark = pytest.mark.slow
ARGS = [a for a in runs.TRAIN_ARGS]


def losses(log: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in log.read_text().splitlines()]


def script(*argv: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, str(runs.SCRIPT), *argv], env=runs.env(), capture_output=True,
                          text=True, timeout=600, cwd=cwd)
    return done


def test_offload_finetune_with_a_config_file_is_the_run_of_the_flags(disk_tmp):
    (disk_tmp / "nvme").mkdir()
    flags = ARGS + ["--steps", "3", "--nvme-path", str(disk_tmp / "nvme")]
    done = script(*flags, "--json-log", str(disk_tmp / "flags.jsonl"))
    assert done.returncode == 0, done.stderr[-3000:]
    run = disk_tmp / "run.toml"
    run.write_text(f'''
[model]
preset = "tiny"
dtype = "fp32"
[data]
batch_tokens = 64
seq_len = 32
seed = 0
[optimizer]
steps = 5
[budgets]
device_budget = "6M"
cpu_budget = "6M"
no_plan = true
nvme_path = ["{disk_tmp / 'nvme'}"]
''')
    done = subprocess.run([sys.executable, "-m", "offload", "finetune", "--config", str(run), "--steps", "3",
                           "--json-log", str(disk_tmp / "toml.jsonl")], env=runs.env(), capture_output=True,
                          text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert losses(disk_tmp / "toml.jsonl") == losses(disk_tmp / "flags.jsonl")
    assert len(losses(disk_tmp / "toml.jsonl")) == 3


def test_a_trainer_subclass_trains_with_its_own_loss(disk_tmp):
    from offload.train import Trainer
    from offload.train.flags import parse

    (disk_tmp / "nvme").mkdir()
    argv = ARGS + ["--steps", "2", "--nvme-path", str(disk_tmp / "nvme")]

    class Doubled(Trainer):
        def compute_loss(self, input_ids, labels):
            self.calls = getattr(self, "calls", 0) + 1
            return 2.0 * super().compute_loss(input_ids, labels)

    plain = Trainer(parse(argv + ["--json-log", str(disk_tmp / "plain.jsonl")]))
    assert plain.train() == 0
    doubled = Doubled(parse(argv + ["--json-log", str(disk_tmp / "doubled.jsonl")]))
    assert doubled.train() == 0
    assert doubled.calls == 2 and doubled.losses == losses(disk_tmp / "doubled.jsonl")
    first, = losses(disk_tmp / "plain.jsonl")[:1]
    assert doubled.losses[0] == pytest.approx(2 * first, rel=1e-6)     # the same first batch and weights


def test_resume_starts_fresh_without_a_checkpoint_and_resumes_under_other_budgets(disk_tmp):
    nvme, ckpt = disk_tmp / "nvme", disk_tmp / "ckpt"
    nvme.mkdir()
    first = ARGS + ["--steps", "4", "--nvme-path", str(nvme), "--checkpoint-dir", str(ckpt),
                    "--checkpoint-every", "2", "--json-log", str(disk_tmp / "a.jsonl")]
    # One requeue command covers the first launch: no checkpoint yet, so it starts at step 0.
    done = script(*first, "--resume")
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"finetune: no checkpoint in {ckpt} yet: starting from step 0" in done.stderr
    straight = losses(disk_tmp / "a.jsonl")
    # Resume the step-2 checkpoint with twice the CPU budget (another auto chunk size).
    resumed = disk_tmp / "resumed"
    resumed.mkdir()
    step2 = sorted(ckpt.glob("step-*"))[0]
    subprocess.run(["cp", "-r", str(step2), str(resumed / step2.name)], check=True)
    (resumed / "latest").write_text(step2.name + "\n")
    args = [a if a != "6M" else "12M" for a in ARGS]
    done = script(*args, "--steps", "4", "--nvme-path", str(nvme), "--checkpoint-dir", str(resumed), "--resume",
                  "--json-log", str(disk_tmp / "b.jsonl"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"resumed from {resumed / step2.name} at step 2" in done.stderr
    assert losses(disk_tmp / "b.jsonl") == pytest.approx(straight[2:], rel=1e-5)


def test_a_preset_run_writes_its_output_in_the_dtype_asked(disk_tmp):
    pytest.importorskip("safetensors")
    from safetensors import safe_open

    (disk_tmp / "nvme").mkdir()
    out = disk_tmp / "out"
    done = script(*ARGS, "--steps", "2", "--nvme-path", str(disk_tmp / "nvme"), "--output", str(out),
                  "--output-dtype", "bf16", "--tensorboard", str(disk_tmp / "tb"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"finetune: wrote the model to {out}" in done.stderr
    assert (out / "config.json").is_file()
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert {str(f.get_slice(k).get_dtype()) for k in f.keys()} == {"BF16"}
    assert list((disk_tmp / "tb").glob("events.out.tfevents.*"))
