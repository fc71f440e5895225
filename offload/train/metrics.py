"""A training run's numbers, written where people look at them: a JSON line per step, TensorBoard
scalars, and at the end a PNG of the loss curve and of where each step's time went.

``Metrics(json_log=..., tensorboard=..., plot_dir=...)`` takes any of the three (``None`` turns one
off); ``log(step, values)`` once per optimizer step; ``close()`` when the run ends, on every path
(it is idempotent). The keys a trainer passes, and where they go in TensorBoard:

==================  ==========================  ===========================================
key                 TensorBoard tag             unit
==================  ==========================  ===========================================
loss                train/loss
lr                  train/lr
loss_scale          train/loss_scale            fp16's dynamic loss scale
tokens_per_s        perf/tokens_per_s           tokens per second
tflops              perf/tflops                 1e12 floating-point operations per second
step_s              time/step_s                 seconds, the whole step as measured
predicted_step_s    time/predicted_step_s       seconds, the planner's prediction
compute_s           time/compute_s              seconds of the step computing
wait_s              time/wait_s                 seconds of the step waiting for chunks
optimizer_s         time/optimizer_s            seconds of the step inside optimizer.step()
activation_wait_s   time/activation_wait_s      seconds of the step waiting for activations
adam_s              time/adam_s                 seconds of CPU Adam (beside backward or not)
optimizer_wait_s    time/optimizer_wait_s       seconds Adam waited for its state
prefetch_hit_rate   prefetch/hit_rate           fraction of chunk fetches already under way
chunk_fetches       prefetch/chunk_fetches      chunks compute asked for
moved/<a>-><b>      moved/<a>_to_<b>            bytes moved from tier <a> to tier <b>
collective_bytes    moved/collectives           bytes this rank sent to the others
peak_rss_bytes      memory/peak_rss_bytes       bytes
anything else       other/<key>
==================  ==========================  ===========================================

The engine's keys come from ``step_values`` (``offload/train/step_split.py``, which says what
each part of the step covers); the others from the trainer.

TensorBoard tags keep to letters, digits, ``_ - . /`` (what TensorFlow's summary ``_clean_tag`` lets
through; torch's ``SummaryWriter`` checks nothing), so ``->`` becomes ``_to_`` and any other character ``_``.
The JSON lines keep every key as given (``{"step": N, **values}``, appended and flushed each step:
``scripts/finetune_100b.py``'s ``loss, tokens_per_s, tflops, step_s, peak_rss_bytes`` among them).

Beside the PNG, ``training-history.jsonl`` keeps what it draws, step by step: a run resumed from a
checkpoint (``resumed_at``) draws the steps before it too, and those a preempted launch took past it
are dropped, as they are in TensorBoard (``purge_step``).

The metrics are a record of the run, never a reason to lose it: a missing ``tensorboard`` package
or an unwritable destination (the PNG's directory included) is an error at construction, before
any training; a missing matplotlib a one-line warning (the run goes on without the PNG); a write
that fails once training is under way (a full disk, the PNG at the end) a one-line warning that
turns that destination off.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import tempfile
from pathlib import Path

from offload.errors import ConfigError, OffloadError, UnsupportedError

logger = logging.getLogger("offload.train")

PNG_NAME = "training.png"
HISTORY_NAME = "training-history.jsonl"     # beside the PNG: what it draws, so a resumed run draws it all
TAGS = {
    "loss": "train/loss",
    "lr": "train/lr",
    "tokens_per_s": "perf/tokens_per_s",
    "tflops": "perf/tflops",
    "step_s": "time/step_s",
    "predicted_step_s": "time/predicted_step_s",
    "compute_s": "time/compute_s",
    "wait_s": "time/wait_s",
    "optimizer_s": "time/optimizer_s",
    "activation_wait_s": "time/activation_wait_s",
    "adam_s": "time/adam_s",
    "optimizer_wait_s": "time/optimizer_wait_s",
    "prefetch_hit_rate": "prefetch/hit_rate",
    "chunk_fetches": "prefetch/chunk_fetches",
    "collective_bytes": "moved/collectives",
    "loss_scale": "train/loss_scale",
    "peak_rss_bytes": "memory/peak_rss_bytes",
}
# What the PNG draws; only these are kept in memory over the run.
PLOTTED = ("loss", "step_s", "compute_s", "wait_s", "optimizer_s", "predicted_step_s")
_NOT_IN_A_TAG = re.compile(r"[^\w./-]")
# Bars stay readable up to a few hundred steps; past that a filled area draws faster and looks the same.
_MAX_BARS = 400
OTHER = "other (rest of the step)"


def tensorboard_tag(key: str) -> str:
    """The TensorBoard tag ``key`` is written under (the table in the module docstring)."""
    if key in TAGS:
        return TAGS[key]
    group, name = ("moved", key[len("moved/"):]) if key.startswith("moved/") else ("other", key)
    return f"{group}/{_NOT_IN_A_TAG.sub('_', name.replace('->', '_to_'))}"


def _keep_steps_up_to(path: Path, step: int) -> list[dict]:
    """A resumed run's JSON-lines file (the log, the plot's history) loses the lines of the steps it
    redoes (logged past its checkpoint by a launch killed before it could save); lines that are not
    a step's JSON are kept. Returns the step lines kept, parsed."""
    if not path.is_file():
        return []
    lines = path.read_text(errors="replace").splitlines(keepends=True)
    kept, rows = [], []
    for line in lines:
        try:
            row = json.loads(line)
            redone = int(row["step"]) > step
        except (ValueError, TypeError, KeyError):
            kept.append(line)
            continue
        if not redone:
            kept.append(line)
            rows.append(row)
    if len(kept) != len(lines):
        path.write_text("".join(kept))
    return rows


