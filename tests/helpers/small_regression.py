"""A small two-layer tanh regression (2,177 parameters in one flat vector) that optimizer tests
train for a few hundred steps and compare against torch.optim.AdamW on."""

from __future__ import annotations

import torch


def problem():
    """(X, y, initial weights): seeded, the same every call."""
    g = torch.Generator().manual_seed(0)
    X = torch.randn(1024, 32, generator=g)
    w1, w2 = torch.randn(32, 64, generator=g) / 32**0.5, torch.randn(64, 1, generator=g) / 8
    y = torch.tanh(X @ w1) @ w2 + 0.3 * torch.randn(1024, 1, generator=g)
    init = torch.cat([torch.randn(32 * 64, generator=g) / 32**0.5, torch.zeros(64),
                      torch.randn(64, generator=g) / 8, torch.zeros(1)])
    return X, y, init


def loss(w, X, y):
    """Mean squared error of the flat weights ``w`` on (X, y)."""
    a, b = w[:2048].view(32, 64), w[2048:2112]
    c, d = w[2112:2176].view(64, 1), w[2176:]
    return ((torch.tanh(X @ a + b) @ c + d - y) ** 2).mean()
