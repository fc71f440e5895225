"""``torch.nn.utils.clip_grad_norm_`` over a wrapped model's parameters (the call HF Trainer and
accelerate make) clips as torch does: the global norm counts offloaded and plain gradients, the
plain ones are scaled in place by torch, the offloaded ones by the engine's Adam. It refuses what
it cannot do exactly, with the reason."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import offload
from offload import ConfigError, OffloadError
from tests.helpers.tiny_gpt import TinyGPT, batches
from tests.helpers.trajectory import assert_run_within_drift, assert_within_drift, drift, float64_twin

pytestmark = pytest.mark.slow


def cfg(path, **kw):
    base = dict(device="cpu", dtype="fp32", device_budget="192KiB", cpu_budget="256KiB",
                nvme_paths=[str(path)], chunk_size=8192)
    base.update(kw)
    return offload.OffloadConfig(**base)


def test_clip_over_wrapped_and_plain_parameters_matches_torch(disk_tmp):
    torch.manual_seed(0)
    ref, ref_head = TinyGPT(), nn.Linear(1, 1)          # a parameter no engine owns
    exact, exact_head = float64_twin(ref), float64_twin(ref_head)
    model, head = offload.wrap(copy.deepcopy(ref), cfg(disk_tmp)), copy.deepcopy(ref_head)
    runs = [(model, head, offload.AdamW), (ref, ref_head, torch.optim.AdamW),
            (exact, exact_head, torch.optim.AdamW)]
    runs = [(m, h, o([*m.parameters(), *h.parameters()], lr=1e-2)) for m, h, o in runs]
    losses, norms = [[], [], []], [[], [], []]
    for x, y in batches(4):
        for (m, h, o), run_losses, run_norms in zip(runs, losses, norms):
            loss = m(x, y) + h(torch.ones(1, dtype=h.weight.dtype)).pow(2).sum()
            loss.backward()
            run_norms.append(torch.nn.utils.clip_grad_norm_([*m.parameters(), *h.parameters()], 0.3).item())
            o.step()
            o.zero_grad()
            run_losses.append(loss.item())
    assert min(norms[1]) > 0.3                                               # clipping was active
    norm = drift("grad norm", *(torch.tensor(n, dtype=torch.float64) for n in norms))
    assert norm.ok, str(norm)
    assert_run_within_drift((model, losses[0]), (ref, losses[1]), (exact, losses[2]))
    assert_within_drift(head.state_dict(), ref_head.state_dict(), exact_head.state_dict())
    model.offload_engine.close()


def test_clip_refuses_part_of_a_model_and_a_clip_after_the_update(disk_tmp):
    torch.manual_seed(0)
    model = offload.wrap(TinyGPT(), cfg(disk_tmp))
    opt = offload.AdamW(model.parameters(), lr=1e-2)
    data = batches(3)
    x, y = next(data)
    model(x, y).backward()
    with pytest.raises(ConfigError, match="takes all its trainable parameters"):
        torch.nn.utils.clip_grad_norm_(list(model.parameters())[:2], 1.0)
    with pytest.raises(ConfigError, match="L2 norm only"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, norm_type=float("inf"))
    opt.step()                      # no clip in the first step: from now on updates run during backward
    opt.zero_grad()
    x, y = next(data)
    model(x, y).backward()
    with pytest.raises(OffloadError, match="pass max_grad_norm"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    model.offload_engine.close()
