"""What a run tells its user: the progress line of each step and the summary at the end.

Everything here prints to stderr (stdout stays free for a caller's own output) and reads only
what it is given: the losses and step times, the model's ``offload_stats()``.
"""

from __future__ import annotations

import sys
import time

from ..units import format_size
from .ranks import Ranks


def peak_rss() -> int:
    """This process's peak resident memory, bytes."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_peak_rss() -> bool:
    """Restart the kernel's peak-RSS counter (VmHWM), so the planner's probes do not count."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def current_rss() -> int:
    """This process's resident memory now, bytes."""
    import psutil

    return psutil.Process().memory_info().rss


def fmt_time(s: float) -> str:
    s = int(max(s, 0))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def progress(step, total, loss, tok_s, tflops, eta, tty):
    """One step's line: a bar, the loss, throughput and ETA (redrawn in place on a terminal)."""
    width = 24
    done = int(width * step / total)
    line = (f"[{'#' * done}{'.' * (width - done)}] step {step}/{total}  loss {loss:.4f}  "
            f"{tok_s:,.0f} tok/s  {tflops:.3f} TFLOPS  ETA {fmt_time(eta)}")
    if tty:
        print("\r" + line, end="", file=sys.stderr, flush=True)
    else:
        print(line, file=sys.stderr, flush=True)


def summary(model, losses, times, predicted, t_start, tokens_per_step, base_rss, ranks: Ranks = Ranks()):
    """The end of a run: steps and time, the loss curve's ends, measured against planned step
    time, peak memory and where the state lives (rank 0's, under several ranks)."""
    if not losses:
        print("finetune: nothing to do (already at --steps)", file=sys.stderr)
        return
    report = model.offload_stats()["memory"]
    steady = sorted(times[1:] or times)
    median = steady[len(steady) // 2]
    first = sum(losses[: min(5, len(losses))]) / min(5, len(losses))
    last = sum(losses[-5:]) / len(losses[-5:])
    print("\nsummary", file=sys.stderr)
    print(f"  steps          {len(losses)} in {time.perf_counter() - t_start:.1f} s "
          f"(median step {median:.3f} s, {tokens_per_step / median:,.0f} tokens/s)", file=sys.stderr)
    print(f"  loss           {first:.4f} (first 5 steps) -> {last:.4f} (last 5)", file=sys.stderr)
    if predicted is not None:
        print(f"  step time      measured {median:.3f} s, planner predicted {predicted:.3f} s "
              f"({median / predicted:.2f}x)", file=sys.stderr)
    budgets = sum(t["budget"] for n, t in report["tiers"].items() if n != "nvme")
    if ranks.many:
        print(f"  (memory and tiers below: rank 0's; each of the {ranks.world} ranks holds its own share)",
              file=sys.stderr)
    print(f"  peak RSS       {format_size(peak_rss())}: {format_size(base_rss)} before the model was built "
          f"(Python, torch) + {format_size(peak_rss() - base_rss)} for the run; device + CPU budgets "
          f"{format_size(budgets)}", file=sys.stderr)
    for name, tier in report["tiers"].items():
        held = sum(tier["bytes_by_kind"].values())
        where = f" in {', '.join(tier['paths'])}" if "paths" in tier else ""
        # A pinned tier is fitted to its chunks (engine.build.fit_pinned_tier): its budget is what it pins.
        fitted = f": pinned, fitted to its chunks, of {format_size(tier['asked_budget'])} asked" \
            if tier.get("asked_budget", 0) > tier["budget"] else ""
        print(f"  {name:<6} tier    {format_size(held)} of state{where} "
              f"(budget {format_size(tier['budget'])}{fitted})", file=sys.stderr)
