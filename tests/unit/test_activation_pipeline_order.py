"""Pipeline-aware activation offload: a stage holding several micro-batches in flight reads back
and spills its parked tensors by when backward needs them (``order="micro-batches"``), not as if
each forward's backward came next (``"reverse"``, the order for one forward at a time).

The store is driven the way a stage's engine drives it under torch's Schedule1F1B: stage ``s`` of
``P`` runs ``P - s`` forwards, then one backward and one forward in turn, then the last backwards;
backwards come in forward order. Each forward saves ``LAYERS`` tensors (a stage's checkpointed
layers' inputs), each backward takes its forward's in reverse and autograd then lets them go."""

from __future__ import annotations

import pytest
import torch

from offload.activations import ActivationArea, ActivationStore, SpillSpace
from offload.aio import AsyncIO
from offload.config import AioConfig, OffloadConfig
from offload.errors import ConfigError
from tests.helpers.sim_streams import GatedStreams

CPU = torch.device("cpu")
LAYERS, MICRO_BATCHES, PREFETCH = 4, 6, 2
NUMEL = 1024                            # 4 KiB per saved tensor (fp32): one area page each
TENSOR_BYTES = NUMEL * 4


def one_f_one_b(stage: int, stages: int, micro_batches: int) -> list[tuple[str, int]]:
    """torch's Schedule1F1B order of one stage: ("F", m) and ("B", m)."""
    warmup = min(micro_batches, stages - stage)
    out = [("F", m) for m in range(warmup)]
    forward, backward = warmup, 0
    while backward < micro_batches:
        out.append(("B", backward))
        backward += 1
        if forward < micro_batches:
            out.append(("F", forward))
            forward += 1
    return out


def drive(store: ActivationStore, schedule, on_backward=None) -> None:
    """Run ``schedule`` through ``store``: values come back bit for bit."""
    saved = {}
    for kind, m in schedule:
        if kind == "F":
            store.begin_forward()
            tensors = [torch.randn(NUMEL) for _ in range(LAYERS)]
            saved[m] = (tensors, [store.pack(t) for t in tensors])
            store.end_forward()
        else:
            if on_backward is not None:
                on_backward(m, saved[m][1])
            tensors, packed = saved.pop(m)
            while packed:                      # autograd lets each node's saved tensors go after it
                assert torch.equal(store.unpack(packed.pop()), tensors.pop())
    assert not saved


def stage0_run(stages: int, order: str) -> dict:
    streams = GatedStreams(lag=1)     # a GPU one copy behind the host
    store = ActivationStore(CPU, ActivationArea(64 << 20), min_bytes=0, prefetch=PREFETCH,
                            streams=lambda: streams, order=order)
    drive(store, one_f_one_b(0, stages, MICRO_BATCHES))
    streams.close()
    stats = store.take_stats()
    store.close()
    return stats


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_stage0_under_1f1b_holds_one_micro_batchs_read_backs_not_one_per_micro_batch_in_flight(stages):
    today = stage0_run(stages, "reverse")
    aware = stage0_run(stages, "micro-batches")
    # "reverse" reads back the last PREFETCH tensors of every forward as it ends: stage 0 has
    # ``stages`` forwards in flight before its first backward, each holding PREFETCH on the device.
    assert today["resident_peak"] >= stages * PREFETCH * TENSOR_BYTES
    # In forward order, only the next backward's come back: PREFETCH ahead, the one in use, and
    # the source of the one download the (simulated) GPU has not finished yet; whatever ``stages``.
    assert aware["resident_peak"] <= (PREFETCH + 2) * TENSOR_BYTES
    assert aware["resident_peak"] < today["resident_peak"]
    # the same tensors parked and brought back, once each
    total = MICRO_BATCHES * LAYERS * TENSOR_BYTES
    for stats in (today, aware):
        assert stats["bytes"]["device->cpu"] == stats["bytes"]["cpu->device"] == total
        assert stats["order"] in ("reverse", "micro-batches")


def test_the_last_stage_orders_the_same_either_way():
    """One micro-batch in flight at a time (the last stage under 1F1B): both orders agree."""
    peaks = []
    for order in ("reverse", "micro-batches"):
        streams = GatedStreams(lag=1)     # a GPU one copy behind the host
        store = ActivationStore(CPU, ActivationArea(64 << 20), min_bytes=0, prefetch=PREFETCH,
                                streams=lambda: streams, order=order)
        drive(store, one_f_one_b(3, 4, MICRO_BATCHES))
        peaks.append(store.take_stats()["resident_peak"])
        store.close()
    assert peaks[0] == peaks[1] <= (PREFETCH + 2) * TENSOR_BYTES


@pytest.mark.parametrize("order,next_backward_spilled", [("reverse", True), ("micro-batches", False)])
def test_a_full_area_spills_the_micro_batch_needed_last(disk_tmp, order, next_backward_spilled):
    """An area of two micro-batches on stage 0 of 4 (4 in flight): "micro-batches" spills the
    newest forwards' tensors and finds the next backward's in memory; "reverse" spills the oldest
    micro-batch's, the very ones the next backward needs, and waits on NVMe for them."""
    spill = SpillSpace([str(disk_tmp)], AsyncIO(AioConfig()), "order", segment_min=1 << 20)
    area = 2 * LAYERS * TENSOR_BYTES
    store = ActivationStore(CPU, ActivationArea(area), tier="nvme", spill=spill, min_bytes=0, prefetch=0,
                            order=order)
    on_nvme = []

    def count(m, packed):
        on_nvme.append(sum(p.entry.host is None for p in packed))

    drive(store, one_f_one_b(0, 4, MICRO_BATCHES), on_backward=count)
    stats = store.take_stats()
    store.close()
    assert stats["area_peak"] <= area and stats["bytes"]["cpu->nvme"] > 0
    assert (on_nvme[0] == LAYERS) == next_backward_spilled, on_nvme
    if not next_backward_spilled:
        assert on_nvme[0] == 0


def test_the_order_is_a_checked_config_choice():
    assert OffloadConfig().activation_backward_order == "auto"
    with pytest.raises(ConfigError, match="activation_backward_order"):
        OffloadConfig(activation_backward_order="lifo")
    with pytest.raises(ConfigError, match="activation_backward_order"):
        ActivationStore(CPU, ActivationArea(1 << 20), order="fifo")
