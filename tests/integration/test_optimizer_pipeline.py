"""The optimizer pipeline when the optimizer is the bottleneck: back-pressure on backward, the
worker's read-ahead, updates still queued when ``step()`` returns, parking, the order of what is
left when backward ends, and a late update's failure.

No clock decides anything here. A slow disk is modelled by ``PacedOptimizer``: the worker starts
an update only while the training thread waits for the optimizer, so backward always runs as far
ahead as the engine lets it and whatever is queued when a wait ends stays queued. What the engine
moved is read from its Chrome trace (``OFFLOAD_TRACE``), what the worker asked for from the chunk
store's ``prefetch``. A slow disk is a delay on each write's completion (``slow_writes``): what
is asserted holds whatever that delay, which only makes the worst case certain.
"""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path

import pytest
import torch

import offload
from offload import OffloadError
from offload.engine.stepper import ChunkAdam
from tests.helpers.tiny_gpt import TinyGPT, batches
from tests.helpers.trajectory import (assert_losses_within_drift, assert_run_within_drift, float64_twin,
                                      train_in_lockstep)

pytestmark = pytest.mark.slow
WORKER = "offload-adam"         # the optimizer worker's thread name
HANG_S = 120.0                  # a wait this long is a failure (the test says so), never a stuck suite
MOVE = re.compile(r"^([a-z_]+?)(\d+) (\w+)->(\w+)$")      # a move's name in the trace: "grad3 cpu->nvme"


def cfg(path, **kw):
    base = dict(device="cpu", dtype="fp32", device_budget="192KiB", cpu_budget="256KiB",
                nvme_paths=[str(path)], chunk_size=8192)
    base.update(kw)
    return offload.OffloadConfig(**base)


class PacedOptimizer:
    """The slowest optimizer there is, without a clock: the worker starts a queued update only while
    the training thread is blocked on the optimizer (``wait_backlog``, ``wait_for`` or ``drain``
    with something to wait for). Updates ``step()`` runs itself, on the training thread, go at once.
    A gate still closed after ``HANG_S`` opens and is counted in ``stuck``."""

    def __init__(self, monkeypatch):
        self._gate = threading.Condition()
        self._waiting = 0
        self.updating = None        # the chunk the worker is updating
        self.stuck = 0
        update = ChunkAdam.update

        def paced_update(adam, c, *args):
            if threading.current_thread().name != WORKER:
                return update(adam, c, *args)
            with self._gate:
                if not self._gate.wait_for(lambda: self._waiting > 0, timeout=HANG_S):
                    self.stuck += 1
            self.updating = c
            try:
                return update(adam, c, *args)
            finally:
                self.updating = None

        monkeypatch.setattr(ChunkAdam, "update", paced_update)
        waits = {"wait_backlog": lambda adam, limit, *_: len(adam.pending_chunks()) > limit,
                 "wait_for": lambda adam, c: adam.pending(c),
                 "drain": lambda adam: bool(adam.pending_chunks())}
        for name, blocks in waits.items():
            monkeypatch.setattr(ChunkAdam, name, self._opens_the_gate(getattr(ChunkAdam, name), blocks))

    def _opens_the_gate(self, wait, blocks):
        def gated(adam, *args, **kw):
            if not blocks(adam, *args):
                return wait(adam, *args, **kw)
            with self._gate:
                self._waiting += 1
                self._gate.notify_all()
            try:
                return wait(adam, *args, **kw)
            finally:
                with self._gate:
                    self._waiting -= 1
        return gated


def moves(trace: Path, since: int = 0) -> tuple[list[tuple[str, int, str, str]], int]:
    """The chunk moves in the trace after its first ``since`` events, as (kind, chunk, from, to),
    and the number of events now (the trace is rewritten at every step's end)."""
    events = json.loads(trace.read_text())["traceEvents"]
    found = [MOVE.match(e["name"]) for e in events[since:] if e.get("ph") == "X"]
    return [(m[1], int(m[2]), m[3], m[4]) for m in found if m], len(events)


