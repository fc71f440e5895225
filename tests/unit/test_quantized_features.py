"""Compressed optimizer state (8-bit and bf16 moments) under the optimizer's features, as a user
drives them: param groups with their own lr / betas / eps / weight decay, ``add_param_group``
after wrapping, an lr scheduler, ``maximize``, hyper-parameters set between backward and step,
gradient accumulation, clipping, an fp16 overflow, frozen parameters and parameters without a
gradient in some steps. Budgets below the state: every step reads and writes it through NVMe.

The reference is the scheme itself per parameter on plain PyTorch (``tests/helpers/param8.py``:
the torch reference the native kernels are bit-identical to). The model's trainable parameters
fill whole 256-element blocks of their own, where the engine's step is that reference's bit
for bit, so the runs are compared exactly (losses and parameters ``==``), not to a tolerance.
(Edge values and the optimizer's state dict: ``test_quantized_features_state.py``.)
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import offload
from offload.errors import UnsupportedError
from offload.optim.quantized import quantize
from tests.helpers.features8 import (LR, STATES, assert_same, batches, config, groups, loss_of, make_model,
                                     nvme_bytes, train, twins)
from tests.helpers.param8 import PerParamAdamW, aligned_bases

# ---- scenario 1: param groups, add_param_group, schedulers, maximize, amsgrad ---------------

@pytest.mark.parametrize("state", STATES)
def test_param_groups_each_step_with_their_own_hyper_parameters(disk_tmp, state):
    ref, model, reference = twins(disk_tmp, state)
    want = train(ref, reference(groups(list(ref.parameters()))), 5)
    got = train(model, offload.AdamW(groups(list(model.parameters()))), 5)
    assert got == want
    assert_same(ref, model)
    assert nvme_bytes(model) > 0      # the state went through NVMe


def test_the_bound_on_exp_avg_uses_each_groups_betas(disk_tmp):
    """exp_avg loaded far past Adam's bound over an exp_avg_sq near zero, in a group with betas
    (0.5, 0.6) (K = 1.04, not the default betas' 7.27): the engine's next steps are the scheme's
    with that group's K, bit for bit."""
    ref, model, reference = twins(disk_tmp)
    ropt = reference(groups(list(ref.parameters())))
    opt = offload.AdamW(groups(list(model.parameters())))
    train(ref, ropt, 1)
    train(model, opt, 1)
    sd = opt.state_dict()
    gen = torch.Generator().manual_seed(7)
    for i, p in enumerate(ref.parameters()):
        n = p.numel()
        m = torch.randn(n, generator=gen) * 1e-2
        v = torch.rand(n, generator=gen) * 1e-12
        sd["state"][i]["exp_avg"], sd["state"][i]["exp_avg_sq"] = m.view(p.shape), v.view(p.shape)
        st = ropt.state[p]
        (st["m"], st["ma"]), (st["v"], st["va"]) = quantize(m, True), quantize(v, False)
    opt.load_state_dict(sd)
    assert train(model, opt, 3) == train(ref, ropt, 3)
    assert_same(ref, model)


@pytest.mark.parametrize("state", STATES)
def test_a_group_added_after_wrapping_is_trained(disk_tmp, state):
    """offload.AdamW over the first layers, then ``add_param_group`` with the rest (as when frozen
    layers are thawed): the new group trains like torch's, with its own lr."""
    ref, model, reference = twins(disk_tmp, state)
    rp, mp = list(ref.parameters()), list(model.parameters())
    ropt, opt = reference(rp[:4], lr=LR), offload.AdamW(mp[:4], lr=LR)
    ropt.add_param_group(dict(params=rp[4:], lr=3e-3))
    opt.add_param_group(dict(params=mp[4:], lr=3e-3))
    assert train(model, opt, 4) == train(ref, ropt, 4)
    assert_same(ref, model)
    assert not torch.equal(model.state_dict()["16.weight"], make_model().state_dict()["16.weight"])


@pytest.mark.parametrize("state", STATES)
def test_an_lr_scheduler_and_maximize_are_followed(disk_tmp, state):
    ref, model, reference = twins(disk_tmp, state)

    def setup(cls, params, **kw):
        opt = cls(params, lr=LR, maximize=True, **kw)
        return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.1)

    ropt, rs = setup(reference, list(ref.parameters()))
    opt, s = setup(offload.AdamW, list(model.parameters()))
    got, want = train(model, opt, 5, sched=s), train(ref, ropt, 5, sched=rs)
    assert got == want
    assert_same(ref, model)


