"""Where to cut a chain of layers into pipeline stages: contiguous runs of about equal cost.

The cost of a unit is its parameter count (what a stage holds, streams from CPU / NVMe and
updates with its CPU Adam) or its measured forward + backward time (``timing.unit_costs``); the
cut minimises the costliest stage (the pipeline runs at the pace
of its slowest stage), exactly, by dynamic programming over the prefix sums (a model has at most a
few hundred units).
"""

from __future__ import annotations

from typing import Sequence

from ..errors import ConfigError


def cut(costs: Sequence[float], stages: int) -> list[tuple[int, int]]:
    """``stages`` contiguous ``[lo, hi)`` ranges of the units whose ``costs`` are given, none empty,
    with the largest total cost as small as it can be (ties: earlier stages take fewer units)."""
    n = len(costs)
    if stages < 1:
        raise ConfigError("stages", stages, "must be at least 1")
    if stages > n:
        raise ConfigError("stages", stages, f"exceeds the {n} layers to cut (each stage needs one)")
    prefix = [0]
    for c in costs:
        if c < 0:
            raise ConfigError("costs", c, "a layer's cost must be >= 0")
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[s][i]: the smallest largest-stage cost cutting units [0, i) into s stages.
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    back = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for s in range(1, stages + 1):
        for i in range(s, n - (stages - s) + 1):
            for j in range(i - 1, s - 2, -1):        # the last stage is [j, i)
                worst = max(best[s - 1][j], prefix[i] - prefix[j])
                if worst < best[s][i]:
                    best[s][i], back[s][i] = worst, j
    ranges, i = [], n
    for s in range(stages, 0, -1):
        j = back[s][i]
        ranges.append((j, i))
        i = j
    return ranges[::-1]
