"""The activation-offload checks' model: checkpointed residual MLP blocks between a float input
projection and a vocabulary head (every kernel on the way runs the same way twice)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


class Block(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, 2 * hidden)
        self.down = nn.Linear(2 * hidden, hidden)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Stack(nn.Module):
    def __init__(self, reentrant: bool, *, vocab: int, hidden: int, layers: int):
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(hidden, hidden)
        self.blocks = nn.ModuleList(Block(hidden) for _ in range(layers))
        self.head = nn.Linear(hidden, vocab)
        self.reentrant = reentrant
        self.vocab = vocab

    def forward(self, features, targets):
        x = self.proj(features)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=self.reentrant)
        return F.cross_entropy(self.head(x).reshape(-1, self.vocab), targets.reshape(-1))
