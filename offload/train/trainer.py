"""``Trainer``: one fine-tuning run, from its config to the trained model.

``train()`` reads as the run does::

    prepare()        checks, the model's shape, the data read and tokenized  (seconds; nothing allocated)
    plan()           the planner's verdict and choices (skipped with --no-plan)
    build_model()    the wrapped model: an HF directory streamed in (+ LoRA), or a preset built lazily
    build_optimizer(), build_scheduler()     AdamW; linear warm-up then cosine decay
    checkpoints.restore(...)                 --resume
    for each step:   train_step(batch) -> loss   (compute_loss per micro-batch, backward, step)
                     after_step(step, loss, seconds)   progress, metrics, checkpoints, --output

A subclass changes a run by overriding those methods (``compute_loss`` for a custom loss,
``build_data`` for another data set, ``after_step`` to watch or stop the run); each gets what it
needs from ``self.config`` and the parts built before it. Under torchrun every rank runs the same
``Trainer``; the stretches that must fail together run inside ``ranks.together()``.
"""

from __future__ import annotations

import math
import sys
import time

from ..data import IGNORE
from ..errors import ConfigError, OffloadError
from . import inputs, planning, report
from .checkpointing import CheckpointManager
from .config import TrainConfig
from .ranks import Ranks

# An untied preset resumed from a tied one's checkpoint: its head starts as the embedding was.
TIED_HEAD = {"lm_head.weight": "model.embed_tokens.weight"}


