"""What users do with a wrapped model's outputs and defaults: modify outputs in place, return
outputs nobody backpropagates through, train under another default device."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import offload
from offload.models.llama import LlamaForCausalLM, get_preset
from tests.helpers.tiny_gpt import TinyGPT, batches
from tests.helpers.trajectory import assert_run_within_drift, float64_twin

pytestmark = pytest.mark.slow


class LossAndLogits(nn.Module):
    """Returns (loss, logits) the way HF models do: only ``loss`` is backpropagated."""

    def __init__(self, vocab=512, d=32):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.head = nn.Linear(d, vocab)

    def forward(self, x, y):
        logits = self.head(self.emb(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)), logits


def cfg(path, **kw):
    base = dict(device="cpu", dtype="fp32", device_budget="768KiB", cpu_budget="1MiB",
                nvme_paths=[str(path)], chunk_size=16384)
    base.update(kw)
    return offload.OffloadConfig(**base)


class ZerosOfShape(TorchDispatchMode):
    """Counts tensors of ``shape`` that are created filled with zeros (materialized gradients)."""

    def __init__(self, shape):
        super().__init__()
        self.shape = tuple(shape)
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in ("zeros", "zeros_like", "new_zeros", "zero_", "fill_") and isinstance(out, torch.Tensor) \
                and tuple(out.shape) == self.shape:
            self.count += 1
        return out


def test_unused_outputs_get_no_zero_gradient(disk_tmp):
    """Backpropagating ``loss`` alone must not build a zero gradient for ``logits``: at 8k tokens
    and a 128k vocabulary that would be 2 GiB outside every budget."""
    torch.manual_seed(0)
    model = offload.wrap(LossAndLogits(), cfg(disk_tmp))
    x = torch.randint(0, 512, (4, 64))
    loss, logits = model(x, x)
    with ZerosOfShape(logits.shape) as probe:
        loss.backward()
    assert probe.count == 0
    model.offload_engine.close()


def test_in_place_changes_to_outputs_train_like_torch(disk_tmp):
    """``loss *= s`` (transformers.Trainer) and ``logits.div_(t)`` work on a wrapped model's outputs
    and give plain PyTorch's numbers (up to rounding: tests/helpers/trajectory.py)."""
    torch.manual_seed(0)
    ref = LossAndLogits()
    exact = float64_twin(ref)
    model = offload.wrap(copy.deepcopy(ref), cfg(disk_tmp))
    runs = [(model, offload.AdamW(model.parameters(), lr=1e-2), [])]
    runs += [(m, torch.optim.AdamW(m.parameters(), lr=1e-2), []) for m in (ref, exact)]
    gen = torch.Generator().manual_seed(1)
    for _ in range(5):
        x = torch.randint(0, 512, (4, 32), generator=gen)
        for m, o, losses in runs:
            loss, logits = m(x, x)
            loss *= 0.5
            logits.div_(2.0)
            total = loss + logits.pow(2).mean() * 1e-3
            total.backward()
            o.step()
            o.zero_grad()
            losses.append(total.item())
    assert_run_within_drift(*((m, losses) for m, _, losses in runs))
    model.offload_engine.close()


def test_fp16_scaled_outputs_can_be_modified_in_place(disk_tmp):
    torch.manual_seed(0)
    model = offload.wrap(TinyGPT(), cfg(disk_tmp, dtype="fp16"))
    opt = offload.AdamW(model.parameters(), lr=1e-3)
    for x, y in batches(3):
        loss = model(x, y)
        loss *= 0.5
        loss.backward()
        opt.step()
        opt.zero_grad()
        assert torch.isfinite(loss)
    model.offload_engine.close()


def test_host_buffers_ignore_the_default_device(disk_tmp):
    """Under ``torch.set_default_device`` (users set "cuda"; "meta" shows the same bug on a CPU box)
    every host buffer of lazy init, state_dict, checkpoints and safetensors stays on the CPU, and
    lazy init draws from the CPU generator: weights equal eager construction."""
    preset = get_preset("tiny")
    torch.manual_seed(0)
    eager = LlamaForCausalLM(preset)
    config = offload.OffloadConfig(device="cpu", dtype="fp32", device_budget="6MiB", cpu_budget="6MiB",
                                   nvme_paths=[str(disk_tmp / "nvme")])
    (disk_tmp / "nvme").mkdir()
    torch.manual_seed(0)
    with offload.lazy_init(config):
        lazy = LlamaForCausalLM(preset)
    torch.set_default_device("meta")
    try:
        model = offload.wrap(lazy)
        first = model.state_dict()
        opt = offload.AdamW(model.parameters(), lr=1e-3)
        offload.save_checkpoint(model, opt, disk_tmp / "ckpt", step=1)
        offload.load_checkpoint(model, opt, disk_tmp / "ckpt")
        offload.export_safetensors(model, disk_tmp / "st")
        offload.load_safetensors(model, disk_tmp / "st")
        second = model.state_dict()
    finally:
        torch.set_default_device(None)
    for k, v in eager.state_dict().items():
        assert first[k].device.type == "cpu" and torch.equal(first[k], v), k
        assert torch.equal(second[k], v), k
    model.offload_engine.close()
