"""Pipeline stages with offloaded state: a model cut by layer into stages, each wrapped by its own
offload engine, driven by ``torch.distributed.pipelining``'s schedules (issue 28).

    mesh = pipeline_mesh(pp=2, dp=1)
    modules = split_llama(model, stage_count("1f1b", 2))
    staged = StagedModel(modules, schedule="1f1b", micro_batches=4, config=cfg,
                         micro_batch=(2, 128), mesh=mesh)
    opt = offload.AdamW(staged.parameters(), lr=1e-4)
    staged.step(input_ids, labels); opt.step(); opt.zero_grad()
    save_pipeline_checkpoint(staged, opt, "ckpt", step=n)     # offload.pipeline.checkpoint
    load_pipeline_checkpoint(staged.targets(), opt, "ckpt")    # any pp x dp: resharded by layer

``offload finetune --pp P --schedule NAME`` trains this way (``offload/train/pipelined.py``).
"""

from .balance import cut
from .schedules import SCHEDULES, make_schedule
from .split import HFStage, LlamaStage, StageSpec, split_hf, split_llama
from .stages import StagedModel, causal_lm_loss, io_meta, pipeline_mesh, stage_count

__all__ = ["SCHEDULES", "HFStage", "LlamaStage", "StageSpec", "StagedModel", "causal_lm_loss", "cut", "io_meta",
           "make_schedule", "pipeline_mesh", "split_hf", "split_llama", "stage_count"]
