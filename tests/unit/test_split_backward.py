"""A split backward (what zero-bubble pipeline schedules run): the input gradients first
(``torch.autograd.grad`` by the stage's input), the weight gradients later (by the parameters,
assigned to ``.grad``, where no accumulation hook runs). Inside ``engine.input_pass()`` and
``engine.weight_pass()`` the engine accumulates the window's micro-batches and updates once, like
plain PyTorch with the ordinary backward; without them it lost the weight gradients."""

from __future__ import annotations

import copy

import pytest
import torch

import offload
from offload.errors import OffloadError
from offload.models.llama import LlamaConfig, LlamaForCausalLM
from offload.pipeline import split_llama

LR, WD, MICRO = 1e-2, 0.1, 3


def middle_stage():
    """The middle stage of a small LLaMA cut in three: hidden states in, hidden states out."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=3, num_heads=2,
                      num_kv_heads=1, max_seq_len=16)
    return split_llama(LlamaForCausalLM(cfg), 3)[1]


def data(steps):
    gen = torch.Generator().manual_seed(1)
    return [[(torch.randn(2, 8, 32, generator=gen), torch.randn(2, 8, 32, generator=gen)) for _ in range(MICRO)]
            for _ in range(steps)]


def train_plain(stage, batches):
    opt = torch.optim.AdamW(stage.parameters(), lr=LR, weight_decay=WD)
    input_grads = []
    for step in batches:
        for x, g in step:
            x = x.clone().requires_grad_(True)
            stage(x).backward(g)
            input_grads.append(x.grad)
        opt.step()
        opt.zero_grad()
    return input_grads, {k: v.detach().clone() for k, v in stage.state_dict().items()}


def train_split(stage, batches, tmp_path, *, tell_engine=True):
    config = offload.OffloadConfig(device="cpu", dtype="fp32", device_budget="128KiB", cpu_budget="128KiB",
                                   nvme_paths=[str(tmp_path)], chunk_size=4096,
                                   gradient_accumulation_steps=MICRO)
    stage = offload.wrap(stage, config)
    engine = stage.offload_engine
    params = [p for p in stage.parameters() if p.requires_grad]
    opt = offload.AdamW(params, lr=LR, weight_decay=WD)
    input_grads = []
    for step in batches:
        held = []
        for x, g in step:                       # every input pass first, as the schedule may order them
            x = x.clone().requires_grad_(True)
            out = stage(x)
            with engine.input_pass() if tell_engine else _nothing():
                (dx,) = torch.autograd.grad(out, [x], g, retain_graph=True)
            input_grads.append(dx)
            held.append((out, g))
        for out, g in held:                     # then the weight passes
            with engine.weight_pass() if tell_engine else _nothing():
                for p, dw in zip(params, torch.autograd.grad(out, params, g)):
                    p.grad = dw if p.grad is None else p.grad + dw
        opt.step()
        opt.zero_grad()
    return input_grads, {k: v.detach().clone() for k, v in stage.state_dict().items()}


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_a_split_backward_accumulates_and_updates_like_plain_pytorch(tmp_path):
    stage = middle_stage()
    batches = data(3)
    want_dx, want = train_plain(copy.deepcopy(stage), batches)
    got_dx, got = train_split(stage, batches, tmp_path)
    for a, b in zip(got_dx, want_dx):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    assert set(got) == set(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-5, msg=k)


def test_without_telling_the_engine_the_weight_gradients_are_lost(tmp_path):
    """Why the passes exist: torch's weight pass writes ``.grad`` itself (no hook runs), so an
    engine that is not told updates without them (the later steps' input gradients differ)."""
    stage = middle_stage()
    batches = data(2)
    want_dx, _ = train_plain(copy.deepcopy(stage), batches)
    got_dx, _ = train_split(stage, batches, tmp_path, tell_engine=False)
    assert max((a - b).abs().max().item() for a, b in zip(got_dx, want_dx)) > 1e-3


def test_a_weight_pass_cannot_begin_inside_an_input_pass(tmp_path):
    stage = offload.wrap(middle_stage(), offload.OffloadConfig(device="cpu", dtype="fp32"))
    with stage.offload_engine.input_pass():
        with pytest.raises(OffloadError, match="inside its input pass"):
            with stage.offload_engine.weight_pass():
                pass
