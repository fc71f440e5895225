"""Checkpoints under data parallelism: saved by N gloo ranks (each its piece of every chunk,
format version 3), resumed by M -- resharding by slicing: 2 -> 1, 2 -> 2, 2 -> 3, 3 -> 2, 1 -> 2.

Every run sees the same *global* batch of 12 samples per step; rank r of N trains on rows
``r*12/N .. (r+1)*12/N`` with a mean loss, so the averaged gradient -- and so the whole run --
does not depend on N. A run of K+M steps saves after K; the resumed runs (1 process without a
process group, 2 and 3 ranks) must reproduce its last M losses and its final parameters (fp32,
atol 1e-5). Also: every rank's files verify; a corrupted piece makes every rank skip that
checkpoint (or raise, when it is the only one) without a hang; a checkpoint of the former
round-robin ranks (version 2, written by hand) still resumes; a failure while one rank writes
makes every rank raise and leaves the previous checkpoint current; the safetensors export under
2 ranks equals the single process's.

Ranks are processes started by tests/helpers/ranks.py on CPU with NVMe swap forced (small budgets,
``nvme_paths`` per rank); each returns its result and the test waits at most ``TIMEOUT`` seconds,
so a hang fails the test instead of stalling the suite.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import shutil
import subprocess
import sys
import tempfile
import traceback
import warnings
from pathlib import Path

import pytest
import torch

import offload
import offload.checkpoint
import offload.checkpoint.format
from tests.helpers.old_checkpoints import rewrite
from tests.helpers.processes import python_env
from tests.helpers.ranks import launch

pytestmark = pytest.mark.slow
TIMEOUT = 110            # seconds for all ranks of one run
GLOBAL_BATCH = 12        # divisible by 1, 2 and 3 ranks
K, M = 3, 3              # steps before the checkpoint, after it
LR, WD = 1e-2, 0.1
TOL = 1e-5


# ---- what each rank runs --------------------------------------------------------------------
def make_model():
    torch.manual_seed(0)
    layers = []
    for _ in range(36):
        layers += [torch.nn.Linear(32, 32), torch.nn.Tanh()]
    layers.append(torch.nn.Linear(32, 4))
    return torch.nn.Sequential(*layers)


def config(tmp: Path, dtype: str = "fp32") -> offload.OffloadConfig:
    # 2048-element chunks: one Linear per chunk, 36 chunks, several per rank; budgets
    # below the state (about 1.1 MiB in one process, 380 KiB per rank at 3) put chunks on NVMe.
    return offload.OffloadConfig(device="cpu", dtype=dtype, device_budget="160KiB", cpu_budget="32KiB",
                                 nvme_paths=[str(tmp / "nvme-{rank}")], chunk_size=2048)


def global_batch(step: int):
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(GLOBAL_BATCH, 32, generator=gen), torch.randn(GLOBAL_BATCH, 4, generator=gen)


def train(model, opt, steps: range, rank: int, world: int) -> list[float]:
    """Local losses of ``steps``: this rank's slice of each global batch."""
    per = GLOBAL_BATCH // world
    losses = []
    for step in steps:
        x, y = global_batch(step)
        x, y = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def build(tmp: Path, dtype: str = "fp32"):
    model = offload.wrap(make_model(), config(tmp, dtype))
    return model, offload.AdamW(model.parameters(), lr=LR, weight_decay=WD)


