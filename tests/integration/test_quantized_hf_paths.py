"""Compressed optimizer state (8-bit or bf16 moments, a bf16 master) through the Hugging Face
paths a user takes: unseen architectures built from configs, ``transformers.Trainer`` with a
checkpoint and a resume, peft LoRA, and ``optimizer.state_dict()`` across to ``torch.optim.AdamW``
and back. Each run is held to the real thing: torch AdamW within the 8-bit map's lr band
(tests/unit/test_adam8bit_training.py derives it), or the scheme written out on flat chunks bit
for bit (tests/helpers/flat8.py), or the uninterrupted run."""

from __future__ import annotations

import copy

import pytest
import torch

import offload
from tests.helpers.hf_models import tiny_llama

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
pytest.importorskip("accelerate")

pytestmark = pytest.mark.slow

LR, WD = 1e-2, 0.1


def config(path, **kw) -> offload.OffloadConfig:
    # Budgets below the state: every chunk goes through NVMe and back.
    base = dict(device="cpu", device_budget="512KiB", cpu_budget="320KiB", nvme_paths=[str(path)], chunk_size=16384)
    return offload.OffloadConfig(**{**base, **kw})


# ---- transformers.Trainer: a checkpoint, then a resume in a fresh process's objects ----------

class Tokens(torch.utils.data.Dataset):
    def __init__(self, n, seed=0):
        gen = torch.Generator().manual_seed(seed)
        self.rows = [torch.randint(0, 128, (16,), generator=gen) for _ in range(n)]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


class RecordingTrainer(transformers.Trainer):
    """Keeps each step's loss as computed (the logged one is rounded)."""

    def compute_loss(self, model, inputs, *args, **kwargs):
        loss = super().compute_loss(model, inputs, *args, **kwargs)
        self.losses.append((loss[0] if isinstance(loss, tuple) else loss).item())
        return loss


class RoundTrip(transformers.TrainerCallback):
    """When Trainer has saved a checkpoint, pass the optimizer's state through ``state_dict`` /
    ``load_state_dict`` once, as the resume from that checkpoint does: the uninterrupted run a
    resumed one must repeat (8-bit moments come back up to the map's rounding)."""

    def on_save(self, args, state, control, optimizer=None, **kwargs):
        optimizer.load_state_dict(optimizer.state_dict())


def lora(model):
    torch.manual_seed(1)
    model = peft.get_peft_model(model, peft.LoraConfig(r=3, lora_alpha=6, target_modules=["q_proj", "v_proj"]))
    for name, p in model.named_parameters():
        if "lora_B" in name:            # peft starts B at zero: give the first steps a gradient on A too
            torch.nn.init.normal_(p, std=0.02)
    return model


def trainer(out, nvme, *, steps, save, adapt=None, callbacks=(), **kw):
    model = tiny_llama()
    model = adapt(model) if adapt else model
    model = offload.wrap(model, config(nvme, **kw))
    opt = offload.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=WD,
                        state=kw.get("optimizer_state"), master=kw.get("master"))
    args = transformers.TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=2, max_steps=steps, learning_rate=LR,
        max_grad_norm=1.0, use_cpu=True, report_to=[], save_strategy="steps" if save else "no", save_steps=save or 1,
        logging_steps=1, disable_tqdm=True, seed=0, dataloader_num_workers=0)
    t = RecordingTrainer(model=model, args=args, train_dataset=Tokens(2 * steps), optimizers=(opt, None),
                         callbacks=list(callbacks))
    t.losses = []
    return t, model


@pytest.mark.parametrize("state,master", [("8bit", "bf16"), ("bf16", "bf16")])
def test_trainer_resumes_a_lora_checkpoint_in_bf16(disk_tmp, state, master):
    """Trainer resumes a PeftModel by ``model.load_adapter(checkpoint)``, which ends by replacing
    every bf16 adapter parameter with a new fp32 one (peft's ``autocast_adapter_dtype``): on a
    wrapped model those are not the engine's parameters, so forward met an empty placeholder
    ("size mismatch ... vec (0)") and the optimizer would have held the old ones. The resume must
    keep the engine's parameters and load the adapter's values into their chunks: the resumed
    run's losses are then the uninterrupted run's (8-bit moments: the run whose state went through
    the same ``state_dict`` round trip, README "Optimizer state precision")."""
    kw = dict(dtype="bf16", optimizer_state=state, master=master)
    full, model = trainer(disk_tmp / "out", disk_tmp / "a", steps=4, save=2, adapt=lora, callbacks=[RoundTrip()], **kw)
    full.train()
    resumed, again = trainer(disk_tmp / "out2", disk_tmp / "b", steps=4, save=0, adapt=lora, **kw)
    params = [p for p in again.parameters()]
    resumed.train(resume_from_checkpoint=str(disk_tmp / "out" / "checkpoint-2"))
    assert [p for p in again.parameters()] == params            # the same objects the engine holds
    assert len(resumed.losses) == 2 and resumed.losses == full.losses[2:]
    for m in (model, again):
        m.offload_engine.close()
