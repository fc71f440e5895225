"""The equivalence tests' rule (tests/helpers/trajectory.py) passes correct fp32 runs whose rounding differs
from the reference's and fails runs with the faults an offload engine can make.

Correct variants: our CPU Adam in place of torch's (other arithmetic), and every gradient one unit in
the last place off, every step (what another CPU's kernels, or autograd summing a gradient's parts
in another order under the engine's backward hooks, do to some of them). Faults: one tensor missing one step's update, a stale copy of one
tensor for one step, a learning rate 1 % off.
"""

from __future__ import annotations

import copy

import pytest
import torch

from offload.optim import CPUAdamW
from tests.helpers.tiny_gpt import TinyGPT, batches
from tests.helpers.trajectory import assert_losses_within_drift, assert_within_drift, float64_twin

LR, WD, STEPS = 1e-2, 0.1, 12


def train(model, *, opt=torch.optim.AdamW, lr=LR, fault=None, ulp_off=False):
    optimizer = opt(model.parameters(), lr=lr, weight_decay=WD)
    losses = []
    for step, (x, y) in enumerate(batches(STEPS)):
        loss = model(x, y)
        loss.backward()
        if ulp_off:
            for p in model.parameters():
                p.grad = torch.nextafter(p.grad, torch.full_like(p.grad, float("inf")))
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
        if fault is not None:
            fault(step, model, before)
        losses.append(loss.item())
    return losses


@pytest.fixture(scope="module")
def references():
    torch.manual_seed(0)
    start = TinyGPT()
    ref, exact = copy.deepcopy(start), float64_twin(start)
    return start, ref, train(ref), exact, train(exact)


def check(references, model, losses):
    _, ref, ref_losses, exact, exact_losses = references
    assert_losses_within_drift(losses, ref_losses, exact_losses)
    assert_within_drift(model.state_dict(), ref.state_dict(), exact.state_dict())


@pytest.mark.parametrize("variant", ["cpu-adam", "gradients-one-ulp-off"])
def test_correct_runs_with_other_rounding_pass(references, variant):
    model = copy.deepcopy(references[0])
    if variant == "cpu-adam":
        losses = train(model, opt=CPUAdamW)
    else:
        losses = train(model, ulp_off=True)
    _, ref, _, _, _ = references
    # They really do differ from the reference (else this shows nothing).
    assert any(not torch.equal(a, b) for a, b in zip(model.state_dict().values(), ref.state_dict().values()))
    check(references, model, losses)


def skip_update(step, model, before):
    if step == 5:
        with torch.no_grad():
            model.blocks[1].fc.weight.copy_(before["blocks.1.fc.weight"])


def stale_copy(step, model, before):
    if step == 3:        # an update landed in a copy that was then dropped for the old one
        with torch.no_grad():
            model.ln_f.weight.copy_(before["ln_f.weight"])


@pytest.mark.parametrize("fault", [skip_update, stale_copy, "lr+1%"], ids=["missed-update", "stale-copy", "lr+1%"])
def test_faults_fail(references, fault):
    model = copy.deepcopy(references[0])
    if fault == "lr+1%":
        losses = train(model, lr=LR * 1.01)
    else:
        losses = train(model, fault=fault)
    with pytest.raises(AssertionError, match="drifted further"):
        check(references, model, losses)
