"""StagedModel.step checks the global batch against the static shapes it was built with: a batch
of another size is a ConfigError naming the tensor and both shapes, raised before anything is sent
(otherwise gloo aborts the receiving rank on a size mismatch, or the loss fails deep in torch)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import offload
from offload.errors import ConfigError
from offload.models.llama import LlamaForCausalLM, get_preset
from offload.pipeline import StagedModel, pipeline_mesh, split_llama


@pytest.fixture
def staged(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = LlamaForCausalLM(get_preset("tiny").replace(tie_embeddings=False, num_layers=1))
        yield StagedModel(split_llama(model, 1), schedule="gpipe", micro_batches=2,
                          config=offload.OffloadConfig(device="cpu", dtype="fp32"), micro_batch=(2, 8),
                          mesh=pipeline_mesh(1, 1))
    finally:
        dist.destroy_process_group()


def test_the_built_shape_trains(staged):
    ids = torch.randint(0, 256, (4, 8))
    losses = staged.step(ids, ids)
    assert len(losses) == 2 and all(torch.isfinite(loss) for loss in losses)


@pytest.mark.parametrize("shape", [(6, 8), (4, 16), (4,)])
def test_another_shape_is_refused_naming_the_tensor(staged, shape):
    bad = torch.randint(0, 256, shape)
    good = torch.randint(0, 256, (4, 8))
    with pytest.raises(ConfigError, match=r"input_ids=.*: has shape .* but the stages were built for \(4, 8\)"):
        staged.step(bad, good)
    with pytest.raises(ConfigError, match=r"labels=.*: has shape .* but the stages were built for \(4, 8\)"):
        staged.step(good, bad)
