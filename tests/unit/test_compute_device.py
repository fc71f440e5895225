"""Which GPU a rank computes on: ``LOCAL_RANK``'s when each rank sees every GPU of its node.

Under torchrun every process starts on cuda:0. A user loop that never calls
``torch.cuda.set_device`` would put every rank of a node on GPU 0; the engine moves the process
to its own GPU when nothing is on another one yet, and refuses clearly when the model already is.
torch.cuda and torch.distributed are stood in for (no GPU, no process group needed).
"""

from __future__ import annotations

import types
import warnings

import pytest
import torch
import torch.distributed as dist

from offload.config import OffloadConfig
from offload.errors import ConfigError
from offload.tiers.budgets import compute_device


class FakeGpus:
    """``count`` visible GPUs, ``current`` the process's current one; set_device calls recorded."""

    def __init__(self, monkeypatch, count: int, current: int = 0):
        self.count, self.current, self.set = count, current, []
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: self.count)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: self.current)
        monkeypatch.setattr(torch.cuda, "set_device", self._set_device)

    def _set_device(self, device):
        index = device if isinstance(device, int) else torch.device(device).index
        self.set.append(index)
        self.current = index


@pytest.fixture
def two_rank_group(monkeypatch):
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    monkeypatch.setenv("LOCAL_RANK", "1")


def on(device: str):
    """Something of the model's with a ``device`` (a real CUDA tensor needs a GPU)."""
    return types.SimpleNamespace(device=torch.device(device))


CUDA = OffloadConfig(device="cuda")


def test_a_rank_left_on_gpu_0_moves_to_its_local_rank_with_a_warning(monkeypatch, two_rank_group):
    gpus = FakeGpus(monkeypatch, count=2)
    with pytest.warns(RuntimeWarning, match=r"rank 1 .*cuda:1.*LOCAL_RANK"):
        device = compute_device(CUDA, [torch.zeros(2), on("meta")])
    assert device == torch.device("cuda", 1)
    assert gpus.set == [1] and gpus.current == 1


def test_a_model_already_on_another_gpu_is_refused_naming_the_fix(monkeypatch, two_rank_group):
    gpus = FakeGpus(monkeypatch, count=2)
    with pytest.raises(ConfigError, match=r'torch\.cuda\.set_device\(int\(os\.environ\["LOCAL_RANK"\]\)\)'):
        compute_device(OffloadConfig(device="auto"), [on("cuda:0")])
    assert gpus.set == []


def test_a_model_on_its_own_gpu_only_needs_the_current_device_moved(monkeypatch, two_rank_group):
    gpus = FakeGpus(monkeypatch, count=2)
    with pytest.warns(RuntimeWarning, match="rank 1"):
        assert compute_device(CUDA, [on("cuda:1")]) == torch.device("cuda", 1)
    assert gpus.set == [1]


def test_one_visible_gpu_per_process_is_cuda_0_without_a_word(monkeypatch, two_rank_group):
    """CUDA_VISIBLE_DEVICES gives each process its own GPU: there it is cuda:0."""
    gpus = FakeGpus(monkeypatch, count=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert compute_device(CUDA, [on("cuda:0")]) == torch.device("cuda", 0)
    assert gpus.set == []


def test_a_rank_on_its_own_gpu_already_is_left_alone(monkeypatch, two_rank_group):
    gpus = FakeGpus(monkeypatch, count=4, current=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert compute_device(CUDA, [on("cuda:1")]) == torch.device("cuda", 1)
    assert gpus.set == []


def test_without_a_process_group_the_current_device_is_kept(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    gpus = FakeGpus(monkeypatch, count=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert compute_device(CUDA) == torch.device("cuda", 0)
    assert gpus.set == []


def test_a_cpu_engine_ignores_the_gpus(monkeypatch, two_rank_group):
    gpus = FakeGpus(monkeypatch, count=2)
    assert compute_device(OffloadConfig(device="cpu"), [on("cuda:0")]) == torch.device("cpu")
    assert gpus.set == []
