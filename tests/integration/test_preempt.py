"""Preemption: SIGTERM mid-run makes finetune_100b.py finish its step, checkpoint and exit 143,
and --resume then ends exactly where an uninterrupted run ends; in a user's own loop
(offload.on_preempt) SIGINT exits 130 with a checkpoint, and a second signal during that save
exits at once leaving the previous checkpoint intact."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import offload
from offload.checkpoint import list_checkpoints, verify_root
from offload.preempt import exit_status
from tests.helpers import finetune_runs as runs
from tests.helpers.processes import python_env
from tests.helpers.tiny_gpt import TinyGPT

pytestmark = pytest.mark.slow


def test_exit_status_is_documented():
    assert exit_status(signal.SIGTERM) == 143 and exit_status(signal.SIGINT) == 130


def _wait_for(pred, timeout=120.0, proc=None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"exited {proc.returncode} early: {proc.stderr.read()[-2000:]}")
        time.sleep(0.01)
    raise AssertionError("timed out")


def test_sigterm_checkpoints_exits_143_and_resume_is_identical(reference_run, disk_tmp):
    reference, steps = reference_run
    nvme, ckpt, log = disk_tmp / "nvme", disk_tmp / "ckpt", disk_tmp / "log.jsonl"
    # No scheduled checkpoints: the one found afterwards is the preemption's.
    cmd = runs.command(steps, nvme, ckpt, log, resume=False, extra=["--checkpoint-every", "0"])
    proc = subprocess.Popen(cmd, env=runs.env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(lambda: len(runs.logged_steps(log)) >= 2, proc=proc)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 143, err[-2000:]
    assert "SIGTERM received" in err and "Traceback" not in err
    saved = list_checkpoints(ckpt)
    done = len(runs.logged_steps(log))
    assert len(saved) == 1 and saved[0].name == f"step-{done:08d}" and 2 <= done < steps, (saved, done)
    assert f"checkpoint {saved[0]}" in err
    assert os.listdir(nvme) == []

    runs.run_to_end(runs.command(steps, nvme, ckpt, log, resume=True, extra=["--checkpoint-every", "0"]))
    assert runs.compare(runs.final_checkpoint(reference / "ckpt"), runs.final_checkpoint(ckpt)) == []
    losses = {r["step"]: r["loss"] for r in runs.logged_steps(log)}
    ref_losses = {r["step"]: r["loss"] for r in runs.logged_steps(reference / "log.jsonl")}
    assert losses == ref_losses


def test_sigterm_without_a_checkpoint_dir_saves_to_the_default_place_said_at_start(disk_tmp):
    """No --checkpoint-dir: the start-up log says where a preemption's checkpoint goes
    (./checkpoints/<run name>), SIGTERM writes it there, and --resume alone finds it."""
    nvme, log = disk_tmp / "nvme", disk_tmp / "log.jsonl"
    nvme.mkdir()
    cmd = [sys.executable, str(runs.SCRIPT), *runs.TRAIN_ARGS, "--steps", "50", "--nvme-path", str(nvme),
           "--json-log", str(log)]
    proc = subprocess.Popen(cmd, env=runs.env(), cwd=disk_tmp, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    try:
        _wait_for(lambda: len(runs.logged_steps(log)) >= 2, proc=proc)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 143, err[-2000:]
    assert "checkpoints: checkpoints/llama-tiny (on SIGTERM/SIGINT)" in err
    saved = list_checkpoints(disk_tmp / "checkpoints" / "llama-tiny")
    done = len(runs.logged_steps(log))
    assert len(saved) == 1 and saved[0].name == f"step-{done:08d}", (saved, done, err[-2000:])
    resumed = subprocess.run(cmd[:cmd.index("--steps") + 1] + [str(done + 1), *cmd[cmd.index("--steps") + 2:],
                                                                 "--resume"],
                             env=runs.env(), cwd=disk_tmp, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"resumed from checkpoints/llama-tiny/step-{done:08d} at step {done}" in resumed.stderr


USER_LOOP = textwrap.dedent("""
    import sys, time
    import torch, offload
    import offload.checkpoint.files as ckfiles
    from tests.helpers.tiny_gpt import TinyGPT, batches
    ckpt, mode = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    model = offload.wrap(TinyGPT(), offload.OffloadConfig(device="cpu", dtype="fp32", device_budget="192KiB",
                         cpu_budget="256KiB", nvme_paths=[sys.argv[3]], chunk_size=8192))
    opt = offload.AdamW(model.parameters(), lr=1e-2)
    data = batches(1000)
    step = 0
    def train_one():
        global step
        x, y = next(data); model(x, y).backward(); opt.step(); opt.zero_grad(); step += 1
    train_one(); train_one()
    offload.save_checkpoint(model, opt, ckpt, step=step)
    if mode == "twice":                      # the preemption's save never ends: a second signal lands in it
        slow = ckfiles.write_chunk
        def paused(writer, data):
            slow(writer, data)
            print("SAVING", flush=True)
            time.sleep(3600)
        ckfiles.write_chunk = paused
    with offload.on_preempt(lambda: offload.save_checkpoint(model, opt, ckpt, step=step)) as preempt:
        print("READY", flush=True)
        while True:
            train_one()
            preempt.after_step()
