"""``offload bench pipeline`` run tiny on gloo ranks: its report's fields agree with each other and
with the schedules' arithmetic (a benchmark is never a timed test: no speed is asserted)."""

from __future__ import annotations

import pytest

from offload.bench.pipeline import measure
from offload.bench.pipeline_report import bubble_theory

pytestmark = pytest.mark.slow


def test_a_tiny_pipeline_bench_reports_consistent_figures():
    r = measure(preset="tiny", pp=2, micro_batches=2, batch=4, seq=16, steps=1, warmup=1,
                schedules=("gpipe", "1f1b", "interleaved-1f1b"), memory_schedules=("1f1b",))
    assert set(r["schedules"]) == {"gpipe", "1f1b", "interleaved-1f1b"}
    for name, s in r["schedules"].items():
        assert s["stages_per_rank"] == (2 if name == "interleaved-1f1b" else 1)
        assert s["bubble_theory"] == bubble_theory(name, 2, 2, s["stages_per_rank"])
        assert 0 <= s["bubble_measured"] < 1
        assert s["vs_data_parallel"] == pytest.approx(s["step_s"] / r["data_parallel_step_s"])
        assert [b["rank"] for b in s["by_rank"]] == [0, 1]
        for b in s["by_rank"]:
            assert 0 < b["busy_s"] <= b["schedule_s"] <= s["step_s"]      # one step: its slowest rank's
        assert sorted(i for b in s["by_rank"] for i in b["stages"]) == list(range(2 * s["stages_per_rank"]))
    stages = r["activations"]["1f1b"]
    assert [s["stage"] for s in stages] == [0, 1] and [s["in_flight_theory"] for s in stages] == [2, 1]
    for s in stages:
        # parking moves tensors off the device, never onto it
        assert s["pipeline_aware_bytes"] <= s["without_offload_bytes"]
        assert s["reverse_order_bytes"] <= s["without_offload_bytes"]
    # stage 0 holds two micro-batches' layer inputs under 1F1B, stage 1 one (two layers each)
    assert stages[0]["parked_peak_bytes"] == 2 * stages[1]["parked_peak_bytes"] > 0