class Trainer:
    """A run of ``config`` on this process's rank (``ranks``: from torchrun's environment)."""

    def __init__(self, config: TrainConfig, ranks: Ranks | None = None):
        self.config = config
        self.ranks = ranks or Ranks()
        self.say = self.ranks.say
        self.checkpoints = CheckpointManager(config, say=self.say)
        self.tty = sys.stderr.isatty()
        # Built by train(), in this order (None until then).
        self.shape = self.described = self.model_info = self.tokenizer = self.data = self.batches = None
        self.engine_config = None
        self.rows = self.seq = 0
        self.predicted: float | None = None
        self.model = self.optimizer = self.scheduler = self.metrics = None
        self.flops_per_token = 0.0
        self.optimizer_step_s = 0.0     # the last step's time inside optimizer.step()
        self.done = 0                   # steps taken (the checkpoint a preemption writes is this step's)
        self.losses: list[float] = []
        self.times: list[float] = []

    # ---- before anything is allocated ----------------------------------------------------------
    def prepare(self) -> None:
        """Check the inputs, read the model's shape and the data: every user mistake ends here,
        before the planner measures the box."""
        import offload
        from ..models.llama import get_preset

        c, ranks = self.config, self.ranks
        with ranks.together():
            inputs.check_config(c, ranks)
            if c.model.model:
                from ..hf import read_checkpoint
                from ..hf.describe import describe

                self.model_info = read_checkpoint(c.model.model)   # every shard's header checked up front
                self.described = describe(c.model.model, inputs.lora_settings(c))
                self.shape = self.described.shape
            else:
                self.shape = get_preset(c.model.preset_name)
            self.seq = min(c.data.seq_len, self.shape.max_seq_len)
            self.rows = c.data.batch_tokens // self.seq          # sequences per step, all ranks together
            if self.rows % self.data_world:
                raise ConfigError("--batch-tokens", c.data.batch_tokens,
                                  f"is global: its {self.rows} sequences of {self.seq} tokens must split evenly "
                                  f"over {self.data_world} ranks")
            inputs.check_paths(c, ranks)
            self.tokenizer, self.data = self.build_data()
            self.checkpoints.check_precision(c.optimizer.state, c.optimizer.master)
            self.engine_config = offload.OffloadConfig(
                dtype=c.model.dtype, device_budget=c.budgets.device_budget, cpu_budget=c.budgets.cpu_budget,
                nvme_paths=c.budgets.nvme_path or None, chunk_size=self.chunk_size() or "auto",
                optimizer_state=c.optimizer.state, master=c.optimizer.master)

    @property
    def data_world(self) -> int:
        """The ranks that split each global batch (all of them; under --pp, those of one stage)."""
        return self.ranks.world

    @property
    def data_rank(self) -> int:
        """This rank's slice of each global batch (``data.shard_rows``)."""
        return self.ranks.rank

    def untied(self) -> bool:
        """Build the preset with an untied LM head: pipeline stages do not sum a tied weight's two
        gradients yet, so --pp runs, and resumes of their checkpoints (and of what those wrote),
        train it untied."""
        return self.config.parallel.pp > 1 or self.checkpoints.resumes_untied_head()

    def chunk_size(self) -> int | None:
        """--chunk-size, else the checkpoint's when resuming (its layout is the one to rebuild),
        else None (the engine's choice from the budgets)."""
        given, saved = self.config.budgets.chunk_size, self.checkpoints.saved_chunk_size()
        if saved is not None and given is not None and given != saved:
            raise ConfigError("--chunk-size", given, f"differs from the checkpoint's ({saved} elements) in "
                                                     f"{self.checkpoints.directory}")
        return given if given is not None else saved

    def build_data(self):
        """(tokenizer or None for byte ids, the tokenized data set ``offload.data.Dataset``)."""
        return inputs.load_dataset(self.config, self.shape.vocab_size, self.seq)

    def describe_run(self) -> None:
        """The start-up log: what is trained, on which tokens, where checkpoints go."""
        c, ranks = self.config, self.ranks
        note = inputs.cpu_without_fast_bf16(c.model.dtype)
        if note:
            self.say(f"finetune: note: {note}")
        if self.described is not None:
            name, n_params = self.described.name, self.described.total
        else:
            from ..models.llama import param_count

            name, n_params = c.run_name, param_count(self.shape)
        trainable = (f" ({self.described.trainable / 1e6:,.3f} M trainable)"
                     if self.described and c.model.lora_rank is not None else "")
        on_ranks = f" over {ranks.world} ranks ({self.rows // ranks.world} each)" if ranks.many else ""
        if self.data_world != ranks.world:      # pipeline stages: the next line says how the ranks split
            on_ranks = f" over {ranks.world} ranks"
        self.say(f"finetune: {name}, {n_params / 1e6:,.1f} M parameters{trainable}, {c.model.dtype}, "
                 f"{self.rows} x {self.seq} tokens per step{on_ranks}, {c.optimizer.steps} steps")
        self.say(f"finetune: {inputs.tokens_line(c, self.tokenizer)}; {self.checkpoints.where()}")
        self.say(f"finetune: {inputs.data_line(c, self.data)}")
        if getattr(self.data, "skipped", 0):
            self.say(f"finetune: note: {self.data.skipped} of {self.data.size + self.data.skipped} examples of "
                     f"{self.data.path} have no token with loss within --seq-len {self.seq}: skipped")

    def plan(self) -> bool:
        """The planner's verdict (rank 0 plans, every rank follows); False: it does not fit."""
        c, ranks = self.config, self.ranks
        decided = None
        with ranks.together():
            if ranks.lead:
                decided = planning.decide(c, self.shape, self.engine_config, self.described, ranks)
        decided = ranks.broadcast(decided)
        self.say(decided["text"])
        if not decided["fits"]:
            self.say(f"finetune: refused by the planner: {decided['reason']}")
            return False
        self.predicted = decided["predicted"]
        chosen = decided["policy"]      # the plan's activation placement, and the device budget it assumed
        self.engine_config = self.engine_config.replace(
            activation_offload=chosen["activation_offload"],
            device_budget=chosen["device_budget"] or self.engine_config.device_budget,
            gradient_accumulation_steps=chosen["micro_batches"])
        if ranks.many:                  # the plan's budgets, the same bytes on every rank
            self.engine_config = self.engine_config.replace(device_budget=decided["budgets"][0],
                                                            cpu_budget=decided["budgets"][1])
        return True

    # ---- the parts of the run --------------------------------------------------------------------
    def build_model(self):
        """The wrapped model: a checkpoint streamed in (+ LoRA adapters), or a preset built lazily."""
        import offload

        c = self.config
        if c.model.model:
            from ..hf import load_pretrained
            from ..hf.load import enable_checkpointing
            from ..hf.lora import apply_lora

            lora = inputs.lora_settings(c)

            def adapt(model):
                model.config.use_cache = False   # training only; --output writes the source's value back
                if not c.model.no_checkpointing:
                    enable_checkpointing(model)
                return apply_lora(model, lora) if lora is not None else model

            return load_pretrained(c.model.model, self.engine_config, adapt=adapt)
        from ..models.llama import LlamaForCausalLM

        shape = self.shape.replace(tie_embeddings=False) if self.untied() else self.shape
        with offload.lazy_init(self.engine_config):
            model = LlamaForCausalLM(shape)
        model.gradient_checkpointing = not c.model.no_checkpointing
        return offload.wrap(model)

    def build_optimizer(self):
        import offload

        o = self.config.optimizer
        return offload.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=o.lr,
                             weight_decay=o.weight_decay, betas=(0.9, 0.95), max_grad_norm=o.max_grad_norm)

    def lr_factor(self, step: int) -> float:
        """The learning rate of ``step`` over --lr: linear warm-up, then cosine decay to 0.1."""
        o = self.config.optimizer
        if step < o.warmup:
            return (step + 1) / o.warmup
        progress = (step - o.warmup) / max(1, o.steps - o.warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))

    def build_scheduler(self):
        import torch

        return torch.optim.lr_scheduler.LambdaLR(self.optimizer, self.lr_factor)

    def build_metrics(self):
        """Where each step's figures go (rank 0 only): --json-log, --tensorboard, and at the end
        the PNG beside the checkpoints of a --checkpoint-dir."""
        from .metrics import Metrics

        lg = self.config.logging
        if not self.ranks.lead:
            return Metrics()
        plots = self.checkpoints.directory if self.checkpoints.chosen else None
        return Metrics(json_log=lg.json_log, tensorboard=lg.tensorboard, plot_dir=plots, resumed_at=self.done)

    # ---- a step ----------------------------------------------------------------------------------
    def compute_loss(self, input_ids, labels):
        """The loss of one micro-batch (a scalar tensor to backpropagate)."""
        return self.model(input_ids=input_ids, labels=labels).loss

    def train_step(self, batch) -> float:
        """One optimizer step over ``batch`` (input ids, labels), split into the micro-batches of
        gradient accumulation; returns the loss, the mean over the ranks. The step's loss is the
        mean over all its target tokens (as one pass over the global batch computes it): each
        micro-batch's mean is weighted by its share of them, so examples of unequal length count
        alike however the step is split over micro-batches and ranks."""
        device = self.model.offload_engine.device
        ids, labels = (t.to(device) for t in batch)
        k = self.engine_config.gradient_accumulation_steps
        parts = list(zip(ids.chunk(k), labels.chunk(k)))
        counts = [int((part_labels[:, 1:] != IGNORE).sum()) for _, part_labels in parts]   # targets: shifted labels
        total = round(self.ranks.mean(float(sum(counts)), device) * self.ranks.world)
        # engine gradients are the ranks' mean: a micro-batch's weight is its targets' share times the world
        weights = [1 / k if total in (0, n * k * self.ranks.world) else n * self.ranks.world / total for n in counts]
        value = 0.0
        for (part_ids, part_labels), w in zip(parts, weights):
            loss = self.compute_loss(part_ids, part_labels)
            loss = loss / k if w == 1 / k else loss * w
            loss.backward()
            value += loss.item()
        t0 = time.perf_counter()
        self.optimizer.step()
        self.optimizer_step_s = time.perf_counter() - t0
        self.optimizer.zero_grad()
        self.scheduler.step()
        # every rank logs (and judges) the same loss: the mean of the ranks' slices of the batch
        return self.ranks.mean(value, self.model.offload_engine.device)

    def after_step(self, done: int, loss: float, seconds: float) -> None:
        """After step ``done`` (1-based): progress, metrics, scheduled checkpoints and --output."""
        c = self.config
        self.losses.append(loss)
        self.times.append(seconds)
        tokens = self.rows * self.seq
        tok_s = tokens / seconds
        tflops = self.flops_per_token * tokens / seconds / 1e12
        recent = self.times[-10:]
        if self.ranks.lead:
            report.progress(done, c.optimizer.steps, loss, tok_s, tflops,
                            (c.optimizer.steps - done) * sum(recent) / len(recent), self.tty)
        self.metrics.log(done, self.step_metrics(loss, seconds, tok_s, tflops))
        if not math.isfinite(loss) and c.model.dtype != "fp16":
            raise OffloadError(f"the loss became {loss} at step {done}")
        self.done = done
        if self.checkpoints.due(done):
            self.save()
        o = c.output
        if o.output and (done == c.optimizer.steps or (o.save_every and done % o.save_every == 0)):
            self.write_output()

    def step_metrics(self, loss: float, seconds: float, tok_s: float, tflops: float) -> dict:
        """The figures of the step just taken (metrics.py's keys): the run's, and the engine's
        (bytes moved per tier and direction, prefetch hits, the step split: ``step_split.py``)."""
        from .step_split import step_values

        return {"loss": loss, "lr": self.scheduler.get_last_lr()[0], "tokens_per_s": tok_s, "tflops": tflops,
                "step_s": seconds, "predicted_step_s": self.predicted, "peak_rss_bytes": report.peak_rss(),
                **step_values(self.model.offload_stats(), step_s=seconds, optimizer_step_s=self.optimizer_step_s)}

    def save(self) -> None:
        """A checkpoint of the last step taken (collective under torchrun)."""
        path = self.checkpoints.save(self.model, self.optimizer, self.scheduler, self.batches, self.done)
        if path is not None:
            if self.tty:
                self.say()
            self.say(f"finetune: checkpoint {path}")

    def write_output(self) -> None:
        """--output (collective under torchrun: every rank gathers its chunks). The source's
        ``use_cache`` is written back, not the training run's."""
        from ..hf.output import write_output

        c, model = self.config, self.model
        # an HF model's config (a preset's is the engine's own, with no use_cache)
        config = getattr(model, "config", None) if self.model_info is not None else None
        training = getattr(config, "use_cache", None)
        if config is not None:
            config.use_cache = getattr(self.model_info.hf_config, "use_cache", training)
        try:
            path = write_output(model, c.output.output, merge=c.output.merge,
                                max_shard_size=c.output.max_shard_size, dtype=c.output.output_dtype,
                                tokenizer=c.model.tokenizer)
        finally:
            if config is not None:
                config.use_cache = training
        if self.tty:
            self.say()
        what = "merged weights" if c.output.merge else "the adapter" if c.model.lora_rank else "the model"
        self.say(f"finetune: wrote {what} to {path}")

    # ---- the run ---------------------------------------------------------------------------------
    def train(self) -> int:
        """The whole run; returns the exit status (0, or 1 when the planner refuses it)."""
        import torch

        from ..data import Batches
        from ..models.llama import flops_per_token
        from ..preempt import Preemption

        c, ranks = self.config, self.ranks
        self.prepare()
        self.describe_run()
        if not c.budgets.no_plan:
            if not self.plan():
                return 1
        elif c.parallel.micro_batches:
            self.engine_config = self.engine_config.replace(gradient_accumulation_steps=c.parallel.micro_batches)
        with ranks.together():
            mine = self.rows // self.data_world
            if mine % self.engine_config.gradient_accumulation_steps:
                raise ConfigError("--micro-batches", self.engine_config.gradient_accumulation_steps,
                                  f"must divide the step's {self.rows} sequences" if not ranks.many else
                                  f"must divide each rank's {mine} sequences")
            if c.budgets.dry_run:
                return 0
            self.engine_config = planning.shared_budgets(self.engine_config, ranks)
            self.batches = Batches(self.data, self.rows, self.seq, rank=self.data_rank, world=self.data_world)
        torch.manual_seed(c.data.seed)
        report.reset_peak_rss()
        base_rss = report.current_rss()
        built = time.perf_counter()
        self.model = self.build_model()
        try:
            self.optimizer = self.build_optimizer()
            self.scheduler = self.build_scheduler()
            with ranks.together():      # load_checkpoint fails alike on every rank: rank 0 says it once
                start = self.done = self.checkpoints.restore(self.model, self.optimizer, self.scheduler, self.batches,
                                                             aliases=TIED_HEAD if self.untied() else None)
            self.say(f"finetune: model ready in {time.perf_counter() - built:.1f} s; "
                     f"{self.lead_module().offload_engine.chunks.layout}")
            self.flops_per_token = flops_per_token(self.shape, self.seq)
            self.metrics = self.build_metrics()
            t_start = time.perf_counter()
            self.model.train()
            # SIGTERM/SIGINT: the step in flight finishes, then save + exit 143/130. torchrun passes
            # a signal on to every rank, so all of them save together.
            preempt = Preemption(self.save, name="finetune", **({} if ranks.lead else {"notify": None})).install()
            try:
                for step in range(start, c.optimizer.steps):
                    t0 = time.perf_counter()
                    loss = self.train_step(self.batches.next())
                    self.after_step(step + 1, loss, time.perf_counter() - t0)
                    preempt.after_step()
                if self.tty:
                    self.say()
                if ranks.lead:
                    report.summary(self.lead_module(), self.losses, self.times, self.predicted, t_start,
                                   self.rows * self.seq, base_rss, ranks)
            finally:
                preempt.uninstall()
                self.metrics.close()
        finally:
            self.close_model()
        return 0

    def lead_module(self):
        """The wrapped module rank 0 reports the layout and memory of."""
        return self.model

    def close_model(self) -> None:
        self.model.offload_engine.close(keep_files=self.config.budgets.keep_nvme)
