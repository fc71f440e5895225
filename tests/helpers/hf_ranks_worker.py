"""One rank (or the one process) of an HF Trainer or accelerate run of tiny_llama, for the tests of
those loops on N ranks (tests/integration/test_hf_loops_ranks.py).

``main(spec)`` (the target of ``tests.helpers.ranks.launch``, or called in-process for the
single-process runs): spec {"loop": "trainer" | "accelerate", "steps", "global_batch",
"offload": OffloadConfig fields or None (plain PyTorch with ``torch.optim.AdamW``), "float64",
"clip", "accumulate" (Trainer's micro-batches a step), "out", "export": a directory to
``export_pretrained`` the trained model to, on every rank}. Every run sees the same
``global_batch`` rows a micro-batch, in order: one process all of them, each of N ranks its 1/N
slice (the loops' own data sharding). Returns this rank's per-micro-batch losses (of its
slice), the clip's gradient norms, the final state dict (every rank: the collective
``state_dict``), how many chunks the rank keeps and the bytes its NVMe tier holds.
"""

from __future__ import annotations

import os

import torch

from tests.helpers.hf_models import tiny_llama
from tests.helpers.trajectory import float64_twin

LR, WD, SEQ = 1e-2, 0.1, 16


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        self.rows = [torch.randint(0, 128, (SEQ,), generator=gen) for _ in range(n)]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def main(spec: dict) -> dict:
    import accelerate

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:       # the process group first (as torchrun scripts do), then offload.wrap
        accelerate.PartialState(cpu=True)
    model = tiny_llama()
    if spec.get("float64"):
        model = float64_twin(model)
    if spec.get("offload") is not None:
        import offload

        model = offload.wrap(model, offload.OffloadConfig(**spec["offload"]))
        opt = offload.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    batch = spec["global_batch"] // world
    data = Tokens(spec["global_batch"] * spec.get("accumulate", 1) * spec["steps"])
    loop = train_with_trainer if spec["loop"] == "trainer" else train_with_accelerate
    losses, norms = loop(model, opt, data, batch, spec)
    engine = getattr(model, "offload_engine", None)
    if spec.get("export") and engine is not None:     # the README's way to save under N ranks
        from offload.hf import export_pretrained

        export_pretrained(model, spec["export"])
    result = {"losses": losses, "norms": norms, "world": world,
              "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}
    if engine is not None:
        nvme = engine.store.memory_report()["tiers"].get("nvme", {})
        result.update(kept=sum(i.piece_numel for i in engine.chunks.chunks()), chunks=engine.chunks.layout.num_chunks,
                      nvme_bytes=sum(nvme.get("bytes_by_kind", {}).values()))
        engine.close()
    return result


def train_with_trainer(model, opt, data, batch, spec) -> tuple[list[float], list[float]]:
    import transformers

    class RecordingTrainer(transformers.Trainer):
        """Keeps each step's loss as computed (the logged one is rounded and averaged)."""

        def compute_loss(self, model, inputs, *args, **kwargs):
            loss = super().compute_loss(model, inputs, *args, **kwargs)
            losses.append((loss[0] if isinstance(loss, tuple) else loss).item())
            return loss

    losses: list[float] = []
    args = transformers.TrainingArguments(
        output_dir=spec["out"], per_device_train_batch_size=batch, max_steps=spec["steps"], learning_rate=LR,
        max_grad_norm=spec.get("clip") or 0.0, use_cpu=True, report_to=[], save_strategy="no",
        logging_steps=1, disable_tqdm=True, seed=0, dataloader_num_workers=0,
        train_sampling_strategy="sequential", gradient_accumulation_steps=spec.get("accumulate", 1))
    trainer = RecordingTrainer(model=model, args=args, train_dataset=data, optimizers=(opt, None))
    trainer.train()
    if trainer.model_wrapped is not model:
        raise AssertionError(f"Trainer wrapped the model in {type(trainer.model_wrapped).__name__}")
    return losses, []


def train_with_accelerate(model, opt, data, batch, spec) -> tuple[list[float], list[float]]:
    import accelerate

    accelerator = accelerate.Accelerator(cpu=True)
    loader = torch.utils.data.DataLoader(data, batch_size=batch, shuffle=False)
    prepared, opt, loader = accelerator.prepare(model, opt, loader)
    if prepared is not model:
        raise AssertionError(f"accelerate wrapped the model in {type(prepared).__name__}")
    losses, norms = [], []
    for inputs in loader:
        loss = prepared(**inputs).loss
        accelerator.backward(loss)
        if spec.get("clip"):
            norms.append(float(accelerator.clip_grad_norm_(prepared.parameters(), spec["clip"])))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms
