"""Checkpoints of 8-bit optimizer state (format version 4): the codes, their per-block scales
and the master saved and loaded bit for bit (NVMe forced), resharded 2 ranks -> 1 process at
block boundaries, and refused by a model of another precision.

Every rank trains on the same rows of each batch (the mean of equal gradients is exact), so a
run is bit for bit the same at any world size: a resumed run must end exactly where the run
that saved ended, and the chunks it loaded must be the saving ranks' pieces put together.
"""

from __future__ import annotations

import datetime
import os
import traceback
from pathlib import Path

import pytest
import torch

import offload
from offload.checkpoint import verify_checkpoint
from offload.checkpoint.format import PRECISION_VERSION, read_manifest
from offload.errors import ConfigError
from tests.helpers.ranks import launch

pytestmark = pytest.mark.slow
K, M = 3, 2
LR, WD = 1e-2, 0.1
TIMEOUT = 240
STATE = ("param", "master", "exp_avg", "exp_avg_sq", "exp_avg_absmax", "exp_avg_sq_absmax")


def make_model():
    torch.manual_seed(0)
    layers = []
    for _ in range(12):
        layers += [torch.nn.Linear(32, 32), torch.nn.Tanh()]
    layers.append(torch.nn.Linear(32, 4))
    return torch.nn.Sequential(*layers)


def config(tmp: Path, **kw) -> offload.OffloadConfig:
    # 2048-element chunks (a Linear and a half each): pieces of 2 ranks cut parameters, never blocks;
    # budgets below the state put chunks on NVMe.
    base = dict(device="cpu", dtype="fp32", device_budget="96KiB", cpu_budget="32KiB",
                nvme_paths=[str(tmp / "nvme-{rank}")], chunk_size=2048, optimizer_state="8bit")
    base.update(kw)
    return offload.OffloadConfig(**base)