def train_paced(path, monkeypatch, cpu_budget, steps=4, park=None):
    """Train TinyGPT (state spilling to NVMe) under ``PacedOptimizer``. Returns the model, the
    losses, the moves from the third step on (a trace to follow, nothing left from set-up), the
    reads the worker started, as (kind, chunk, the chunk it was updating or None), and the pacer.
    ``model.pending_after_step``: the chunks whose update was still queued when each step() returned.
    ``park``: what ``Parking.choose`` parks (default nothing)."""
    from offload.chunks.store import ChunkStore
    from offload.engine import stepper
    from offload.engine.pipeline import Parking

    trace = Path(path) / "trace.json"
    monkeypatch.setenv("OFFLOAD_TRACE", str(trace))
    pacer = PacedOptimizer(monkeypatch)
    # A loaded machine must not turn the back-pressure's stall escape into a spill here.
    monkeypatch.setattr(stepper, "BACKLOG_STALL_S", HANG_S)
    # Nor may parking (updates held for the next forward; it learns from timings) stand in for
    # back-pressure, unless the test says what to park.
    monkeypatch.setattr(Parking, "choose", park or (lambda self: set()))
    prefetch, seen, started = ChunkStore.prefetch, [], []

    def observed_prefetch(store, key, tier, **kw):
        move = prefetch(store, key, tier, **kw)
        if move is not None and not any(move is m for m in seen):
            seen.append(move)
            if threading.current_thread().name == WORKER:
                started.append((key[0], key[1], pacer.updating))
        return move

    monkeypatch.setattr(ChunkStore, "prefetch", observed_prefetch)
    torch.manual_seed(0)
    model = offload.wrap(TinyGPT(), cfg(path / "nvme", cpu_budget=cpu_budget))
    assert model.offload_engine.spills and model.offload_engine.layout.num_chunks >= 6
    opt = offload.AdamW(model.parameters(), lr=1e-3)
    losses, since = [], None
    model.pending_after_step = []
    for i, (x, y) in enumerate(batches(steps)):
        if i == 2:
            _, since = moves(trace)
            started.clear()
        loss = model(x, y)
        loss.backward()
        opt.step()
        model.pending_after_step.append(model.offload_engine.adam.pending_chunks())
        opt.zero_grad()
        losses.append(loss.item())
    later, _ = moves(trace, since)
    return model, losses, later, started, pacer


def torch_runs(steps=4):
    """Plain PyTorch's fp32 run of what train_paced trains, and the same run in float64 (the exact
    one): ``(model, losses)`` of each."""
    torch.manual_seed(0)
    ref = TinyGPT()
    exact = float64_twin(ref)
    runs = [(m, torch.optim.AdamW(m.parameters(), lr=1e-3)) for m in (ref, exact)]
    losses = train_in_lockstep(runs, batches(steps), lambda m, b: m(*b))
    return (ref, losses[0]), (exact, losses[1])


def slow_writes(monkeypatch, seconds: float) -> None:
    """Every NVMe write lands ``seconds`` after it starts at the earliest: a disk slower than the
    optimizer, so the state it wrote down is still being written when backward needs room."""
    from offload.tiers.nvme import NvmeTier

    write = NvmeTier.write

    def slow_write(tier, slot, src, src_name="cpu"):
        move = write(tier, slot, src, src_name)
        started, wait, poll = time.perf_counter(), move._wait, move._poll

        def landed():
            wait()
            time.sleep(max(0.0, seconds - (time.perf_counter() - started)))

        move._wait = landed
        move._poll = lambda: poll() and time.perf_counter() - started >= seconds
        return move

    monkeypatch.setattr(NvmeTier, "write", slow_write)


