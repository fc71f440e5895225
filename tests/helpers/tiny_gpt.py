"""A small GPT-style model for the engine's equivalence tests: tied embeddings, optional
activation checkpointing, a learned root-level parameter used outside any submodule."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True, bias=False)  # key bias gets only rounding-noise gradients
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.proj = nn.Linear(4 * d, d)

    def forward(self, x):
        h = self.ln1(x)
        mask = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device), 1)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.proj(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    def __init__(self, vocab=64, d=32, layers=4, heads=2, seq=16, checkpointing=False):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(seq, d) * 0.02)     # used directly in the root forward
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight                       # tied
        self.checkpointing = checkpointing

    def forward(self, idx, targets):
        x = self.wte(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            if self.checkpointing and self.training:
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        logits = self.head(self.ln_f(x))
        # fp32 or wider: bf16 logits are promoted, a float64 twin (tests/helpers/trajectory.py) keeps its precision
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def batches(n, batch=4, seq=16, vocab=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n):
        # on the CPU whatever torch.set_default_device says: the generator is a CPU one
        x = torch.randint(0, vocab, (batch, seq + 1), generator=gen, device="cpu")
        yield x[:, :-1], x[:, 1:]
