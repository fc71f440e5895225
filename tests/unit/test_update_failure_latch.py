"""An update failing on the optimizer's worker (here a plain error, not the NVMe tier's) leaves some
chunks a step ahead of the others: ``drain`` reports it once, and from then on neither a step, a
forward, ``state_dict()`` nor a checkpoint may build on those chunks."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import offload
from offload.errors import OffloadError


def test_an_update_failing_on_the_worker_stops_the_model(disk_tmp):
    torch.manual_seed(0)
    model = offload.wrap(nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)]),
                         offload.OffloadConfig(device="cpu", dtype="fp32", chunk_size=4096))
    opt = offload.AdamW(model.parameters(), lr=1e-2)
    opt.clips_expected = False          # updates run on the worker during backward
    engine = model.offload_engine
    x = torch.randn(3, 64)
    real_update, calls = engine.adam.update, []

    def update(c, runs, grad_scale):
        calls.append(c)
        if len(calls) == 2:             # the second chunk of the step fails, the others ran
            raise RuntimeError("injected update failure")
        return real_update(c, runs, grad_scale)

    try:
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        engine.adam.update = update
        with pytest.raises(OffloadError, match="injected update failure"):
            model(x).pow(2).mean().backward()
            opt.step()
            engine.chunks.drain()
        assert len(calls) >= 2
        with pytest.raises(OffloadError):       # the worker's error, if the step did not report it yet
            engine.chunks.drain()
        for attempt in (lambda: offload.save_checkpoint(model, opt, disk_tmp / "ckpt", step=2),
                        lambda: opt.step(), lambda: opt.state_dict(), lambda: model(x)):
            with pytest.raises(OffloadError, match="resume from the last checkpoint"):
                attempt()
        assert not (disk_tmp / "ckpt").exists() or not any((disk_tmp / "ckpt").iterdir())
    finally:
        engine.close()