def test_amsgrad_is_refused_naming_it(disk_tmp):
    model = offload.wrap(make_model(), config(disk_tmp))
    with pytest.raises(UnsupportedError, match="amsgrad=True"):
        offload.AdamW(model.parameters(), amsgrad=True)
    opt = offload.AdamW(model.parameters())
    opt.param_groups[0]["amsgrad"] = True       # set later, as a user may: refused at the step
    loss_of(model, *batches(1)[0]).backward()
    with pytest.raises(UnsupportedError, match="amsgrad=True"):
        opt.step()


# ---- scenario 2: accumulation, clipping, fp16 overflow, frozen and idle parameters ----------

@pytest.mark.parametrize("state", STATES)
def test_gradient_accumulation_steps_once_per_window(disk_tmp, state):
    n = 3
    ref, model, reference = twins(disk_tmp, state, gradient_accumulation_steps=n)
    runs = {}
    for name, m, opt in (("ref", ref, reference(ref.parameters(), lr=LR)),
                         ("engine", model, offload.AdamW(model.parameters(), lr=LR))):
        data = iter(batches(3 * n))
        runs[name] = []
        for _ in range(3):
            for _ in range(n):
                loss = loss_of(m, *next(data)) / n
                loss.backward()
            opt.step()
            opt.zero_grad()
            runs[name].append(loss.item())
    assert runs["engine"] == runs["ref"]
    assert_same(ref, model)


MAX_NORM = 0.01


@pytest.mark.parametrize("state", STATES)
@pytest.mark.parametrize("how", ["torch.nn.utils", "optimizer", "max_grad_norm"])
def test_clipping_scales_the_step_by_the_clip_coefficient(disk_tmp, how, state):
    """Clipped to MAX_NORM, below every step's norm: the scheme's step with its gradients
    times max_norm / (norm + 1e-6), the norm being the one the engine measured (in double)."""
    ref, model, reference = twins(disk_tmp, state)
    ropt = reference(ref.parameters(), lr=LR)
    kw = {"max_grad_norm": MAX_NORM} if how == "max_grad_norm" else {}
    opt = offload.AdamW(model.parameters(), lr=LR, **kw)
    for x, y in batches(4):
        loss_of(model, x, y).backward()
        returned = None
        if how == "torch.nn.utils":
            returned = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        elif how == "optimizer":
            returned = opt.clip_grad_norm_(MAX_NORM)
        opt.step()
        opt.zero_grad()
        norm = opt.last_grad_norm       # in double; the returned tensor is float32
        assert norm > MAX_NORM and (returned is None or float(returned) == float(torch.tensor(norm)))
        loss_of(ref, x, y).backward()
        ropt.grad_scale = min(1.0, MAX_NORM / (norm + 1e-6))
        ropt.step()
        ropt.zero_grad()
    assert_same(ref, model)


@pytest.mark.parametrize("state", STATES)
def test_an_fp16_overflow_leaves_the_state_unchanged(disk_tmp, state):
    model = offload.wrap(make_model(), config(disk_tmp, dtype="fp16", cpu_budget="56KiB", optimizer_state=state))
    opt = offload.AdamW(model.parameters(), lr=LR)
    engine = model.offload_engine

    def snapshot():
        engine.chunks.drain()
        return {k: engine.store.read(k).clone() for k in engine.store.records if k[0].startswith("exp_avg")}

    for i, (x, y) in enumerate(batches(4)):
        if i == 2:
            before, params = snapshot(), {k: v.clone() for k, v in model.state_dict().items()}
            x = x * 1e6     # fp16 activations overflow: every gradient is inf or NaN
        loss_of(model, x.half(), y.half()).float().backward()
        opt.step()
        opt.zero_grad()
        if i == 2:
            after = snapshot()
            assert engine.scaler.skipped == 1
            kinds = {"exp_avg", "exp_avg_sq"} | ({"exp_avg_absmax", "exp_avg_sq_absmax"} if state == "8bit" else set())
            assert before.keys() == after.keys() and {k[0] for k in before} == kinds
            for k in before:
                assert torch.equal(before[k], after[k]), k
            for k, v in model.state_dict().items():
                assert torch.equal(v, params[k]), k
    assert all(bool(v.isfinite().all()) for v in model.state_dict().values())


