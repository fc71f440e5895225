"""``CPUAdamW`` / ``CPUAdam`` as drop-ins for torch's AdamW / Adam on CPU: results against
torch in float64, param groups, lr schedulers, state dicts both ways, non-contiguous
parameters, and bad input raising before anything changes."""

from __future__ import annotations

import copy

import pytest
import torch

from offload.errors import ConfigError, OffloadError, UnsupportedError
from offload.optim import CPUAdam, CPUAdamW

PAIRS = [(CPUAdamW, torch.optim.AdamW), (CPUAdam, torch.optim.Adam)]


def model(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(13, 17), torch.nn.Tanh(), torch.nn.Linear(17, 3))
    return net.to(dtype)


def batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 13, generator=g), torch.randn(8, 3, generator=g)) for _ in range(n)]


def train(net, opt, data, sched=None):
    for x, y in data:
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(net(x.to(next(net.parameters()).dtype)),
                                            y.to(next(net.parameters()).dtype))
        loss.backward()
        opt.step()
        if sched is not None:
            sched.step()


def groups(net, lr):
    first, second = net[0], net[2]
    return [{"params": first.parameters(), "lr": lr, "weight_decay": 0.1},
            {"params": second.parameters(), "lr": lr * 3, "weight_decay": 0.0, "betas": (0.8, 0.99)}]


def rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def close(net_a, net_b, tol=1e-6):
    for pa, pb in zip(net_a.parameters(), net_b.parameters()):
        assert rel(pa.detach(), pb.detach()) < tol


@pytest.mark.parametrize("ours_cls,torch_cls", PAIRS)
def test_single_step_same_update_as_torch_on_fixed_grads(ours_cls, torch_cls):
    # the same gradients fed to both (no feedback through the model): fp32 results agree
    # to float rounding, and both stay within 1e-6 of torch in float64
    p32 = torch.nn.Parameter(torch.randn(1000, generator=torch.Generator().manual_seed(2)))
    pours, ptorch, p64 = (torch.nn.Parameter(p32.detach().clone()),
                          torch.nn.Parameter(p32.detach().clone()),
                          torch.nn.Parameter(p32.detach().double()))
    kw = dict(lr=1e-2, weight_decay=0.05, eps=1e-8)
    opts = [ours_cls([pours], **kw), torch_cls([ptorch], **kw), torch_cls([p64], foreach=False, **kw)]
    g = torch.Generator().manual_seed(3)
    for _ in range(100):
        grad = torch.randn(1000, generator=g)
        pours.grad, ptorch.grad, p64.grad = grad.clone(), grad.clone(), grad.double()
        for o in opts:
            o.step()
    assert rel(pours.detach(), p64.detach()) < 1e-6
    assert (pours.detach() - ptorch.detach()).abs().max() < 1e-5


@pytest.mark.parametrize("ours_cls,torch_cls", PAIRS)
def test_training_with_groups_and_scheduler_matches_torch_float64(ours_cls, torch_cls):
    data = batches(100)
    ours_net, ref_net = model(), model(dtype=torch.float64)
    ours = ours_cls(groups(ours_net, 1e-2))
    ref = torch_cls(groups(ref_net, 1e-2), foreach=False)
    s1 = torch.optim.lr_scheduler.CosineAnnealingLR(ours, T_max=100)
    s2 = torch.optim.lr_scheduler.CosineAnnealingLR(ref, T_max=100)
    # the model feeds its own rounding back into the gradients: compare against torch's own
    # fp32 distance from float64 rather than an absolute bound
    t32_net = model()
    t32 = torch_cls(groups(t32_net, 1e-2))
    s3 = torch.optim.lr_scheduler.CosineAnnealingLR(t32, T_max=100)
    train(ours_net, ours, data, s1)
    train(ref_net, ref, data, s2)
    train(t32_net, t32, data, s3)
    for po, pr, pt in zip(ours_net.parameters(), ref_net.parameters(), t32_net.parameters()):
        assert rel(po.detach(), pr.detach()) <= max(1e-6, 4 * rel(pt.detach(), pr.detach()))
    assert ours.param_groups[1]["lr"] == pytest.approx(ref.param_groups[1]["lr"])


