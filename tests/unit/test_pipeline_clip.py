"""Under pipeline stages an optimizer that clips each engine by its own stage's norm is refused."""

from __future__ import annotations

import pytest
import torch

import offload
from offload.errors import ConfigError
from offload.pipeline.clip import check_optimizer


def wrapped():
    torch.manual_seed(0)
    return offload.wrap(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)),
                        offload.OffloadConfig(device="cpu", dtype="fp32"))


def test_max_grad_norm_is_refused_naming_what_to_call_instead():
    model = wrapped()
    offload.AdamW(model.parameters(), lr=1e-3, max_grad_norm=1.0)
    with pytest.raises(ConfigError, match=r"max_grad_norm=1.0: .*staged.clip_grad_norm_"):
        check_optimizer([model.offload_engine])


def test_an_optimizer_without_it_passes():
    model = wrapped()
    offload.AdamW(model.parameters(), lr=1e-3)
    check_optimizer([model.offload_engine])
    assert model.offload_engine.optimizer.max_grad_norm is None
