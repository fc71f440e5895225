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
