"""A step's loss is the mean over its target tokens, however the step is split: examples of unequal
length (prompt/completion, chat) give the same update with --micro-batches 2 as in one pass (the
mean of the micro-batches' means weighted short examples' tokens more)."""

from __future__ import annotations

import json

import pytest

from offload.train.cli import main
from tests.helpers.hf_models import save_tiny

pytestmark = pytest.mark.slow
pytest.importorskip("transformers")


def _train(tmp, src, data, name, *extra):
    (tmp / "nvme").mkdir(exist_ok=True)
    out = tmp / name
    argv = ["--model", str(src), "--data", str(data), "--steps", "2", "--batch-tokens", "128", "--seq-len", "32",
            "--dtype", "fp32", "--nvme-path", str(tmp / "nvme"), "--no-plan", "--lr", "1e-2", "--warmup", "0",
            "--byte-tokens", "--output", str(out), "--json-log", str(tmp / f"{name}.jsonl"), *extra]
    assert main(argv) == 0
    from safetensors.torch import load_file

    losses = [json.loads(line)["loss"] for line in (tmp / f"{name}.jsonl").read_text().splitlines()]
    return load_file(out / "model.safetensors"), losses


def test_micro_batches_weigh_every_target_token_alike(disk_tmp):
    src = save_tiny(disk_tmp / "src", "llama", shard="5GB")
    data = disk_tmp / "pc.jsonl"
    data.write_text("".join(json.dumps({"prompt": "Q: ", "completion": "abc " * (1 + 5 * (i % 4 >= 2))}) + "\n"
                            for i in range(8)))
    whole, loss_whole = _train(disk_tmp, src, data, "one")
    split, loss_split = _train(disk_tmp, src, data, "two", "--micro-batches", "2")
    assert loss_split == pytest.approx(loss_whole, rel=1e-5)
    worst = max((whole[k] - split[k]).abs().max().item() for k in whole)
    assert worst < 1e-4, worst
