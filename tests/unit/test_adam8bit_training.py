"""The 8-bit Adam kernel in use: 200 steps of training against torch.optim.AdamW (fp32 and
bf16 masters), and ``offload bench adam --state 8bit``'s report (its shape, not a timing)."""

from __future__ import annotations

import functools

import pytest
import torch

from offload.errors import ConfigError
from offload.optim import quantized as q

from tests.helpers.small_regression import loss as _loss, problem as _problem

MASTERS = [torch.float32, torch.bfloat16]


# ---- quality: 200 steps of training against torch.optim.AdamW ---------------------------

@functools.lru_cache(maxsize=None)
def _torch_losses(lr, steps=200):
    X, y, init = _problem()
    w = torch.nn.Parameter(init.clone())
    opt = torch.optim.AdamW([w], lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = _loss(w, X, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _8bit_losses(master, lr, steps=200):
    X, y, init = _problem()
    n = init.numel()
    w = init.clone().to(master)
    mc, vc = torch.full((n,), 127, dtype=torch.uint8), torch.zeros(n, dtype=torch.uint8)
    ma, va = torch.zeros(q.blocks(n)), torch.zeros(q.blocks(n))
    losses = []
    for t in range(1, steps + 1):
        wf = w.float().requires_grad_(True)
        loss = _loss(wf, X, y)
        (g,) = torch.autograd.grad(loss, wf)
        q.adam_step_8bit(w, g, mc, ma, vc, va, lr=lr, beta1=0.9, beta2=0.999, eps=1e-8,
                         weight_decay=0.01, step=t)
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("master", MASTERS)
def test_200_steps_track_torch_adamw_within_a_7_percent_lr_band(master):
    """The tolerance: the signed map's largest relative rounding error on a moment in the top
    decade of its block is half a step (0.9/64/2) over that decade's smallest code (0.107),
    6.6%, so each update may be off by up to ~7%. Whatever that does to training, it must do
    no more than changing AdamW's lr by 7% does: after a 20-step warm-up, the 8-bit loss's mean
    distance from AdamW's L(lr) is at most the mean of band(t) = max(|L(lr*0.93) - L(lr)|,
    |L(lr*1.07) - L(lr)|), and the final loss lies within the final band. (Step by step the
    band pinches to nothing where the curves cross, so the mean is the robust comparison.)"""
    lr = 1e-2
    ref, low, high = _torch_losses(lr), _torch_losses(lr * 0.93), _torch_losses(lr * 1.07)
    ours = _8bit_losses(master, lr)
    assert ref[-1] < 0.1 * ref[0]  # the problem is really being learnt
    band = [max(abs(lo - r), abs(hi - r)) for lo, hi, r in zip(low, high, ref)]
    dist = [abs(o - r) for o, r in zip(ours, ref)]
    assert sum(dist[20:]) <= sum(band[20:]), (sum(dist[20:]), sum(band[20:]))
    assert dist[-1] <= band[-1], (ours[-1], ref[-1], band[-1])


# ---- the benchmark's JSON for 8-bit state (its shape, not a timing) ---------------------

@pytest.mark.parametrize("master,bpp", [("fp32", 16.0625), ("bf16", 12.0625)])
def test_bench_8bit_counts_its_own_bytes(master, bpp):
    from offload.bench.adam import measure

    report = measure(params=20_000, threads=2, grad_dtype="bf16", out_dtype="bf16", repeats=1,
                     levels=["scalar"], state="8bit", master=master)
    assert report["state"] == "8bit" and report["master"] == master
    assert report["bytes_per_param"] == bpp and report["roofline_bytes_per_param"] == 28
    res = report["results"]
    assert {"offload_scalar", "fp32_kernel", "roofline"} <= res.keys() and "torch_fused" not in res
    assert res["offload"]["gbps"] == pytest.approx(res["offload"]["params_per_s"] * bpp / 1e9)
    assert report["roofline_fraction"] > 0 and report["speedup_vs_fp32_kernel"] > 0
    with pytest.raises(ConfigError) as info:
        measure(params=1000, state="4bit")
    assert info.value.field == "state"
