"""Engine behaviour beyond equivalence: inference, re-tracing, statistics, traces, misuse. (The optimizer
pipeline under a slow optimizer: test_optimizer_pipeline.py.)"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn

import offload
from offload import OffloadError
from tests.helpers.tiny_gpt import TinyGPT, batches
from tests.helpers.trajectory import (assert_run_within_drift, assert_within_drift, drift, float64_twin,
                                      train_in_lockstep)

pytestmark = pytest.mark.slow


def cfg(path, **kw):
    base = dict(device="cpu", dtype="fp32", device_budget="192KiB", cpu_budget="256KiB",
                nvme_paths=[str(path)], chunk_size=8192)
    base.update(kw)
    return offload.OffloadConfig(**base)


def test_eval_and_no_grad_inference_match(disk_tmp):
    torch.manual_seed(0)
    ref = TinyGPT()
    model = offload.wrap(copy.deepcopy(ref), cfg(disk_tmp))
    x, y = next(batches(1))
    ref.eval()
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(x, y), ref(x, y))
    model.train()
    assert model.training and all(m.training for m in model.modules())
    model.offload_engine.close()


class Branchy(nn.Module):
    """Control flow changes which layers run: the trace must be dropped, never trusted."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(64, 64) for _ in range(6))

    def forward(self, x, skip):
        for i, layer in enumerate(self.layers):
            if i not in skip:
                x = torch.tanh(layer(x))
        return x.pow(2).mean()


def test_changed_control_flow_retraces_and_stays_correct(disk_tmp):
    torch.manual_seed(0)
    ref = Branchy()
    exact = float64_twin(ref)
    model = offload.wrap(copy.deepcopy(ref), cfg(disk_tmp, chunk_size=4096, device_budget="96KiB",
                                                 cpu_budget="96KiB"))
    runs = [(model, offload.AdamW(model.parameters(), lr=1e-2))]
    runs += [(m, torch.optim.AdamW(m.parameters(), lr=1e-2)) for m in (ref, exact)]
    gen = torch.Generator().manual_seed(1)
    skips = [set(), set(), {1, 4}, {1, 4}, set(), {0}, set(), set()]
    data = [(torch.randn(8, 64, generator=gen), skip) for skip in skips]
    losses = train_in_lockstep(runs, data, lambda m, b: m(b[0].double() if m is exact else b[0], b[1]))
    stats = model.offload_stats()
    assert stats["retraces"] >= 2
    assert_run_within_drift((model, losses[0]), (ref, losses[1]), (exact, losses[2]))
    model.offload_engine.close()


def test_stats_and_chrome_trace(disk_tmp, monkeypatch):
    trace = disk_tmp / "trace.json"
    monkeypatch.setenv("OFFLOAD_TRACE", str(trace))
    torch.manual_seed(0)
    model = offload.wrap(TinyGPT(checkpointing=True), cfg(disk_tmp / "nvme"))
    opt = offload.AdamW(model.parameters(), lr=1e-3)
    for x, y in batches(3):
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
    stats = model.offload_stats()
    for key in ("step", "moved_bytes", "prefetch_hit_rate", "wait_s", "optimizer_s", "memory", "layout"):
        assert key in stats
    assert stats["step"] == 3 and stats["optimizer_s"] > 0
    assert any(k.startswith("nvme->") for k in stats["moved_bytes"])
    assert 0.0 <= stats["prefetch_hit_rate"] <= 1.0
    events = json.loads(trace.read_text())["traceEvents"]
    cats = {e["cat"] for e in events}
    assert {"adam", "wait"} <= cats
    model.offload_engine.close()


def test_backward_twice_without_step_is_a_clear_error(disk_tmp):
    torch.manual_seed(0)
    model = offload.wrap(TinyGPT(), cfg(disk_tmp))
    opt = offload.AdamW(model.parameters(), lr=1e-3)
    data = batches(3)
    # The first step's update waits for step() (a clip_grad_norm_ may come between); from the
    # second on, with no clip seen, updates run during backward.
    x, y = next(data)
    model(x, y).backward()
    opt.step()
    opt.zero_grad()
    x, y = next(data)
    model(x, y).backward()
    x, y = next(data)
    with pytest.raises(OffloadError, match="gradient_accumulation_steps"):
        model(x, y)
    opt.step()
    model.offload_engine.close()


