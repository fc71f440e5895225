"""The cluster planner (issue 28): schedule theory's bubbles and activations in flight, how a pp x dp
mesh lies on boxes, what each pipeline rank holds, and the choice of pp x dp x micro-batches x
schedule — never one that does not fit, pp = 1 exactly today's data-parallel plan, pipelining
chosen where data parallelism's collectives over the links between boxes cost more."""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from offload.cli import main
from offload.errors import ConfigError
from offload.models.llama import PRESETS, param_count
from offload.plan import Hardware, Policy, plan
from offload.plan.cluster import choose_cluster, micro_options
from offload.plan.memory import GPU_WORKSPACE
from offload.plan.model import resolve_model
from offload.plan.schedule_theory import SCHEDULE_NAMES, bubble_fraction, in_flight, runnable, stages_per_rank
from offload.plan.stage_layout import Cluster, mesh_links, rank_layouts

SCHEDULES = st.sampled_from(SCHEDULE_NAMES)
BOX = Hardware(gpu_mem=80 << 30, cpu_mem=2048 << 30, nvme_capacity=30 << 40, nvme_read_gbps=50, nvme_write_gbps=50,
               compute_tflops=400, adam_params_per_s=4e9)
CLI_BOX = ["--gpu-mem", "80G", "--gpu-tflops", "400", "--cpu-mem", "2T", "--nvme-capacity", "30T", "--nvme-gbps", "50"]


def test_schedule_names_are_the_pipeline_librarys():
    from offload.pipeline import SCHEDULES as LIBRARY

    assert SCHEDULE_NAMES == tuple(LIBRARY)


@given(pp=st.integers(1, 64), m=st.integers(1, 512))
def test_bubbles_follow_the_papers(pp, m):
    one = (pp - 1) / (m + pp - 1)
    assert bubble_fraction("gpipe", pp, m) == pytest.approx(one) == bubble_fraction("1f1b", pp, m)
    looped = (pp - 1) / (2 * m + pp - 1)
    assert bubble_fraction("interleaved-1f1b", pp, m) == pytest.approx(looped) == bubble_fraction("looped-bfs", pp, m)
    zb = (pp - 1) / 3 / (2 * m + (pp - 1) / 3)
    assert bubble_fraction("zero-bubble", pp, m) == pytest.approx(zb)
    for name in SCHEDULE_NAMES:
        b = bubble_fraction(name, pp, m)
        assert 0 <= b < 1 and (b == 0) == (pp == 1)
        assert bubble_fraction(name, pp, m + 1) <= b          # more micro-batches, less bubble
    assert bubble_fraction("zero-bubble", pp, m) <= bubble_fraction("interleaved-1f1b", pp, m) <= one


@given(pp=st.integers(1, 64), m=st.integers(1, 512), name=SCHEDULES)
def test_activations_in_flight_on_the_first_rank(pp, m, name):
    held = in_flight(name, pp, m)
    assert 1 / stages_per_rank(name) <= held <= m
    assert in_flight("gpipe", pp, m) == in_flight("looped-bfs", pp, m) == m
    assert in_flight("1f1b", pp, m) == min(m, pp)
    later = [in_flight(name, pp, m, r) for r in range(pp)]
    assert later == sorted(later, reverse=True) and later[0] == held      # the first rank holds the most
    assert in_flight("1f1b", pp, m, pp - 1) == 1
    if m % pp == 0:    # torch's interleaved 1F1B warms up (v - 1) P + 2 (P - 1) stage-micro-batches
        assert in_flight("interleaved-1f1b", pp, m) == pytest.approx(min(pp + 2 * (pp - 1) + 1, 2 * m) / 2)
        assert runnable(name, pp, m)


def test_bubble_refuses_nonsense():
    with pytest.raises(ConfigError, match="micro_batches"):
        bubble_fraction("1f1b", 4, 0)


