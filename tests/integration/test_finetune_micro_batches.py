"""The trainer (``offload finetune``, scripts/finetune_100b.py) with gradient accumulation: a step's sequences split into
``--micro-batches`` passes trains as the one-pass step does (fp32: the gradients add up in fp32),
and a count that does not divide the step's sequences is a one-line error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from offload import ConfigError
from offload.train.cli import main
from offload.train.flags import parse
from offload.train.inputs import check_config

pytestmark = pytest.mark.slow


def losses(tmp: Path, micro: int) -> list[float]:
    log = tmp / f"log-{micro}.jsonl"
    (tmp / f"nvme-{micro}").mkdir()
    argv = ["--preset", "tiny", "--steps", "3", "--dtype", "fp32", "--batch-tokens", "512", "--seq-len", "64",
            "--device-budget", "6M", "--cpu-budget", "8M", "--nvme-path", str(tmp / f"nvme-{micro}"),
            "--no-plan", "--micro-batches", str(micro), "--json-log", str(log)]
    assert main(argv) == 0
    return [json.loads(line)["loss"] for line in log.read_text().splitlines()]


def test_micro_batches_train_as_one_pass(disk_tmp):
    one, four = losses(disk_tmp, 1), losses(disk_tmp, 4)
    assert len(one) == len(four) == 3
    for a, b in zip(one, four):
        assert abs(a - b) <= 1e-4 * abs(a), (one, four)
    assert four[-1] < four[0]


def test_micro_batches_must_divide_the_sequences():
    config = parse(["--preset", "tiny", "--batch-tokens", "512", "--seq-len", "64", "--micro-batches", "3"])
    with pytest.raises(ConfigError, match="--micro-batches"):
        check_config(config)
