"""The figures of one gpu_check.sh stage, as one JSON file (what comes back from the device machine).

    gpu_figures.py suite OUT.json SUITE.xml                test counts and failures (JUnit XML)
    gpu_figures.py sanitizer OUT.json SANITIZER.xml LOG    the same under CSAN, and the races it reported
    gpu_figures.py bench OUT.json BENCH_STEP.json          step vs bound, in-memory curve vs PyTorch
    gpu_figures.py largest OUT.json WORKDIR PRESET         plans, steps, TFLOPS vs peak, vs predicted
    gpu_figures.py matmul-peak OUT.json                    measured bf16 matmul TFLOPS (8192^3)

A missing input (a step skipped without CUDA, or killed by its timeout) is recorded as such,
never invented: the JSON says what ran.
"""

from __future__ import annotations

import json
import re
import statistics
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

# Dense bf16 tensor-core peak by card name (datasheets, no sparsity), TFLOPS.
DATASHEET_BF16_TFLOPS = {"H100 80GB HBM3": 989.4, "H100 PCIe": 756.0, "H100 NVL": 835.0, "H200": 989.4,
                         "A100": 312.0, "L40S": 362.0, "L4": 121.0}


def machine() -> dict:
    import torch

    info = {"torch": torch.__version__, "cuda": torch.cuda.is_available()}
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        info["gpu"] = name
        info["datasheet_bf16_tflops"] = next((v for k, v in DATASHEET_BF16_TFLOPS.items() if k in name), None)
    return info


def junit(path: Path) -> dict:
    if not path.is_file():
        return {"ran": False}
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    failed = [f"{c.get('classname')}::{c.get('name')}" for s in suites for c in s.iter("testcase")
              if c.find("failure") is not None or c.find("error") is not None]
    skipped = sorted({(c.find("skipped").get("message") or "")[:120] for s in suites for c in s.iter("testcase")
                      if c.find("skipped") is not None})
    return {"ran": True, **counts, "passed": counts["tests"] - counts["failures"] - counts["errors"]
            - counts["skipped"], "failed": failed, "skip_reasons": skipped}


def load(path: Path):
    return json.loads(path.read_text()) if path.is_file() else None


def suite(out: Path, tests: str) -> dict:
    return {"stage": "suite", "machine": machine(), "gpu_tests": junit(Path(tests))}


# A CSAN report names the kernel of each access on the line after its stream's.
RACE = re.compile(r"CSAN detected a possible data race.*?\nAccess by stream (\d+) during kernel:\n(.*?)\n"
                  r".*?\nPrevious access by stream (\d+) during kernel:\n(.*?)\n", re.S)


def sanitizer(out: Path, tests: str, log: str) -> dict:
    """The sanitized tests' counts, and each distinct race CSAN reported in ``log`` (a report
    appears there more than once: printed, then in the failure): the two kernels and streams."""
    text = Path(log).read_text(errors="replace") if Path(log).is_file() else ""
    races = sorted({f"{a.strip()} on stream {sa} after {b.strip()} on stream {sb}"
                    for sa, a, sb, b in RACE.findall(text)})
    return {"stage": "sanitizer", "machine": machine(), "sanitizer": junit(Path(tests)), "races": races}


def bench(out: Path, step_json: str, precision_json: str | None = None) -> dict:
    raw = load(Path(step_json))
    fig = {"stage": "bench", "machine": machine(), "ran": raw is not None}
    compared = load(Path(precision_json)) if precision_json else None
    if compared is not None:        # `--state fp32,8bit --master fp32,bf16`: one row per precision
        fig["precisions"] = [{k: r.get(k) for k in ("state", "master", "step_s", "speedup", "nvme_bytes_ratio",
                                                    "nvme_read_bytes", "nvme_write_bytes")}
                             for r in compared.get("results") or []]
    if raw is not None:
        breakdown = raw.get("breakdown") or {}
        default_tokens = (breakdown.get("run") or {}).get("batch_tokens")     # the --batch-tokens run
        fig.update({"step_s": raw.get("step_s"), "bound_s": raw.get("bound_s"),
                    "step_over_bound": raw.get("bound_ratio"), "bottleneck": breakdown.get("bottleneck"),
                    "bound_terms_s": {k: breakdown.get(k) for k in ("compute_s", "pcie_s", "nvme_s", "adam_s")},
                    "pcie_gbps": {"h2d": breakdown.get("pcie_h2d_gbps"), "d2h": breakdown.get("pcie_d2h_gbps")},
                    "in_memory_vs_torch": [{"batch_tokens": p.get("batch_tokens", default_tokens),
                                            "ratio": p.get("ratio")}
                                           for p in [raw.get("in_memory") or {}, *(raw.get("batch_curve") or [])]
                                           if p],
                    "raw": raw})
    return fig


def largest(out: Path, work: str, preset: str) -> dict:
    work = Path(work)
    plans = {p.stem.removeprefix("plan-"): load(p) for p in sorted(work.glob("plan-*.json"))}
    fig = {"stage": "largest", "machine": machine(), "chosen": preset or None,
           "verdicts": {k: {"fits": v.get("fits"), "reason": v.get("reason"), "predicted_step_s": v.get("predicted_step_s")}
                        for k, v in plans.items() if v}}
    steps_file = work / "steps.jsonl"
    steps = [json.loads(line) for line in steps_file.read_text().splitlines() if line.strip()] \
        if steps_file.is_file() else []
    fig["steps"] = steps
    peak = load(work / "peak.json")
    fig["measured_bf16_matmul_tflops"] = peak.get("tflops") if peak else None
    timed = steps[1:] or steps           # the first step carries the trace and warm-up
    if timed:
        tflops = statistics.median(s["tflops"] for s in timed)
        step_s = statistics.median(s["step_s"] for s in timed)
        predicted = (plans.get(preset) or {}).get("predicted_step_s")
        datasheet = fig["machine"].get("datasheet_bf16_tflops")
        fig.update({"median_step_s": step_s, "median_tflops": tflops, "predicted_step_s": predicted,
                    "measured_over_predicted": step_s / predicted if predicted else None,
                    "fraction_of_datasheet_peak": tflops / datasheet if datasheet else None,
                    "fraction_of_measured_peak": tflops / peak["tflops"] if peak else None})
    return fig


def matmul_peak(out: Path) -> dict:
    import time

    import torch

    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    runs = []
    for _ in range(10):
        t = time.perf_counter()
        a @ b
        torch.cuda.synchronize()
        runs.append(time.perf_counter() - t)
    return {"n": n, "tflops": 2 * n**3 / statistics.median(runs) / 1e12}


def main(argv: list[str]) -> int:
    stages = {"suite": suite, "sanitizer": sanitizer, "bench": bench, "largest": largest, "matmul-peak": matmul_peak}
    if len(argv) < 2 or argv[0] not in stages:
        print(__doc__, file=sys.stderr)
        return 2
    out = Path(argv[1])
    fig = stages[argv[0]](out, *argv[2:])
    out.write_text(json.dumps(fig, indent=1, default=str))
    print(json.dumps({k: v for k, v in fig.items() if k != "raw"}, default=str)[:4000])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
