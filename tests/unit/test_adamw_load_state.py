"""``offload.AdamW``'s state dicts are torch's at every state precision: ``state_dict()`` holds fp32
moments (README "Optimizer state precision"), and ``load_state_dict`` replaces the optimizer's
state as torch's does: a wrapped parameter with no entry in the loaded state dict starts afresh
(step 0, zero moments) instead of keeping the moments and step count it had before the load."""

from __future__ import annotations

import copy

import pytest
import torch

import offload
from offload.optim.quantized import qmap


def model_and_batches():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.Tanh(), torch.nn.Linear(40, 8))
    gen = torch.Generator().manual_seed(0)
    return model, [(torch.randn(4, 24, generator=gen), torch.randn(4, 8, generator=gen)) for _ in range(3)]


def step(model, opt, x, y):
    ((model(x) - y) ** 2).mean().backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("state", ["fp32", "bf16", "8bit"])
def test_parameters_missing_from_a_loaded_state_dict_start_afresh(state):
    plain, data = model_and_batches()
    # What torch.optim.AdamW does: state only for the last layer (the first one was frozen then).
    for p in plain[0].parameters():
        p.requires_grad_(False)
    torch_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    step(plain, torch_opt, *data[0])
    partial = copy.deepcopy(torch_opt.state_dict())     # torch's holds its live (updated in place) tensors
    assert set(partial["state"]) == {2, 3}

    model = offload.wrap(model_and_batches()[0], offload.OffloadConfig(
        device="cpu", dtype="fp32", optimizer_state=state, chunk_size=4096))
    opt = offload.AdamW(model.parameters(), lr=1e-2)
    for x, y in data[:2]:
        step(model, opt, x, y)                     # every parameter now has two steps of state
    opt.load_state_dict(partial)
    sd = opt.state_dict()
    assert set(sd["state"]) == {2, 3}              # torch: the others have no state after the load
    assert all(float(st["step"]) == 1 for st in sd["state"].values())
    # The next step against torch's, from the same weights and the state torch holds after its load.
    plain.load_state_dict(model.state_dict())
    for p in plain[0].parameters():
        p.requires_grad_(True)
    step(model, opt, *data[2])
    step(plain, torch_opt, *data[2])
    got, want = opt.state_dict()["state"], torch_opt.state_dict()["state"]
    assert [float(got[i]["step"]) for i in range(4)] == [float(want[i]["step"]) for i in range(4)] == [1, 1, 2, 2]
    for kind, signed, beta in (("exp_avg", True, 0.9), ("exp_avg_sq", False, 0.999)):
        top = max(float(st[kind].abs().max()) for st in want.values())
        for i in range(4):
            g, w = got[i][kind].double(), want[i][kind].double()
            # Two roundings of the stored moments: the load's (of the loaded moment, carried by
            # beta into this step) and the step's.
            before = partial["state"][i][kind].double().abs() if i in partial["state"] else torch.zeros_like(w)
            if state == "8bit":     # each: half the map's widest gap at the largest scale (+ the -0.993 end)
                q = qmap(signed)
                bound = torch.full_like(w, 2 * top * (float((q[1:] - q[:-1]).max()) / 2 + float(1 + q[0]) * signed))
            elif state == "bf16":   # a nearest rounding on load (half an ulp), a stochastic one (an ulp) at the step
                bound = 2.0 ** -8 * beta * before + 2.0 ** -7 * w.abs()
            else:
                bound = 1e-5 * w.abs() + 1e-6 * top
            assert bool(((g - w).abs() <= bound + 1e-12 * top).all()), (kind, i, float(((g - w).abs() - bound).max()))
    model.offload_engine.close()


@pytest.mark.parametrize("state", ["fp32", "bf16", "8bit"])
def test_state_dict_moments_are_fp32_at_every_precision(state):
    model, data = model_and_batches()
    model = offload.wrap(model, offload.OffloadConfig(device="cpu", dtype="bf16", optimizer_state=state,
                                                      master="bf16", chunk_size=4096))
    opt = offload.AdamW(model.parameters(), lr=1e-2)
    step(model, opt, *(t.bfloat16() for t in data[0]))
    sd = opt.state_dict()["state"]
    assert len(sd) == 4
    assert {st[kind].dtype for st in sd.values() for kind in ("exp_avg", "exp_avg_sq")} == {torch.float32}
    model.offload_engine.close()