@pytest.mark.parametrize("scheduler", ["step", "lambda", "onecycle", "plateau"])
def test_every_kind_of_scheduler_drives_lr(scheduler):
    net = model()
    opt = CPUAdamW(net.parameters(), lr=1e-2)
    make = {
        "step": lambda: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5),
        "lambda": lambda: torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 1 / (1 + e)),
        "onecycle": lambda: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=10),
        "plateau": lambda: torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0),
    }[scheduler]
    sched = make()
    lrs = []
    for x, y in batches(6):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(net(x), y)
        loss.backward()
        opt.step()
        sched.step(1.0) if scheduler == "plateau" else sched.step()
        lrs.append(opt.param_groups[0]["lr"])
    assert len(set(lrs)) > 1


def test_lr_as_tensor_and_betas_as_tensors():
    p1 = torch.nn.Parameter(torch.randn(50))
    p2 = torch.nn.Parameter(p1.detach().clone())
    o1 = CPUAdamW([p1], lr=torch.tensor(1e-2), betas=(torch.tensor(0.9), torch.tensor(0.999)))
    # like torch, a tensor's value is what counts: float32(0.9) is not 0.9
    o2 = CPUAdamW([p2], lr=torch.tensor(1e-2).item(),
                  betas=(torch.tensor(0.9).item(), torch.tensor(0.999).item()))
    for _ in range(5):
        g = torch.randn(50)
        p1.grad, p2.grad = g.clone(), g.clone()
        o1.step()
        o2.step()
    assert torch.equal(p1, p2)


@pytest.mark.parametrize("ours_cls,torch_cls", PAIRS)
def test_state_dict_from_torch_loads_into_ours_and_back(ours_cls, torch_cls):
    data = batches(20)
    kw = dict(lr=1e-2, weight_decay=0.01)
    # torch trains 10 steps, ours continues from its state dict; torch continues too
    net_t, net_o = model(), model()
    opt_t = torch_cls(net_t.parameters(), **kw)
    train(net_t, opt_t, data[:10])
    net_o.load_state_dict(net_t.state_dict())
    opt_o = ours_cls(net_o.parameters(), **kw)
    opt_o.load_state_dict(copy.deepcopy(opt_t.state_dict()))
    train(net_t, opt_t, data[10:])
    train(net_o, opt_o, data[10:])
    close(net_o, net_t, tol=1e-5)
    # and ours -> torch
    net_t2 = model()
    net_t2.load_state_dict(net_o.state_dict())
    opt_t2 = torch_cls(net_t2.parameters(), **kw)
    opt_t2.load_state_dict(copy.deepcopy(opt_o.state_dict()))
    train(net_o, opt_o, data[:5])
    train(net_t2, opt_t2, data[:5])
    close(net_o, net_t2, tol=1e-5)


def test_state_dict_layout_is_torchs():
    net_o, net_t = model(), model()
    opt_o, opt_t = CPUAdamW(net_o.parameters()), torch.optim.AdamW(net_t.parameters())
    train(net_o, opt_o, batches(2))
    train(net_t, opt_t, batches(2))
    so, st = opt_o.state_dict(), opt_t.state_dict()
    assert so["param_groups"] == st["param_groups"]
    assert so["state"].keys() == st["state"].keys()
    for k in st["state"]:
        assert so["state"][k].keys() == st["state"][k].keys()
        for name, t in st["state"][k].items():
            assert so["state"][k][name].dtype == t.dtype
            assert so["state"][k][name].shape == t.shape
    assert so["state"][0]["step"].item() == 2.0 and so["state"][0]["step"].dim() == 0


def test_non_contiguous_parameters_match_contiguous_ones():
    base = torch.randn(6, 10)
    pt = torch.nn.Parameter(base.clone().t())              # transposed leaf: non-contiguous
    pc = torch.nn.Parameter(base.clone().t().contiguous())
    assert not pt.is_contiguous()
    o1, o2 = CPUAdamW([pt], lr=1e-2), CPUAdamW([pc], lr=1e-2)
    ref = torch.nn.Parameter(base.clone().t())
    o3 = torch.optim.AdamW([ref], lr=1e-2)
    for _ in range(5):
        g = torch.randn(10, 6)
        pt.grad, pc.grad, ref.grad = g.clone(), g.clone(), g.clone()
        for o in (o1, o2, o3):
            o.step()
    assert torch.equal(pt, pc)
    assert (pt - ref).abs().max() < 1e-5
    assert o1.state[pt]["exp_avg"].stride() == pt.stride()


