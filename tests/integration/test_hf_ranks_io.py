"""Hugging Face weights in and out under 3 gloo ranks of sliced chunks, equal to one process.

A tiny Llama (28 layers) saved by transformers (fp32 safetensors shards) is loaded on 3 ranks and
in one process (bf16 compute, 4096-element chunks: no chunk splits evenly in 3, tensors straddle
the ranks' pieces, NVMe forced) by ``load_pretrained`` and by ``load_safetensors`` into a wrapped
model, and written back by ``export_pretrained`` (bf16 from the param pieces, fp32 from the
masters), ``export_safetensors``, and for a LoRA model ``write_output`` (peft adapter, merged
export). Every file the 3 ranks write is byte for byte the one process's. Also:
``state_dict`` / ``load_state_dict`` and the optimizer's, round trips on pieces; each rank reads
only the weights in its pieces when loading (about a third); a failed read of one rank's piece
during an export ends every rank with one error (no hang, no directory left).
"""

from __future__ import annotations

import datetime
import filecmp
import os
import traceback
from pathlib import Path

import pytest
import torch

from tests.helpers.ranks import launch

pytest.importorskip("transformers")
pytest.importorskip("peft")

pytestmark = pytest.mark.slow
TIMEOUT = 240
CHUNK = 4096


def config(tmp: Path, label: str):
    import offload

    # 277 k parameters: 1.7 MB of bf16 parameters and fp32 masters, 550 KB a rank at 3, against
    # 432 KiB of budgets (the least these chunks allow): pieces go through NVMe.
    return offload.OffloadConfig(device="cpu", dtype="bf16", device_budget="288KiB", cpu_budget="144KiB",
                                 nvme_paths=[str(tmp / f"nvme-{label}-{{rank}}")], chunk_size=CHUNK)


def counting(module, name: str, size) -> list[int]:
    """Count what ``module.name`` (a reader) returns, ``size(result)`` bytes a call; the reads stay real."""
    total = [0]
    real = getattr(module, name)

    def wrapper(*args, **kwargs):
        out = real(*args, **kwargs)
        total[0] += size(out)
        return out

    setattr(module, name, wrapper)
    return total


