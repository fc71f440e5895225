"""What the ``transformers.Trainer`` tests share: a dataset of token rows, and a Trainer that keeps
each step's loss as computed. Import after ``pytest.importorskip("transformers")``."""

from __future__ import annotations

import torch
import transformers


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
