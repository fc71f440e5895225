"""Two ranks over NCCL, a GPU each, train like one process on the global batch (``pytest -m gpu``;
skipped without CUDA or with fewer than two GPUs visible).

The CPU suite runs the same equivalence over gloo (tests/integration/test_distributed_engine.py);
only here do the collectives run on NCCL's streams, ordered against the engine's compute stream,
issued by the communication thread. Each rank must compute on its own GPU, ``cuda:LOCAL_RANK``:
once when the worker calls ``torch.cuda.set_device`` itself (as torchrun scripts should), once when
it does not and the engine has to move it there (saying so).
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.ranks import launch
from tests.helpers.reference import mean_losses
from tests.helpers.tiny_gpt import TinyGPT, batches
from tests.helpers.trajectory import assert_losses_within_drift, assert_within_drift, float64_twin

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                 reason="needs two CUDA devices")]

WORKER = "tests.helpers.dp_worker:main"
LR, WD = 1e-2, 0.1          # dp_worker's
STEPS = 8


@pytest.fixture(autouse=True)
def exact_fp32():
    """TF32 off in the reference, as it is by default in the ranks: fp32 matmuls on both sides."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def reference(steps: int) -> list[tuple[list[float], dict]]:
    """Plain PyTorch on one GPU and the whole global batch, in fp32 and in float64 (the exact run,
    tests/helpers/trajectory.py): each run's losses and final state (on the CPU)."""
    torch.manual_seed(0)            # dp_worker's seed: the same initial values
    model = TinyGPT(checkpointing=True)
    runs = []
    for m in (model, float64_twin(model)):
        m = m.to("cuda:0")
        opt = torch.optim.AdamW(m.parameters(), lr=LR, weight_decay=WD)
        losses = []
        for x, y in batches(steps, batch=4):
            loss = m(x.to("cuda:0"), y.to("cuda:0"))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        runs.append((losses, {k: v.detach().cpu() for k, v in m.state_dict().items()}))
    return runs


@pytest.mark.parametrize("user_sets_device", [True, False], ids=["set_device", "engine_moves"])
def test_two_nccl_ranks_train_like_one_process_each_on_its_own_gpu(disk_tmp, user_sets_device):
    (want_losses, want_state), (exact_losses, exact_state) = reference(STEPS)
    config = dict(device="cuda", dtype="fp32", device_budget="256KiB", cpu_budget="256KiB",
                  nvme_paths=[str(disk_tmp / "nvme-{rank}")], chunk_size=4096)
    spec = {"steps": STEPS, "out": str(disk_tmp / "result"), "config": config, "backend": "nccl",
            "set_device": user_sets_device, "timeout_s": 120}
    results = launch(WORKER, spec, 2, disk_tmp, timeout_s=400)
    for r in results:
        if r.returncode != 0:
            pytest.fail(f"rank {r.rank} exited with {r.returncode}:\n{r.output[-3000:]}")
    out = [torch.load(disk_tmp / f"result.rank{r}.pt") for r in range(2)]
    for rank, o in enumerate(out):
        assert o["device"] == f"cuda:{rank}" and o["current_device"] == rank
        moved = [w for w in o["warnings"] if "LOCAL_RANK" in w]
        # Only a rank left on another GPU is moved (rank 0 already is on cuda:0).
        assert len(moved) == (1 if rank == 1 and not user_sets_device else 0), o["warnings"]
        coll = o["stats"][-1]["collectives"]
        assert coll["by_op"].get("broadcast", 0) > 0 and coll["by_op"].get("reduce", 0) > 0
    assert_losses_within_drift(mean_losses(out), want_losses, exact_losses)
    for o in out:
        assert_within_drift({k: v.cpu() for k, v in o["state"].items()}, want_state, exact_state)