def seeded(shape, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def rank_io(spec: dict) -> dict:
    """One rank (or the one process) of the whole sequence; its results, or its error."""
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    try:
        if world > 1:
            dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=TIMEOUT // 2))
        return {"ok": _io(Path(spec["tmp"]), Path(spec["src"]), spec["label"], rank)}
    except BaseException as exc:      # noqa: BLE001 - reported to the test
        return {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    finally:
        if world > 1 and dist.is_initialized():
            dist.destroy_process_group()


def _io(tmp: Path, src: Path, label: str, rank: int) -> dict:
    import transformers

    import offload
    import offload.hf.safetensors_load as st_load
    import offload.hf.tensor_files as tensor_files
    from offload.errors import NvmeIOError
    from offload.hf import export_pretrained, load_pretrained
    from offload.hf.lora import LoraSettings, apply_lora
    from offload.hf.output import write_output

    out = tmp / label
    result: dict = {}
    # 1. load_pretrained: every rank fills its piece of every chunk (rows read: counted).
    read = counting(tensor_files, "read_rows", lambda t: t.numel() * t.element_size())
    model = load_pretrained(src, config(tmp, label))
    result["read_bytes"] = read[0]
    infos = model.offload_engine.chunks.chunks()
    result["chunks"] = [(i.numel, i.span, i.used) for i in infos]
    result["nvme"] = sum(model.offload_engine.store.memory_report()["tiers"].get("nvme", {})
                         .get("bytes_by_kind", {}).values())
    export_pretrained(model, out / "hf", max_shard_size="40KB")
    export_pretrained(model, out / "hf32", max_shard_size="40KB", dtype="fp32")
    # 2. state_dict: the fp32 masters, whole, on every rank; load_state_dict then state_dict: the same.
    result["state"] = model.state_dict()
    changed = {k: seeded(v.shape, i) for i, (k, v) in enumerate(result["state"].items())}
    model.load_state_dict(changed)
    result["state_back"] = model.state_dict()
    # 3. The optimizer's state on pieces: loaded, then given back.
    opt = offload.AdamW(model.parameters(), lr=1e-3)
    sd = opt.state_dict()
    shapes = [model.offload_engine.chunks.param(p).slot.shape for g in opt.param_groups for p in g["params"]]
    sd["state"] = {i: {"step": torch.tensor(float(3 + i % 2)), "exp_avg": seeded(s, 1000 + i),
                       "exp_avg_sq": seeded(s, 2000 + i).abs()} for i, s in enumerate(shapes)}
    opt.load_state_dict(sd)
    result["opt_in"], result["opt_out"] = sd["state"], opt.state_dict()["state"]
    model.offload_engine.close()
    # 4. load_safetensors into a wrapped model built with other values; export_safetensors.
    rows = counting(st_load, "copy_rows", lambda n: 4 * n)          # the files are fp32
    torch.manual_seed(1)
    plain = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(src))
    wrapped = offload.wrap(plain, config(tmp, label + "-st"))
    offload.load_safetensors(wrapped, src)
    result["st_read_bytes"] = rows[0]
    offload.export_safetensors(wrapped, out / "st", max_shard_bytes=20000)
    # 5. A failed read of rank 1's piece of chunk 2 (of 3 ranks) during an export: every rank raises.
    chunks = wrapped.offload_engine.chunks
    real = chunks.read

    def failing(kind, c, out=None):
        if c == 2 and (chunks.sharding is None or chunks.sharding.rank == 1):
            raise NvmeIOError(5, "swap", 0, 1, "injected: bad sector")
        return real(kind, c, out)

    chunks.read = failing
    try:
        export_pretrained(wrapped, out / "failed", max_shard_size="40KB")
        result["failed"] = None
    except Exception as exc:
        result["failed"] = (type(exc).__name__, str(exc))
    result["failed_left"] = (out / "failed").exists()
    chunks.read = real
    wrapped.offload_engine.close()
    # 6. LoRA: the adapter in peft's format and the merged model, from a LoRA model with trained-looking values.
    torch.manual_seed(2)
    lora = load_pretrained(src, config(tmp, label + "-lora"),
                           adapt=lambda m: apply_lora(m, LoraSettings(rank=4, targets=("q_proj", "v_proj"))))
    adapters = {k: seeded(lora.offload_engine.chunks.param(p).slot.shape, 3000 + i)
                for i, (k, p) in enumerate(lora.named_parameters()) if ".lora_" in k}
    lora.load_state_dict(adapters, strict=False)
    write_output(lora, out / "adapter")
    write_output(lora, out / "merged", merge=True, max_shard_size="40KB")
    lora.offload_engine.close()
    return result


def run(tmp: Path, src: Path, world: int, label: str) -> list[dict]:
    ranks = launch(f"{__name__}:rank_io", {"tmp": str(tmp), "src": str(src), "label": label}, world, tmp,
                   timeout_s=TIMEOUT)
    for r in ranks:
        if r.returncode is None:
            pytest.fail(f"{world} ranks: rank {r.rank} still running after {TIMEOUT} s (a hang)")
        if r.value is None:
            pytest.fail(f"{world} ranks: rank {r.rank} exited ({r.returncode}) with no result:\n{r.output[-3000:]}")
        if "error" in r.value:
            pytest.fail(f"{world} ranks: rank {r.rank}: {r.value['error']}\n{r.value['traceback']}")
    return [r.value["ok"] for r in ranks]


@pytest.fixture(scope="module")
def runs():
    """(the directory, the one process's result, the 3 ranks' results)."""
    import shutil
    import tempfile

    from tests.helpers.hf_models import save_tiny

    base = Path(__file__).resolve().parents[2] / ".pytest-tmp"
    base.mkdir(exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=base))
    try:
        src = save_tiny(tmp / "src", "llama", shard="40KB", num_hidden_layers=28)
        yield tmp, run(tmp, src, 1, "one")[0], run(tmp, src, 3, "three")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def adapter_config(path: Path) -> dict:
    import json

    config = json.loads(path.read_text())
    config["target_modules"] = sorted(config["target_modules"])
    return config


