"""What each unit of a model's chain costs when stages are balanced by measured time.

``unit_costs(balance, ...)`` turns a ``balance`` choice into the per-unit costs ``balance.cut``
splits: ``"params"`` (parameter counts: what a stage holds, streams and updates), ``"time"``
(each unit's forward + backward measured on a probe batch: what a stage spends per micro-batch,
so the pipeline's slowest stage is as fast as it can be), or the costs themselves (a sequence, one
per unit: a measurement from elsewhere, or a test's). The partition over them is the same exact
min-max cut either way.

The time of a unit is measured alone, on the output its predecessors gave on the probe (token ids
for the first unit, hidden states after), as the median of ``repeats`` forward + backward passes
after one warm-up (allocator, kernels chosen on first use), with the module in the mode it is in
(a layer that recomputes in backward is timed with its recompute). The parameters' ``.grad`` are
as they were afterwards: the probe leaves no trace in training.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Callable, Sequence

import torch
from torch import nn

from ..errors import ConfigError

BALANCES = ("params", "time")


def unit_times(units: Sequence[nn.Module], first_input: torch.Tensor, *, repeats: int = 3) -> list[float]:
    """Seconds of one forward + backward of each unit of a chain (median of ``repeats``), each on
    what the units before it returned for ``first_input``."""
    if repeats < 1:
        raise ConfigError("repeats", repeats, "must be at least 1")
    times, x = [], first_input
    for unit in units:
        params = [p for p in unit.parameters() if p.requires_grad]
        kept = [p.grad for p in params]
        for p in params:
            p.grad = None           # backward would add into a kept gradient in place
        inp = x.detach().requires_grad_(x.is_floating_point())
        samples, out = [], None
        for i in range(repeats + 1):
            started = time.perf_counter()
            out = unit(inp)
            out.backward(torch.ones_like(out))
            if i:                                     # the first pass warms up
                samples.append(time.perf_counter() - started)
        for p, g in zip(params, kept):
            p.grad = g
        times.append(statistics.median(samples))
        x = out.detach()
    return times


def unit_costs(balance, param_costs: list[int], make_unit: Callable[[int], nn.Module],
               probe_input: Callable[[], torch.Tensor], *, repeats: int = 3) -> list[float]:
    """The cost of each of the ``len(param_costs)`` units for ``balance`` ("params", "time" or a
    sequence of costs). ``make_unit(i)``: unit ``i`` alone as a module; ``probe_input()``: the
    first unit's input for "time"."""
    n = len(param_costs)
    if isinstance(balance, str):
        if balance == "params":
            return list(param_costs)
        if balance == "time":
            with torch.enable_grad():
                return unit_times([make_unit(i) for i in range(n)], probe_input(), repeats=repeats)
        raise ConfigError("balance", balance, f"must be one of {', '.join(BALANCES)} or a sequence of {n} costs")
    costs = list(balance)
    if len(costs) != n:
        raise ConfigError("balance", f"{len(costs)} costs", f"the model's chain has {n} units "
                          "(embedding, each decoder layer, final norm with the LM head)")
    for c in costs:
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not math.isfinite(c) or c < 0:
            raise ConfigError("balance", c, "each unit's cost must be a finite number >= 0")
    return [float(c) for c in costs]
