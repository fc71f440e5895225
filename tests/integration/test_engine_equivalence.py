"""offload.wrap + offload.AdamW give the same training run as plain PyTorch + torch.optim.AdamW.

Budgets are small enough that every chunk passes through every tier: on this CPU-only suite the
device and CPU budgets are one host-memory tier (the default) plus NVMe in a temp dir, and with
``merge_host_tiers=False`` three tiers (a CPU region standing in for the device, CPU, NVMe) with
the copies between them a GPU run makes. Tolerances: fp32 losses and final parameters as close to
the same run in float64 as plain PyTorch's fp32 run is (tests/helpers/trajectory.py: no fixed tolerance holds
on every CPU, as Adam amplifies rounding-level gradient differences); bf16 against a plain-PyTorch mixed-precision reference (bf16 compute copy, fp32
master weights, torch AdamW) within 2e-2 relative on the loss, and against fp32 training within
5e-2 (bf16's own tolerance); fp16 with loss scaling against fp32 within 3e-2.
"""

from __future__ import annotations

import copy

import pytest
import torch

import offload
from tests.helpers.reference import LR, WD, Reference, make_models, run_reference, small_config
from tests.helpers.tiny_gpt import batches

pytestmark = pytest.mark.slow


def run_offload(model, cfg, steps, *, accumulate=1, clip=None, overflow_at=None):
    model = offload.wrap(model, cfg)
    opt = offload.AdamW(model.parameters(), lr=LR, weight_decay=WD, max_grad_norm=clip)
    losses = []
    data = iter(batches(steps * accumulate))
    for step in range(steps):
        total = 0.0
        for _ in range(accumulate):
            x, y = next(data)
            loss = model(x, y) / accumulate
            if step == overflow_at:
                loss = loss * float("inf")
            loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return model, opt, losses


def assert_params_close(model, ref, rtol, atol):
    got = model.state_dict()
    for name, want in ref.state_dict().items():
        torch.testing.assert_close(got[name].float(), want.float(), rtol=rtol, atol=atol, msg=name)


def assert_all_tiers_used(model):
    report = model.offload_engine.store.memory_report()
    assert report["tiers"]["nvme"]["bytes_by_kind"], "nothing reached NVMe"
    stats = model.offload_stats()
    assert stats["step"] > 0
    if len(model.offload_engine.store.order) == 3:      # separate device and CPU tiers
        moved = stats["moved_bytes"]
        assert moved.get("cpu->device") and moved.get("device->cpu"), moved


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("merged", [True, False], ids=["host-tier", "three-tiers"])
def test_fp32_matches_torch(disk_tmp, overlap, merged):
    ref, mine = make_models()
    want = Reference(ref, 20)
    cfg = small_config(disk_tmp, overlap_optimizer=overlap, merge_host_tiers=merged)
    model, _, got = run_offload(mine, cfg, 20)
    want.check(model, got)
    assert_all_tiers_used(model)
    model.offload_engine.close()


def test_overlapped_and_deferred_updates_are_bit_identical(disk_tmp):
    _, a = make_models()
    _, b = make_models()
    ma, _, la = run_offload(a, small_config(disk_tmp / "a", overlap_optimizer=True), 8)
    mb, _, lb = run_offload(b, small_config(disk_tmp / "b", overlap_optimizer=False), 8)
    assert la == lb
    sa, sb = ma.state_dict(), mb.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    for m in (ma, mb):
        m.offload_engine.close()


def test_gradient_accumulation(disk_tmp):
    ref, mine = make_models()
    want = Reference(ref, 8, accumulate=3)
    model, _, got = run_offload(mine, small_config(disk_tmp, gradient_accumulation_steps=3), 8, accumulate=3)
    want.check(model, got)
    model.offload_engine.close()


def test_gradient_clipping(disk_tmp):
    ref, mine = make_models()
    want = Reference(ref, 10, clip=0.5)
    model, opt, got = run_offload(mine, small_config(disk_tmp), 10, clip=0.5)
    want.check(model, got)
    assert opt.last_grad_norm is not None and opt.last_grad_norm > 0.5   # clipping was active
    model.offload_engine.close()


class MixedReference:
    """Plain-PyTorch mixed precision: a low-precision compute copy, fp32 master weights, torch AdamW."""

    def __init__(self, master: torch.nn.Module, dtype: torch.dtype):
        self.master = master
        self.compute = copy.deepcopy(master).to(dtype)
        self.opt = torch.optim.AdamW(master.parameters(), lr=LR, weight_decay=WD)

    def step(self, x, y) -> float:
        loss = self.compute(x, y)
        loss.backward()
        for pm, pc in zip(self.master.parameters(), self.compute.parameters()):
            pm.grad = pc.grad.float()
            pc.grad = None
        self.opt.step()
        self.opt.zero_grad()
        with torch.no_grad():
            for pm, pc in zip(self.master.parameters(), self.compute.parameters()):
                pc.copy_(pm)
        return loss.item()


@pytest.mark.parametrize("merged", [True, False], ids=["host-tier", "three-tiers"])
def test_bf16_matches_mixed_precision_reference(disk_tmp, merged):
    ref32, mine = make_models()
    mixed_master = copy.deepcopy(ref32)
    want32 = run_reference(ref32, 20)
    mixed = MixedReference(mixed_master, torch.bfloat16)
    want_mixed = [mixed.step(x, y) for x, y in batches(20)]
    model, _, got = run_offload(mine, small_config(disk_tmp, dtype="bf16", merge_host_tiers=merged), 20)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want_mixed), rtol=2e-2, atol=0)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want32), rtol=5e-2, atol=0)
    assert_params_close(model, mixed_master, rtol=0, atol=2e-2)
    assert_all_tiers_used(model)
    model.offload_engine.close()