def files(directory: Path) -> list[str]:
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file())


@pytest.mark.parametrize("what", ["hf", "hf32", "st", "adapter", "merged"])
def test_three_ranks_write_the_single_process_files_byte_for_byte(runs, what):
    tmp, one, three = runs
    a, b = tmp / "one" / what, tmp / "three" / what
    assert files(a) == files(b) and any(f.endswith(".safetensors") for f in files(a)), (files(a), files(b))
    if what in ("hf", "hf32", "st", "merged"):
        assert sum(f.endswith(".safetensors") for f in files(a)) > 1       # several shards
    for f in files(a):
        if f == "adapter_config.json":       # peft writes target_modules from a set: in any order
            assert adapter_config(a / f) == adapter_config(b / f)
            continue
        assert filecmp.cmp(a / f, b / f, shallow=False), f"{what}/{f} differs"


def test_three_ranks_load_every_tensor_and_slice_every_chunk(runs):
    tmp, one, three = runs
    assert all(r["nvme"] > 0 for r in three), "no piece was on NVMe"
    sizes = [n for n, _, _ in one["chunks"]]
    assert any(n % 3 for n in sizes) and max(sizes) > CHUNK        # uneven pieces, an oversized chunk
    for rank, r in enumerate(three):
        for (n, span, _), (n1, whole, _) in zip(r["chunks"], one["chunks"]):
            p = -(-n // 3)
            assert n == n1 and whole == (0, n) and span == (rank * p, rank * p + p)


def test_each_rank_reads_only_the_weights_in_its_pieces(runs):
    import math

    from safetensors import safe_open

    tmp, one, three = runs
    total = 0
    for f in (tmp / "src").glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as st:
            total += 4 * sum(math.prod(st.get_slice(k).get_shape()) for k in st.keys())
    assert one["read_bytes"] == total and one["st_read_bytes"] == total
    print(f"weights {total} B; bytes read per rank of 3: load_pretrained {[r['read_bytes'] for r in three]}, "
          f"load_safetensors {[r['st_read_bytes'] for r in three]}")
    for key in ("read_bytes", "st_read_bytes"):
        per_rank = [r[key] for r in three]
        assert sum(per_rank) >= total, (key, per_rank, total)
        for r, b in zip(three, per_rank):
            # The parameters' elements in its spans (a third of each chunk, less the padding at a
            # chunk's end), plus at most a row (64 fp32 elements here: down_proj's) at either end
            # of each span where a tensor straddles it.
            inside = sum(max(0, min(hi, used) - lo) for _, (lo, hi), used in r["chunks"])
            assert b <= 4 * (inside + 2 * 64 * len(r["chunks"])), (key, per_rank, total)
            assert b < 0.4 * total, (key, per_rank, total)


def test_state_dicts_on_pieces_are_the_whole_tensors_on_every_rank(runs):
    tmp, one, three = runs
    for r in three:
        for which in ("state", "state_back"):
            assert r[which].keys() == one[which].keys()
            for k in one[which]:
                assert torch.equal(r[which][k], one[which][k]), (which, k)
        changed = {k: seeded(v.shape, i) for i, (k, v) in enumerate(one["state"].items())}
        for k, v in changed.items():
            assert torch.equal(r["state_back"][k], v), k
        assert r["opt_out"].keys() == r["opt_in"].keys()
        for i, st in r["opt_in"].items():
            assert float(r["opt_out"][i]["step"]) == float(st["step"]), i
            for kind in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(r["opt_out"][i][kind], st[kind]), (i, kind)


def test_a_failed_piece_read_in_an_export_ends_every_rank_with_one_error(runs):
    tmp, one, three = runs
    assert one["failed"][0] == "NvmeIOError" and "bad sector" in one["failed"][1]
    assert three[1]["failed"][0] == "NvmeIOError" and "bad sector" in three[1]["failed"][1]
    for r in (three[0], three[2]):
        assert r["failed"][0] == "PeerFailed" and "rank 1" in r["failed"][1] and "bad sector" in r["failed"][1], r
    assert not any(r["failed_left"] for r in [one, *three])