def test_unwrapped_params_behave_as_cpu_adamw(disk_tmp):
    torch.manual_seed(0)
    extra = nn.Parameter(torch.randn(10))
    extra_ref = nn.Parameter(extra.detach().clone())
    extra_exact = nn.Parameter(extra.detach().double())
    model = offload.wrap(TinyGPT(), cfg(disk_tmp))
    opt = offload.AdamW([{"params": model.parameters()}, {"params": [extra], "lr": 0.1}], lr=1e-3)
    ref_opts = [torch.optim.AdamW([p], lr=0.1) for p in (extra_ref, extra_exact)]
    for x, y in batches(3):
        (model(x, y) + extra.pow(2).sum()).backward()
        opt.step()
        opt.zero_grad()
        for p, o in zip((extra_ref, extra_exact), ref_opts):
            p.pow(2).sum().backward()
            o.step()
            o.zero_grad()
    assert_within_drift({"extra": extra}, {"extra": extra_ref}, {"extra": extra_exact})
    model.offload_engine.close()


def test_lr_scheduler_drives_offloaded_params(disk_tmp):
    torch.manual_seed(0)
    ref = TinyGPT()
    exact = float64_twin(ref)
    model = offload.wrap(copy.deepcopy(ref), cfg(disk_tmp))
    runs = []
    for m, optimizer in ((model, offload.AdamW), (ref, torch.optim.AdamW), (exact, torch.optim.AdamW)):
        o = optimizer(m.parameters(), lr=1e-2)
        runs.append((m, o, torch.optim.lr_scheduler.OneCycleLR(o, max_lr=2e-2, total_steps=6), []))
    for x, y in batches(6):
        for m, o, s, losses in runs:
            loss = m(x, y)
            loss.backward()
            o.step()
            o.zero_grad()
            s.step()
            losses.append(loss.item())
    assert_run_within_drift(*((m, losses) for m, _, _, losses in runs))
    model.offload_engine.close()


def test_a_forward_or_backward_that_raises_releases_what_it_held(disk_tmp):
    torch.manual_seed(0)
    model = offload.wrap(TinyGPT(), cfg(disk_tmp))
    opt = offload.AdamW(model.parameters(), lr=1e-3)
    data = list(batches(3))
    x, y = data[0]
    loss = model(x, y)

    def boom(grad):
        raise RuntimeError("boom")

    hook = model.blocks[1].fc.weight.register_hook(boom)
    with pytest.raises(RuntimeError, match="boom"):
        loss.backward()
    hook.remove()
    opt.zero_grad()
    with pytest.raises(AttributeError):
        model(x, None)                                  # targets=None: the forward raises
    for x, y in data[1:]:
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
    model.offload_engine.adam.drain()       # the last updates may still be running
    states = model.offload_engine.store.memory_report()["chunk_states"]
    assert "COMPUTE" not in states and model.offload_stats()["step"] == 2
    model.offload_engine.close()


def test_clip_grad_norm_between_backward_and_step_matches_torch(disk_tmp):
    torch.manual_seed(0)
    ref = TinyGPT()
    exact = float64_twin(ref)
    model = offload.wrap(copy.deepcopy(ref), cfg(disk_tmp, overlap_optimizer=False))
    opt = offload.AdamW(model.parameters(), lr=1e-2)
    runs = [(model, opt, opt.clip_grad_norm_)]
    runs += [(m, torch.optim.AdamW(m.parameters(), lr=1e-2),
              lambda n, m=m: torch.nn.utils.clip_grad_norm_(m.parameters(), n)) for m in (ref, exact)]
    losses, norms = [[], [], []], [[], [], []]
    for x, y in batches(3):
        for (m, o, clip), run_losses, run_norms in zip(runs, losses, norms):
            loss = m(x, y)
            loss.backward()
            run_norms.append(clip(0.5).item())
            o.step()
            o.zero_grad()
            run_losses.append(loss.item())
    assert opt.max_grad_norm is None          # one call clips one step
    assert min(norms[1]) > 0.5                # and clipping was active
    norm = drift("grad norm", *(torch.tensor(n, dtype=torch.float64) for n in norms))
    assert norm.ok, str(norm)
    assert_run_within_drift((model, losses[0]), (ref, losses[1]), (exact, losses[2]))
    model.offload_engine.close()
