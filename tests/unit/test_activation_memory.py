"""What activation offload takes off the compute device, and what a finished run leaves on it.

The GPU check measured ``max_memory_allocated`` of a run with the layer inputs kept and then of one
with them parked, in one process; the parked run came out *higher*, by a fixed amount. The parked
run was not holding more: the first run's engine was never freed (its parameters' post-accumulate-
grad hooks, which the garbage collector cannot see, held it), so its device chunks stayed allocated
under the second run. Here, on the CPU as the compute device: a closed or dropped engine is freed,
and parking lowers the peak of live compute-device bytes (``tests.helpers.live_bytes``, the CPU's
``max_memory_allocated`` for one size of tensor) by about the parked inputs.
"""

from __future__ import annotations

import gc
import weakref
from unittest import mock

import pytest
import torch
from torch import nn

import offload
from tests.helpers.checkpointed_stack import Stack as CheckpointedStack
from offload.engine import build
from tests.helpers.live_bytes import LiveBytes
from tests.helpers.sim_streams import GatedStreams

# Sizes chosen so that no weight, gradient of a weight, or logits tensor has a layer input's size.
VOCAB, HIDDEN, LAYERS, BATCH, SEQ, STEPS = 40, 32, 12, 2, 24, 2
LAYER_INPUT = BATCH * SEQ * HIDDEN * 4      # bytes of one block's fp32 input (6 KiB)
PREFETCH = 2


def stack(reentrant: bool) -> nn.Module:
    return CheckpointedStack(reentrant, vocab=VOCAB, hidden=HIDDEN, layers=LAYERS)


def config(mode: str) -> offload.OffloadConfig:
    return offload.OffloadConfig(device="cpu", dtype="fp32", chunk_size=65536, activation_offload=mode,
                                 activation_budget="4MiB", activation_prefetch=PREFETCH)


def data():
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, SEQ, HIDDEN, generator=gen), torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen))
            for _ in range(STEPS)]


def peak_live_bytes(reentrant: bool, mode: str) -> tuple[int, dict]:
    """The most compute-device bytes of layer-input-sized tensors (the inputs, the copies brought
    back, LayerNorm outputs, their gradients) alive at once in a forward and backward after the
    first step, and that step's activation statistics. The rest (weight gradients, chunks) is left
    out: when those go depends on the optimizer thread's progress."""
    model = offload.wrap(stack(reentrant), config(mode))
    opt = offload.AdamW(model.parameters(), lr=1e-3)
    peaks, acts = [], None
    try:
        for step, (features, targets) in enumerate(data()):
            gc.collect()
            gc.disable()    # cycles freed at the collector's whim would move the peak between runs
            try:
                with LiveBytes(nbytes=LAYER_INPUT) as live:
                    model(features, targets).backward()
            finally:
                gc.enable()
            opt.step()
            opt.zero_grad()
            if step > 0:
                peaks.append(live.peak)
            if mode != "none":
                acts = model.offload_stats()["activations"]
        return max(peaks), acts
    finally:
        model.offload_engine.close()


@pytest.mark.parametrize("reentrant, streams", [(False, False), (True, False), (False, True)],
                         ids=["non-reentrant", "reentrant", "copy-streams"])
def test_parked_layer_inputs_lower_the_peak_of_live_device_bytes(reentrant, streams):
    """``copy-streams``: the GPU path's copies and read-backs ahead of need, on simulated streams
    that keep up (each copy runs as it is queued: deterministic)."""
    kept, _ = peak_live_bytes(reentrant, "none")
    with mock.patch.object(build, "copy_streams", lambda device: GatedStreams(lag=0) if streams else None):
        parked, acts = peak_live_bytes(reentrant, "cpu")
    assert acts["parked"] == LAYERS and acts["kept_on_device_bytes"] == 0, acts
    # Kept, every block's input waits for backward on the device. Parked, the device holds the
    # one a checkpoint is being given (until the next module shows it is a boundary) and, in
    # backward, the one in use and those brought back ahead of it (without streams, none early:
    # then that is the margin).
    saved = (LAYERS - 1 - 1 - PREFETCH) * LAYER_INPUT
    assert parked <= kept - saved, (parked, kept, saved)


def run_and_drop(mode: str, close: bool) -> list[weakref.ref]:
    model = offload.wrap(stack(False), config(mode))
    opt = offload.AdamW(model.parameters(), lr=1e-3)
    for features, targets in data()[:2]:
        model(features, targets).backward()
        opt.step()
        opt.zero_grad()
    engine = model.offload_engine
    refs = [weakref.ref(model), weakref.ref(engine), weakref.ref(engine.store)]
    if close:
        engine.close()
    return refs


@pytest.mark.parametrize("close", [True, False], ids=["closed", "dropped"])
@pytest.mark.parametrize("mode", ["none", "cpu"])
def test_a_finished_engine_is_freed_with_its_device_chunks(mode, close):
    """What a run leaves behind is what the next run's peak starts from."""
    refs = run_and_drop(mode, close)
    gc.collect()
    assert [r() for r in refs] == [None, None, None]