@pytest.mark.parametrize("write_s", [0.0, 0.05], ids=["disk", "slow-writes"])
def test_backward_waits_for_a_slow_optimizer_instead_of_spilling_gradients(disk_tmp, monkeypatch, write_s):
    """Gradients that wait for an optimizer far behind only take the room its state needs, and
    with state on NVMe they are written down and read back. Backward runs at most the optimizer's
    read-ahead window ahead, so no gradient chunk goes to NVMe, and training is unchanged. Also
    when the disk is slower still: room is made by waiting for the state's write-backs already
    under way, not by writing the waiting gradients down (CI once saw ``grad3 cpu->nvme``)."""
    if write_s:
        slow_writes(monkeypatch, write_s)
    (_, want), (_, exact) = torch_runs()
    model, got, moved, _, pacer = train_paced(disk_tmp, monkeypatch, "544KiB")
    assert any(m[3] == "nvme" for m in moved), "nothing went to NVMe: the optimizer was no bottleneck"
    assert [m for m in moved if m[0] == "grad" and m[3] == "nvme"] == []
    assert_losses_within_drift(got, want, exact)
    model.offload_engine.close()
    assert pacer.stuck == 0


def test_the_optimizer_keeps_reading_ahead_of_its_queue(disk_tmp, monkeypatch):
    """With backward ahead, the fetches asked for when a chunk was queued may have found no room;
    the worker asks again for the chunks queued behind the one it takes, so their state is
    coming while it updates (without this it waited for each chunk's reads in turn)."""
    # Little enough room that fetches asked for at submission are skipped.
    model, _, _, started, pacer = train_paced(disk_tmp, monkeypatch, "256KiB")
    ahead = [s for s in started if s[0] in ("exp_avg", "exp_avg_sq") and s[1] != s[2]]
    assert ahead, "while updating a chunk, the optimizer worker started no reads for the next ones"
    model.offload_engine.close()
    assert pacer.stuck == 0


def test_updates_still_queued_at_step_finish_before_the_next_forward_uses_them(disk_tmp, monkeypatch):
    """optimizer.step() does not wait for the updates still queued: they run on while the next
    forward starts, and each chunk's forward waits for its own. zero_grad() in between leaves
    their gradients alone. Losses and final parameters are torch AdamW's, up to rounding
    (tests/helpers/trajectory.py)."""
    ref, exact = torch_runs()
    model, got, _, _, pacer = train_paced(disk_tmp, monkeypatch, "544KiB")
    # The first step's updates wait for step() (a clip_grad_norm_ may come between); from the
    # second on they overlap backward, and the last ones queued are still queued.
    assert model.pending_after_step[0] == set() and all(model.pending_after_step[1:]), model.pending_after_step
    assert_run_within_drift((model, got), ref, exact)   # its state_dict() waits for what is still queued
    model.offload_engine.close()
    assert pacer.stuck == 0


