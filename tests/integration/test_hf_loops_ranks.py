"""HF Trainer and a plain accelerate loop (``Accelerator().prepare``) on 2 gloo ranks train a
wrapped model like one process on the same global batch (issue 26, point 11): under torchrun both
would wrap the model in DDP, which the engine refuses; a model wrapped under N ranks is marked as
already data parallel (``offload.hf.accelerate_ranks``), so they leave it as it is and only shard
the data. fp32, NVMe forced (budgets far below each rank's state), clipping active, Trainer also with
gradient accumulation (the engine reduces once a window, without DDP's ``no_sync``); the ranks'
mean losses, the clip's norms and every rank's final weights are as close to the same loop's
float64 run in one process as plain PyTorch's fp32 run is (tests/helpers/trajectory.py); the
model exported on every rank after the loop holds those weights."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.hf_ranks_worker import main
from tests.helpers.ranks import launch
from tests.helpers.reference import mean_losses
from tests.helpers.trajectory import assert_losses_within_drift, assert_within_drift, drift

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

pytestmark = pytest.mark.slow
WORKER = "tests.helpers.hf_ranks_worker:main"
STEPS, GLOBAL_BATCH, CLIP = 5, 4, 1.0


def config(tmp, accumulate: int) -> dict:
    # Each rank keeps about half of tiny_llama's 92 k parameters: 0.7 MB of fp32 state against
    # 448 KiB of budgets, so every rank's master and moments go through NVMe. The engine is told
    # the loop's accumulation (it reduces on the window's last micro-batch).
    return dict(device="cpu", dtype="fp32", device_budget="320KiB", cpu_budget="128KiB",
                nvme_paths=[str(tmp / "nvme-{rank}")], chunk_size=4096,
                gradient_accumulation_steps=accumulate)


@pytest.mark.parametrize("loop, accumulate", [("trainer", 1), ("trainer", 2), ("accelerate", 1)])
def test_two_ranks_train_like_one_process(disk_tmp, loop, accumulate):
    spec = dict(loop=loop, steps=STEPS, global_batch=GLOBAL_BATCH, clip=CLIP, accumulate=accumulate,
                out=str(disk_tmp / "out"))
    ref, exact = main({**spec, "offload": None}), main({**spec, "offload": None, "float64": True})
    export = disk_tmp / "export"
    results = launch(WORKER, {**spec, "offload": config(disk_tmp, accumulate), "export": str(export)},
                     2, disk_tmp, timeout_s=300)
    for r in results:
        if r.returncode != 0:
            pytest.fail(f"rank {r.rank} exited with {r.returncode}:\n{r.output[-3000:]}")
    out = [r.value for r in results]
    assert all(o["world"] == 2 and len(o["losses"]) == STEPS * accumulate for o in out)   # per micro-batch
    assert_losses_within_drift(mean_losses(out), ref["losses"], exact["losses"])
    for o in out:                       # the state_dict gathers every chunk on every rank
        assert_within_drift(o["state"], ref["state"], exact["state"])
        assert o["nvme_bytes"] > 0, o["nvme_bytes"]
    # Every rank keeps an equal piece of every chunk ("kept": its elements), none is idle.
    assert out[0]["kept"] == out[1]["kept"] > 0
    # Saved the way the README says under N ranks (every rank exports; rank 0 writes): the weights
    # the ranks trained, gathered from their pieces.
    saved = {}
    for f in export.glob("*.safetensors"):
        saved.update(load_file(f))
    assert saved and all(torch.equal(v, out[0]["state"][k]) for k, v in saved.items()), sorted(saved)
    if loop == "accelerate":            # the clip saw the global norm, on every rank
        assert max(ref["norms"]) > CLIP
        for o in out:
            norms = (torch.tensor(r["norms"], dtype=torch.float64) for r in (o, ref, exact))
            norm = drift("grad norm", *norms)
            assert norm.ok, str(norm)
