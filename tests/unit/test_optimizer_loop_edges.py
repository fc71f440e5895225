"""Ordinary loops the step's safety checks must leave alone (a review of this session's changes):
a short accumulation window at an epoch's end, a late lr on a group of plain parameters, a group
dict the user keeps editing, clipping a frozen offloaded encoder, and a failed read in a model that
only infers (no step to leave half applied)."""

from __future__ import annotations

import errno
import warnings

import torch
from torch import nn

import offload
from offload.errors import NvmeIOError
from tests.helpers.features8 import batches, loss_of, make_model


def test_a_short_window_at_an_epochs_end_keeps_the_overlap(disk_tmp):
    # HF Trainer: 7 micro-batches an epoch under accumulation 2 -> windows 2, 2, 2, 1; the
    # scheduler steps after optimizer.step(), never between backward and step.
    cfg = offload.OffloadConfig(device="cpu", dtype="fp32", nvme_paths=[str(disk_tmp)], chunk_size=2048,
                                gradient_accumulation_steps=2)
    model = offload.wrap(make_model(), cfg)
    opt = offload.AdamW(model.parameters(), lr=1e-2)
    opt.clips_expected = False          # no clip comes: updates may overlap backward
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    data = batches(7)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for _ in range(2):
                for i, (x, y) in enumerate(data):
                    loss_of(model, x, y).backward()
                    if (i + 1) % 2 == 0 or i == len(data) - 1:
                        opt.step()
                        sched.step()
                        opt.zero_grad()
        assert not opt.hypers_set_late and not opt.defers_update()
    finally:
        model.offload_engine.close()


def test_plain_groups_are_the_callers_dicts_and_their_late_lr_changes_nothing(disk_tmp):
    torch.manual_seed(0)
    model = offload.wrap(nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16)),
                         offload.OffloadConfig(device="cpu", dtype="fp32", nvme_paths=[str(disk_tmp)]))
    extra = nn.Linear(4, 4)
    g0 = {"params": list(model.parameters()), "lr": 1e-2}
    opt = offload.AdamW([g0], lr=1e-2)
    g1 = {"params": list(extra.parameters()), "lr": 1e-3}
    opt.add_param_group(g1)
    assert opt.param_groups[0] is g0 and opt.param_groups[1] is g1      # as torch keeps them
    g1["lr"] = 0.5
    assert opt.param_groups[1]["lr"] == 0.5
    opt.clips_expected = False
    x = torch.randn(2, 16)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for i in range(3):
                (model(x).sum() + extra(torch.randn(2, 4)).sum()).backward()
                if i == 1:
                    opt.param_groups[1]["lr"] = 1e-4    # CPUAdamW reads it at step(): nothing to warn of
                opt.step()
                opt.zero_grad()
        assert not opt.hypers_set_late
    finally:
        model.offload_engine.close()


def test_clipping_over_a_frozen_offloaded_encoder_clips_the_trained_head(disk_tmp):
    torch.manual_seed(0)
    enc = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))
    for p in enc.parameters():
        p.requires_grad_(False)
    enc = offload.wrap(enc, offload.OffloadConfig(device="cpu", dtype="fp32", nvme_paths=[str(disk_tmp)]))
    head = nn.Linear(16, 1)
    opt = torch.optim.AdamW(head.parameters(), lr=1e-2)
    x = torch.randn(4, 16)
    try:
        head(enc(x)).pow(2).mean().backward()
        want = float(torch.linalg.vector_norm(torch.cat([p.grad.reshape(-1) for p in head.parameters()])))
        norm = torch.nn.utils.clip_grad_norm_(list(enc.parameters()) + list(head.parameters()), 1e-3)
        assert abs(float(norm) - want) <= 1e-6 * want
        got = float(torch.linalg.vector_norm(torch.cat([p.grad.reshape(-1) for p in head.parameters()])))
        assert abs(got - 1e-3) <= 1e-5
        opt.step()
    finally:
        enc.offload_engine.close()


def test_a_failed_read_fails_one_forward_of_a_model_that_only_infers(disk_tmp):
    cfg = offload.OffloadConfig(device="cpu", dtype="fp32", device_budget="72KiB", cpu_budget="96KiB",
                                nvme_paths=[str(disk_tmp)], chunk_size=2048)
    torch.manual_seed(0)
    model = offload.wrap(nn.Sequential(*[nn.Linear(64, 64, bias=False) for _ in range(12)]), cfg)
    x = torch.randn(3, 64)
    nvme = model.offload_engine.store.tiers["nvme"]
    try:
        with torch.no_grad():
            want = model(x)
        real_wait = nvme.aio.wait
        fails = [1]

        def flaky(handles, timeout=None):       # one transient EIO, then the disk works again
            if fails:
                fails.pop()
                raise NvmeIOError(errno.EIO, "swap", 0, 4096, "transient (injected)")
            return real_wait(handles, timeout)

        nvme.aio.wait = flaky
        try:
            with torch.no_grad():
                model(x)
        except NvmeIOError:
            pass
        assert not fails, "the injected failure was never met: the model did not read NVMe"
        with torch.no_grad():
            assert torch.equal(model(x), want)
    finally:
        model.offload_engine.close()


def test_parameters_keep_their_number_of_dimensions_for_grouping(disk_tmp):
    # nanoGPT's and timm's weight-decay groups: matrices decay, vectors (biases, norms) do not.
    torch.manual_seed(0)
    net = nn.Sequential(nn.Embedding(32, 16), nn.Linear(16, 16), nn.LayerNorm(16), nn.Linear(16, 32))
    want = {n: p.dim() for n, p in net.named_parameters()}
    model = offload.wrap(net, offload.OffloadConfig(device="cpu", dtype="fp32", nvme_paths=[str(disk_tmp)]))
    try:
        assert {n: p.dim() for n, p in model.named_parameters()} == want
        assert all(p.numel() == 0 for p in model.parameters())      # nothing stale to read outside forward
        decay = [p for p in model.parameters() if p.dim() >= 2]
        opt = offload.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}])
        model(torch.randint(0, 32, (2, 5))).pow(2).mean().backward()
        opt.step()
        assert {n: p.dim() for n, p in model.named_parameters()} == want      # after a step too
        assert len(decay) == 3
    finally:
        model.offload_engine.close()