def test_parked_updates_run_during_the_next_forward_and_change_nothing(disk_tmp, monkeypatch):
    """Half the chunks (those the next forward uses last) parked every step: their updates wait
    for backward to end and overlap the next forward. The numbers are torch's, up to rounding."""
    def park_half(parking):
        order = sorted(parking.trainable, key=parking.deadline)
        return set(order[len(order) // 2:]) if parking.prefetcher.trace is not None else set()

    ref, exact = torch_runs()
    model, got, _, _, pacer = train_paced(disk_tmp, monkeypatch, "544KiB", park=park_half)
    engine = model.offload_engine
    parked = engine.progress.parked
    assert parked and all(p & parked for p in model.pending_after_step[2:])
    assert_run_within_drift((model, got), ref, exact)
    engine.close()
    assert pacer.stuck == 0


def test_park_count_follows_idle_disk_and_forward_stalls(disk_tmp, monkeypatch):
    """The number of parked chunks grows by the updates that would have fit in the time the worker
    sat idle during forward (idle time from before forward began does not count, and growth is
    capped per step), shrinks by one when forward stalled longer than an update or backward did
    not wait for the optimizer, stays within half the chunks, and the parked ones are those the
    next forward uses last."""
    import time

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

    def forward_ended(idle_s, forward_s, stalled_s=0.0, throttled_s=1.0):
        # The durations the policy reads, as if measured (the policy only compares them).
        idle[0] = idle_s
        engine.adam.backlog_wait_s = throttled_s
        parking.started_at = time.perf_counter() - forward_s
        parking.wait_at_start = engine.tracer.totals["wait"] - stalled_s
        parking.tail_wait_s = 0.0
        return parking.choose()

    parking = engine.parking
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


def test_backlog_wait_is_back_pressure_not_a_barrier(disk_tmp, monkeypatch):
    """wait_backlog(limit) returns at once with at most ``limit`` updates queued, else once the
    worker has brought them down to ``limit``; and should the worker finish nothing (an update
    waiting for room only the training thread could free), it goes on after the stall time
    instead of hanging."""
    model = offload.wrap(TinyGPT(), cfg(disk_tmp))
    adam = model.offload_engine.adam
    finish = threading.Semaphore(0)      # updates the worker may finish

    def held(self, c, runs, scale):
        finish.acquire()

    monkeypatch.setattr(ChunkAdam, "update", held)
    for c in (5, 4, 3, 2):
        adam.submit(c, [], 1.0)

    def wait(limit, stall_s, ready=None):
        """wait_backlog on another thread (a broken one must fail the test, not hang it); the
        chunks still pending when it returned."""
        seen = []

        def body():
            if ready is not None:
                ready.set()
            adam.wait_backlog(limit, stall_s=stall_s)
            seen.append(adam.pending_chunks())

        t = threading.Thread(target=body, daemon=True)
        t.start()
        return t, seen

    t, seen = wait(4, stall_s=HANG_S)              # within the limit: no wait for the worker at all
    t.join(HANG_S)
    assert seen == [{2, 3, 4, 5}]
    t, seen = wait(1, stall_s=0.05)                # the worker finishes nothing: not a barrier
    t.join(HANG_S)
    assert seen == [{2, 3, 4, 5}]
    ready = threading.Event()
    t, seen = wait(2, stall_s=HANG_S, ready=ready)  # the worker may finish two: back-pressure
    ready.wait(HANG_S)
    finish.release(2)
    t.join(HANG_S)
    assert seen == [{3, 2}], "wait_backlog returned before the worker brought the backlog down to 2"
    finish.release(2)
    adam.drain()
    model.offload_engine.close()


def test_updates_left_when_backward_ends_go_in_next_forward_order(disk_tmp, monkeypatch):
    """While backward runs the worker takes chunks first come, first served; what is still
    queued when it ends is taken in the order the next forward uses the chunks."""
    model = offload.wrap(TinyGPT(), cfg(disk_tmp))
    adam = model.offload_engine.adam
    taken, gate, order = threading.Event(), threading.Event(), []

    def record(self, c, runs, scale):
        order.append(c)
        taken.set()
        gate.wait(HANG_S)

    monkeypatch.setattr(ChunkAdam, "update", record)
    for c in (5, 4, 3, 2):
        adam.submit(c, [], 1.0)
    assert taken.wait(HANG_S)           # the worker holds chunk 5
    adam.reorder(lambda c: {4: 2.0, 3: 0.0, 2: 1.0}[c])
    gate.set()
    adam.drain()
    assert order == [5, 3, 2, 4]
    model.offload_engine.close()


def test_an_update_failing_after_step_returned_is_raised_by_close(disk_tmp, monkeypatch):
    """An update still queued when step() returned that then fails is not lost: close() waits for
    the queue, still removes the swap files, and raises the error."""
    model = offload.wrap(TinyGPT(), cfg(disk_tmp, cpu_budget="544KiB"))
    opt = offload.AdamW(model.parameters(), lr=1e-3)
    data = list(batches(3))
    for x, y in data[:2]:
        model(x, y).backward()
        opt.step()

    update, armed = ChunkAdam.update, threading.Event()

    def late_failure(self, c, *args):
        if armed.is_set():
            raise RuntimeError(f"disk gone while updating chunk {c}")
        return update(self, c, *args)

    monkeypatch.setattr(ChunkAdam, "update", late_failure)
    pacer = PacedOptimizer(monkeypatch)     # updates wait for the training thread to wait for them
    x, y = data[2]
    model(x, y).backward()
    opt.step()
    armed.set()                             # updates that start from now on fail
    assert model.offload_engine.adam.pending_chunks()
    with pytest.raises(OffloadError, match="disk gone"):
        model.offload_engine.close()
    assert not any(Path(disk_tmp).iterdir())
    assert pacer.stuck == 0
