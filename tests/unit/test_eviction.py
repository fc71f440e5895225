"""Eviction policies with a fake clock: next use (Belady) beats LRU on a forward+backward trace."""

from __future__ import annotations

import torch

from offload.chunks import ChunkStore
from offload.scheduler import AccessTrace, LRUPolicy, NextUsePolicy
from offload.tiers import MemoryTier

CHUNK = 4096  # elements of fp32 = 16 KiB


def _train_trace(layers: int) -> list[tuple[str, int]]:
    """One training step as the CPU tier sees it: forward over the parameter chunks, then backward
    in reverse with each chunk's optimizer state (master, exp_avg, exp_avg_sq) updated as soon as
    its gradients are complete. Pure forward/backward alone is a case where LRU already equals
    Belady (both evict the earliest layers); the once-per-step optimizer state is what LRU gets wrong.
    """
    forward = [("param", i) for i in range(layers)]
    backward = []
    for i in reversed(range(layers)):
        backward += [("param", i), ("master", i), ("exp_avg", i), ("exp_avg_sq", i)]
    return forward + backward


def _bytes_moved(policy, trace, iterations=3, device_chunks=8):
    nbytes = CHUNK * 4
    store = ChunkStore([MemoryTier("device", device_chunks * nbytes), MemoryTier("cpu", 64 * nbytes)], policy)
    layers = len({i for _, i in trace})
    for kind in ("param", "master", "exp_avg", "exp_avg_sq"):
        for key in store.register(kind, layers, CHUNK, torch.float32):
            store.initialize(key, "cpu")
    store.reset_counters()
    for _ in range(iterations):
        if isinstance(policy, NextUsePolicy):
            policy.start_iteration()
        for key in trace:
            store.access(key, "device")
            store.release(key, "device")
    return store.moved_bytes()


def test_next_use_beats_lru_on_forward_backward():
    trace = _train_trace(12)
    lru = _bytes_moved(LRUPolicy(), trace)
    belady = _bytes_moved(NextUsePolicy(AccessTrace(trace)), trace)
    assert belady < 0.9 * lru, (belady, lru)


def test_trace_next_use_queries():
    t = AccessTrace(["a", "b", "c", "b", "a"])
    assert t.next_use("b", 0) == 1 and t.next_use("b", 2) == 3
    assert t.next_use("c", 3) == 5 + 2          # next iteration, at its first use
    assert t.next_use("zz", 0) == float("inf")
    assert t.upcoming(3, 2) == ["b", "a"] and t.keys() == ["a", "b", "c"]


def test_lru_picks_oldest():
    p = LRUPolicy()
    for k in "abc":
        p.on_access(k)
    assert p.choose(["a", "b", "c"], 1, lambda k: 1) == ["a"]
    p.on_access("a")
    assert p.choose(["a", "b", "c"], 2, lambda k: 1) == ["b", "c"]


def test_optimizer_prefetch_never_pushes_out_parameters():
    """A "soon" prefetch (the optimizer's next state chunk) may evict state the trace never uses,
    but not a parameter, even one not needed again this iteration: that would cost a write and a
    read before the next forward. With only parameters to evict, the prefetch is skipped."""
    nbytes = CHUNK * 4
    trace = AccessTrace([("param", 0), ("param", 1), ("param", 1), ("param", 0)])
    policy = NextUsePolicy(trace, auto_advance=False)
    store = ChunkStore([MemoryTier("cpu", 3 * nbytes), MemoryTier("slow", 64 * nbytes)], policy)
    for kind in ("param", "master"):
        for key in store.register(kind, 2, CHUNK, torch.float32):
            store.initialize(key, "slow")
    for key in (("param", 0), ("param", 1), ("master", 0)):
        store.ensure(key, "cpu")
    policy.position = 3             # backward is done with param 1; param 0 is next
    move = store.prefetch(("master", 1), "cpu", soon=True)
    assert move is not None
    move.wait()
    assert store.records[("master", 0)].has("cpu") is False
    assert all(store.records[("param", i)].has("cpu") for i in (0, 1))
    # Now only parameters (and the hinted chunk) are there: nothing may go.
    assert store.prefetch(("master", 0), "cpu", soon=True) is None
    assert all(store.records[("param", i)].has("cpu") for i in (0, 1))
