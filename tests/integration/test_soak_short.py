"""The soak in short: two kill -9s (one at a random moment, one inside a checkpoint write), each
resumed; the final parameters and optimizer state equal an uninterrupted run's byte for byte,
and no kill leaves anything in the NVMe directory or a checkpoint that does not verify."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow


def test_two_kills_end_bit_identical(soak, reference_run, disk_tmp):
    reference, steps = reference_run
    report = soak.kill_and_resume(disk_tmp, steps, kills=2, seed=1, say=lambda m: None, reference=reference)
    assert len(report["kills"]) == 2
    assert report["kills"][1]["mode"] == "in-save"
    assert report["nvme_clean_after_every_kill"], report["kills"]
    assert report["checkpoints_verify_after_every_kill"], report["kills"]
    assert report["bit_identical"], report["differences"]
