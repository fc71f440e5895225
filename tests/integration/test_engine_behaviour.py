"""Engine behaviour beyond equivalence: inference, re-tracing, statistics, traces, misuse."""

from __future__ import annotations

import copy
import json
import queue
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import offload
from offload import OffloadError

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_gpt import TinyGPT, batches  # noqa: E402
from trajectory import (assert_losses_within_drift, assert_run_within_drift, assert_within_drift,  # noqa: E402
                        drift, float64_twin, train_in_lockstep)


def cfg(path, **kw):
    base = dict(device="cpu", dtype="fp32", device_budget="192KiB", cpu_budget="256KiB",
                nvme_paths=[str(path)], chunk_size=8192)
    base.update(kw)
    return offload.OffloadConfig(**base)


def test_eval_and_no_grad_inference_match(disk_tmp):
    torch.manual_seed(0)
    ref = TinyGPT()
    model = offload.wrap(copy.deepcopy(ref), cfg(disk_tmp))
    x, y = next(batches(1))
    ref.eval()
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(x, y), ref(x, y))
    model.train()
    assert model.training and all(m.training for m in model.modules())
    model.offload_engine.close()


class Branchy(nn.Module):
    """Control flow changes which layers run: the trace must be dropped, never trusted."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(64, 64) for _ in range(6))

    def forward(self, x, skip):
        for i, layer in enumerate(self.layers):
            if i not in skip:
                x = torch.tanh(layer(x))
        return x.pow(2).mean()


def test_changed_control_flow_retraces_and_stays_correct(disk_tmp):
    torch.manual_seed(0)
    ref = Branchy()
    exact = float64_twin(ref)
    model = offload.wrap(copy.deepcopy(ref), cfg(disk_tmp, chunk_size=4096, device_budget="96KiB",
                                                 cpu_budget="96KiB"))
    runs = [(model, offload.AdamW(model.parameters(), lr=1e-2))]
    runs += [(m, torch.optim.AdamW(m.parameters(), lr=1e-2)) for m in (ref, exact)]
    gen = torch.Generator().manual_seed(1)
    skips = [set(), set(), {1, 4}, {1, 4}, set(), {0}, set(), set()]
    data = [(torch.randn(8, 64, generator=gen), skip) for skip in skips]
    losses = train_in_lockstep(runs, data, lambda m, b: m(b[0].double() if m is exact else b[0], b[1]))
    stats = model.offload_stats()
    assert stats["retraces"] >= 2
    assert_run_within_drift((model, losses[0]), (ref, losses[1]), (exact, losses[2]))
    model.offload_engine.close()


def test_stats_and_chrome_trace(disk_tmp, monkeypatch):
    trace = disk_tmp / "trace.json"
    monkeypatch.setenv("OFFLOAD_TRACE", str(trace))
    torch.manual_seed(0)
    model = offload.wrap(TinyGPT(checkpointing=True), cfg(disk_tmp / "nvme"))
    opt = offload.AdamW(model.parameters(), lr=1e-3)
    for x, y in batches(3):
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
    stats = model.offload_stats()
    for key in ("step", "moved_bytes", "prefetch_hit_rate", "wait_s", "optimizer_s", "memory", "layout"):
        assert key in stats
    assert stats["step"] == 3 and stats["optimizer_s"] > 0
    assert any(k.startswith("nvme->") for k in stats["moved_bytes"])
    assert 0.0 <= stats["prefetch_hit_rate"] <= 1.0
    events = json.loads(trace.read_text())["traceEvents"]
    cats = {e["cat"] for e in events}
    assert {"adam", "wait"} <= cats
    model.offload_engine.close()


def test_backward_twice_without_step_is_a_clear_error(disk_tmp):
    torch.manual_seed(0)
    model = offload.wrap(TinyGPT(), cfg(disk_tmp))
    opt = offload.AdamW(model.parameters(), lr=1e-3)
    data = batches(3)
    # The first step's update waits for step() (a clip_grad_norm_ may come between); from the
    # second on, with no clip seen, updates run during backward.
    x, y = next(data)
    model(x, y).backward()
    opt.step()
    opt.zero_grad()
    x, y = next(data)
    model(x, y).backward()
    x, y = next(data)
    with pytest.raises(OffloadError, match="gradient_accumulation_steps"):
        model(x, y)
    opt.step()
    model.offload_engine.close()


def test_unwrapped_params_behave_as_cpu_adamw(disk_tmp):
    torch.manual_seed(0)
    extra = nn.Parameter(torch.randn(10))
    extra_ref = nn.Parameter(extra.detach().clone())
    extra_exact = nn.Parameter(extra.detach().double())
    model = offload.wrap(TinyGPT(), cfg(disk_tmp))
    opt = offload.AdamW([{"params": model.parameters()}, {"params": [extra], "lr": 0.1}], lr=1e-3)
    ref_opts = [torch.optim.AdamW([p], lr=0.1) for p in (extra_ref, extra_exact)]
    for x, y in batches(3):
        (model(x, y) + extra.pow(2).sum()).backward()
        opt.step()
        opt.zero_grad()
        for p, o in zip((extra_ref, extra_exact), ref_opts):
            p.pow(2).sum().backward()
            o.step()
            o.zero_grad()
    assert_within_drift({"extra": extra}, {"extra": extra_ref}, {"extra": extra_exact})
    model.offload_engine.close()


def test_lr_scheduler_drives_offloaded_params(disk_tmp):
    torch.manual_seed(0)
    ref = TinyGPT()
    exact = float64_twin(ref)
    model = offload.wrap(copy.deepcopy(ref), cfg(disk_tmp))
    runs = []
    for m, optimizer in ((model, offload.AdamW), (ref, torch.optim.AdamW), (exact, torch.optim.AdamW)):
        o = optimizer(m.parameters(), lr=1e-2)
        runs.append((m, o, torch.optim.lr_scheduler.OneCycleLR(o, max_lr=2e-2, total_steps=6), []))
    for x, y in batches(6):
        for m, o, s, losses in runs:
            loss = m(x, y)
            loss.backward()
            o.step()
            o.zero_grad()
            s.step()
            losses.append(loss.item())
    assert_run_within_drift(*((m, losses) for m, _, _, losses in runs))
    model.offload_engine.close()


def test_a_forward_or_backward_that_raises_releases_what_it_held(disk_tmp):
    torch.manual_seed(0)
    model = offload.wrap(TinyGPT(), cfg(disk_tmp))
    opt = offload.AdamW(model.parameters(), lr=1e-3)
    data = list(batches(3))
    x, y = data[0]
    loss = model(x, y)

    def boom(grad):
        raise RuntimeError("boom")

    hook = model.blocks[1].fc.weight.register_hook(boom)
    with pytest.raises(RuntimeError, match="boom"):
        loss.backward()
    hook.remove()
    opt.zero_grad()
    with pytest.raises(AttributeError):
        model(x, None)                                  # targets=None: the forward raises
    for x, y in data[1:]:
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
    model.offload_engine.adam.drain()       # the last updates may still be running
    states = model.offload_engine.store.memory_report()["chunk_states"]
    assert "COMPUTE" not in states and model.offload_stats()["step"] == 2
    model.offload_engine.close()


def test_clip_grad_norm_between_backward_and_step_matches_torch(disk_tmp):
    torch.manual_seed(0)
    ref = TinyGPT()
    exact = float64_twin(ref)
    model = offload.wrap(copy.deepcopy(ref), cfg(disk_tmp, overlap_optimizer=False))
    opt = offload.AdamW(model.parameters(), lr=1e-2)
    runs = [(model, opt, opt.clip_grad_norm_)]
    runs += [(m, torch.optim.AdamW(m.parameters(), lr=1e-2),
              lambda n, m=m: torch.nn.utils.clip_grad_norm_(m.parameters(), n)) for m in (ref, exact)]
    losses, norms = [[], [], []], [[], [], []]
    for x, y in batches(3):
        for (m, o, clip), run_losses, run_norms in zip(runs, losses, norms):
            loss = m(x, y)
            loss.backward()
            run_norms.append(clip(0.5).item())
            o.step()
            o.zero_grad()
            run_losses.append(loss.item())
    assert opt.max_grad_norm is None          # one call clips one step
    assert min(norms[1]) > 0.5                # and clipping was active
    norm = drift("grad norm", *(torch.tensor(n, dtype=torch.float64) for n in norms))
    assert norm.ok, str(norm)
    assert_run_within_drift((model, losses[0]), (ref, losses[1]), (exact, losses[2]))
    model.offload_engine.close()


def _train_with_a_slow_optimizer(path, monkeypatch, cpu_budget, steps=4, park=None):
    """Train TinyGPT (state spilling to NVMe) with every chunk update made 20 ms slower, as with a
    slow disk: backward then runs ahead of the optimizer. Returns the model, the losses, and each
    move started as (kind, chunk, destination, who): who is "main", or for the optimizer worker
    the chunk it was updating (None between updates)."""
    from offload.chunks.traffic import ChunkTraffic
    from offload.engine import stepper
    from offload.engine.stepper import ChunkAdam

    real_update, real_start = ChunkAdam.update, ChunkTraffic.start_move
    moves = []
    updating = [None]       # the chunk the optimizer worker is updating

    def slow_update(self, c, *args):
        updating[0] = c
        time.sleep(0.02)
        try:
            return real_update(self, c, *args)
        finally:
            updating[0] = None

    def start_move(self, rec, src, dst):
        worker = threading.current_thread().name == "offload-adam"
        moves.append((rec.key[0], rec.key[1], dst, updating[0] if worker else "main"))
        return real_start(self, rec, src, dst)

    monkeypatch.setattr(ChunkAdam, "update", slow_update)
    # A loaded machine must not turn the back-pressure's stall escape into a spill here.
    monkeypatch.setattr(stepper, "BACKLOG_STALL_S", 10.0)
    # Nor may parking (updates held for the next forward, their gradients written down when room
    # is short: it learns from timings, which a loaded machine skews) stand in for back-pressure,
    # unless the test chooses what ``park`` parks.
    from offload.engine.pipeline import Parking

    monkeypatch.setattr(Parking, "choose", park or (lambda self: set()))
    monkeypatch.setattr(ChunkTraffic, "start_move", start_move)
    torch.manual_seed(0)
    model = offload.wrap(TinyGPT(), cfg(path, cpu_budget=cpu_budget))
    assert model.offload_engine.spills and model.offload_engine.layout.num_chunks >= 6
    opt = offload.AdamW(model.parameters(), lr=1e-3)
    losses = []
    model.pending_after_step = []       # chunks whose update was still queued when step() returned
    for i, (x, y) in enumerate(batches(steps)):
        if i == 2:
            moves.clear()       # from the third step: a trace to follow, nothing left from set-up
        loss = model(x, y)
        loss.backward()
        opt.step()
        model.pending_after_step.append(model.offload_engine.adam.pending_chunks())
        opt.zero_grad()
        losses.append(loss.item())
    return model, losses, moves


def _torch_runs(steps=4):
    """Plain PyTorch's fp32 run of what _train_with_a_slow_optimizer trains, and the same run in
    float64 (the exact one): ``(model, losses)`` of each."""
    torch.manual_seed(0)
    ref = TinyGPT()
    exact = float64_twin(ref)
    runs = [(m, torch.optim.AdamW(m.parameters(), lr=1e-3)) for m in (ref, exact)]
    losses = train_in_lockstep(runs, batches(steps), lambda m, b: m(*b))
    return (ref, losses[0]), (exact, losses[1])


def test_backward_waits_for_a_slow_optimizer_instead_of_spilling_gradients(disk_tmp, monkeypatch):
    """Gradients that wait for an optimizer far behind only take the room its state needs, and
    with state on NVMe they are written down and read back. Backward runs at most the optimizer's
    read-ahead window ahead, so no gradient chunk goes to NVMe, and training is unchanged."""
    (_, want), (_, exact) = _torch_runs()
    model, got, moves = _train_with_a_slow_optimizer(disk_tmp, monkeypatch, "544KiB")
    assert [m for m in moves if m[0] == "grad" and m[2] == "nvme"] == []
    assert_losses_within_drift(got, want, exact)
    model.offload_engine.close()


def test_the_optimizer_keeps_reading_ahead_of_its_queue(disk_tmp, monkeypatch):
    """With backward ahead, the fetches asked for when a chunk was queued may have found no room;
    the worker asks again for the chunks queued behind the one it takes, so their state is
    coming while it updates (without this it waited for each chunk's reads in turn)."""
    # Little enough room that fetches asked for at submission are skipped.
    model, _, moves = _train_with_a_slow_optimizer(disk_tmp, monkeypatch, "256KiB")
    ahead = [m for m in moves if m[0] in ("exp_avg", "exp_avg_sq") and m[2] == "cpu"
             and m[3] not in ("main", m[1])]
    assert ahead, "while updating a chunk, the optimizer worker started no reads for the next ones"
    model.offload_engine.close()


def test_backlog_wait_is_back_pressure_not_a_barrier(disk_tmp):
    """Should the optimizer ever finish nothing (an update waiting for room only the training
    thread could free), backward stops waiting for it after the stall time instead of hanging."""
    model = offload.wrap(TinyGPT(), cfg(disk_tmp))
    adam = model.offload_engine.adam
    adam._queue = queue.PriorityQueue()
    adam._pending.update({0, 1, 2})     # queued, and no worker to take them
    start = time.perf_counter()
    adam.wait_backlog(3, stall_s=30.0)  # within the limit: no wait at all
    assert time.perf_counter() - start < 1.0
    adam.wait_backlog(1, stall_s=0.05)
    assert 0.04 <= time.perf_counter() - start < 5.0
    adam._queue = None
    adam._pending.clear()
    model.offload_engine.close()


def test_updates_still_queued_at_step_finish_before_the_next_forward_uses_them(disk_tmp, monkeypatch):
    """optimizer.step() does not wait for the updates still queued: they run on while the next
    forward starts, and each chunk's forward waits for its own. zero_grad() in between leaves
    their gradients alone. Losses and final parameters are torch AdamW's, up to rounding
    (tests/trajectory.py)."""
    ref, exact = _torch_runs()
    model, got, _ = _train_with_a_slow_optimizer(disk_tmp, monkeypatch, "544KiB")
    assert any(model.pending_after_step), "every update had finished when step() returned"
    assert_run_within_drift((model, got), ref, exact)   # its state_dict() waits for what is still queued
    model.offload_engine.close()


def test_parked_updates_run_during_the_next_forward_and_change_nothing(disk_tmp, monkeypatch):
    """Half the chunks (those the next forward uses last) parked every step: their updates wait
    for backward to end and overlap the next forward. The numbers are torch's, up to rounding."""
    from offload.engine.pipeline import Parking

    def park_half(self):
        order = sorted(self.trainable, key=self.deadline)
        return set(order[len(order) // 2:]) if self.prefetcher.trace is not None else set()

    ref, exact = _torch_runs()
    model, got, _ = _train_with_a_slow_optimizer(disk_tmp, monkeypatch, "544KiB", park=park_half)
    engine = model.offload_engine
    assert engine.progress.parked and any(p & engine.progress.parked for p in model.pending_after_step[1:])
    assert_run_within_drift((model, got), ref, exact)
    engine.close()


def test_park_count_follows_idle_disk_and_forward_stalls(disk_tmp, monkeypatch):
    """The number of parked chunks grows by the updates that would have fit in the time the worker
    sat idle during forward (idle time from before forward began does not count, and growth is
    capped per step), shrinks by one when forward stalled longer than an update or backward did
    not wait for the optimizer, stays within half the chunks, and the parked ones are those the
    next forward uses last."""
    from offload.engine import pipeline as engine_module

    model = offload.wrap(TinyGPT(), cfg(disk_tmp, cpu_budget="544KiB"))
    opt = offload.AdamW(model.parameters(), lr=1e-3)
    for x, y in batches(2):             # a trace to follow
        model(x, y).backward()
        opt.step()
    engine = model.offload_engine
    engine.adam.drain()
    assert engine.layout.num_chunks == 9
    monkeypatch.setattr(engine_module, "PARK_GROWTH", 2)
    idle = [0.0]
    monkeypatch.setattr(engine.adam, "idle_s", lambda: idle[0])
    engine.adam.update_s = 0.01

    parking = engine.parking

    def forward_ended(idle_s, forward_s, stalled_s=0.0, throttled_s=1.0):
        idle[0] = idle_s
        engine.adam.backlog_wait_s = throttled_s
        parking.started_at = time.perf_counter() - forward_s
        parking.wait_at_start = engine.tracer.totals["wait"] - stalled_s
        parking.tail_wait_s = 0.0
        return parking.choose()

    parking.count = 0
    parked = forward_ended(0.03, 10.0)              # 3 updates' time idle: +1
    assert parking.count == 1 and len(parked) == 1
    parked = forward_ended(100.0, 0.045)            # idle since before a 45 ms forward: +2
    assert parking.count == 3 and len(parked) == 3
    last = sorted(range(engine.layout.num_chunks), key=engine.pins.deadline)[-3:]
    assert parked == set(last)
    forward_ended(0.0, 10.0, stalled_s=0.05)       # forward stalled 50 ms: one fewer
    assert parking.count == 2
    forward_ended(100.0, 100.0)                     # at most PARK_GROWTH more a step
    assert parking.count == 4
    forward_ended(100.0, 100.0)                     # and never more than half the chunks
    assert parking.count == 4
    forward_ended(100.0, 100.0, throttled_s=0.0)    # backward never waited for the optimizer
    assert parking.count == 3
    engine.close()


def test_updates_left_when_backward_ends_go_in_next_forward_order(disk_tmp, monkeypatch):
    """While backward runs the worker takes chunks first come, first served; what is still
    queued when it ends is taken in the order the next forward uses the chunks."""
    from offload.engine.stepper import ChunkAdam

    model = offload.wrap(TinyGPT(), cfg(disk_tmp))
    adam = model.offload_engine.adam
    gate, order = threading.Event(), []

    def record(self, c, runs, scale):
        order.append(c)
        gate.wait(10)

    monkeypatch.setattr(ChunkAdam, "update", record)
    for c in (5, 4, 3, 2):
        adam.submit(c, [], 1.0)
    while not order:                    # the worker holds chunk 5
        time.sleep(0.001)
    adam.reorder(lambda c: {4: 2.0, 3: 0.0, 2: 1.0}[c])
    gate.set()
    adam.drain()
    assert order == [5, 3, 2, 4]
    model.offload_engine.close()


def test_an_update_failing_after_step_returned_is_raised_by_close(disk_tmp, monkeypatch):
    """An update still queued when step() returned that then fails is not lost: close() waits for
    the queue, still removes the swap files, and raises the error."""
    from offload.engine.stepper import ChunkAdam

    model = offload.wrap(TinyGPT(), cfg(disk_tmp, cpu_budget="544KiB"))
    opt = offload.AdamW(model.parameters(), lr=1e-3)
    data = list(batches(3))
    for x, y in data[:2]:
        model(x, y).backward()
        opt.step()

    real_update, armed = ChunkAdam.update, threading.Event()

    def late_failure(self, c, *args):
        time.sleep(0.05)                # slow: updates are still queued when step() returns
        if armed.is_set():
            raise RuntimeError(f"disk gone while updating chunk {c}")
        return real_update(self, c, *args)

    monkeypatch.setattr(ChunkAdam, "update", late_failure)
    x, y = data[2]
    model(x, y).backward()
    opt.step()
    armed.set()                         # updates that start from now on fail
    assert model.offload_engine.adam.pending_chunks()
    with pytest.raises(OffloadError, match="disk gone"):
        model.offload_engine.close()
    assert not any(Path(disk_tmp).iterdir())
