"""scripts/finetune_100b.py end to end on tiny HF checkpoints, NVMe forced: full, LoRA, merge, resume.

"The trained wrapped model" is the run's last checkpoint loaded into a freshly built model (the
script closes its engine at exit); what --output wrote must equal it exactly.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import offload
from offload import ConfigError, OffloadError
from offload.train.cli import main
from tests.helpers.hf_models import hf_load, save_tiny, token_batch
from tests.helpers.processes import python_env

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")


from offload.checkpoint import load_checkpoint  # noqa: E402
from offload.hf import load_pretrained  # noqa: E402

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "finetune_100b.py"


def corpus(tmp) -> Path:
    path = tmp / "data.txt"
    path.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    return path


def run(tmp, src, *extra, steps=4):
    """The trainer in-process, NVMe forced (budgets below the state), fp32, on byte ids (the tiny
    checkpoints have no tokenizer); returns the losses."""
    log = tmp / f"log-{len(list(tmp.glob('log-*')))}.jsonl"
    (tmp / "nvme").mkdir(exist_ok=True)
    argv = ["--model", str(src), "--data", str(corpus(tmp)), "--steps", str(steps), "--batch-tokens", "64",
            "--seq-len", "32", "--dtype", "fp32", "--device-budget", "224KiB", "--cpu-budget", "224KiB",
            "--nvme-path", str(tmp / "nvme"), "--no-plan", "--lr", "1e-2", "--warmup", "1",
            "--json-log", str(log), "--checkpoint-dir", str(tmp / "ckpt"), "--byte-tokens", *extra]
    assert main(argv) == 0
    return [json.loads(line)["loss"] for line in log.read_text().splitlines()]


def restored(tmp, src, adapt=None):
    """A fresh model with the run's last checkpoint loaded: the trained wrapped model."""
    cfg = offload.OffloadConfig(device="cpu", dtype="fp32", device_budget="224KiB", cpu_budget="224KiB",
                                nvme_paths=[str(tmp / "nvme2")])
    model = load_pretrained(src, cfg, adapt=adapt)
    opt = offload.AdamW([p for p in model.parameters() if p.requires_grad])
    manifest = load_checkpoint(model, opt, tmp / "ckpt")
    return model.eval(), manifest


def logits(model):
    with torch.no_grad():
        return model(input_ids=token_batch(7)).logits


def test_full_finetune_writes_the_trained_model(disk_tmp):
    src = save_tiny(disk_tmp / "src", "llama")
    losses = run(disk_tmp, src, "--output", str(disk_tmp / "out"), "--max-shard-size", "20KB", "--save-every", "2")
    assert losses[-1] < losses[0]
    assert len(list((disk_tmp / "out").glob("model-*.safetensors"))) > 1
    model, manifest = restored(disk_tmp, src)
    assert manifest["extra"]["data"]["next_batch"] == 4
    out = hf_load(disk_tmp / "out")
    mine = model.state_dict()
    for name, value in out.state_dict().items():
        assert torch.equal(value, mine[name]), name
    assert torch.equal(logits(out), logits(model))
    model.offload_engine.close()


@pytest.mark.parametrize("dropout", [None, "0.2"], ids=["plain", "lora-dropout"])
def test_resume_continues_with_the_next_batch(disk_tmp, dropout):
    # The checkpoint carries the data position and torch's RNG state (LoRA dropout draws from it).
    extra = () if dropout is None else ("--lora-rank", "4", "--lora-dropout", dropout)
    src = save_tiny(disk_tmp / "src", "llama")
    (disk_tmp / "a").mkdir()
    straight = run(disk_tmp / "a", src, "--checkpoint-every", "2", *extra, steps=4)
    # Resume from the step-2 checkpoint alone (same --steps, so the same lr schedule).
    (disk_tmp / "b" / "ckpt").mkdir(parents=True)
    shutil.copytree(disk_tmp / "a" / "ckpt" / "step-00000002", disk_tmp / "b" / "ckpt" / "step-00000002")
    (disk_tmp / "b" / "ckpt" / "latest").write_text("step-00000002\n")
    rest = run(disk_tmp / "b", src, "--resume", *extra, steps=4)
    assert rest == straight[2:]            # bit-identical: batches 3 and 4, not 1 and 2, come next