""")


def _user_loop(disk_tmp, mode):
    (disk_tmp / "nvme").mkdir(exist_ok=True)
    return subprocess.Popen([sys.executable, "-c", USER_LOOP, str(disk_tmp / "ckpt"), mode, str(disk_tmp / "nvme")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=python_env())


def _read_until(proc, word):
    line = proc.stdout.readline().strip()
    assert line == word, (line, proc.stderr.read() if proc.poll() is not None else "")


def test_user_loop_sigint_saves_and_exits_130(disk_tmp):
    proc = _user_loop(disk_tmp, "once")
    try:
        _read_until(proc, "READY")
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert "SIGINT received" in err and "Traceback" not in err
    saved = list_checkpoints(disk_tmp / "ckpt")
    assert len(saved) == 2 and int(saved[-1].name.split("-")[1]) > 2
    verdicts, _ = verify_root(disk_tmp / "ckpt")
    assert all(v.ok for v in verdicts)


def test_second_signal_exits_at_once_previous_checkpoint_intact(disk_tmp):
    proc = _user_loop(disk_tmp, "twice")
    try:
        _read_until(proc, "READY")
        proc.send_signal(signal.SIGTERM)
        _read_until(proc, "SAVING")              # the preemption's save is under way (and never ends)
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)                            # so only the second signal can have ended it
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err = proc.stderr.read()
    assert proc.returncode == 143 and "again: exiting now" in err, err
    ckpt = disk_tmp / "ckpt"
    assert (ckpt / "latest").read_text().strip() == "step-00000002"
    assert [p.name for p in list_checkpoints(ckpt)] == ["step-00000002"]
    assert any(p.name.startswith(".tmp-step-") for p in ckpt.iterdir())   # the interrupted save
    assert os.listdir(disk_tmp / "nvme") == []
    verdicts, _ = verify_root(ckpt)
    assert [v.ok for v in verdicts] == [True]
    model = offload.wrap(TinyGPT(), offload.OffloadConfig(device="cpu", dtype="fp32", device_budget="192KiB",
                                                          cpu_budget="256KiB", nvme_paths=[str(disk_tmp / "nvme")],
                                                          chunk_size=8192))
    opt = offload.AdamW(model.parameters(), lr=1e-2)
    assert offload.load_checkpoint(model, opt, ckpt)["step"] == 2
    model.offload_engine.close()


def test_on_preempt_outside_the_main_thread_is_an_error():
    import threading

    errors = []

    def body():
        try:
            with offload.on_preempt():
                pass
        except offload.ConfigError as exc:
            errors.append(exc)

    t = threading.Thread(target=body)
    t.start()
    t.join()
    assert errors and "main thread" in str(errors[0])


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_handlers_are_restored(signum):
    before = signal.getsignal(signum)
    with offload.on_preempt(notify=None) as p:
        assert signal.getsignal(signum) == p._handle
        assert not p.requested
    assert signal.getsignal(signum) == before
