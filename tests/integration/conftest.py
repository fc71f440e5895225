"""Fixtures shared by the fine-tuning script's integration tests."""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
REFERENCE_STEPS = 8


@pytest.fixture(scope="session")
def soak():
    """``benchmarks/soak.py`` as a module (its run helpers drive the script in subprocesses)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import soak as module
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return module


@pytest.fixture(scope="session")
def reference_run(soak):
    """An uninterrupted ``finetune_100b.py`` run of ``REFERENCE_STEPS`` steps (soak.TRAIN_ARGS,
    a checkpoint every step): the final checkpoint that interrupted runs must reproduce.
    Yields ``(work directory, steps)``."""
    base = ROOT / ".pytest-tmp"
    base.mkdir(exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=base))
    try:
        soak.run_to_end(soak.command(REFERENCE_STEPS, work / "nvme", work / "ckpt", work / "log.jsonl",
                                     resume=False))
        yield work, REFERENCE_STEPS
    finally:
        shutil.rmtree(work, ignore_errors=True)