def test_lora_adapter_is_the_trained_adapter(disk_tmp):
    peft = pytest.importorskip("peft")
    from offload.hf.lora import LoraSettings, apply_lora

    src = save_tiny(disk_tmp / "src", "qwen2")
    losses = run(disk_tmp, src, "--lora-rank", "4", "--lora-targets", "q_proj,v_proj", "--output",
                 str(disk_tmp / "adapter"))
    assert losses[-1] < losses[0]
    settings = LoraSettings(rank=4, targets=("q_proj", "v_proj"))
    model, _ = restored(disk_tmp, src, adapt=lambda m: apply_lora(m, settings))
    loaded = peft.PeftModel.from_pretrained(hf_load(src), str(disk_tmp / "adapter")).eval()
    mine = model.state_dict()
    adapter = {n: p for n, p in loaded.named_parameters() if ".lora_" in n}
    assert adapter and adapter.keys() == {n for n, p in model.named_parameters() if p.requires_grad}
    for name, p in adapter.items():
        assert torch.equal(p.detach(), mine[name]), name
    assert torch.equal(logits(loaded), logits(model))
    model.offload_engine.close()


def test_lora_merge_writes_base_plus_adapter(disk_tmp):
    peft = pytest.importorskip("peft")
    from offload.hf.lora import LoraSettings, apply_lora, save_adapter

    src = save_tiny(disk_tmp / "src", "llama")
    run(disk_tmp, src, "--lora-rank", "4", "--merge", "--output", str(disk_tmp / "merged"), steps=2)
    model, _ = restored(disk_tmp, src, adapt=lambda m: apply_lora(m, LoraSettings(rank=4)))
    save_adapter(model, disk_tmp / "adapter")
    expected = peft.PeftModel.from_pretrained(hf_load(src), str(disk_tmp / "adapter")).merge_and_unload()
    merged = hf_load(disk_tmp / "merged")
    assert merged.state_dict().keys() == expected.state_dict().keys()
    for name, value in expected.state_dict().items():
        assert torch.equal(merged.state_dict()[name], value), name
    model.offload_engine.close()


@pytest.mark.parametrize("extra,error,match", [
    (["--merge"], ConfigError, "--merge=True: needs --lora-rank"),
    (["--preset", "tiny"], ConfigError, "exclude each other"),
    (["--data", "{empty}"], ConfigError, "empty.jsonl.* is empty"),
    (["--data", "{nothing}"], ConfigError, "nothing.jsonl.*no usable record"),
    (["--lora-rank", "2", "--lora-targets", "nope_proj"], ConfigError, "--lora-targets"),
])
def test_bad_arguments_are_one_line_errors(disk_tmp, extra, error, match):
    src = save_tiny(disk_tmp / "src", "llama")
    (disk_tmp / "empty.jsonl").write_text("")
    (disk_tmp / "nothing.jsonl").write_text('{"text": ""}\n')
    extra = [x.format(empty=disk_tmp / "empty.jsonl", nothing=disk_tmp / "nothing.jsonl") for x in extra]
    with pytest.raises(error, match=match) as err:
        run(disk_tmp, src, *extra, steps=1)
    assert isinstance(err.value, OffloadError) and "\n" not in str(err.value)


def test_cli_prints_one_line_without_traceback(disk_tmp):
    src = save_tiny(disk_tmp / "src", "llama")
    shard = sorted(src.glob("model-*.safetensors"))[1]
    shard.write_bytes(b"\x00" * 7)
    done = subprocess.run([sys.executable, str(SCRIPT), "--model", str(src), "--no-plan", "--steps", "1"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, env=python_env())
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("finetune: error:")]
    assert len(errors) == 1 and shard.name in errors[0], done.stderr[-2000:]
