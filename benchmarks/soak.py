"""Soak: kill -9 a fine-tune at random moments, resume it each time, and check that it ends
bit-identical to a run nobody interrupted; then a long run with RSS, descriptors and NVMe files
watched.

    python benchmarks/soak.py [--kills 5] [--steps 40] [--leak-steps 500] [--work DIR] [--json FILE]
                              [--reference DIR]

Kill-and-resume: ``scripts/finetune_100b.py --preset tiny`` (small batch, tight budgets, so the
optimizer state lives on the NVMe tier) runs with a checkpoint after every step. The driver waits
until the run has logged a random number of steps, then ``kill -9``s it at a random moment or just after a
checkpoint write has started (a ``.tmp-*`` directory appeared: the kill lands inside the save),
alternating. After each kill it checks that the NVMe directory holds nothing of the dead process
and that every checkpoint left verifies, then starts the run again with ``--resume``. When it
finishes, its final checkpoint (parameters, fp32 master, both Adam moments, step counts) is
compared byte for byte with the one of an uninterrupted run with the same seed and data.

Leak check: one run of ``--leak-steps`` steps, sampled from outside through ``/proc``: resident
memory, open descriptors, swap files held open (and their bytes) and names in the NVMe directory.
"Flat" means no growth between the first and the last fifth of the run beyond noise.

Everything runs with ``OMP_NUM_THREADS=1``: deterministic CPU kernels, and on a 2-core box
torch's own threads otherwise fight the engine's I/O and Adam threads (steps run ~30x slower).
How a run is started, logged and compared is shared with the script's tests:
tests/helpers/finetune_runs.py.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))       # run as a script: the repository root, for tests.helpers
from tests.helpers.finetune_runs import (SCRIPT, TRAIN_ARGS, command, compare, env,  # noqa: E402
                                         final_checkpoint, logged_steps, run_to_end)


def nvme_names(nvme: Path) -> list[str]:
    try:
        return sorted(os.listdir(nvme))
    except FileNotFoundError:
        return []


@dataclass
class Kill:
    life: int
    mode: str              # "random" or "in-save"
    after_s: float         # seconds after the life's first logged step
    steps_logged: int      # steps this life logged before the kill
    in_save: bool          # a checkpoint write was under way (a .tmp-* directory existed)
    resumed_from: int | None = None
    nvme_left: list[str] = field(default_factory=list)
    checkpoints_ok: bool = True


def kill_and_resume(work: Path, steps: int, kills: int, seed: int, say=print, reference: Path | None = None) -> dict:
    """The kill-and-resume series and the uninterrupted reference; returns the report.

    ``reference``: the work directory of an uninterrupted run already made with ``command(steps,
    ...)`` (``nvme``, ``ckpt``, ``log.jsonl`` inside); by default one is made first."""
    from offload.checkpoint import list_checkpoints, verify_root

    rng = random.Random(seed)
    ref_dir, run_dir = reference or work / "reference", work / "killed"
    for d in ((run_dir,) if reference else (ref_dir, run_dir)):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
    t0 = time.perf_counter()
    if reference is None:
        run_to_end(command(steps, ref_dir / "nvme", ref_dir / "ckpt", ref_dir / "log.jsonl", resume=False))
    ref_s = time.perf_counter() - t0
    step_s = statistics.median(r["step_s"] for r in logged_steps(ref_dir / "log.jsonl"))
    if reference is None:
        say(f"soak: uninterrupted reference: {steps} steps in {ref_s:.1f} s (median step {step_s:.3f} s)")

    nvme, ckpt, log = run_dir / "nvme", run_dir / "ckpt", run_dir / "log.jsonl"
    history: list[Kill] = []
    life = 0
    while len(history) < kills:
        life += 1
        before = len(logged_steps(log))
        have = list_checkpoints(ckpt)
        proc = subprocess.Popen(command(steps, nvme, ckpt, log, resume=bool(have)), env=env(),
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        mode = "in-save" if len(history) % 2 else "random"
        # Armed after a random number of this life's steps, so the kills spread over the run.
        arm_after = rng.randint(1, max(1, steps // (kills + 2)))
        started = None
        in_save = False
        try:
            while proc.poll() is None:
                n = len(logged_steps(log)) - before
                if n >= arm_after and started is None:
                    started = time.perf_counter()
                    wait = rng.uniform(0.0, 2.0 * step_s)
                if started is not None:
                    tmp = [p for p in ckpt.iterdir() if p.name.startswith(".tmp-")] if ckpt.exists() else []
                    if mode == "in-save" and tmp:
                        time.sleep(rng.uniform(0.0, 0.004))
                    elif mode == "random" and time.perf_counter() - started >= wait:
                        pass
                    else:
                        time.sleep(0.001)
                        continue
                    in_save = any(p.name.startswith(".tmp-") for p in ckpt.iterdir())
                    os.kill(proc.pid, signal.SIGKILL)
                    break
                time.sleep(0.005)
            proc.wait(60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if proc.returncode != -signal.SIGKILL:
            if proc.returncode == 0:
                say("soak: the run finished before it could be killed; starting over with more steps left")
                shutil.rmtree(run_dir)
                run_dir.mkdir()
                continue
            raise RuntimeError(f"life {life} exited {proc.returncode}: {proc.stderr.read()[-3000:]}")
        verdicts, _ = verify_root(ckpt) if ckpt.exists() else ([], [])
        k = Kill(life, mode, round(time.perf_counter() - started, 3), len(logged_steps(log)) - before, in_save,
                 nvme_left=nvme_names(nvme), checkpoints_ok=all(v.ok for v in verdicts))
        have = list_checkpoints(ckpt)
        k.resumed_from = int(have[-1].name.split("-")[1]) if have else None
        history.append(k)
        say(f"soak: kill {len(history)}/{kills} ({mode}{', inside a checkpoint write' if in_save else ''}) "
            f"after {k.steps_logged} step(s) of life {life}; newest checkpoint step {k.resumed_from}; "
            f"NVMe dir {'empty' if not k.nvme_left else k.nvme_left}; checkpoints verify: {k.checkpoints_ok}")
    run_to_end(command(steps, nvme, ckpt, log, resume=bool(list_checkpoints(ckpt))))
    diffs = compare(final_checkpoint(ref_dir / "ckpt"), final_checkpoint(ckpt))
    report = {
        "steps": steps, "kills": [asdict(k) for k in history],
        "kills_inside_checkpoint_writes": sum(k.in_save for k in history),
        "nvme_clean_after_every_kill": all(not k.nvme_left for k in history),
        "checkpoints_verify_after_every_kill": all(k.checkpoints_ok for k in history),
        "bit_identical": not diffs, "differences": diffs, "reference_s": round(ref_s, 2),
        "median_step_s": step_s,
    }
    say(f"soak: final state after {kills} kills vs uninterrupted: "
        f"{'bit-identical' if not diffs else 'DIFFERENT: ' + '; '.join(diffs)}")
    return report


def _proc_sample(pid: int, nvme: Path) -> dict | None:
    try:
        rss = next(int(line.split()[1]) * 1024 for line in open(f"/proc/{pid}/status") if line.startswith("VmRSS:"))
        fds = os.listdir(f"/proc/{pid}/fd")
    except (OSError, StopIteration):
        return None
    swaps: dict[tuple[int, int], int] = {}      # each swap file once, however many descriptors hold it
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(str(nvme)):
                st = os.stat(f"/proc/{pid}/fd/{fd}")
                swaps[(st.st_dev, st.st_ino)] = st.st_blocks * 512
        except OSError:
            continue
    return {"rss": rss, "fds": len(fds), "swap_fds": len(swaps), "swap_bytes": sum(swaps.values()),
            "nvme_names": len(nvme_names(nvme))}


def leak_check(work: Path, steps: int, say=print) -> dict:
    """A ``steps``-step run sampled through /proc; returns samples by step and the verdict."""
    run_dir = work / "leak"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    nvme, log = run_dir / "nvme", run_dir / "log.jsonl"
    nvme.mkdir()                                          # the trainer refuses a missing NVMe directory
    cmd = [sys.executable, str(SCRIPT), *TRAIN_ARGS, "--steps", str(steps), "--nvme-path", str(nvme),
           "--json-log", str(log)]
    proc = subprocess.Popen(cmd, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    samples: list[dict] = []
    t0 = time.perf_counter()
    try:
        while proc.poll() is None:
            step = len(logged_steps(log))
            s = _proc_sample(proc.pid, nvme)
            if s is not None and 0 < step < steps:       # training, not start-up or shutdown
                samples.append({"step": step, **s})
            time.sleep(0.5)
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if proc.returncode != 0:
        raise RuntimeError(f"leak run exited {proc.returncode}: {proc.stderr.read()[-3000:]}")
    elapsed = time.perf_counter() - t0
    fifth = max(1, steps // 5)
    early = [s for s in samples if s["step"] <= fifth + 1] or samples[:1]
    late = [s for s in samples if s["step"] >= steps - fifth] or samples[-1:]

    def med(rows, key):
        return statistics.median(r[key] for r in rows)

    verdict = {
        "rss_early": med(early, "rss"), "rss_late": med(late, "rss"),
        "fds_early": med(early, "fds"), "fds_late": med(late, "fds"),
        "swap_fds": sorted({s["swap_fds"] for s in samples}), "swap_bytes": sorted({s["swap_bytes"] for s in samples}),
        "nvme_names": sorted({s["nvme_names"] for s in samples}), "nvme_names_after": len(nvme_names(nvme)),
    }
    growth = (verdict["rss_late"] - verdict["rss_early"]) / verdict["rss_early"]
    verdict["rss_growth"] = round(growth, 4)
    verdict["flat"] = (growth < 0.05 and verdict["fds_late"] == verdict["fds_early"]
                       and len(verdict["swap_fds"]) == 1 and verdict["nvme_names"] == [0]
                       and verdict["nvme_names_after"] == 0)
    steps_s = [r["step_s"] for r in logged_steps(log)]
    by_step = []
    for mark in sorted({min(steps - 1, m) for m in (1, *range(100, steps + 1, 100), steps)}):
        near = min(samples, key=lambda s: abs(s["step"] - mark))
        by_step.append({k: near[k] for k in ("step", "rss", "fds", "swap_fds", "swap_bytes", "nvme_names")})
    say(f"soak: leak check, {steps} steps in {elapsed:.0f} s (median step {statistics.median(steps_s):.3f} s):")
    for row in by_step:
        say(f"  step {row['step']:>5}: RSS {row['rss'] / 2**20:7.1f} MiB  fds {row['fds']:>3}  "
            f"swap files {row['swap_fds']} ({row['swap_bytes'] / 2**20:.1f} MiB on disk)  "
            f"names in NVMe dir {row['nvme_names']}")
    say(f"soak: RSS {verdict['rss_early'] / 2**20:.1f} -> {verdict['rss_late'] / 2**20:.1f} MiB "
        f"({100 * growth:+.1f} %), fds {verdict['fds_early']} -> {verdict['fds_late']}, "
        f"NVMe names {verdict['nvme_names']} (after exit {verdict['nvme_names_after']}): "
        f"{'flat' if verdict['flat'] else 'NOT FLAT'}")
    return {"steps": steps, "seconds": round(elapsed, 1), "median_step_s": statistics.median(steps_s),
            "by_step": by_step, **verdict}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kills", type=int, default=5, help="kill -9s before the run may finish (default 5)")
    p.add_argument("--steps", type=int, default=40, help="steps of the kill-and-resume run (default 40)")
    p.add_argument("--leak-steps", type=int, default=500, help="steps of the leak check (0: skip; default 500)")
    p.add_argument("--seed", type=int, default=0, help="seed of the kill moments")
    p.add_argument("--work", help="scratch directory on a real disk (default: a temp dir, removed)")
    p.add_argument("--json", help="write the report here")
    p.add_argument("--reference", help="work directory of an uninterrupted run of --steps steps already made "
                                       "(nvme, ckpt, log.jsonl inside; default: one is made first)")
    args = p.parse_args(argv)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="offload-soak-", dir=ROOT))
    work.mkdir(parents=True, exist_ok=True)
    try:
        reference = Path(args.reference) if args.reference else None
        report = {"kill_and_resume": kill_and_resume(work, args.steps, args.kills, args.seed, reference=reference)}
        if args.leak_steps:
            report["leak"] = leak_check(work, args.leak_steps)
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    ok = report["kill_and_resume"]["bit_identical"] and report["kill_and_resume"]["nvme_clean_after_every_kill"] \
        and report["kill_and_resume"]["checkpoints_verify_after_every_kill"] \
        and (not args.leak_steps or report["leak"]["flat"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