class Metrics:
    """The sinks a run asked for. ``json_log``: a file, one JSON object per step, appended (a
    resumed run first drops the lines past its checkpoint's step);
    ``tensorboard``: a directory of event files; ``plot_dir``: where ``close()`` writes
    ``training.png``. Each may be ``None``."""

    def __init__(self, *, json_log: str | os.PathLike | None = None, tensorboard: str | os.PathLike | None = None,
                 plot_dir: str | os.PathLike | None = None, resumed_at: int = 0):
        """``resumed_at``: the step a resumed run starts after (its checkpoint's). The PNG then draws
        the earlier steps too, from ``training-history.jsonl`` in ``plot_dir``, and TensorBoard drops
        the events a preempted run logged past that step (they are redone)."""
        self._closed = False
        self._resumed_at = resumed_at
        self._history_file = None
        self._history: dict[str, list[tuple[int, float]]] | None = None
        self._json = self._tensorboard = None
        self._json_path = json_log
        self._tensorboard_dir = tensorboard
        self._plot_dir = Path(plot_dir) if plot_dir is not None else None
        # The writer that can fail for want of a package comes first: nothing is created before it.
        if tensorboard is not None:
            self._tensorboard = _open_tensorboard(tensorboard, resumed_at)
        if self._plot_dir is not None:
            if _has_matplotlib():
                self._check_plot_dir()
                self._history = self._earlier_history()
            else:
                logger.warning("no %s: matplotlib is not installed (pip install 'offload[plot]'); the run goes on "
                               "without it", self._plot_dir / PNG_NAME)
        if json_log is not None:
            try:
                Path(json_log).parent.mkdir(parents=True, exist_ok=True)
                if resumed_at:
                    _keep_steps_up_to(Path(json_log), resumed_at)
                self._json = open(json_log, "a")
            except OSError as e:
                self._close_tensorboard()
                raise ConfigError("--json-log", json_log, f"cannot write it: {e.strerror or e}") from None

    def log(self, step: int, values: dict[str, float]) -> None:
        """Record one step: ``values`` by key (module docstring); ``None`` means "not measured this step"
        (written as ``null``, left out of TensorBoard and the plot)."""
        if self._closed:
            raise OffloadError(f"Metrics.log(step={step}) after close()")
        if "step" in values:
            raise OffloadError(f"Metrics.log(step={step}): 'step' is the first argument, not a value")
        values = {k: _number(k, v) for k, v in values.items()}
        if self._json is not None:
            try:
                self._json.write(json.dumps({"step": step, **values}) + "\n")
                self._json.flush()
            except OSError as e:
                self._json = self._give_up(self._json, f"the JSON log {self._json_path}", e)
        if self._tensorboard is not None:
            try:
                for key, v in values.items():
                    if v is not None:
                        self._tensorboard.add_scalar(tensorboard_tag(key), v, global_step=step)
                # a killed job keeps every step it logged (the writer would otherwise wait up to 2 min)
                self._tensorboard.flush()
            except Exception as e:  # noqa: BLE001 - whatever the event writer raises, the run goes on
                self._tensorboard = self._give_up(self._tensorboard, f"TensorBoard events in "
                                                  f"{self._tensorboard_dir}", e)
        if self._history is not None:
            kept = {key: float(values[key]) for key in PLOTTED if values.get(key) is not None}
            for key, v in kept.items():
                self._history[key].append((step, v))
            if self._history_file is not None:
                try:
                    self._history_file.write(json.dumps({"step": step, **kept}) + "\n")
                    self._history_file.flush()
                except OSError as e:
                    self._history_file = self._give_up(self._history_file, f"the plot's history "
                                                       f"{self._plot_dir / HISTORY_NAME}", e)

    def close(self) -> None:
        """Flush and close every destination and write the PNG; safe to call again (then it does
        nothing). Failures here are warnings: training has finished and its results are kept."""
        if self._closed:
            return
        self._closed = True
        if self._json is not None:
            try:
                self._json.close()
            except OSError as e:
                logger.warning("the JSON log %s: could not flush it: %s", self._json_path, e)
            self._json = None
        self._close_tensorboard()
        if self._history_file is not None:
            try:
                self._history_file.close()
            except OSError:
                pass        # the PNG below still draws what is in memory
            self._history_file = None
        if self._history is not None:
            try:
                self._write_png()
            except Exception as e:  # noqa: BLE001 - a plot is never worth the run's results
                logger.warning("could not write %s: %s: %s", self._plot_dir / PNG_NAME, type(e).__name__, e)
            self._history = None

    # ---- internals --------------------------------------------------------
    def _close_tensorboard(self) -> None:
        if self._tensorboard is None:
            return
        try:
            self._tensorboard.close()
        except Exception as e:  # noqa: BLE001
            logger.warning("TensorBoard events in %s: could not flush them: %s: %s", self._tensorboard_dir,
                        type(e).__name__, e)
        self._tensorboard = None

    def _check_plot_dir(self) -> None:
        """Where the PNG goes must take a file now: a run of hours must not learn it at its end."""
        try:
            self._plot_dir.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=self._plot_dir):
                pass
        except OSError as e:
            self._close_tensorboard()
            raise ConfigError("plot_dir", str(self._plot_dir),
                              f"cannot write {PNG_NAME} there: {e.strerror or e}") from None

    def _earlier_history(self) -> dict[str, list[tuple[int, float]]]:
        """The plotted values of steps up to ``resumed_at`` that an earlier launch kept in the history
        file (none for a fresh run, whose file starts empty); the file is then appended to."""
        history: dict[str, list[tuple[int, float]]] = {k: [] for k in PLOTTED}
        path = self._plot_dir / HISTORY_NAME
        rows = _keep_steps_up_to(path, self._resumed_at) if self._resumed_at > 0 else []
        for row in rows:
            for key in PLOTTED:
                if isinstance(row.get(key), (int, float)):
                    history[key].append((int(row["step"]), float(row[key])))
        try:
            self._history_file = open(path, "a" if self._resumed_at > 0 else "w")
        except OSError as e:
            logger.warning("%s: %s; the plot draws this launch's steps only", path, e.strerror or e)
            self._history_file = None
        return history

    @staticmethod
    def _give_up(sink, what: str, e: Exception):
        logger.warning("%s: %s: %s; no more of them this run", what, type(e).__name__, e)
        try:
            sink.close()
        except Exception:  # noqa: BLE001 - already failing; the first error is the one reported
            pass
        return None

    def _write_png(self) -> None:
        h = self._history
        if not any(h[k] for k in PLOTTED):
            logger.warning("no %s: no step logged a loss or a step time", self._plot_dir / PNG_NAME)
            return
        self._plot_dir.mkdir(parents=True, exist_ok=True)
        path = self._plot_dir / PNG_NAME
        tmp = path.with_name(f".{PNG_NAME}.tmp")
        try:
            _draw(h).savefig(tmp, format="png", dpi=100)
            os.replace(tmp, path)          # a failed write leaves no half PNG behind
        finally:
            tmp.unlink(missing_ok=True)


