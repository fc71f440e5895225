"""The harness of the features' tests of compressed optimizer state (tests/unit/test_quantized_features*.py):
a small model whose trainable weights fill whole 256-element blocks, budgets below its state (every
step reads and writes it through NVMe files), its wrapped twin and the reference optimizer per
parameter (``param8.PerParamAdamW``) that the engine's steps equal bit for bit."""

from __future__ import annotations

import functools

import torch
from torch import nn

import offload

from .param8 import PerParamAdamW, aligned_bases

LR = 1e-2


def config(path, **kw) -> offload.OffloadConfig:
    base = dict(device="cpu", dtype="fp32", device_budget="72KiB", cpu_budget="48KiB", nvme_paths=[str(path)],
                chunk_size=2048, optimizer_state="8bit")
    base.update(kw)
    return offload.OffloadConfig(**base)


def make_model(seed=0) -> nn.Sequential:
    """Four 64x64 layers (each a chunk of its own) and five small ones sharing two 2048-element
    chunks; every weight a whole number of 256-element blocks."""
    torch.manual_seed(seed)
    dims = [(64, 64)] * 4 + [(64, 16), (16, 16), (16, 16), (16, 16), (16, 64)]
    layers = []
    for a, b in dims:
        layers += [nn.Linear(a, b, bias=False), nn.Tanh()]
    return nn.Sequential(*layers[:-1])


def twins(path, state="8bit", **kw):
    """(reference model, wrapped model, its reference optimizer: ``reference(params, **hyper)``)."""
    ref = make_model()
    model = offload.wrap(make_model(), config(path, optimizer_state=state, **kw))
    bases = aligned_bases(ref, model.offload_engine.chunks.layout)
    return ref, model, functools.partial(PerParamAdamW, bases=bases, moments=state)


def batches(n):
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 64, generator=gen), torch.randn(8, 64, generator=gen)) for _ in range(n)]


def loss_of(model, x, y):
    return (model(x) - y).pow(2).mean()


def train(model, opt, steps, *, sched=None) -> list[float]:
    losses = []
    for x, y in batches(steps):
        loss = loss_of(model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if sched is not None:
            sched.step()
    return losses


def assert_same(ref, model) -> None:
    sd = model.state_dict()
    for name, p in ref.named_parameters():
        assert torch.equal(sd[name], p.detach()), name


def nvme_bytes(model) -> int:
    return sum(v for k, v in model.offload_stats()["moved_bytes"].items() if "nvme" in k)


def groups(params, split=(1, 5)):
    """Three groups, each with its own lr, weight decay, betas and eps (Adam's bound on exp_avg,
    K(beta1, beta2), differs in each: 7.27, 1.04 and 1.18)."""
    a, b = split
    return [dict(params=params[:a], lr=LR, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8),
            dict(params=params[a:b], lr=3e-3, weight_decay=0.1, betas=(0.5, 0.6), eps=1e-6),
            dict(params=params[b:], lr=2e-2, weight_decay=0.01, betas=(0.8, 0.9), eps=1e-3)]


STATES = ["8bit", "bf16"]      # moments: block-wise 8-bit codes and scales, or bf16 by stochastic rounding
