"""Recording an NVMe tier's requests and replaying them alone (``offload bench step``'s replay line)."""

from __future__ import annotations

import pytest
import torch

from offload.aio import aligned_empty
from offload.bench.replay import replay
from offload.errors import ConfigError
from offload.tiers.nvme import IoRecord, NvmeTier

pytestmark = pytest.mark.nvme

SLOT = 64 << 10


@pytest.fixture
def tier(disk_tmp):
    t = NvmeTier([str(disk_tmp)], prefix="replay-test")
    yield t
    t.close()


def _filled(value: int) -> torch.Tensor:
    buf = aligned_empty(SLOT)
    buf.fill_(value)
    return buf


def test_requests_are_recorded_only_while_recording(tier):
    slots = tier.reserve_group("state", 4, SLOT)
    src = _filled(7)
    tier.write(slots[0], src).wait()
    assert tier.recording is None
    tier.recording = []
    tier.write(slots[2], src).wait()
    tier.read(slots[2], aligned_empty(SLOT), urgent=True).wait()
    tier.read(slots[1], aligned_empty(SLOT)).wait()
    assert tier.recording == [IoRecord(slots[2], True, False), IoRecord(slots[2], False, True),
                              IoRecord(slots[1], False, False)]


@pytest.mark.parametrize("inflight", [1, SLOT, 3 * SLOT, 1 << 30])
def test_replay_rewrites_exactly_the_recorded_slots(tier, inflight):
    # Replayed writes carry the replay's (zeroed) buffers: the recorded slots change, the
    # others keep their bytes. That pins each request's file, offset and size.
    slots = tier.reserve_group("state", 6, SLOT)
    for s in slots:
        tier.write(s, _filled(0xAB)).wait()
    records = [IoRecord(slots[i], True, False) for i in (4, 1, 3)] + \
              [IoRecord(slots[i], False, i == 0) for i in (0, 5, 4)]
    seconds = replay(tier, records, inflight)
    assert seconds > 0
    for i, s in enumerate(slots):
        out = aligned_empty(SLOT)
        tier.read(s, out).wait()
        assert bool((out == (0 if i in (1, 3, 4) else 0xAB)).all()), f"slot {i}"


def test_replay_of_nothing_or_a_bad_window_is_a_config_error(tier):
    with pytest.raises(ConfigError, match="records"):
        replay(tier, [])
    slot = tier.reserve_group("state", 1, SLOT)[0]
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ConfigError, match="inflight_bytes"):
            replay(tier, [IoRecord(slot, False, False)], bad)
