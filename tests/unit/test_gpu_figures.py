"""benchmarks/gpu_figures.py: the JSON a gpu_check stage brings back says what ran, never invents.

Run as the stage runs it (a subprocess), on inputs shaped like pytest's JUnit XML, ``offload bench
step --json`` and the planner's and trainer's outputs.
"""

from __future__ import annotations

import json
import subprocess
import sys
import traceback
from pathlib import Path

import pytest

from tests.helpers.processes import ROOT, python_env

pytestmark = pytest.mark.slow
SCRIPT = ROOT / "benchmarks" / "gpu_figures.py"

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="3" failures="1"
errors="0" skipped="1"><testcase classname="tests.gpu.test_gpu_path" name="test_a"/><testcase
classname="tests.gpu.test_gpu_path" name="test_b"><failure message="boom"/></testcase><testcase
classname="tests.gpu.test_gpu_path" name="test_c"><skipped message="needs two GPUs"/></testcase>
</testsuite></testsuites>"""


def figures(*args) -> dict:
    out = Path(args[1])
    proc = subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True, cwd=ROOT,
                          env=python_env())
    assert proc.returncode == 0, proc.stderr
    return json.loads(out.read_text())


def test_suite_counts_failures_and_a_missing_step(tmp_path):
    (tmp_path / "suite.xml").write_text(JUNIT)
    fig = figures("suite", tmp_path / "suite.json", tmp_path / "suite.xml")
    tests = fig["gpu_tests"]
    assert (tests["tests"], tests["passed"], tests["failures"], tests["skipped"]) == (3, 1, 1, 1)
    assert tests["failed"] == ["tests.gpu.test_gpu_path::test_b"]
    assert tests["skip_reasons"] == ["needs two GPUs"]
    assert figures("suite", tmp_path / "none.json", tmp_path / "never-ran.xml")["gpu_tests"] == {"ran": False}


def csan_report(stream: int, op: str, previous_stream: int, previous_op: str) -> str:
    """A race report as torch's sanitizer prints it."""
    from torch.cuda._sanitizer import Access, AccessType, UnsynchronizedAccessError

    stack = traceback.StackSummary.extract(traceback.walk_stack(None), limit=2)
    now = Access(AccessType.WRITE, 9, stream, op, ["self"], True, stack)
    before = Access(AccessType.READ, 4, previous_stream, previous_op, ["src"], False, stack)
    return str(UnsynchronizedAccessError(1234, None, now, before))


def test_sanitizer_lists_each_race_once_and_a_run_cut_short(tmp_path):
    copy_op = "aten::copy_(Tensor(a!) self, Tensor src, bool non_blocking=False) -> Tensor(a!)"
    report = csan_report(7, copy_op, 3, copy_op)
    # The same race twice (printed, then in the failure), and another.
    log = "\n".join(["setup", report, "E   " + report, csan_report(7, "aten::add_.Tensor(...)", 5, copy_op)])
    (tmp_path / "sanitizer.log").write_text(log)
    (tmp_path / "sanitizer.xml").write_text(JUNIT)
    fig = figures("sanitizer", tmp_path / "sanitizer.json", tmp_path / "sanitizer.xml", tmp_path / "sanitizer.log")
    assert fig["sanitizer"]["failed"] == ["tests.gpu.test_gpu_path::test_b"]
    assert fig["races"] == [f"aten::add_.Tensor(...) on stream 7 after {copy_op} on stream 5",
                            f"{copy_op} on stream 7 after {copy_op} on stream 3"]
    cut = figures("sanitizer", tmp_path / "cut.json", tmp_path / "never-ran.xml", tmp_path / "no.log")
    assert cut["sanitizer"] == {"ran": False} and cut["races"] == []


def test_bench_takes_the_bound_and_the_curve(tmp_path):
    raw = {"step_s": 2.4, "bound_s": 2.0, "bound_ratio": 1.2,
           "breakdown": {"bottleneck": "nvme", "compute_s": 1.0, "pcie_s": 0.5, "nvme_s": 2.0, "adam_s": 0.3,
                         "pcie_h2d_gbps": 24.0, "pcie_d2h_gbps": 23.0, "run": {"batch_tokens": 512}},
           "in_memory": {"ratio": 0.95}, "batch_curve": [{"batch_tokens": 2048, "ratio": 0.97}]}
    (tmp_path / "step.json").write_text(json.dumps(raw))
    fig = figures("bench", tmp_path / "bench.json", tmp_path / "step.json")
    assert fig["ran"] and fig["step_over_bound"] == 1.2 and fig["bottleneck"] == "nvme"
    assert fig["in_memory_vs_torch"] == [{"batch_tokens": 512, "ratio": 0.95}, {"batch_tokens": 2048, "ratio": 0.97}]
    assert figures("bench", tmp_path / "none.json", tmp_path / "absent.json")["ran"] is False
    assert "precisions" not in fig


def test_bench_takes_the_precision_comparison_when_it_ran(tmp_path):
    (tmp_path / "step.json").write_text(json.dumps({"step_s": 2.4}))
    rows = [{"state": "fp32", "master": "fp32", "step_s": 0.4, "speedup": 1.0, "nvme_bytes_ratio": 1.0,
             "nvme_read_bytes": 7, "nvme_write_bytes": 7, "step_times_s": [0.4]},
            {"state": "8bit", "master": "bf16", "step_s": 0.2, "speedup": 2.0, "nvme_bytes_ratio": 0.3,
             "nvme_read_bytes": 2, "nvme_write_bytes": 2}]
    (tmp_path / "precision.json").write_text(json.dumps({"results": rows}))
    fig = figures("bench", tmp_path / "bench.json", tmp_path / "step.json", tmp_path / "precision.json")
    assert [(r["state"], r["master"], r["speedup"]) for r in fig["precisions"]] == [("fp32", "fp32", 1.0),
                                                                                   ("8bit", "bf16", 2.0)]
    assert "step_times_s" not in fig["precisions"][0]
    cut = figures("bench", tmp_path / "cut.json", tmp_path / "step.json", tmp_path / "never-ran.json")
    assert "precisions" not in cut and cut["ran"]


def test_largest_compares_with_the_plan_after_the_first_step(tmp_path):
    (tmp_path / "plan-7b.json").write_text(json.dumps({"fits": False, "reason": "NVMe", "predicted_step_s": 90.0}))
    (tmp_path / "plan-1b.json").write_text(json.dumps({"fits": True, "reason": "fits", "predicted_step_s": 10.0}))
    steps = [{"step": 1, "step_s": 30.0, "tflops": 100.0}, {"step": 2, "step_s": 12.0, "tflops": 300.0},
             {"step": 3, "step_s": 14.0, "tflops": 260.0}]
    (tmp_path / "steps.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    fig = figures("largest", tmp_path / "largest.json", tmp_path, "1b")
    assert fig["chosen"] == "1b" and fig["verdicts"]["7b"]["fits"] is False
    assert fig["median_step_s"] == 13.0 and fig["median_tflops"] == 280.0
    assert fig["measured_over_predicted"] == 1.3
    assert fig["measured_bf16_matmul_tflops"] is None and fig["fraction_of_measured_peak"] is None