@settings(max_examples=60)
@given(boxes=st.integers(1, 8), gpus=st.sampled_from([1, 2, 4, 8]), data=st.data())
def test_mesh_links_cross_boxes_where_the_ranks_do(boxes, gpus, data):
    cl = Cluster(boxes=boxes, gpus_per_box=gpus, inter_box_gbps=25, intra_box_gbps=150)
    n = cl.ranks
    pp = data.draw(st.sampled_from([p for p in range(1, n + 1) if n % p == 0]))
    dp = n // pp
    for order in ("dp-inner", "pp-inner"):
        links = mesh_links(cl, pp, order)
        assert links.dp_gbps == (25 if links.dp_crosses_boxes else 150)
        assert links.act_gbps == (25 if links.act_crosses_boxes else 150)
        if boxes == 1:
            assert not links.dp_crosses_boxes and not links.act_crosses_boxes
    # dp ranks side by side: a dp group stays in a box when it tiles one, and some neighbouring
    # stages always sit in different boxes; stages side by side: the same the other way round
    inner, staged = mesh_links(cl, pp, "dp-inner"), mesh_links(cl, pp, "pp-inner")
    assert inner.act_crosses_boxes == (pp > 1 and boxes > 1)
    assert staged.dp_crosses_boxes == (dp > 1 and boxes > 1)
    for links, group in ((inner, dp), (staged, pp)):
        crosses = links.dp_crosses_boxes if group == dp and links is inner else links.act_crosses_boxes
        if group > gpus:
            assert crosses
        if gpus % group == 0:
            assert not crosses


@settings(max_examples=30, deadline=None)
@given(name=st.sampled_from(["tiny", "small", "1b", "7b"]), pp=st.integers(1, 8), v=st.integers(1, 2))
def test_each_rank_holds_its_stages_and_together_the_model(name, pp, v):
    cfg = PRESETS[name]
    if pp * v > cfg.num_layers + 2:
        return
    layouts = rank_layouts(cfg, pp, v)
    assert len(layouts) == pp
    assert sum(lay.params for lay in layouts) == param_count(cfg.replace(tie_embeddings=False))
    assert sum(lay.layers for lay in layouts) == cfg.num_layers
    assert [lay.has_head for lay in layouts].count(True) == 1 and layouts[(pp * v - 1) % pp].has_head
    assert layouts[0].numels[0] == cfg.vocab_size * cfg.hidden_size          # the embedding starts rank 0


def test_micro_batch_options_reach_one_sequence_each():
    assert micro_options(4, 100) == [4, 8, 16, 32, 64, 100]
    assert micro_options(8, 3) == [3]


@settings(max_examples=12, deadline=None)
@given(name=st.sampled_from(["tiny", "small", "1b"]), boxes=st.integers(1, 3), gpus=st.sampled_from([1, 2, 4]),
       gpu_gib=st.sampled_from([1, 2, 8, 24]), cpu_gib=st.sampled_from([4, 16, 64]),
       rows=st.sampled_from([4, 16, 64]))
def test_the_choice_never_picks_what_does_not_fit(name, boxes, gpus, gpu_gib, cpu_gib, rows):
    hw = Hardware(gpu_mem=gpu_gib << 30, cpu_mem=cpu_gib << 30, nvme_capacity=1 << 40, nvme_read_gbps=6,
                  nvme_write_gbps=5, compute_tflops=100, adam_params_per_s=1e9)
    cl = Cluster(boxes=boxes, gpus_per_box=gpus)
    seq = 128
    c = choose_cluster(name, hw, Policy(batch_tokens=rows * seq * cl.ranks, seq_len=seq), cl)
    fitting = [x for x in [c.data_parallel, *c.by_pp.values()] if x.fits]
    for x in fitting:
        assert all(p.fits for p in x.rank_plans)
        assert x.rank_memory["device"] + GPU_WORKSPACE <= hw.gpu_mem
        assert x.step_s >= max(p.predicted_step_s for p in x.rank_plans)
    if c.best is None:
        assert not fitting
    else:
        assert c.best.fits and c.best.step_s <= min(x.step_s for x in fitting) * 1.01


