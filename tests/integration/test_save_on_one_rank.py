"""HF Trainer.save_model on 2 ranks (issue 26 review): transformers saves on rank 0 alone, but a
wrapped model's state_dict is a collective. Rank 1 went on to accelerate's wait_for_everyone
while rank 0 waited in a broadcast for chunks rank 1 owns: a hang until the process group's
timeout (so did export_pretrained under ``if rank == 0``). Now rank 0's state_dict finds rank 1 missing (offload/distributed/arrival.py) and stops
with one line saying what to call instead; rank 1's barrier then fails as its peer exits."""

from __future__ import annotations

import os

import pytest

from tests.helpers.ranks import launch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytestmark = pytest.mark.slow


def worker(spec: dict) -> str:
    from datetime import timedelta

    import accelerate
    import transformers

    import offload
    from tests.helpers.hf_ranks_worker import Tokens
    from tests.helpers.hf_models import tiny_llama

    rank = int(os.environ["RANK"])
    accelerate.PartialState(cpu=True, timeout=timedelta(seconds=spec["pg_timeout_s"]))
    model = offload.wrap(tiny_llama(), offload.OffloadConfig(device="cpu", dtype="fp32", chunk_size=4096,
                                                             nvme_paths=[spec["nvme"].format(rank=rank)]))
    opt = offload.AdamW(model.parameters(), lr=1e-3)
    args = transformers.TrainingArguments(output_dir=spec["out"], per_device_train_batch_size=2, max_steps=2,
                                          use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(8), optimizers=(opt, None))
    trainer.train()
    if spec.get("export"):                    # the README's export, by mistake under `if rank == 0`
        if trainer.is_world_process_zero():
            from offload.hf import export_pretrained

            export_pretrained(model, spec["out"])
    else:
        trainer.save_model(spec["out"])       # rank 0 alone calls model.state_dict()
    trainer.accelerator.wait_for_everyone()
    return "finished"


@pytest.mark.parametrize("export, what", [(False, "state_dict"), (True, "export_pretrained")])
def test_a_save_on_rank_0_alone_fails_loudly_instead_of_hanging(disk_tmp, export, what):
    (disk_tmp / "nvme-0").mkdir()
    (disk_tmp / "nvme-1").mkdir()
    spec = dict(out=str(disk_tmp / "out"), nvme=str(disk_tmp / "nvme-{rank}"), pg_timeout_s=240, export=export)
    results = launch("tests.integration.test_save_on_one_rank:worker", spec, 2, disk_tmp, timeout_s=150,
                     env={"OFFLOAD_ARRIVAL_TIMEOUT_S": "5"})
    assert all(r.returncode is not None for r in results), "hung: " + results[0].output[-2000:]
    rank0 = results[0]
    assert rank0.returncode != 0
    assert f"{what}: rank 1 did not call it" in rank0.output, rank0.output[-3000:]
    assert "call it on every rank" in rank0.output
    assert not (disk_tmp / "out" / "model.safetensors").exists()