class Sometimes(nn.Module):
    """``make_model``'s layers, the 7th (one of the small ones, sharing its chunk) used only on
    even steps; the 2nd frozen (``requires_grad=False`` before wrapping)."""

    def __init__(self):
        super().__init__()
        self.body = make_model()
        self.body[2].weight.requires_grad_(False)
        self.even = True

    def forward(self, x):
        for i, layer in enumerate(self.body):
            if i in (12, 13) and not self.even:      # Linear(16, 16) and its Tanh
                continue
            x = layer(x)
        return x


@pytest.mark.parametrize("state", STATES)
def test_frozen_and_idle_parameters_keep_their_state(disk_tmp, state):
    """A parameter without a gradient in a step keeps its value, codes and scales (torch AdamW
    leaves its state alone too); a frozen one has no state at all."""
    ref = Sometimes()
    model = offload.wrap(Sometimes(), config(disk_tmp, optimizer_state=state))
    bases = aligned_bases(ref, model.offload_engine.chunks.layout)
    ropt = PerParamAdamW([p for p in ref.parameters() if p.requires_grad], bases, lr=LR, moments=state)
    opt = offload.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    engine = model.offload_engine
    idle = engine.chunks.param(model.body[12].weight)
    for step, (x, y) in enumerate(batches(5)):
        ref.even = model.even = step % 2 == 0
        if not model.even:
            engine.chunks.drain()
            before = {k: engine.store.read(k).clone() for k in engine.store.records
                      if k[0].startswith("exp_avg") and k[1] == idle.slot.chunk}
        for m, opt_ in ((ref, ropt), (model, opt)):
            loss_of(m, x, y).backward()
            opt_.step()
            opt_.zero_grad()
        if not model.even:
            engine.chunks.drain()
            lo, hi = idle.slot.offset, idle.slot.end
            for k, v in before.items():
                now = engine.store.read(k)
                if k[0].endswith("absmax"):
                    lo_, hi_ = lo // 256, hi // 256
                    assert torch.equal(now[lo_:hi_], v[lo_:hi_]), k
                else:
                    assert torch.equal(now[lo:hi], v[lo:hi]), k
        assert_same(ref, model)
    assert {k for k, v in engine.store.records.items() if k[0] == "exp_avg"} and not any(
        k[1] == engine.chunks.param(model.body[2].weight).slot.chunk
        for k in engine.store.records if k[0] == "exp_avg")


# ---- hyper-parameters set between backward and step() -------------------------------------

def train_setting_lr_late(model, opt, steps, lr_at) -> None:
    """Each step's lr is set after backward, just before ``step()`` (as a hand-written warm-up
    may do); torch reads it at ``step()``."""
    for step, (x, y) in enumerate(batches(steps)):
        loss_of(model, x, y).backward()
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("state", STATES)
def test_an_lr_set_between_backward_and_step_is_the_one_used(disk_tmp, state):
    """A warm-up from LR / 5 set after backward. The engine overlaps updates with backward once
    the first step shows nothing needs them to wait: the lr set after backward was ignored from
    the second step on (the update had run with the lr read when backward began). The first step
    now shows the lr changing after backward, and updates wait for step()."""
    ref, model, reference = twins(disk_tmp, state)

    def lr_at(step):
        return LR * min(1.0, (step + 1) / 5)

    train_setting_lr_late(ref, reference(ref.parameters(), lr=LR), 5, lr_at)
    train_setting_lr_late(model, offload.AdamW(model.parameters(), lr=LR), 5, lr_at)
    assert_same(ref, model)


def test_an_lr_first_set_late_after_overlapped_steps_warns_then_is_followed(disk_tmp):
    """The lr first changes after backward at the fourth step (of six), whose updates already ran during
    backward with the lr read then: that step keeps it, says so (naming the group and field), and
    the later ones wait for step() and use what it says."""
    ref, model, reference = twins(disk_tmp)

    def lr_at(step):
        return LR if step < 3 else LR / 4

    train_setting_lr_late(ref, reference(ref.parameters(), lr=LR), 6, lambda step: lr_at(step - 1))
    opt = offload.AdamW(model.parameters(), lr=LR)
    with pytest.warns(RuntimeWarning, match=r"param_groups\[0\]\['lr'\]"):
        train_setting_lr_late(model, opt, 6, lr_at)
    assert_same(ref, model)
    assert opt.defers_update()