def params_of(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def nvme_bytes(model) -> int:
    report = model.offload_engine.store.memory_report()["tiers"]
    return sum(report.get("nvme", {}).get("bytes_by_kind", {}).values())


def scenario_train_and_save(tmp, rank, world, args):
    """K steps, save (or several saves: ``args["saves"]``), M more steps: the reference run."""
    model, opt = build(tmp, args.get("dtype", "fp32"))
    losses, paths = [], []
    done = 0
    for at in args.get("saves", [K]):
        losses += train(model, opt, range(done, at), rank, world)
        nvme = nvme_bytes(model)
        paths.append(str(offload.save_checkpoint(model, opt, tmp / "ckpt", step=at, extra={"at": at})))
        done = at
    losses += train(model, opt, range(done, K + M), rank, world)
    return {"losses": losses, "params": params_of(model), "paths": paths, "nvme": nvme,
            "dp": None if model.offload_engine.dp is None else model.offload_engine.dp.world}


def scenario_resume(tmp, rank, world, args):
    model, opt = build(tmp, args.get("dtype", "fp32"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        manifest = offload.load_checkpoint(model, opt, tmp / "ckpt")
    at = manifest["extra"]["at"]
    nvme = nvme_bytes(model)
    losses = train(model, opt, range(at, K + M), rank, world)
    return {"losses": losses, "nvme": nvme, "params": params_of(model), "at": at, "skipped": manifest["skipped"],
            "warnings": [str(w.message) for w in caught if issubclass(w.category, offload.checkpoint.CheckpointSkipped)]}


def scenario_reload(tmp, rank, world, args):
    """Save at K, train M steps, (``args["eval"]``: an evaluation pass, which leaves gathered groups
    in the window), then load the checkpoint back into the same model and train the M steps again."""
    model, opt = build(tmp)
    train(model, opt, range(K), rank, world)
    offload.save_checkpoint(model, opt, tmp / "ckpt", step=K, extra={"at": K})
    first = train(model, opt, range(K, K + M), rank, world)
    if args.get("eval"):
        with torch.no_grad():
            model(global_batch(0)[0][:GLOBAL_BATCH // world])
    offload.load_checkpoint(model, opt, tmp / "ckpt")
    again = train(model, opt, range(K, K + M), rank, world)
    return {"first": first, "again": again}


def scenario_failing_save(tmp, rank, world, args):
    """A checkpoint at K, then one at K+1 during which rank ``args["bad"]``'s writes fail."""
    import offload.checkpoint.files as files

    model, opt = build(tmp)
    train(model, opt, range(K), rank, world)
    offload.save_checkpoint(model, opt, tmp / "ckpt", step=K, extra={"at": K})
    train(model, opt, range(K, K + 1), rank, world)
    if rank == args["bad"]:
        def broken(writer, data):
            raise offload.errors.NvmeIOError(28, str(writer.path), writer.offset, 1, "injected: disk full")
        files.write_chunk = broken
    offload.save_checkpoint(model, opt, tmp / "ckpt", step=K + 1, extra={"at": K + 1})
    return {"saved": True}


def scenario_export(tmp, rank, world, args):
    from offload import export_safetensors

    model, opt = build(tmp)
    offload.load_checkpoint(model, opt, tmp / "ckpt")
    out = tmp / f"export-{args['label']}"
    export_safetensors(model, out, max_shard_bytes=args.get("shard", 8192))
    return {"files": sorted(p.name for p in out.iterdir()) if rank == 0 else None}


def scenario_hf_export(tmp, rank, world, args):
    """A tiny Llama (tied embeddings) in bf16 written as an HF directory, in bf16 and in fp32 (from the
    fp32 masters). Untrained: the values do not depend on the world size, so files compare exactly."""
    from offload.hf import export_pretrained

    from tests.helpers.hf_models import tiny_llama

    cfg = dataclasses.replace(config(tmp, "bf16"), device_budget="256KiB", cpu_budget="256KiB", chunk_size=4096)
    model = offload.wrap(tiny_llama(), cfg)
    out = tmp / f"hf-{args['label']}"
    export_pretrained(model, out, max_shard_size="40KB")                    # bf16: the param chunks
    export_pretrained(model, tmp / f"hf32-{args['label']}", max_shard_size="40KB", dtype="fp32")  # the masters
    return {"files": sorted(p.name for p in out.iterdir()) if rank == 0 else None}


SCENARIOS = {f.__name__[len("scenario_"):]: f for f in
             (scenario_train_and_save, scenario_resume, scenario_reload, scenario_failing_save, scenario_export, scenario_hf_export)}


def scenario_rank(spec: dict) -> dict:
    """One rank of scenario ``spec["name"]`` (tests/helpers/ranks.py runs it): its result, or the
    error it ended with (reported to the test, not swallowed)."""
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    try:
        if world > 1:
            dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=TIMEOUT // 2))
        return {"ok": SCENARIOS[spec["name"]](Path(spec["tmp"]), rank, world, spec["args"])}
    except BaseException as exc:      # noqa: BLE001 - reported to the test, not swallowed
        return {"error": f"{type(exc).__name__}: {exc}", "type": type(exc).__name__,
                "traceback": traceback.format_exc()}
    finally:
        if world > 1 and dist.is_initialized():
            dist.destroy_process_group()


def run(name: str, tmp: Path, world: int, **args) -> list[dict]:
    """Run scenario ``name`` on ``world`` ranks (one process without a process group when
    ``world`` is 1); each rank's result dict, in rank order. Fails on a hang."""
    ranks = launch(f"{__name__}:scenario_rank", {"name": name, "tmp": str(tmp), "args": args}, world, tmp,
                   timeout_s=TIMEOUT)
    hung = [r.rank for r in ranks if r.returncode is None]
    if hung:
        pytest.fail(f"scenario {name} at {world} ranks: ranks {hung} still running after {TIMEOUT} s (a hang)")
    for r in ranks:
        if r.value is None:
            pytest.fail(f"scenario {name} at {world} ranks: rank {r.rank} exited ({r.returncode}) with no result:\n"
                        f"{r.output[-3000:]}")
    return [r.value for r in ranks]


def ok(results: list[dict]) -> list[dict]:
    failed = [f"rank {r}: {res['error']}\n{res['traceback']}" for r, res in enumerate(results) if "error" in res]
    if failed:
        pytest.fail("\n".join(failed))
    return [res["ok"] for res in results]


def global_losses(results: list[dict]) -> list[float]:
    """Each step's loss over the global batch: the mean of the ranks' equal-sized slices."""
    return [sum(step) / len(step) for step in zip(*(r["losses"] for r in results))]


def assert_params_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=TOL, rtol=0, msg=lambda m, k=k: f"{k}: {m}")


def assert_resumes(results: list[dict], reference: list[dict]) -> None:
    """The resumed run loaded step K and took the steps the saving run took after it."""
    assert all(r["at"] == K and not r["skipped"] for r in results)
    torch.testing.assert_close(global_losses(results), global_losses(reference)[K:], atol=TOL, rtol=0)
    for r in results:
        assert_params_equal(r["params"], reference[0]["params"])


# ---- tests ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def saved_by():
    """``saved_by(n)``: an n-rank run (one process for 1) of K+M steps that saved after K: (its
    directory, its results); each run once per module. On a real disk under the repository
    (O_DIRECT does not work on tmpfs)."""
    base = Path(__file__).resolve().parents[2] / ".pytest-tmp"
    base.mkdir(exist_ok=True)
    runs: dict[int, tuple[Path, list[dict]]] = {}

    def get(world: int) -> tuple[Path, list[dict]]:
        if world not in runs:
            runs[world] = (tmp := Path(tempfile.mkdtemp(dir=base)), ok(run("train_and_save", tmp, world)))
        return runs[world]

    try:
        yield get
    finally:
        for tmp, _ in runs.values():
            shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture
def saved(saved_by):
    """The 2-rank run that saved after K."""
    return saved_by(2)


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_save_their_pieces_of_every_chunk(saved_by, world):
    tmp, results = saved_by(world)
    assert all(r["dp"] == world for r in results), f"the engine did not shard over the {world}-rank group"
    assert all(r["nvme"] > 0 for r in results), "no chunk was on NVMe when saved"
    ckpt = tmp / "ckpt" / f"step-{K:08d}"
    assert all(r["paths"] == [str(ckpt)] for r in results)
    assert (tmp / "ckpt" / "latest").read_text().strip() == ckpt.name
    manifest = offload.checkpoint.format.read_manifest(ckpt)
    assert manifest["world"] == world and manifest["version"] == offload.checkpoint.format.SLICED_VERSION
    pieces = 0
    for kind, info in manifest["kinds"].items():
        files = [f"rank-{r:05d}/{kind}.bin" for r in range(world)]
        assert info["files"] == files
        for c, entry in enumerate(info["chunks"]):
            assert entry is not None, (kind, c)
            numel, p = entry["numel"], -(-entry["numel"] // world)
            # Rank r's span [r*p, r*p + p) cut at the chunk's end: in its file, or zeros (moments never updated).
            want = [(r, r * p, min(r * p + p, numel)) for r in range(world) if r * p < numel]
            assert [(e["rank"], e["lo"], e["hi"]) for e in entry["pieces"]] == want, (kind, c)
            for e in entry["pieces"]:
                assert e["file"] == files[e["rank"]] if "file" in e else e["zeros"] and kind.startswith("exp_avg")
            pieces += sum("file" in e for e in entry["pieces"])
    assert sorted(p.name for p in ckpt.iterdir()) == ["manifest.json"] + [f"rank-{r:05d}" for r in range(world)]
    verdict = offload.checkpoint.verify_checkpoint(ckpt)
    assert verdict.ok, verdict.problems
    assert verdict.files == world * len(manifest["kinds"]) and verdict.world == world
    assert verdict.chunks == sum(len(info["chunks"]) for info in manifest["kinds"].values())
    assert verdict.pieces == pieces
    cli = subprocess.run([sys.executable, "-m", "offload", "checkpoint", "verify", str(tmp / "ckpt")],
                         capture_output=True, text=True, env=python_env())
    assert cli.returncode == 0, cli.stderr
    assert f"ok       {ckpt.name}" in cli.stdout and f"of {world} ranks" in cli.stdout


@pytest.mark.parametrize("saver,world", [(2, 1), (2, 2), (2, 3), (3, 2), (1, 2)])
def test_resume_at_any_world_size_continues_the_run_that_saved(saved_by, saver, world):
    tmp, reference = saved_by(saver)
    results = ok(run("resume", tmp, world))
    assert all(r["nvme"] > 0 for r in results), "no chunk was on NVMe after loading"
    assert_resumes(results, reference)


def test_a_round_robin_checkpoint_of_the_former_scheme_resumes_at_three_ranks(saved_by, disk_tmp):
    src, reference = saved_by(1)
    shutil.copytree(src / "ckpt", disk_tmp / "ckpt")
    rewrite(disk_tmp / "ckpt" / f"step-{K:08d}", 2, offload.checkpoint.format.SHARDED_VERSION)
    assert offload.checkpoint.format.read_manifest(disk_tmp / "ckpt" / f"step-{K:08d}")["version"] == 2
    assert_resumes(ok(run("resume", disk_tmp, 3)), reference)


@pytest.mark.parametrize("evaluate", [False, True])
def test_loading_into_a_trained_model_replaces_its_state(disk_tmp, evaluate):
    results = ok(run("reload", disk_tmp, 2, eval=evaluate))
    for r in results:
        torch.testing.assert_close(r["again"], r["first"], atol=TOL, rtol=0)


def test_corrupt_shard_falls_back_on_every_rank(disk_tmp):
    ok(run("train_and_save", disk_tmp, 2, saves=[K - 1, K]))
    bad = disk_tmp / "ckpt" / f"step-{K:08d}" / "rank-00001" / "exp_avg.bin"
    data = bytearray(bad.read_bytes())
    data[len(data) // 2] ^= 0xFF
    bad.write_bytes(bytes(data))
    verdicts, _ = offload.checkpoint.verify_root(disk_tmp / "ckpt")
    assert [v.ok for v in verdicts] == [True, False]
    assert any("rank-00001/exp_avg.bin" in p for p in verdicts[1].problems)
    for world in (2, 3, 1):
        results = ok(run("resume", disk_tmp, world))
        for r in results:
            assert r["at"] == K - 1
            assert len(r["skipped"]) == 1 and "exp_avg.bin" in r["skipped"][0]["reason"]
            assert r["skipped"] == results[0]["skipped"]
            assert len(r["warnings"]) == 1


def test_the_only_checkpoint_corrupt_raises_on_every_rank(disk_tmp):
    ok(run("train_and_save", disk_tmp, 2))
    bad = disk_tmp / "ckpt" / f"step-{K:08d}" / "rank-00000" / "param.bin"
    with open(bad, "r+b") as f:
        f.truncate(bad.stat().st_size - 8)
    results = run("resume", disk_tmp, 3)
    assert all("error" in r for r in results)
    assert any("rank-00000/param.bin" in r["error"] for r in results)


def test_a_failed_write_on_one_rank_fails_every_rank(disk_tmp):
    results = run("failing_save", disk_tmp, 2, bad=1)
    assert all("error" in r for r in results), results
    assert "disk full" in results[1]["error"]
    assert "rank 1" in results[0]["error"]
    ckpt = disk_tmp / "ckpt"
    assert (ckpt / "latest").read_text().strip() == f"step-{K:08d}"
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", f"step-{K:08d}"]


def test_export_under_two_ranks_equals_the_single_process_export(saved):
    from safetensors.torch import load_file

    tmp, _ = saved
    one = ok(run("export", tmp, 1, label="one"))
    two = ok(run("export", tmp, 2, label="two"))
    assert one[0]["files"] == two[0]["files"] and len(one[0]["files"]) > 2
    for f in one[0]["files"]:
        if f.endswith(".safetensors"):
            a, b = load_file(tmp / "export-one" / f), load_file(tmp / "export-two" / f)
            assert a.keys() == b.keys()
            for k in a:
                torch.testing.assert_close(a[k], b[k], atol=0, rtol=0)


def test_hf_export_under_two_ranks_equals_the_single_process_export(disk_tmp):
    from safetensors.torch import load_file

    one = ok(run("hf_export", disk_tmp, 1, label="one"))
    two = ok(run("hf_export", disk_tmp, 2, label="two"))
    assert one[0]["files"] == two[0]["files"] and "config.json" in one[0]["files"]
    shards = [f for f in one[0]["files"] if f.endswith(".safetensors")]
    assert len(shards) > 1
    for prefix in ("hf", "hf32"):
        for f in sorted(p.name for p in (disk_tmp / f"{prefix}-one").glob("*.safetensors")):
            a, b = load_file(disk_tmp / f"{prefix}-one" / f), load_file(disk_tmp / f"{prefix}-two" / f)
            assert a.keys() == b.keys()
            for k in a:
                torch.testing.assert_close(a[k], b[k], atol=0, rtol=0, msg=lambda m, k=k: f"{k}: {m}")
