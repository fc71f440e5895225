"""The soak in short, run as its users run it (``python benchmarks/soak.py``): two kill -9s (one at
a random moment, one inside a checkpoint write), each resumed; the final parameters and optimizer
state equal an uninterrupted run's byte for byte, and no kill leaves anything in the NVMe directory
or a checkpoint that does not verify."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers import finetune_runs
from tests.helpers.processes import ROOT

pytestmark = pytest.mark.slow


def test_two_kills_end_bit_identical(reference_run, disk_tmp):
    reference, steps = reference_run
    out = disk_tmp / "soak.json"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "soak.py"), "--kills", "2", "--steps", str(steps),
                           "--seed", "1", "--leak-steps", "0", "--work", str(disk_tmp / "work"),
                           "--reference", str(reference), "--json", str(out)],
                          capture_output=True, text=True, env=finetune_runs.env(), timeout=900)
    assert out.exists(), done.stderr[-3000:]
    report = json.loads(out.read_text())["kill_and_resume"]
    assert len(report["kills"]) == 2
    assert report["kills"][1]["mode"] == "in-save"
    assert report["nvme_clean_after_every_kill"], report["kills"]
    assert report["checkpoints_verify_after_every_kill"], report["kills"]
    assert report["bit_identical"], report["differences"]
    assert done.returncode == 0, done.stdout[-3000:]
