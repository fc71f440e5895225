"""The optimizer's read-ahead (``ChunkAdam.submit``) brings the next chunks' state to the host, but
not their gradients: backward has not completed those yet (under accumulation they hold partial
sums it will add to), so a download taken then is thrown away as stale once backward writes the
chunk, and compute would wait on the GPU for a copy nobody uses."""

from __future__ import annotations

from collections import Counter
from unittest import mock

import pytest

import offload
from offload.chunks import traffic as traffic_mod
from offload.engine import build
from tests.helpers.reference import LR, WD, make_models, small_config
from tests.helpers.sim_streams import GatedStreams
from tests.helpers.tiny_gpt import batches


def gradient_downloads(monkeypatch, accumulate: int) -> Counter:
    log = Counter()
    start_move = traffic_mod.ChunkTraffic.start_move

    def counting(self, rec, src, dst):
        move = start_move(self, rec, src, dst)
        if rec.key[0] == "grad" and (src, dst) == ("device", "cpu"):
            log["started"] += 1
            version, done = rec.version, move.on_done

            def on_done():
                log["stale"] += rec.version != version
                done()

            move.on_done = on_done
        return move

    monkeypatch.setattr(traffic_mod.ChunkTraffic, "start_move", counting)
    _, mine = make_models()
    streams = GatedStreams(lag=0)
    cfg = small_config(None, nvme_paths=None, device_budget="8MiB", cpu_budget="32MiB", merge_host_tiers=False,
                       gradient_accumulation_steps=accumulate)
    with mock.patch.object(build, "copy_streams", lambda device: streams):
        model = offload.wrap(mine, cfg)
    streams.lock = model.offload_engine.store.lock
    try:
        opt = offload.AdamW(model.parameters(), lr=LR, weight_decay=WD)
        data = iter(batches(3 * accumulate))
        for _ in range(3):
            for _ in range(accumulate):
                x, y = next(data)
                (model(x, y) / accumulate).backward()
            opt.step()
            opt.zero_grad()
        model.offload_engine.chunks.drain()
        chunks = sum(1 for key in model.offload_engine.store.records if key[0] == "grad")
    finally:
        model.offload_engine.close()
        streams.close()
    log["chunks"] = chunks
    return log


@pytest.mark.parametrize("accumulate", [1, 2])
def test_no_gradient_is_downloaded_before_backward_completes_it(monkeypatch, accumulate):
    log = gradient_downloads(monkeypatch, accumulate)
    assert log["stale"] == 0, log
    # each step downloads each gradient chunk once, for its update (3 steps)
    assert log["started"] == 3 * log["chunks"], log
