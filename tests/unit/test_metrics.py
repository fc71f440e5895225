"""offload.train.metrics: the JSON lines, the TensorBoard events read back, the PNG, and what a
missing package or an unwritable place does (the module docstring's promises)."""

from __future__ import annotations

import builtins
import json
import logging
import os
import shutil

import pytest

from offload.errors import ConfigError, OffloadError, UnsupportedError
from offload.train.metrics import HISTORY_NAME, PNG_NAME, Metrics, tensorboard_tag, time_split

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _step_values(step: int) -> dict:
    return {"loss": 4.0 / step, "lr": 1e-3 * step, "tokens_per_s": 1000.0 + step, "tflops": 0.5,
            "step_s": 1.0, "predicted_step_s": 0.8, "compute_s": 0.5, "wait_s": 0.2, "optimizer_s": 0.25,
            "prefetch_hit_rate": 0.75, "moved/cpu->nvme": 4096 * step, "moved/nvme->cpu": 8192,
            "peak_rss_bytes": 1 << 30, "grad norm": 1.5}


def _is_png(path) -> bool:
    with open(path, "rb") as f:
        head = f.read(24)
    # the signature, then the IHDR chunk whose width and height are not zero
    return (head[:8] == PNG_SIGNATURE and head[12:16] == b"IHDR"
            and int.from_bytes(head[16:20], "big") > 0 and int.from_bytes(head[20:24], "big") > 0)


def test_json_log_is_one_object_per_step_with_every_key_as_given(tmp_path):
    path = tmp_path / "logs" / "run.jsonl"          # its directory is created
    m = Metrics(json_log=str(path))
    for step in (1, 2, 3):
        m.log(step, _step_values(step))
    m.log(4, {"loss": 1.0, "tflops": None})
    m.close()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[1] == {"step": 2, **_step_values(2)}
    assert rows[3] == {"step": 4, "loss": 1.0, "tflops": None}


def test_json_log_is_appended_and_flushed_each_step(tmp_path):
    path = tmp_path / "run.jsonl"
    path.write_text(json.dumps({"step": 0, "loss": 9.0}) + "\n")   # an earlier run resumed
    m = Metrics(json_log=path)
    m.log(1, {"loss": 2.0})
    # readable before close(): a killed job keeps what it logged
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [0, 1]
    m.close()