def _open_tensorboard(directory: str, resumed_at: int = 0):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise UnsupportedError("--tensorboard needs the tensorboard package, which is not installed: "
                               "pip install 'offload[tensorboard]' (or pip install tensorboard)") from None
    try:
        # purge_step: TensorBoard hides what a preempted run logged after the step resumed from
        return SummaryWriter(log_dir=str(directory), purge_step=resumed_at + 1 if resumed_at else None)
    except OSError as e:
        raise ConfigError("--tensorboard", directory, f"cannot write event files there: {e.strerror or e}") from None


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _number(key: str, v):
    if v is None or isinstance(v, (int, float)):
        return v
    if hasattr(v, "item"):              # a numpy scalar or a one-element tensor
        return v.item()
    raise OffloadError(f"Metrics.log: {key}={v!r} is not a number")


def _draw(h: dict[str, list[tuple[int, float]]]):
    """The figure: the loss above, each step's time split below (compute / waiting for chunks /
    optimizer, stacked; the rest of a measured step as "other"), the planner's prediction as a line."""
    # The object-oriented API, not pyplot: no global backend switched, nothing left open.
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 7), layout="constrained")
    top, bottom = fig.subplots(2, 1, sharex=True)
    if h["loss"]:
        steps, loss = zip(*h["loss"])
        top.plot(steps, loss, marker="o" if len(steps) <= 50 else None, markersize=3, color="tab:blue")
    top.set_ylabel("loss")
    top.set_title("training loss")
    top.grid(True, alpha=0.3)

    steps, parts = time_split(h)
    if steps:
        colors = {"compute": "tab:green", "waiting for chunks": "tab:red", "optimizer": "tab:orange",
                  OTHER: "tab:gray"}
        if len(steps) <= _MAX_BARS:
            base = [0.0] * len(steps)
            for name, ys in parts.items():
                bottom.bar(steps, ys, bottom=base, width=1.0, align="center", color=colors[name], label=name)
                base = [b + y for b, y in zip(base, ys)]
        else:
            bottom.stackplot(steps, *parts.values(), labels=list(parts), colors=[colors[n] for n in parts])
    else:
        bottom.text(0.5, 0.5, "no step times were logged", transform=bottom.transAxes, ha="center", va="center")
    if h["predicted_step_s"]:
        ps, pv = zip(*h["predicted_step_s"])
        bottom.plot(ps, pv, color="black", linestyle="--", linewidth=1.5, label="planner's prediction")
    bottom.set_xlabel("step")
    bottom.set_ylabel("seconds")
    bottom.set_title("step time")
    bottom.grid(True, alpha=0.3, axis="y")
    bottom.xaxis.get_major_locator().set_params(integer=True)
    if bottom.get_legend_handles_labels()[0]:
        # beside the axes, never over the bars; the stack's order top down
        handles, labels = bottom.get_legend_handles_labels()
        bottom.legend(handles[::-1], labels[::-1], loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    return fig


def time_split(h: dict[str, list[tuple[int, float]]]) -> tuple[list[int], dict[str, list[float]]]:
    """Per step: compute, waiting, optimizer and the unaccounted rest of ``step_s``, in seconds.
    Without ``compute_s``, compute is what is left of ``step_s`` once waiting and optimizer are taken."""
    by = {k: dict(h[k]) for k in ("step_s", "compute_s", "wait_s", "optimizer_s")}
    steps = sorted(set().union(*(d.keys() for d in by.values())))
    parts = {"compute": [], "waiting for chunks": [], "optimizer": [], OTHER: []}
    for s in steps:
        wait, opt = by["wait_s"].get(s, 0.0), by["optimizer_s"].get(s, 0.0)
        total = by["step_s"].get(s)
        compute = by["compute_s"].get(s)
        if compute is None:
            compute = max(0.0, total - wait - opt) if total is not None else 0.0
        rest = max(0.0, total - compute - wait - opt) if total is not None else 0.0
        for name, y in zip(parts, (compute, wait, opt, rest)):
            parts[name].append(y if math.isfinite(y) else 0.0)
    # "other" only where it says something: more than 1 % of the longest step
    if max(parts[OTHER], default=0.0) <= 0.01 * max((sum(p) for p in zip(*parts.values())), default=0.0):
        del parts[OTHER]
    return steps, parts
