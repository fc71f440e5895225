"""Fixtures shared by the fine-tuning script's integration tests."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest

from tests.helpers import finetune_runs
from tests.helpers.processes import ROOT

REFERENCE_STEPS = 8


@pytest.fixture(scope="session")
def reference_run():
    """An uninterrupted ``finetune_100b.py`` run of ``REFERENCE_STEPS`` steps (finetune_runs.TRAIN_ARGS,
    a checkpoint every step): the final checkpoint that interrupted runs must reproduce.
    Yields ``(work directory, steps)``."""
    base = ROOT / ".pytest-tmp"
    base.mkdir(exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=base))
    try:
        finetune_runs.run_to_end(finetune_runs.command(REFERENCE_STEPS, work / "nvme", work / "ckpt",
                                                       work / "log.jsonl", resume=False))
        yield work, REFERENCE_STEPS
    finally:
        shutil.rmtree(work, ignore_errors=True)
