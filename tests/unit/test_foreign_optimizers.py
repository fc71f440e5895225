"""A torch optimizer over a wrapped model's parameters is refused at its first step() (it would
update nothing: the values, gradients and state live in the engine's chunks), naming the optimizer,
a parameter and offload.AdamW; optimizers that legitimately meet a wrapped model go through."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import offload
from offload.errors import ConfigError
from tests.helpers.features8 import batches, loss_of, make_model


class Wrapping(torch.optim.Optimizer):
    """An optimizer around another, as accelerate's ``AcceleratedOptimizer`` is (which skips
    ``Optimizer.__init__``; this one runs it, so torch's step hooks see it too)."""

    def __init__(self, optimizer):
        self.optimizer = optimizer
        super().__init__([{"params": g["params"]} for g in optimizer.param_groups], {})

    def step(self, closure=None):
        return self.optimizer.step(closure)

    def zero_grad(self, set_to_none=True):
        self.optimizer.zero_grad(set_to_none)


def wrapped():
    return offload.wrap(make_model(), offload.OffloadConfig(device="cpu", dtype="fp32", chunk_size=2048))


def weights(model) -> list[torch.Tensor]:
    return [t.clone() for t in model.state_dict().values()]


def frozen_encoder_under_a_head():
    """A wrapped encoder frozen after wrap, a plain head, and one torch AdamW given both (torch skips
    parameters without gradients): ``(encoder, head, optimizer)``."""
    encoder = wrapped()
    for p in encoder.parameters():
        p.requires_grad_(False)
    head = nn.Linear(64, 64)
    return encoder, head, torch.optim.AdamW([*encoder.parameters(), *head.parameters()], lr=1e-2)


@pytest.mark.parametrize("optimizer", [
    lambda ps: torch.optim.AdamW(ps, lr=1e-2),
    lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
    lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=False),
], ids=["AdamW", "SGD", "Adam"])
def test_a_torch_optimizer_over_a_wrapped_model_is_refused_at_step(optimizer):
    model = wrapped()
    try:
        before = weights(model)
        opt = optimizer(model.parameters())
        x, y = batches(1)[0]
        loss_of(model, x, y).backward()
        with pytest.raises(ConfigError, match=r"torch\.optim\..*holds '0\.weight'.*offload\.AdamW") as err:
            opt.step()
        assert err.value.field == "optimizer"
        assert all(torch.equal(a, b) for a, b in zip(before, weights(model)))
        # The user's fix: the same loop with offload.AdamW trains.
        opt = offload.AdamW(model.parameters(), lr=1e-2)
        for x, y in batches(3):
            loss_of(model, x, y).backward()
            opt.step()
            opt.zero_grad()
        assert not all(torch.equal(a, b) for a, b in zip(before, weights(model)))
    finally:
        model.offload_engine.close()


def test_optimizers_that_meet_a_wrapped_model_legitimately_step():
    """A plain head under its own torch optimizer beside a frozen offloaded encoder that the same
    optimizer was also given (torch skips parameters without gradients); offload.AdamW inside
    a wrapper optimizer; a parameter group added later is checked too."""
    encoder, head, opt = frozen_encoder_under_a_head()
    try:
        before = head.weight.detach().clone()
        for x, y in batches(2):
            loss_of(head, encoder(x), y).backward()
            opt.step()
            opt.zero_grad()
        assert not torch.equal(before, head.weight)
        for p in encoder.parameters():      # staged unfreezing: the torch optimizer would not train them
            p.requires_grad_(True)
        with pytest.raises(ConfigError, match="offload.AdamW"):
            opt.step()
        for p in encoder.parameters():
            p.requires_grad_(False)

        trained = wrapped()
        try:
            inner = offload.AdamW(trained.parameters(), lr=1e-2)
            outer = Wrapping(inner)
            for x, y in batches(2):
                loss_of(trained, x, y).backward()
                outer.step()
                outer.zero_grad()
            opt.add_param_group({"params": list(trained.parameters())})
            with pytest.raises(ConfigError, match="offload.AdamW"):
                opt.step()
        finally:
            trained.offload_engine.close()
    finally:
        encoder.offload_engine.close()


def test_a_torch_optimizer_that_stepped_before_its_model_was_wrapped_is_refused_after():
    """The verdict cached at a step before ``offload.wrap`` (the hook already installed by another
    wrapped model) must not let the same optimizer through once its parameters are placeholders:
    wrap keeps the parameter objects, so the groups look unchanged while the step updates nothing."""
    other = wrapped()
    try:
        model = make_model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        x, y = batches(1)[0]
        loss_of(model, x, y).backward()
        opt.step()
        opt.zero_grad()
        offload.wrap(model, offload.OffloadConfig(device="cpu", dtype="fp32", chunk_size=2048))
        try:
            loss_of(model, x, y).backward()
            with pytest.raises(ConfigError, match=r"holds '0\.weight'.*offload\.AdamW"):
                opt.step()
        finally:
            model.offload_engine.close()
    finally:
        other.offload_engine.close()


def test_offload_adamw_built_before_wrap_trains_as_one_built_after():
    """``offload.AdamW(model.parameters())`` then ``offload.wrap(model)`` (an optimizer made before
    the model is prepared, as accelerate-style loops do): its class lets the hook pass it, so
    it must train the wrapped parameters, the same as one built after wrap, not skip them."""
    models, opts = [], []
    try:
        for before_wrap in (True, False):
            model = make_model()
            opt = offload.AdamW(model.parameters(), lr=1e-2) if before_wrap else None
            offload.wrap(model, offload.OffloadConfig(device="cpu", dtype="fp32", chunk_size=2048))
            models.append(model)
            opts.append(opt or offload.AdamW(model.parameters(), lr=1e-2))
        start = weights(models[1])
        for x, y in batches(3):
            for model, opt in zip(models, opts):
                loss_of(model, x, y).backward()
                opt.step()
                opt.zero_grad()
        assert not all(torch.equal(a, b) for a, b in zip(start, weights(models[1])))
        assert all(torch.equal(a, b) for a, b in zip(weights(models[0]), weights(models[1])))
    finally:
        for model in models:
            model.offload_engine.close()


def test_thawing_wrapped_parameters_while_freezing_as_many_plain_ones_is_refused():
    """Staged training that swaps which part trains (the head frozen, as many wrapped parameters
    thawed): the groups hold as many trainable parameters as before, yet now wrapped ones."""
    encoder, head, opt = frozen_encoder_under_a_head()
    try:
        x, y = batches(1)[0]
        loss_of(head, encoder(x), y).backward()
        opt.step()
        opt.zero_grad()
        thawed = list(encoder.parameters())[-len(list(head.parameters())):]
        for p in head.parameters():
            p.requires_grad_(False)
        for p in thawed:
            p.requires_grad_(True)
        loss_of(head, encoder(x), y).backward()
        with pytest.raises(ConfigError, match="offload.AdamW"):
            opt.step()
    finally:
        encoder.offload_engine.close()
