"""Checkpoints of pipeline stages resumed under another cut (issue 28): a pp = 2 run's checkpoint
resumed by one process holding the whole model (pp = 1), and a one-process checkpoint resumed by
two stages, each take the steps the uninterrupted run takes -- every parameter's master, Adam
moments and step count found by name in the old layout's chunks (gloo ranks, NVMe forced)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers.ranks import launch

pytestmark = pytest.mark.slow
WORKER = "tests.helpers.pp_ckpt_worker:main"
STEPS, SAVE_AT, BATCH, SEQ, M = 5, 2, 8, 16, 4


def spec(tmp: Path, pp: int, **extra) -> dict:
    # budgets far below a stage's state: every chunk passes through the NVMe tier; another chunk
    # size for each layout, so no parameter sits where it sat when saved
    config = dict(device="cpu", dtype="fp32", device_budget="5MiB", cpu_budget="5MiB",
                  nvme_paths=[str(tmp / f"nvme-pp{pp}-{{rank}}")], chunk_size=65536 if pp else 49152)
    return dict(pp=pp, dp=1, schedule="1f1b", micro_batches=M, batch=BATCH, seq=SEQ, steps=STEPS,
                config=config, ckpt=str(tmp / "ckpt"), **extra)


def ok(results) -> list:
    for r in results:
        assert r.returncode == 0, f"rank {r.rank} exited with {r.returncode}:\n{r.output[-4000:]}"
    return results


def merged(results) -> dict:
    state = {}
    for r in results:
        state.update(r.value["state"])
    return state


def same(a: dict, b: dict) -> None:
    """Bitwise: the resumed run applies the same fp32 operations in the same order to each element
    (a parameter's chunk and offset change, its arithmetic does not)."""
    assert set(a) == set(b)
    for name in a:
        assert torch.equal(a[name], b[name]), (name, (a[name] - b[name]).abs().max())


def test_two_stages_saved_resume_in_one_process_like_the_uninterrupted_run(tmp_path):
    whole = ok(launch(WORKER, spec(tmp_path, 2, save_at=SAVE_AT), 2, tmp_path))
    resumed = ok(launch(WORKER, spec(tmp_path, 0, resume=str(tmp_path / "ckpt"), start=SAVE_AT), 1, tmp_path))
    loaded = resumed[0].value["loaded"]
    assert loaded["resharded"] and loaded["step"] == SAVE_AT and loaded["extra"] == {"step": SAVE_AT}
    assert resumed[0].value["losses"] == whole[1].value["losses"][SAVE_AT:]
    same(resumed[0].value["state"], merged(whole))


def test_one_process_saved_resumes_in_two_stages_like_the_uninterrupted_run(tmp_path):
    whole = ok(launch(WORKER, spec(tmp_path, 0, save_at=SAVE_AT), 1, tmp_path))
    resumed = ok(launch(WORKER, spec(tmp_path, 2, resume=str(tmp_path / "ckpt"), start=SAVE_AT), 2, tmp_path))
    assert all(r.value["loaded"]["resharded"] for r in resumed)
    assert resumed[1].value["losses"] == whole[0].value["losses"][SAVE_AT:]
    same(merged(resumed), whole[0].value["state"])


# (1 -> 2 with a bf16 master: tests/unit/test_pipeline_reshard_state.py; each case here is ~10 s)
@pytest.mark.parametrize("pp_saved,pp_resumed,master", [(2, 0, "fp32"), (0, 2, "fp32"), (2, 0, "bf16")])
def test_8bit_moments_reshard_between_cuts(tmp_path, pp_saved, pp_resumed, master):
    """Compressed state (issue 29) resumed under another cut: the stages' 8-bit moments are moved
    into the new chunks (``reshard_state``). Every parameter of the tiny LLaMA is a whole number
    of 256-element blocks, so every block keeps its codes and scale: with an fp32 master the
    resumed run takes the uninterrupted run's steps bit for bit. With a bf16 master (bf16
    compute: the parameters themselves) the first resumed loss is the same; later steps differ
    by design, the master's stochastic rounding being keyed by each element's index in the
    layout, which the cut moves. The whole model runs on 2 data-parallel ranks (pp = 0 under 2
    processes, the same rows on each), so the 8-bit pieces are read from, and written to, two
    ranks' halves of each chunk."""
    precision = dict(optimizer_state="8bit") if master == "fp32" else \
        dict(dtype="bf16", optimizer_state="8bit", master="bf16")
    saving = spec(tmp_path, pp_saved, save_at=SAVE_AT)
    saving["config"].update(precision)
    whole = ok(launch(WORKER, saving, 2, tmp_path))
    resuming = spec(tmp_path, pp_resumed, resume=str(tmp_path / "ckpt"), start=SAVE_AT)
    resuming["config"].update(precision)
    resumed = ok(launch(WORKER, resuming, 2, tmp_path))
    assert all(r.value["loaded"]["resharded"] for r in resumed)
    losses, expected = resumed[-1].value["losses"], whole[-1].value["losses"][SAVE_AT:]
    if master == "fp32":
        assert losses == expected
        same(merged(resumed) if pp_resumed else resumed[0].value["state"],
             merged(whole) if pp_saved else whole[0].value["state"])
    else:
        assert losses[0] == expected[0]
        assert len(losses) == STEPS - SAVE_AT and all(torch.isfinite(torch.tensor(losses)))
