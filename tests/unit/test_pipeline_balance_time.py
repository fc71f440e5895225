"""Stages balanced by measured time: the same exact min-max cut over per-unit forward + backward
seconds instead of parameter counts; injected costs for the partition itself, one real
measurement on a small model."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from offload.errors import ConfigError
from offload.models.llama import LlamaConfig, LlamaForCausalLM
from offload.pipeline import cut, split_llama
from offload.pipeline.timing import unit_costs, unit_times
from tests.unit.test_pipeline_split import brute_force_best

CFG = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=4, num_heads=2,
                  num_kv_heads=1, max_seq_len=16, tie_embeddings=False)
UNITS = CFG.num_layers + 2          # embedding, the layers, norm + LM head


def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(CFG)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(0, 1e3, allow_nan=False), min_size=1, max_size=8), st.integers(1, 8))
def test_a_cut_over_measured_seconds_is_the_least_costliest_stage(costs, stages):
    if stages > len(costs):
        return
    ranges = cut(costs, stages)
    assert ranges[0][0] == 0 and ranges[-1][1] == len(costs)
    assert all(lo < hi for lo, hi in ranges) and all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    # the DP and the brute force add the same floats in the same order: the optimum is exact
    assert max(sum(costs[lo:hi]) for lo, hi in ranges) == brute_force_best(costs, stages)


def test_injected_times_move_the_cut_where_parameter_counts_would_not():
    """A slow LM head (a large vocabulary's softmax on few parameters): by parameters the last
    stage takes layers too; by time it stands alone."""
    by_params = split_llama(model(), 2)
    by_time = split_llama(model(), 2, balance=[1.0, 1.0, 1.0, 1.0, 1.0, 5.0])
    assert [len(m.layers) for m in by_params] == [2, 2]
    assert [len(m.layers) for m in by_time] == [4, 0] and by_time[1].lm_head is not None
    # the stages still chain to the whole model
    ids = torch.randint(0, CFG.vocab_size, (2, 8))
    want = model()(ids).logits
    x = ids
    for m in by_time:
        x = m(x)
    torch.testing.assert_close(x, want, rtol=0, atol=0)


def test_a_real_measurement_times_every_unit_and_leaves_no_gradient_behind():
    m = model()
    times = unit_costs("time", [1] * UNITS, lambda i: split_llama(m, UNITS)[i],
                       lambda: torch.randint(0, CFG.vocab_size, (2, 16)), repeats=2)
    assert len(times) == UNITS and all(t > 0 for t in times)
    assert all(p.grad is None for p in m.parameters())
    stages = split_llama(m, 3, balance="time", probe=(2, 16))
    assert len(stages) == 3 and sum(len(s.layers) for s in stages) == CFG.num_layers
    assert all(p.grad is None for p in m.parameters())


def test_a_unit_keeps_the_gradient_it_had():
    m = model()
    head = split_llama(m, UNITS)[-1]
    for p in head.parameters():
        p.grad = torch.full_like(p, 3.0)
    unit_times([head], torch.randn(1, 4, CFG.hidden_size), repeats=1)
    assert all(torch.equal(p.grad, torch.full_like(p, 3.0)) for p in head.parameters())


@pytest.mark.parametrize("balance,why", [("flops", "params, time"), ([1.0, 2.0], "6 units"),
                                         ([1, 1, 1, -1, 1, 1], ">= 0"), ([1, 1, float("nan"), 1, 1, 1], "finite")])
def test_a_bad_balance_is_refused_by_name(balance, why):
    with pytest.raises(ConfigError, match="balance") as err:
        split_llama(model(), 2, balance=balance)
    assert why in str(err.value)