def test_tensorboard_events_read_back_with_their_tags_and_values(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    m = Metrics(tensorboard=tmp_path / "tb")
    for step in (1, 2, 3):
        m.log(step, _step_values(step))
    m.log(4, {"loss": 0.5, "tflops": None})           # None: left out, not written as a number
    m.close()
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert tags == {"train/loss", "train/lr", "perf/tokens_per_s", "perf/tflops", "time/step_s",
                    "time/predicted_step_s", "time/compute_s", "time/wait_s", "time/optimizer_s",
                    "prefetch/hit_rate", "moved/cpu_to_nvme", "moved/nvme_to_cpu", "memory/peak_rss_bytes",
                    "other/grad_norm"}
    loss = acc.Scalars("train/loss")
    assert [e.step for e in loss] == [1, 2, 3, 4]
    assert [e.value for e in loss] == pytest.approx([4.0, 2.0, 4.0 / 3, 0.5])
    assert [e.step for e in acc.Scalars("perf/tflops")] == [1, 2, 3]
    assert [e.value for e in acc.Scalars("moved/cpu_to_nvme")] == [4096.0, 8192.0, 12288.0]
    assert [e.value for e in acc.Scalars("prefetch/hit_rate")] == pytest.approx([0.75] * 3)


def test_tensorboard_tags_keep_to_the_characters_tensorboard_allows():
    assert tensorboard_tag("loss") == "train/loss"
    assert tensorboard_tag("moved/gpu->cpu") == "moved/gpu_to_cpu"
    assert tensorboard_tag("moved/cpu->nvme") == "moved/cpu_to_nvme"
    assert tensorboard_tag("tokens per s (rank 0)") == "other/tokens_per_s__rank_0_"


def test_close_writes_a_valid_png_next_to_the_checkpoints_and_is_idempotent(tmp_path):
    m = Metrics(plot_dir=tmp_path / "ckpt")
    for step in range(1, 6):
        m.log(step, _step_values(step))
    m.close()
    png = tmp_path / "ckpt" / PNG_NAME
    assert _is_png(png)
    first = png.stat().st_mtime_ns
    m.close()                                          # again: nothing happens
    assert png.stat().st_mtime_ns == first
    # no temporary left: the PNG and what it draws (for a resumed run to continue)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == sorted([PNG_NAME, HISTORY_NAME])
    with pytest.raises(OffloadError, match="after close"):
        m.log(6, {"loss": 1.0})


def test_png_draws_hundreds_of_steps(tmp_path):
    m = Metrics(plot_dir=tmp_path)
    for step in range(1, 601):
        m.log(step, {"loss": 1.0 / step, "step_s": 0.1, "wait_s": 0.01, "optimizer_s": 0.02})
    m.close()
    assert _is_png(tmp_path / PNG_NAME)


def test_time_split_takes_compute_as_the_rest_when_not_measured():
    h = {"step_s": [(1, 1.0), (2, 2.0)], "compute_s": [], "wait_s": [(1, 0.25), (2, 0.5)],
         "optimizer_s": [(1, 0.25), (2, 0.5)]}
    steps, parts = time_split(h)
    assert steps == [1, 2]
    assert parts == {"compute": [0.5, 1.0], "waiting for chunks": [0.25, 0.5], "optimizer": [0.25, 0.5]}
    h["compute_s"] = [(1, 0.25), (2, 0.5)]            # now measured: the rest shows as "other"
    _, parts = time_split(h)
    assert parts["compute"] == [0.25, 0.5]
    assert parts["other (rest of the step)"] == [0.25, 0.5]


def test_a_missing_matplotlib_is_one_warning_and_the_run_goes_on(tmp_path, monkeypatch, caplog):
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    with caplog.at_level(logging.WARNING, logger="offload.train"):
        m = Metrics(json_log=tmp_path / "run.jsonl", plot_dir=tmp_path / "plots")
        m.log(1, {"loss": 1.0})
        m.close()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "matplotlib is not installed" in warnings[0] and PNG_NAME in warnings[0]
    assert not (tmp_path / "plots" / PNG_NAME).exists()
    assert (tmp_path / "run.jsonl").read_text().count("\n") == 1


def test_a_missing_tensorboard_package_is_an_error_before_anything_is_created(tmp_path, monkeypatch):
    real_import = builtins.__import__

    def no_tensorboard(name, *args, **kwargs):
        if name == "torch.utils.tensorboard" or name.startswith("tensorboard"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tensorboard)
    with pytest.raises(UnsupportedError, match=r"--tensorboard needs the tensorboard package.*pip install"):
        Metrics(json_log=tmp_path / "run.jsonl", tensorboard=tmp_path / "tb")
    assert not (tmp_path / "run.jsonl").exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only directory")
def test_unwritable_destinations_are_errors_naming_the_flag_at_construction(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        with pytest.raises(ConfigError, match=r"--json-log=.*cannot write it"):
            Metrics(json_log=ro / "run.jsonl")
        with pytest.raises(ConfigError, match=r"--tensorboard=.*cannot write event files"):
            Metrics(tensorboard=ro / "tb")
        with pytest.raises(ConfigError, match=r"plot_dir=.*cannot write"):
            Metrics(plot_dir=ro)
    finally:
        ro.chmod(0o700)


def test_a_path_through_a_file_is_an_error_naming_the_flag(tmp_path):
    # works as root too: nothing can be created under a regular file
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match=r"--json-log=.*cannot write it"):
        Metrics(json_log=blocker / "run.jsonl")
    with pytest.raises(ConfigError, match=r"--tensorboard=.*cannot write event files"):
        Metrics(tensorboard=blocker / "tb")
    with pytest.raises(ConfigError, match=rf"plot_dir=.*cannot write {PNG_NAME} there"):
        Metrics(json_log=tmp_path / "run.jsonl", plot_dir=blocker / "plots")
    assert not (tmp_path / "run.jsonl").exists()       # refused before anything was written


def test_a_plot_dir_gone_at_close_is_a_warning_and_the_run_keeps_its_log(tmp_path, caplog):
    plots = tmp_path / "plots"
    m = Metrics(json_log=tmp_path / "run.jsonl", plot_dir=plots)
    m.log(1, {"loss": 1.0, "step_s": 0.1})
    shutil.rmtree(plots)
    plots.write_text("")                               # the directory became a file during the run
    with caplog.at_level(logging.WARNING, logger="offload.train"):
        m.close()
    assert any(f"could not write {plots / PNG_NAME}" in r.getMessage() for r in caplog.records)
    assert json.loads((tmp_path / "run.jsonl").read_text()) == {"step": 1, "loss": 1.0, "step_s": 0.1}


def test_values_that_are_not_numbers_are_refused_and_tensors_are_read():
    torch = pytest.importorskip("torch")
    m = Metrics()
    m.log(1, {"loss": torch.tensor(2.5)})            # a one-element tensor is a number
    with pytest.raises(OffloadError, match=r"loss='high' is not a number"):
        m.log(2, {"loss": "high"})
    with pytest.raises(OffloadError, match="'step' is the first argument"):
        m.log(3, {"step": 3})
    m.close()


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (a device that is always full)")
def test_a_full_disk_under_way_is_one_warning_and_the_other_destinations_go_on(tmp_path, caplog):
    m = Metrics(json_log="/dev/full", plot_dir=tmp_path)
    with caplog.at_level(logging.WARNING, logger="offload.train"):
        for step in (1, 2, 3):
            m.log(step, {"loss": 1.0 / step, "step_s": 0.1})
        m.close()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "/dev/full" in warnings[0] and "no more of them this run" in warnings[0]
    assert _is_png(tmp_path / PNG_NAME)


def test_nothing_to_draw_is_a_warning_and_no_png(tmp_path, caplog):
    m = Metrics(plot_dir=tmp_path / "plots")
    m.log(1, {"lr": 1e-3})
    with caplog.at_level(logging.WARNING, logger="offload.train"):
        m.close()
    assert any("no step logged a loss or a step time" in r.getMessage() for r in caplog.records)
    assert not (tmp_path / "plots" / PNG_NAME).exists()


def test_a_resumed_run_draws_the_steps_before_its_checkpoint_and_drops_those_redone(tmp_path):
    """Launch 1 logs steps 1-3 and is preempted; its checkpoint is step 2. Launch 2 resumes after
    step 2 and logs 3-4: the plot's history is steps 1, 2 (launch 1) and 3, 4 (launch 2)."""
    first = Metrics(plot_dir=tmp_path)
    for step in (1, 2, 3):
        first.log(step, {"loss": 10.0 + step, "step_s": 1.0})
    first.close()
    second = Metrics(plot_dir=tmp_path, resumed_at=2)
    for step in (3, 4):
        second.log(step, {"loss": 20.0 + step, "step_s": 1.0})
    second.close()
    rows = [json.loads(line) for line in (tmp_path / HISTORY_NAME).read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in rows] == [(1, 11.0), (2, 12.0), (3, 23.0), (4, 24.0)]
    assert _is_png(tmp_path / PNG_NAME)
    fresh = Metrics(plot_dir=tmp_path)      # a run from scratch starts its own history
    fresh.log(1, {"loss": 1.0})
    fresh.close()
    assert len((tmp_path / HISTORY_NAME).read_text().splitlines()) == 1


def test_a_resumed_run_drops_the_json_lines_of_the_steps_it_redoes(tmp_path):
    """A launch killed at step 3 (checkpoint at step 2, SIGKILL: no last checkpoint) logged step 3;
    the resumed launch redoes it: the log keeps one line per step, as TensorBoard (purge_step) does."""
    path = tmp_path / "run.jsonl"
    first = Metrics(json_log=path)
    for step in (1, 2, 3):
        first.log(step, {"loss": 10.0 + step})
    first.close()
    second = Metrics(json_log=path, resumed_at=2)
    for step in (3, 4):
        second.log(step, {"loss": 20.0 + step})
    second.close()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in rows] == [(1, 11.0), (2, 12.0), (3, 23.0), (4, 24.0)]
