"""The mark that keeps accelerate (and HF Trainer through it) from wrapping a model offload already
runs over N ranks in DDP (issue 26, point 11; the 2-rank runs are tests/integration/test_hf_loops_ranks.py)."""

from __future__ import annotations

import inspect

import pytest
from torch import nn

from offload.hf.accelerate_ranks import PREPARED_FLAG, mark_data_parallel

accelerate = pytest.importorskip("accelerate")


def test_only_a_model_over_several_ranks_is_marked():
    one, two = nn.Linear(2, 2), nn.Linear(2, 2)
    mark_data_parallel(one, 1)
    mark_data_parallel(two, 2)
    assert not hasattr(one, PREPARED_FLAG) and getattr(two, PREPARED_FLAG) is True


def test_accelerate_still_reads_the_mark_before_wrapping():
    # The installed accelerate's prepare_model returns a model carrying the mark before any DDP
    # wrap: if an upgrade renames it, this fails here rather than as DDP's refusal under torchrun.
    source = inspect.getsource(accelerate.Accelerator.prepare_model)
    assert f'getattr(model, "{PREPARED_FLAG}", False)' in source
    assert source.index(PREPARED_FLAG) < source.index("DistributedDataParallel(")
