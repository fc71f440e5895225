"""Under pipeline stages: an optimizer that clips each engine by its own stage's norm, and fp16, are refused."""

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


def test_fp16_stages_are_refused_before_anything_is_built():
    """Each stage's engine would scale the gradient into its outputs by its own loss scale."""
    from offload.errors import UnsupportedError
    from offload.pipeline import StagedModel

    with pytest.raises(UnsupportedError, match="dtype='fp16'"):
        StagedModel([], schedule="1f1b", micro_batches=2, config=offload.OffloadConfig(device="cpu", dtype="fp16"),
                    micro_batch=(1, 4), mesh=None)