@pytest.mark.parametrize("model,boxes,gpus", [("1b", 1, 4), ("7b", 2, 4), ("100b", 4, 8)])
def test_pp_1_is_todays_data_parallel_plan(model, boxes, gpus):
    cl = Cluster(boxes=boxes, gpus_per_box=gpus)
    po = Policy(batch_tokens=64 * 4096 * cl.ranks // 8, seq_len=4096)
    dp = choose_cluster(model, BOX, po, cl, pps=[]).data_parallel
    got = dp.rank_plans[0]
    link = cl.inter_box_gbps if boxes > 1 else cl.intra_box_gbps
    way = {k: got.policy[k] for k in ("micro_batches", "activation_offload", "device_budget")}
    today = plan(model, dataclasses.replace(BOX, net_gbps=link),
                 dataclasses.replace(po, world=cl.ranks, local_world=gpus, **way))
    mine, theirs = got.to_json_dict(), today.to_json_dict()
    for data in (mine, theirs):
        data["policy"].pop("chunk_size")        # searched once by the cluster planner, by plan() when None
    assert mine == theirs
    assert dp.step_s == today.predicted_step_s and dp.pp == 1 and dp.dp == cl.ranks


def test_pipelining_wins_where_data_parallel_collectives_cross_slow_links():
    po = Policy(batch_tokens=4 << 20, seq_len=4096)
    many = choose_cluster("1t", BOX, po, Cluster(boxes=64, gpus_per_box=8))
    assert many.best.pp > 1 and many.data_parallel.bottleneck == "interconnect"
    assert many.best.step_s < many.data_parallel.step_s and not many.best.dp_crosses_boxes
    one = choose_cluster("100b", BOX, po, Cluster(boxes=1, gpus_per_box=8))
    assert one.best.pp == 1        # within a box: no bubble, and the links are fast


def test_1t_preset_is_the_planners_alone():
    label, cfg = resolve_model("llama-1t")
    assert label == "llama-1t" and 0.99e12 < param_count(cfg) < 1.01e12
    assert "1t" not in PRESETS


CLI = ["plan", "--model", "llama-100b", *CLI_BOX, "--batch-tokens", str(1 << 20), "--seq-len", "4096"]


def test_cli_plans_a_cluster(capsys):
    assert main(CLI + ["--boxes", "4", "--json", "-"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["cluster"] == {"boxes": 4, "gpus_per_box": 8, "inter_box_gbps": 25.0, "intra_box_gbps": 150.0}
    assert data["chosen"]["fits"] and data["data_parallel"]["pp"] == 1 and data["verdict"]
    assert main(CLI + ["--boxes", "2", "--pp", "4", "--schedule", "1f1b"]) == 0
    out = capsys.readouterr().out
    assert "4 x 4" in out and "1f1b" in out and "verdict:" in out and "2 x 8" not in out


@pytest.mark.parametrize("extra,flag", [(["--boxes", "2", "--pp", "3"], "--pp"),
                                        (["--boxes", "2", "--world", "4"], "--world"),
                                        (["--boxes", "2", "--net-gbps", "10"], "--net-gbps"),
                                        (["--gpus-per-box", "4"], "--gpus-per-box"),
                                        (["--pp", "2"], "--pp"),
                                        (["--boxes", "2", "--pp", "4", "--schedule", "1f1b", "--micro-batches", "2"],
                                         "--micro-batches=2: cannot run --schedule 1f1b over --pp 4")])
def test_cli_cluster_errors_name_the_flag(capsys, extra, flag):
    assert main(CLI + extra) != 0
    err = capsys.readouterr().err
    assert flag in err and "Traceback" not in err


@pytest.mark.parametrize("flag,value", [("--boxes", "0"), ("--gpus-per-box", "-1"), ("--schedule", "1f2b"),
                                        ("--inter-box-gbps", "0"), ("--intra-box-gbps", "x"), ("--pp", "0")])
def test_cli_cluster_flags_are_checked_at_parse_time(capsys, flag, value):
    with pytest.raises(SystemExit) as exit_info:
        main(CLI + ["--boxes", "2", f"{flag}={value}"])
    assert exit_info.value.code == 2
    assert f"argument {flag}" in capsys.readouterr().err


def test_cli_cluster_of_cpu_boxes_names_gpu_mem(capsys):
    assert main(["plan", "--model", "llama-100b", "--boxes", "2", "--cpu-mem", "512G", "--cpu-gflops", "100",
                 "--nvme-capacity", "1T", "--nvme-gbps", "5", "--adam-params-per-s", "1e9"]) == 1
    err = capsys.readouterr().err
    assert "--gpu-mem" in err and "Traceback" not in err


def test_1f1b_with_fewer_micro_batches_than_stages_is_not_runnable():
    """torch's Schedule1F1B raises for M < P (and finetune --pp refuses it): the planner must not
    plan it under an explicit --micro-batches."""
    assert not runnable("1f1b", 4, 2)
    assert runnable("1f1b", 4, 4) and runnable("gpipe", 4, 2)
