"""Cutting a causal LM into pipeline stages (offload.pipeline): balanced contiguous cuts, stage
modules that chain to the whole model, and the refusals."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from offload.errors import ConfigError, UnsupportedError
from offload.models.llama import LlamaConfig, LlamaForCausalLM
from offload.pipeline import cut, split_llama, stage_count
from offload.pipeline.schedules import SCHEDULES, check_name

CFG = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=5, num_heads=2,
                  num_kv_heads=1, max_seq_len=16)


def brute_force_best(costs, stages):
    n = len(costs)
    best = None
    for bounds in itertools.combinations(range(1, n), stages - 1):
        edges = (0, *bounds, n)
        worst = max(sum(costs[a:b]) for a, b in zip(edges, edges[1:]))
        best = worst if best is None else min(best, worst)
    return best


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 1000), min_size=1, max_size=9), st.integers(1, 9))
def test_a_cut_tiles_the_layers_and_its_costliest_stage_is_the_least_possible(costs, stages):
    if stages > len(costs):
        with pytest.raises(ConfigError, match="stages"):
            cut(costs, stages)
        return
    ranges = cut(costs, stages)
    assert len(ranges) == stages
    assert ranges[0][0] == 0 and ranges[-1][1] == len(costs)
    assert all(lo < hi for lo, hi in ranges)
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert max(sum(costs[lo:hi]) for lo, hi in ranges) == brute_force_best(costs, stages)


@pytest.mark.parametrize("stages", [1, 2, 3, 4, 7])
def test_llama_stages_chain_to_the_whole_model_and_hold_each_parameter_once(stages):
    torch.manual_seed(0)
    model = LlamaForCausalLM(CFG)
    ids = torch.randint(0, CFG.vocab_size, (2, 8))
    want = model(ids).logits
    modules = split_llama(model, stages)
    x = ids
    for m in modules:
        x = m(x)
    torch.testing.assert_close(x, want, rtol=0, atol=0)
    held = [id(p) for m in modules for p in m.parameters()]
    assert sorted(held) == sorted(id(p) for p in model.parameters())
    assert [m.is_first for m in modules] == [True] + [False] * (stages - 1)
    assert [m.is_last for m in modules] == [False] * (stages - 1) + [True]


def test_tied_embeddings_are_refused_with_what_to_do():
    model = LlamaForCausalLM(CFG.replace(tie_embeddings=True))
    with pytest.raises(UnsupportedError, match="tie_embeddings=False"):
        split_llama(model, 2)


def test_more_stages_than_layers_is_refused():
    with pytest.raises(ConfigError, match="stages=8"):
        split_llama(LlamaForCausalLM(CFG), 8)       # 7 units: embedding, 5 layers, head


def test_schedules_by_name_and_their_stage_counts():
    assert set(SCHEDULES) == {"gpipe", "1f1b", "interleaved-1f1b", "looped-bfs", "zero-bubble"}
    assert stage_count("1f1b", 4) == 4 and stage_count("GPipe", 2) == 2
    assert stage_count("interleaved-1f1b", 4) == 8 and stage_count("zero-bubble", 2, stages_per_rank=3) == 6
    with pytest.raises(ConfigError, match="schedule='dualpipe': unknown"):
        check_name("dualpipe")
    with pytest.raises(ConfigError, match="stages_per_rank"):
        stage_count("looped-bfs", 2, stages_per_rank=1)
