"""The figures of ``offload bench pipeline``, from its ranks' results: bubble fractions measured
against each schedule's theory, step times against pure data parallelism, activation memory per
stage; and the printed report.

Per schedule and timed step, a rank's bubble is ``1 - busy / schedule wall time`` (its time
outside its stages' compute: waiting for activations and gradients, sends); the step's bubble
is the mean over the pipeline's ranks (the theory's idle fraction of a rank, averaged), and the
figure is the median over steps. A step's time is its slowest rank's.

Theory (stages of equal cost, no communication time): GPipe and 1F1B idle ``(P-1)/(M+P-1)`` of
a step; interleaved 1F1B and looped BFS, ``v`` stages per rank, ``(P-1)/(vM+P-1)``. The
zero-bubble schedule fills its bubble with deferred weight passes (0 when they fit), but its
residue depends on the relative pass costs: no closed form is reported for it.
"""

from __future__ import annotations

import statistics
import sys


def bubble_theory(schedule: str, pp: int, micro_batches: int, stages_per_rank: int) -> float | None:
    """The idle fraction of a step of ``schedule`` in theory (None: no closed form used)."""
    if schedule in ("gpipe", "1f1b"):
        return (pp - 1) / (micro_batches + pp - 1)
    if schedule in ("interleaved-1f1b", "looped-bfs"):
        return (pp - 1) / (stages_per_rank * micro_batches + pp - 1)
    return None


def in_flight_theory(schedule: str, stage: int, pp: int, micro_batches: int) -> int | None:
    """Micro-batches whose activations stage ``stage`` holds at once, in theory (one stage per rank)."""
    if schedule == "gpipe":
        return micro_batches
    if schedule == "1f1b":
        return min(micro_batches, pp - stage)
    return None


def summarize_schedule(schedule: str, ranks: list[dict], pp: int, micro_batches: int,
                       dp_step_s: float) -> dict:
    """One schedule's figures from every rank's ``schedules[schedule]``."""
    per = [r["schedules"][schedule] for r in ranks]
    steps = len(per[0]["step_s"])
    bubbles = []
    for i in range(steps):
        fractions = [1 - p["busy_s"][i] / p["schedule_s"][i] for p in per]
        bubbles.append(statistics.fmean(fractions))
    step_s = statistics.median(max(p["step_s"][i] for p in per) for i in range(steps))
    v = len(per[0]["stages"])
    theory = bubble_theory(schedule, pp, micro_batches, v)
    by_rank = [{"rank": r["rank"], "stages": p["stages"], "busy_s": statistics.median(p["busy_s"]),
                "schedule_s": statistics.median(p["schedule_s"]),
                "bubble": statistics.median(1 - b / s for b, s in zip(p["busy_s"], p["schedule_s"]))}
               for r, p in zip(ranks, per)]
    return {"stages_per_rank": v, "step_s": step_s, "bubble_measured": statistics.median(bubbles),
            "bubble_theory": theory, "vs_data_parallel": step_s / dp_step_s, "by_rank": by_rank}


def summarize_memory(schedule: str, ranks: list[dict], pp: int, micro_batches: int) -> list[dict]:
    """Each stage's activation memory (the first data-parallel rank's of each stage), by stage."""
    seen, out = set(), []
    for r in ranks:
        for s in r["activations"][schedule]:
            if s["stage"] not in seen:
                seen.add(s["stage"])
                out.append({**s, "in_flight_theory": in_flight_theory(schedule, s["stage"], pp, micro_batches)})
    return sorted(out, key=lambda s: s["stage"])


def print_report(r: dict, out=sys.stdout) -> None:
    p = lambda *a: print(*a, file=out)  # noqa: E731
    run = r["run"]
    p(f"offload bench pipeline: {run['preset']} ({r['params'] / 1e6:.1f}M params, fp32), pp {r['pp']} x dp {r['dp']} "
      f"on gloo, {r['micro_batches']} micro-batches, global batch {r['global_batch'][0]} x {r['global_batch'][1]} "
      f"tokens, {r['threads_per_rank']} thread(s) per rank, medians of {run['steps']} steps")
    p(f"pure data parallelism ({r['pp'] * r['dp']} ranks, same global batch): {r['data_parallel_step_s'] * 1e3:.1f} ms/step")
    p(f"{'schedule':<18}{'step ms':>9}{'vs DP':>7}{'bubble':>8}{'theory':>8}   per rank: busy ms / schedule ms")
    for name, s in r["schedules"].items():
        theory = "-" if s["bubble_theory"] is None else f"{s['bubble_theory']:.2f}"
        ranks = ", ".join(f"r{b['rank']} {b['busy_s'] * 1e3:.0f}/{b['schedule_s'] * 1e3:.0f}" for b in s["by_rank"])
        p(f"{name:<18}{s['step_s'] * 1e3:>9.1f}{s['vs_data_parallel']:>7.2f}{s['bubble_measured']:>8.2f}"
          f"{theory:>8}   {ranks}")
    for name, stages in r["activations"].items():
        p(f"activation memory under {name}, recomputing stages: saved tensors on the device at most, MiB "
          f"(without offload / parked in reverse order / pipeline-aware; parked at most)")
        for s in stages:
            mib = [s[k] / 2**20 for k in ("without_offload_bytes", "reverse_order_bytes", "pipeline_aware_bytes",
                                          "parked_peak_bytes")]
            p(f"  stage {s['stage']} ({s['in_flight_theory']} micro-batch(es) in flight): "
              f"{mib[0]:.2f} / {mib[1]:.2f} / {mib[2]:.2f}; parked {mib[3]:.2f}")
