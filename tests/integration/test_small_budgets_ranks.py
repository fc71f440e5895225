"""Issue 27 review (R1): budgets the planner calls a fit must train under N ranks as they do in one
process. offload's tiny Llama at an explicit chunk_size of 2048 elements (most parameters are then
oversized chunks of their own), fp32, NVMe forced, device 5 MiB + CPU 4 MiB (merged host tier):
one process trains; under 2 ranks every rank failed in the first steps with TierFullError ("tier
'cpu' is full: ... 704512 more requested and nothing evictable; held by 15 chunks in COMPUTE
(gathered0, ...)") although 3 MB of the tier were free (``offload finetune --chunk-size 2048
--device-budget 5MiB --cpu-budget 4MiB`` under torchrun, which the planner accepted)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.ranks import launch

pytestmark = pytest.mark.slow
WORKER = "tests.helpers.dp_worker:main"


def test_planner_accepted_small_budgets_train_at_two_ranks_as_in_one_process(tmp_path):
    config = dict(device="cpu", dtype="fp32", device_budget="5MiB", cpu_budget="4MiB",
                  nvme_paths=[str(tmp_path / "nvme-{rank}")], chunk_size=2048)
    spec = {"steps": 3, "out": str(tmp_path / "result"), "model": "llama", "config": config, "batch": 4}
    results = launch(WORKER, spec, 2, tmp_path, timeout_s=240)
    for r in results:
        if r.returncode != 0:
            pytest.fail(f"rank {r.rank} exited with {r.returncode}:\n{r.output[-3000:]}")
    out = [torch.load(tmp_path / f"result.rank{r}.pt") for r in range(2)]
    assert len(out[0]["losses"]) == 3
    assert out[0]["state"].keys() == out[1]["state"].keys()
    for k in out[0]["state"]:
        assert torch.equal(out[0]["state"][k], out[1]["state"][k]), k     # every rank gathers the same model
