"""``CheckpointManager``: where a run's checkpoints go, when they are written, and resuming.

It owns the interval (``--checkpoint-every``), how many are kept (``--keep-checkpoints``), and the
state a checkpoint carries besides the model and optimizer: the step, the LR scheduler, torch's
random generators and the data position -- so a resumed run takes exactly the steps the
interrupted one would have taken.

The directory is ``--checkpoint-dir``, or by default ``<--output>-checkpoints`` (beside the output,
not inside it: writing the output replaces its directory whole) or ``./checkpoints/<run name>``.
Without ``--checkpoint-dir`` only a preemption (SIGTERM, SIGINT) or ``--checkpoint-every`` writes
there, and ``--resume`` looks there: one requeue command covers a job's first launch (no
checkpoint yet: the run starts fresh, saying so) and every launch after.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

from .config import TrainConfig


def default_directory(config: TrainConfig) -> str:
    """Where checkpoints go without --checkpoint-dir."""
    if config.output.output:
        return str(Path(config.output.output)) + "-checkpoints"
    return os.path.join("checkpoints", config.run_name)


def rng_state() -> dict:
    """torch's random generators (CPU, and every GPU's), for a checkpoint."""
    import torch

    return {"cpu": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def set_rng_state(state: dict) -> None:
    import torch

    torch.set_rng_state(state["cpu"])
    if state.get("cuda") and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])


class CheckpointManager:
    """A run's checkpoints. ``say``: one line for the run's log."""

    def __init__(self, config: TrainConfig, say: Callable[[str], None]):
        c = config.checkpoint
        self.directory = c.checkpoint_dir or default_directory(config)
        self.chosen = c.checkpoint_dir is not None      # the user named it: the end of the run saves too
        self.every = c.checkpoint_every
        self.keep = c.keep_checkpoints
        self.resume_asked = c.resume
        self.steps = config.optimizer.steps
        self.say = say
        self.saved_step: int | None = None

    def where(self) -> str:
        """The start-up log's line about checkpoints."""
        when = [f"every {self.every} steps"] if self.every else []
        if self.chosen:
            when.append("at the end")
        when.append("on SIGTERM/SIGINT")
        return f"checkpoints: {self.directory} ({', '.join(when)})"

    def found(self) -> bool:
        """There is a checkpoint to resume from (an engine's, or a pipeline run's)."""
        from ..pipeline.checkpoint import list_any

        return bool(list_any(self.directory))

    def resumes_pipeline(self) -> bool:
        """--resume loads a pipeline run's checkpoint (``offload.pipeline.checkpoint``)."""
        if not self.resuming():
            return False
        from ..pipeline.checkpoint import is_pipeline, newest

        ckpt = newest(self.directory)
        return ckpt is not None and is_pipeline(ckpt)

    def resuming(self) -> bool:
        """--resume and a checkpoint exists (else the run starts fresh)."""
        return self.resume_asked and self.found()

    def resumes_untied_head(self) -> bool:
        """--resume loads a checkpoint whose LM head is a parameter of its own: a pipeline run's
        (stages untie a tied preset), or one a run resumed from such a checkpoint wrote."""
        if not self.resuming():
            return False
        if self.resumes_pipeline():
            return True
        from ..checkpoint import resumable
        from ..errors import OffloadError

        try:
            chosen = resumable(self.directory)      # the one resume() starts with (it falls back alike)
        except OffloadError:
            return False                            # none verifies: resume() says so
        return chosen is not None and any(e[0] == "lm_head.weight" for e in chosen[1]["layout"]["params"])

    def saved_chunk_size(self) -> int | None:
        """The chunk size the checkpoint a resume loads was written with (None: no resume): the
        model is built with it, so a checkpoint resumes under other budgets."""
        if not self.resuming():
            return None
        if self.resumes_pipeline():
            from ..pipeline.checkpoint import saved_chunk_size as pipeline_chunk_size

            return pipeline_chunk_size(self.directory)
        from ..checkpoint import saved_chunk_size

        return saved_chunk_size(self.directory)

    def check_precision(self, state: str, master: str) -> None:
        """A resume must train with the optimizer-state precision its checkpoint holds (the chunks
        are laid out for it): a different --optimizer-state / --master is refused naming the flags
        to give (a pipeline checkpoint's stages are checked as they load)."""
        if not self.resuming() or self.resumes_pipeline():
            return
        from ..checkpoint import resumable
        from ..checkpoint.format import saved_precision
        from ..errors import ConfigError, OffloadError

        try:
            chosen = resumable(self.directory)      # the one resume() starts with
        except OffloadError:
            return                                  # none verifies: resume() says so
        if chosen is None:
            return
        saved = saved_precision(chosen[1])
        if (saved["optimizer_state"], saved["master"]) != (state, master):
            flag, given = ("--optimizer-state", state) if saved["optimizer_state"] != state else ("--master", master)
            raise ConfigError(flag, given, f"the checkpoint {chosen[0]} holds {saved['optimizer_state']} optimizer "
                                           f"state with a {saved['master']} master: resume it with "
                                           f"--optimizer-state {saved['optimizer_state']} --master {saved['master']}")

    def restore(self, model, optimizer, scheduler, batches, aliases: dict | None = None) -> int:
        """Load the latest checkpoint that verifies into the run (--resume); returns the step to
        go on from (0: fresh, said so when --resume found nothing). A pipeline run's checkpoint,
        or any checkpoint into pipeline stages (``model`` a ``StagedModel``), loads by
        ``offload.pipeline.checkpoint`` (resharded by layer when the cut differs; ``aliases``:
        a parameter read under another saved name). A checkpoint that does not verify is then
        an error (no fallback to an older one)."""
        if not self.resume_asked:
            return 0
        if not self.found():
            self.say(f"finetune: no checkpoint in {self.directory} yet: starting from step 0")
            return 0
        targets = getattr(model, "targets", None)
        if targets is not None or self.resumes_pipeline():
            from ..pipeline.checkpoint import Target, load_pipeline_checkpoint

            manifest = load_pipeline_checkpoint(targets() if targets is not None else [Target(0, 1, model)],
                                                optimizer, self.directory, aliases=aliases)
            if manifest["resharded"]:
                self.say(f"finetune: {manifest['path']} resharded by layer into this run's layout")
        else:
            from ..checkpoint import resume

            manifest = resume(model, optimizer, self.directory, say=lambda m: self.say(f"finetune: {m}"))
        extra = manifest["extra"]
        start = int(extra["step"])
        scheduler.load_state_dict(extra["scheduler"])
        if "rng" in extra:                  # dropout and other random layers go on as they would have
            set_rng_state(extra["rng"])
        # Older checkpoints have no data position: batch i was the i-th step's.
        rows, seq = batches.rows, batches.seq_len
        changed = batches.restore(extra.get("data", {"next_batch": start, "rows": rows, "seq_len": seq,
                                                     "path": None, "bytes": None}))
        if changed and "data" in extra:
            self.say(f"finetune: note: {changed}")
        self.say(f"finetune: resumed from {manifest['path']} at step {start}")
        self.saved_step = start
        return start

    def due(self, done: int) -> bool:
        """A scheduled checkpoint after step ``done``."""
        return (self.every and done % self.every == 0) or (self.chosen and done == self.steps)

    def save(self, model, optimizer, scheduler, batches, done: int) -> Path | None:
        """Write the checkpoint of step ``done`` (collective under torchrun: every rank writes its
        chunks); nothing when that step is already saved (a preemption right after a save)."""
        if self.saved_step == done:
            return None
        extra = {"step": done, "scheduler": scheduler.state_dict(), "data": batches.state(), "rng": rng_state()}
        if hasattr(model, "targets"):           # pipeline stages
            from ..pipeline.checkpoint import save_pipeline_checkpoint as save
        else:
            from ..checkpoint import save_checkpoint as save
        path = save(model, optimizer, self.directory, step=done, extra=extra, keep=self.keep)
        self.saved_step = done
        return path