def train(model, opt, steps: range) -> list[float]:
    losses = []
    for step in steps:
        gen = torch.Generator().manual_seed(1000 + step)
        x, y = torch.randn(4, 32, generator=gen), torch.randn(4, 4, generator=gen)
        dtype = model.offload_engine.dtype
        loss = torch.nn.functional.mse_loss(model(x.to(dtype)).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def pieces(model) -> dict:
    """This rank's raw piece of every chunk of every saved kind (codes as codes)."""
    chunks = model.offload_engine.chunks
    chunks.drain()
    out = {}
    for info in chunks.chunks():
        for kind in info.kinds:
            data = chunks.read(kind, info.index)
            out[(kind, info.index)] = None if data is None else data.clone()
    return out


def scenario(spec: dict) -> dict:
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    tmp, args = Path(spec["tmp"]), spec["args"]
    try:
        if world > 1:
            dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=TIMEOUT // 2))
        model = offload.wrap(make_model(), config(tmp / spec["name"], **args.get("config", {})))
        opt = offload.AdamW(model.parameters(), lr=LR, weight_decay=WD)
        if spec["name"] == "save":
            train(model, opt, range(K))
            at_save = pieces(model)
            offload.save_checkpoint(model, opt, tmp / "ckpt", step=K)
        else:
            offload.load_checkpoint(model, opt, tmp / "ckpt")
            at_save = pieces(model)
        losses = train(model, opt, range(K, K + M))
        spans = {info.index: tuple(info.span) for info in model.offload_engine.chunks.chunks()}
        nvme = model.offload_engine.store.memory_report()["tiers"]["nvme"]["bytes_by_kind"]
        return {"ok": {"pieces": at_save, "losses": losses, "spans": spans, "nvme": dict(nvme),
                       "params": {k: v.clone() for k, v in model.state_dict().items()}}}
    except BaseException as exc:      # noqa: BLE001 - reported to the test
        return {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    finally:
        if world > 1 and dist.is_initialized():
            dist.destroy_process_group()


def run(name: str, tmp: Path, world: int, **args) -> list[dict]:
    (tmp / name).mkdir(exist_ok=True)
    ranks = launch(f"{__name__}:scenario", {"name": name, "tmp": str(tmp), "args": args}, world, tmp / name,
                   timeout_s=TIMEOUT)
    out = []
    for r in ranks:
        if r.value is None or "error" in r.value:
            pytest.fail(f"{name} rank {r.rank}: {r.value or r.output[-3000:]}")
        out.append(r.value["ok"])
    return out


def whole(results: list[dict], key) -> torch.Tensor | None:
    """Chunk ``key`` put together from the ranks' pieces (a scale kind's in blocks), cut at its end."""
    parts = [r["pieces"][key] for r in results]
    if all(p is None for p in parts):
        return None
    return torch.cat([p for p in parts if p is not None])


def assert_same_run(resumed: list[dict], saved: list[dict]) -> None:
    assert all(r["losses"] == saved[0]["losses"] for r in resumed)
    for r in resumed:
        for name, value in saved[0]["params"].items():
            assert torch.equal(r["params"][name], value), name


@pytest.mark.parametrize("case", [{}, {"dtype": "bf16", "master": "bf16"}])
def test_one_process_round_trip_is_bit_identical(disk_tmp, case):
    saved = run("save", disk_tmp, 1, config=case)
    ckpt = next((disk_tmp / "ckpt").glob("step-*"))
    verdict = verify_checkpoint(ckpt)        # codes and scales checked like any chunk data
    assert not verdict.problems and verdict.chunks > 0, verdict.problems
    manifest = read_manifest(ckpt)
    assert manifest["version"] == PRECISION_VERSION
    assert manifest["precision"]["optimizer_state"] == "8bit"
    assert manifest["kinds"]["exp_avg"]["dtype"] == "uint8" and "exp_avg_sq_absmax" in manifest["kinds"]
    assert "master" not in manifest["kinds"]         # fp32 compute, or a bf16 master that is the parameters
    assert saved[0]["nvme"].get("exp_avg"), "nothing of the 8-bit state reached NVMe"
    resumed = run("resume", disk_tmp, 1, config=case)
    keys = saved[0]["pieces"].keys()
    assert keys == resumed[0]["pieces"].keys() and {k[0] for k in keys} <= set(STATE)
    for key in keys:
        a, b = saved[0]["pieces"][key], resumed[0]["pieces"][key]
        assert (a is None and b is None) or torch.equal(a, b), key
    assert_same_run(resumed, saved)


def test_two_ranks_reshard_to_one_process_at_block_boundaries(disk_tmp):
    saved = run("save", disk_tmp, 2)
    assert not verify_checkpoint(next((disk_tmp / "ckpt").glob("step-*"))).problems
    assert all(lo % 256 == 0 for r in saved for lo, _ in r["spans"].values())
    resumed = run("resume", disk_tmp, 1)
    for key, got in resumed[0]["pieces"].items():
        want = whole(saved, key)
        assert (got is None and want is None) or torch.equal(got, want[:got.numel()]), key
    assert_same_run(resumed, saved)


def test_one_process_reshards_to_two_ranks_at_block_boundaries(disk_tmp):
    saved = run("save", disk_tmp, 1, config={"dtype": "bf16", "master": "bf16"})
    resumed = run("resume", disk_tmp, 2, config={"dtype": "bf16", "master": "bf16"})
    for key, want in saved[0]["pieces"].items():
        got = whole(resumed, key)
        assert (got is None and want is None) or torch.equal(got[:want.numel()], want), key
    assert_same_run(resumed, saved)


def test_a_checkpoint_of_another_precision_is_refused_by_name(disk_tmp):
    run("save", disk_tmp, 1)
    model = offload.wrap(make_model(), config(disk_tmp / "fp32", optimizer_state="fp32"))
    opt = offload.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    with pytest.raises(ConfigError, match="optimizer_state.*8bit optimizer state.*state_dict"):
        offload.load_checkpoint(model, opt, disk_tmp / "ckpt")