def test_fp16_loss_scaling_with_forced_overflow(disk_tmp):
    ref, mine = make_models()
    want = run_reference(ref, 12, skip={5})
    cfg = small_config(disk_tmp, dtype="fp16", initial_loss_scale=2.0**12)
    model, opt, got = run_offload(mine, cfg, 12, overflow_at=5)
    engine = model.offload_engine
    assert engine.scaler.skipped == 1 and engine.scaler.scale == 2.0**11
    assert engine.step_count == 11
    finite = [l for i, l in enumerate(got) if i != 5]
    torch.testing.assert_close(torch.tensor(finite), torch.tensor([l for i, l in enumerate(want) if i != 5]),
                               rtol=3e-2, atol=0)
    sd = model.state_dict()
    assert all(torch.isfinite(v).all() for v in sd.values())          # nothing corrupted
    st = opt.state_dict()["state"]
    assert all(torch.isfinite(s["exp_avg"]).all() and torch.isfinite(s["exp_avg_sq"]).all() for s in st.values())
    engine.close()


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_resume_from_state_dicts_continues_identically(disk_tmp, dtype):
    _, a = make_models()
    _, b = make_models()
    cfg_a = small_config(disk_tmp / "a", dtype=dtype)
    model_a = offload.wrap(a, cfg_a)
    opt_a = offload.AdamW(model_a.parameters(), lr=LR, weight_decay=WD)
    data = list(batches(6))
    losses_a = []
    saved = None
    for i, (x, y) in enumerate(data):
        loss = model_a(x, y)
        loss.backward()
        opt_a.step()
        opt_a.zero_grad()
        losses_a.append(loss.item())
        if i == 2:
            saved = (copy.deepcopy(model_a.state_dict()), copy.deepcopy(opt_a.state_dict()))
    model_b = offload.wrap(b, small_config(disk_tmp / "b", dtype=dtype))
    opt_b = offload.AdamW(model_b.parameters(), lr=LR, weight_decay=WD)
    model_b.load_state_dict(saved[0])
    opt_b.load_state_dict(saved[1])
    losses_b = []
    for x, y in data[3:]:
        loss = model_b(x, y)
        loss.backward()
        opt_b.step()
        opt_b.zero_grad()
        losses_b.append(loss.item())
    assert losses_b == losses_a[3:]
    sa, sb = model_a.state_dict(), model_b.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    model_a.offload_engine.close()
    model_b.offload_engine.close()


def test_optimizer_state_dict_interchangeable_with_torch(disk_tmp):
    ref, mine = make_models()
    run_reference(ref, 3)
    torch_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD)
    # a state produced by torch (3 steps on the reference) loads into ours and back out unchanged
    for x, y in batches(3):
        ref(x, y).backward()
        torch_opt.step()
        torch_opt.zero_grad()
    mine.load_state_dict(ref.state_dict())
    model = offload.wrap(mine, small_config(disk_tmp))
    opt = offload.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    opt.load_state_dict(torch_opt.state_dict())
    back = opt.state_dict()
    want = torch_opt.state_dict()
    assert back["state"].keys() == want["state"].keys()
    for i in want["state"]:
        for k in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(back["state"][i][k], want["state"][i][k]), (i, k)
    # and training continues identically on both
    x, y = next(batches(1, seed=7))
    l_ref = ref(x, y)
    l_ref.backward()
    torch_opt.step()
    l_mine = model(x, y)
    l_mine.backward()
    opt.step()
    assert abs(l_ref.item() - l_mine.item()) <= 1e-6 * abs(l_ref.item())
    assert_params_close(model, ref, rtol=1e-5, atol=1e-6)
    model.offload_engine.close()


def test_step_consumes_gradients(disk_tmp):
    """optimizer.step() consumes the window's gradients (their chunks are freed as each update
    finishes, as DeepSpeed's engine does): leaving out zero_grad() changes nothing."""
    _, a = make_models()
    _, b = make_models()
    ma = offload.wrap(a, small_config(disk_tmp / "a"))
    mb = offload.wrap(b, small_config(disk_tmp / "b"))
    oa = offload.AdamW(ma.parameters(), lr=LR, weight_decay=WD)
    ob = offload.AdamW(mb.parameters(), lr=LR, weight_decay=WD)
    for x, y in batches(4):
        for model, opt, zero in ((ma, oa, True), (mb, ob, False)):
            model(x, y).backward()
            opt.step()
            engine = model.offload_engine
            engine.adam.drain()     # updates still queued at step() may finish during the next forward
            assert all(engine.store.records[("grad", c)].state.name == "FREE"
                       for c in range(engine.layout.num_chunks))
            if zero:
                opt.zero_grad()
    sa, sb = ma.state_dict(), mb.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    for m in (ma, mb):
        m.offload_engine.close()


def test_gradient_chunks_keep_autograd_dtype_unless_accumulating(disk_tmp):
    """Without accumulation a gradient chunk holds bf16 copies of bf16 gradients (lossless, half
    the bytes); accumulating micro-batches sums them in fp32, and still trains like fp32 does."""
    ref32, mine = make_models()
    plain = offload.wrap(make_models()[1], small_config(disk_tmp / "plain", dtype="bf16"))
    assert plain.offload_engine.store.records[("grad", 0)].dtype == torch.bfloat16
    plain.offload_engine.close()
    want32 = run_reference(ref32, 6, accumulate=2)
    cfg = small_config(disk_tmp / "acc", dtype="bf16", gradient_accumulation_steps=2)
    model, _, got = run_offload(mine, cfg, 6, accumulate=2)
    assert model.offload_engine.store.records[("grad", 0)].dtype == torch.float32
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want32), rtol=5e-2, atol=0)
    model.offload_engine.close()
