"""A wrapped model with ``offload.AdamW`` under ``transformers.Trainer`` trains as the same Trainer run
with a plain model and ``torch.optim.AdamW`` (fp32, NVMe forced): with Trainer's default
``max_grad_norm=1.0`` (its clip goes through ``torch.nn.utils.clip_grad_norm_``, which the engine
answers with the real global norm) and with clipping off. Losses and final weights as close to the same
Trainer run in float64 as plain PyTorch's (tests/helpers/trajectory.py)."""

from __future__ import annotations

import copy

import pytest
import torch

import offload
from tests.helpers.hf_models import tiny_llama
from tests.helpers.trajectory import assert_run_within_drift, float64_twin

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from tests.helpers.trainer_runs import RecordingTrainer, Tokens  # noqa: E402 (after the skips)

pytestmark = pytest.mark.slow
STEPS = 5


def train(model, optimizer, out_dir, max_grad_norm):
    args = transformers.TrainingArguments(
        output_dir=str(out_dir), per_device_train_batch_size=2, max_steps=STEPS, learning_rate=1e-2,
        max_grad_norm=max_grad_norm, use_cpu=True, report_to=[], save_strategy="no", logging_steps=1,
        disable_tqdm=True, seed=0, dataloader_num_workers=0)
    trainer = RecordingTrainer(model=model, args=args, train_dataset=Tokens(2 * STEPS),
                               optimizers=(optimizer, None))
    trainer.losses = []
    trainer.train()
    return trainer.losses


@pytest.mark.parametrize("max_grad_norm", [1.0, 0.0])
def test_trainer_matches_torch(disk_tmp, max_grad_norm):
    ref = tiny_llama()
    mine, exact = copy.deepcopy(ref), float64_twin(ref)
    want = train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1), disk_tmp / "ref",
                 max_grad_norm)
    exact_losses = train(exact, torch.optim.AdamW(exact.parameters(), lr=1e-2, weight_decay=0.1),
                         disk_tmp / "exact", max_grad_norm)
    cfg = offload.OffloadConfig(device="cpu", dtype="fp32", device_budget="512KiB", cpu_budget="320KiB",
                                nvme_paths=[str(disk_tmp / "nvme")], chunk_size=16384)
    model = offload.wrap(mine, cfg)
    opt = offload.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    got = train(model, opt, disk_tmp / "mine", max_grad_norm)
    assert len(got) == len(want) == len(exact_losses) == STEPS
    if max_grad_norm:
        assert opt.last_grad_norm is not None and opt.last_grad_norm > max_grad_norm   # the clip was active
    assert_run_within_drift((model, got), (ref, want), (exact, exact_losses))
    assert model.offload_engine.store.memory_report()["tiers"]["nvme"]["bytes_by_kind"]
    model.offload_engine.close()