def test_closure_params_without_grad_and_threads():
    net = model()
    frozen = torch.nn.Parameter(torch.ones(3))
    opt = CPUAdamW([{"params": net.parameters()}, {"params": [frozen]}], threads=1)
    x, y = batches(1)[0]

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(net(x), y)
        loss.backward()
        return loss

    assert isinstance(opt.step(closure), torch.Tensor)
    assert torch.equal(frozen, torch.ones(3)) and frozen not in opt.state
    assert opt.threads == 1


def test_amsgrad_and_other_unsupported_flags_say_so():
    p = [torch.nn.Parameter(torch.randn(3))]
    with pytest.raises(UnsupportedError, match="amsgrad"):
        CPUAdamW(p, amsgrad=True)
    with pytest.raises(UnsupportedError, match="capturable"):
        CPUAdam(p, capturable=True)
    with pytest.raises(UnsupportedError, match="differentiable"):
        CPUAdamW(p, differentiable=True)
    CPUAdamW(p, foreach=True, fused=True, maximize=True)  # accepted


@pytest.mark.parametrize("kw,field", [({"lr": -1.0}, "lr"), ({"betas": (1.0, 0.999)}, "beta1"),
                                      ({"betas": (0.9, -0.1)}, "beta2"), ({"eps": 0.0}, "eps"),
                                      ({"weight_decay": -1e-2}, "weight_decay"),
                                      ({"threads": 0}, "threads")])
def test_bad_constructor_arguments(kw, field):
    with pytest.raises(ConfigError) as info:
        CPUAdamW([torch.nn.Parameter(torch.randn(3))], **kw)
    assert info.value.field == field


def _snapshot(net, opt):
    return ([p.detach().clone() for p in net.parameters()],
            copy.deepcopy(opt.state_dict()["state"]))


def _assert_unchanged(net, opt, snap):
    params, state = snap
    for p, before in zip(net.parameters(), params):
        assert torch.equal(p.detach(), before)
    now = opt.state_dict()["state"]
    assert now.keys() == state.keys()
    for k in state:
        for name in state[k]:
            assert torch.equal(now[k][name], state[k][name])


@pytest.mark.parametrize("breakage", ["lr", "betas", "eps", "sparse_grad", "meta_param", "float64"])
def test_bad_state_at_step_raises_and_modifies_nothing(breakage):
    net = model()
    opt = CPUAdamW(net.parameters(), lr=1e-2)
    train(net, opt, batches(2))
    x, y = batches(1, seed=9)[0]
    opt.zero_grad()
    torch.nn.functional.mse_loss(net(x), y).backward()
    last = list(net.parameters())[-1]
    if breakage == "lr":
        opt.param_groups[0]["lr"] = -1e-3
    elif breakage == "betas":
        opt.param_groups[0]["betas"] = (0.9, 1.0)
    elif breakage == "eps":
        opt.param_groups[0]["eps"] = -1e-8
    elif breakage == "sparse_grad":
        last.grad = last.grad.to_sparse()
    elif breakage == "meta_param":
        opt.param_groups[0]["params"].append(torch.nn.Parameter(torch.empty(3, device="meta")))
    elif breakage == "float64":
        opt.param_groups[0]["params"].append(torch.nn.Parameter(torch.zeros(3, dtype=torch.float64)))
    snap = _snapshot(net, opt)
    with pytest.raises(OffloadError):
        opt.step()
    _assert_unchanged(net, opt, snap)


def test_maximize_matches_torch():
    p1 = torch.nn.Parameter(torch.randn(64))
    p2 = torch.nn.Parameter(p1.detach().clone())
    o1 = CPUAdam([p1], lr=1e-2, weight_decay=0.1, maximize=True)
    o2 = torch.optim.Adam([p2], lr=1e-2, weight_decay=0.1, maximize=True)
    for _ in range(10):
        g = torch.randn(64)
        p1.grad, p2.grad = g.clone(), g.clone()
        o1.step()
        o2.step()
    assert (p1 - p2).abs().max() < 1e-5
