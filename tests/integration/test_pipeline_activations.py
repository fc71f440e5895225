"""Pipeline-aware activation offload inside pipeline stages (issue 28): stages that recompute their
layers park each layer's input under 1F1B, spilling to NVMe from an area smaller than stage 0's
micro-batches in flight, in the order backward needs them (forward order across micro-batches),
and still train exactly like one process of plain PyTorch."""

from __future__ import annotations

import pytest

from tests.integration.test_pipeline_stages import Reference, config, run

pytestmark = pytest.mark.slow


def test_stages_parking_and_spilling_activations_under_1f1b_train_like_one_process(tmp_path):
    want = Reference()
    # A boundary is 2 x 16 x 256 fp32 = 32 KiB; stage 0 holds 2 micro-batches x 2 layers of them
    # before its first backward: a 64 KiB area spills.
    cfg = dict(config(tmp_path), activation_offload="nvme", activation_budget="64KiB", activation_prefetch=1)
    results = run(tmp_path, "1f1b", checkpointing=True, config=cfg)
    for r in results:
        assert r.returncode == 0, f"rank {r.rank} exited with {r.returncode}:\n{r.output[-4000:]}"
    want.check(results)
    first = results[0].value["activations"][0]      # stage 0, the last step
    assert first["order"] == "micro-batches" and first["parked"] > 0, first
    assert first["bytes"]["cpu->nvme"] > 0 and first["area_peak"] <= 64 << 10, first
