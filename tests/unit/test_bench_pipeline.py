"""``offload bench pipeline``'s arithmetic and argument checks (the run itself:
tests/integration/test_bench_pipeline.py)."""

from __future__ import annotations

import pytest

from offload.bench.pipeline import _names, measure
from offload.bench.pipeline_report import bubble_theory, in_flight_theory, summarize_schedule
from offload.cli import main
from offload.errors import ConfigError


def test_the_theory_is_the_schedules_idle_fraction():
    assert bubble_theory("gpipe", 2, 4, 1) == bubble_theory("1f1b", 2, 4, 1) == 1 / 5
    assert bubble_theory("1f1b", 4, 8, 1) == 3 / 11
    assert bubble_theory("interleaved-1f1b", 2, 4, 2) == bubble_theory("looped-bfs", 2, 4, 2) == 1 / 9
    assert bubble_theory("zero-bubble", 2, 4, 2) is None
    assert [in_flight_theory("1f1b", s, 4, 8) for s in range(4)] == [4, 3, 2, 1]
    assert [in_flight_theory("1f1b", s, 4, 2) for s in range(4)] == [2, 2, 2, 1]
    assert in_flight_theory("gpipe", 3, 4, 8) == 8


def test_a_schedules_figures_are_its_ranks_busy_and_wall_times():
    """Two ranks, two steps: the step's bubble is the ranks' mean, the step time the slowest rank's."""
    ranks = [{"rank": 0, "schedules": {"1f1b": {"stages": [0], "busy_s": [1.0, 2.0], "schedule_s": [2.0, 4.0],
                                                 "step_s": [2.5, 4.5]}}},
             {"rank": 1, "schedules": {"1f1b": {"stages": [1], "busy_s": [1.5, 3.0], "schedule_s": [2.0, 4.0],
                                                 "step_s": [2.2, 5.5]}}}]
    s = summarize_schedule("1f1b", ranks, 2, 4, dp_step_s=2.0)
    assert s["bubble_measured"] == pytest.approx(0.375)          # steps: (0.5 + 0.25) / 2 each
    assert s["step_s"] == pytest.approx(4.0)                      # median of 2.5 and 5.5
    assert s["vs_data_parallel"] == pytest.approx(2.0)
    assert s["bubble_theory"] == pytest.approx(0.2) and s["stages_per_rank"] == 1
    assert [b["bubble"] for b in s["by_rank"]] == pytest.approx([0.5, 0.25])


@pytest.mark.parametrize("kwargs,field", [(dict(pp=1), "--pp"), (dict(batch=6, micro_batches=4), "--batch"),
                                          (dict(seq=100000), "--seq"), (dict(steps=0), "--steps"),
                                          (dict(pp=4, schedules=("interleaved-1f1b",)), "--schedules"),
                                          (dict(cpu_budget="1MiB"), "--path")])
def test_arguments_that_cannot_run_are_refused_by_name(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        measure(**kwargs)


def test_schedule_names_are_checked():
    assert _names("1f1b, GPipe", "--schedules") == ["1f1b", "gpipe"]
    with pytest.raises(ConfigError, match="schedule"):
        _names("2f2b", "--schedules")
    with pytest.raises(ConfigError, match="--memory-schedules"):
        _names("looped-bfs", "--memory-schedules", ("gpipe", "1f1b"))


def test_the_cli_says_what_is_wrong_without_a_traceback(capsys):
    assert main(["bench", "pipeline", "--pp", "1"]) == 1
    err = capsys.readouterr().err
    assert "--pp" in err and "Traceback" not in err
