"""Threads the engine starts make the engine's GPU their current device before anything else.

A new thread's current CUDA device is device 0: on rank 1 of a node, an event query or a copy
from a thread that never called ``torch.cuda.set_device`` creates a second CUDA context on GPU 0,
after GPU 0's budget was measured. ``torch.cuda.set_device`` is recorded here (no GPU needed): the
engine's device is made ``cuda:1`` for the thread's sake only.
"""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

import offload
from offload.checkpoint.model_state import pipelined


@pytest.fixture
def set_device_calls(monkeypatch):
    """(thread name, device index) of every torch.cuda.set_device call, in order."""
    calls = []

    def record(device):
        calls.append((threading.current_thread().name,
                      device if isinstance(device, int) else torch.device(device).index))

    monkeypatch.setattr(torch.cuda, "set_device", record)
    return calls


def test_the_adam_worker_makes_the_engines_gpu_current_before_its_first_update(monkeypatch, set_device_calls):
    torch.manual_seed(0)
    model = offload.wrap(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)),
                         offload.OffloadConfig(device="cpu", dtype="fp32", device_budget="1MiB",
                                               cpu_budget="1MiB", chunk_size=2048))
    engine = model.offload_engine
    try:
        monkeypatch.setattr(engine.adam, "device", torch.device("cuda", 1))     # the worker's, from the engine
        real_update = engine.adam.update

        def update(c, runs, grad_scale):
            set_device_calls.append((threading.current_thread().name, "update"))
            return real_update(c, runs, grad_scale)

        monkeypatch.setattr(engine.adam, "update", update)
        engine.adam.submit(0, [], 1.0)
        engine.adam.drain()
    finally:
        engine.close()
    assert set_device_calls[:2] == [("offload-adam", 1), ("offload-adam", "update")]


def test_the_checkpoint_fetch_thread_makes_the_engines_gpu_current_first(set_device_calls):
    fetched = []

    def fetch(i):
        fetched.append((threading.current_thread().name, i))
        return i

    pipelined([10, 11], fetch, lambda i, r: None, device=torch.device("cuda", 1))
    name = fetched[0][0]
    assert name.startswith("offload-ckpt")
    assert set_device_calls == [(name, 1)]


def test_threads_of_a_cpu_engine_touch_no_cuda_device(set_device_calls):
    pipelined([1], lambda i: i, lambda i, r: None, device=torch.device("cpu"))
    assert set_device_calls == []