@pytest.mark.parametrize("state", STATES)
def test_bf16_parameters_as_the_master_follow_groups_and_a_late_lr(disk_tmp, state):
    """bf16 compute with ``master="bf16"``: the parameters are the master, rounded stochastically
    in place. Three param groups, each lr lowered after backward every step: the scheme's steps."""
    ref = make_model().to(torch.bfloat16)
    model = offload.wrap(make_model(), config(disk_tmp, optimizer_state=state, dtype="bf16", master="bf16"))
    reference = functools.partial(PerParamAdamW, bases=aligned_bases(ref, model.offload_engine.chunks.layout),
                                  moments=state)
    runs = []
    for m, opt in ((ref, reference(groups(list(ref.parameters())))),
                   (model, offload.AdamW(groups(list(model.parameters())), state=state, master="bf16"))):
        losses = []
        for x, y in batches(5):
            loss = loss_of(m, x.bfloat16(), y.bfloat16()).float()
            loss.backward()
            for g in opt.param_groups:
                g["lr"] *= 0.9
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        runs.append(losses)
    assert runs[0] == runs[1]
    assert_same(ref, model)
    assert "master" not in {k[0] for k in model.offload_engine.store.records}


def test_a_group_added_between_backward_and_step_warns_then_trains(disk_tmp):
    """Added after backward while the updates overlapped it: that step's gradients of its
    parameters were not used (torch would use them). It says so; the group trains from then on."""
    model = offload.wrap(make_model(), config(disk_tmp))
    params = list(model.parameters())
    opt = offload.AdamW(params[:4], lr=LR)
    for step, (x, y) in enumerate(batches(5)):
        loss_of(model, x, y).backward()
        if step == 2:
            before = model.state_dict()["16.weight"].clone()
            with pytest.warns(RuntimeWarning, match=r"a group added: 1 -> 2"):
                opt.add_param_group(dict(params=params[4:], lr=3e-3))
                opt.step()
        else:
            opt.step()
        opt.zero_grad()
    assert not torch.equal(model.state_dict()["16.weight"], before)


def test_thawing_a_parameter_frozen_at_wrap_is_refused_naming_it(disk_tmp):
    """A parameter frozen (``requires_grad=False``) when the model was wrapped lives in a chunk with
    no gradient, master or moments. Thawed later and handed to the optimizer it was silently never
    trained; both ways of handing it over now say why."""
    from offload.errors import ConfigError

    m = make_model()
    m[2].weight.requires_grad_(False)
    model = offload.wrap(m, config(disk_tmp))
    opt = offload.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    train(model, opt, 1)
    model[2].weight.requires_grad_(True)
    with pytest.raises(ConfigError, match=r"2\.weight.*frozen.*offload\.wrap"):
        opt.add_param_group(dict(params=[model[2].weight]))
    assert len(opt.param_groups) == 1
    m = make_model()
    m[2].weight.requires_grad_(False)
    frozen = offload.wrap(m, config(disk_tmp / "b"))
    opt = offload.AdamW(frozen.parameters(), lr=LR)     # frozen ones included, as torch allows
    train(frozen, opt, 1)
    frozen[2].weight.requires_grad_(True)
    loss_of(frozen, *batches(1)[0]).backward()
    with pytest.raises(ConfigError, match=r"2\.weight.*frozen.*offload\.wrap"):
        opt.step()


def test_freezing_after_wrap_then_thawing_trains_as_the_scheme(disk_tmp):
    """What the refusal above advises: wrapped trainable, frozen after wrapping for two steps (no
    gradient: its state is kept), thawed: the scheme's steps throughout."""
    ref, model, reference = twins(disk_tmp)
    ropt, opt = reference(ref.parameters(), lr=LR), offload.AdamW(model.parameters(), lr=LR)
    for step, (x, y) in enumerate(batches(5)):
        for m, o in ((ref, ropt), (model, opt)):
            m[2].weight.requires_grad_(step not in (1, 2))
            loss_of(m, x, y).backward()
            o.step()
            o.zero_grad()
    assert_same(ref, model)
