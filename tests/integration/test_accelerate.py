"""A wrapped model with ``offload.AdamW`` in a plain ``accelerate`` loop (``prepare``,
``accelerator.backward``, ``accelerator.clip_grad_norm_``) trains as the same loop with a plain
model and ``torch.optim.AdamW`` (fp32, NVMe forced), with and without clipping: losses, gradient
norms and final weights as close to the same loop's float64 run as plain PyTorch's (tests/helpers/trajectory.py)."""

from __future__ import annotations

import copy

import pytest
import torch

import offload
from tests.helpers.hf_models import tiny_llama
from tests.helpers.trajectory import assert_run_within_drift, drift, float64_twin

transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")

pytestmark = pytest.mark.slow
STEPS = 5


def loader():
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 128, (2 * STEPS, 16), generator=gen)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=2, shuffle=False)


def train(model, optimizer, clip):
    accelerator = accelerate.Accelerator(cpu=True)
    model, optimizer, data = accelerator.prepare(model, optimizer, loader())
    losses, norms = [], []
    for (ids,) in data:
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        if clip is not None:
            norms.append(float(accelerator.clip_grad_norm_(model.parameters(), clip)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, norms


@pytest.mark.parametrize("clip", [0.5, None])
def test_accelerate_loop_matches_torch(disk_tmp, clip):
    ref = tiny_llama()
    mine, exact = copy.deepcopy(ref), float64_twin(ref)
    want, want_norms = train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1), clip)
    exact_losses, exact_norms = train(exact, torch.optim.AdamW(exact.parameters(), lr=1e-2, weight_decay=0.1),
                                      clip)
    cfg = offload.OffloadConfig(device="cpu", dtype="fp32", device_budget="512KiB", cpu_budget="320KiB",
                                nvme_paths=[str(disk_tmp)], chunk_size=16384)
    model = offload.wrap(mine, cfg)
    got, norms = train(model, offload.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1), clip)
    assert len(got) == STEPS and len(norms) == len(want_norms)
    if clip is not None:
        assert max(want_norms) > clip                   # the clip was active
        norm = drift("grad norm", *(torch.tensor(n, dtype=torch.float64)
                                     for n in (norms, want_norms, exact_norms)))
        assert norm.ok, str(norm)
    assert_run_within_drift((model, got), (ref, want), (exact, exact_losses))
    assert model.offload_engine.store.memory_report()["tiers"]["nvme"]["bytes_by_kind"]
    model.offload_engine.close()
