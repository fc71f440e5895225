"""One optimizer step's engine statistics (``model.offload_stats()``) as the values a run logs.

``step_values(model.offload_stats(), step_s=..., optimizer_step_s=...)`` after each optimizer step
gives ``Metrics.log`` (``offload/train/metrics.py``) its engine keys:

- ``moved/<src>-><dst>``: bytes the chunk store moved between tiers (``device``, ``cpu``, ``nvme``)
  in that direction; ``moved/activations/<src>-><dst>`` the same for parked activations;
  ``collective_bytes`` what this rank sent to the others (several ranks only).
- ``prefetch_hit_rate``: the fraction of chunk fetches already under way when compute asked for
  them (``None`` when the step fetched nothing); ``chunk_fetches``: how many.
- the split of ``step_s`` (the step as the caller timed it, seconds), each part on the thread
  that runs the model, so the three add up to the step:
  ``wait_s`` compute blocked on chunks: being fetched, or still being updated from the last step;
  ``optimizer_s`` the time inside ``optimizer.step()`` (as the caller timed it: the optimizer's
  share the compute could not hide); ``compute_s`` the rest of the step: forward, backward, hooks,
  data. Time blocked on parked activations is its own ``activation_wait_s``, not in those three.
- ``adam_s``: seconds of CPU Adam (the engine's own ``optimizer_s``; in the worker thread it runs
  beside backward, so it is not a part of the split); ``optimizer_wait_s``: seconds Adam waited
  for its state to arrive from NVMe; ``loss_scale`` under fp16.

In a loop (the trainer's shape)::

    t0 = time.perf_counter()
    model(ids, labels=labels).loss.backward()
    t1 = time.perf_counter()
    optimizer.step()
    t2 = time.perf_counter()
    optimizer.zero_grad()
    step_s = time.perf_counter() - t0
    metrics.log(step, {"loss": ..., "step_s": step_s,
                       **step_values(model.offload_stats(), step_s=step_s, optimizer_step_s=t2 - t1)})

The engine resets its counters at every ``step()``, so one ``offload_stats()`` is one step's: no
differences between snapshots are needed. Its window runs from one ``optimizer.step()`` to the
next, which a caller's step (data, forward, backward, ``optimizer.step()``) covers.
"""

from __future__ import annotations

from typing import Mapping

from offload.errors import OffloadError


def step_values(stats: Mapping, *, step_s: float, optimizer_step_s: float) -> dict[str, float | int | None]:
    """The values to log for the step ``stats`` (one ``model.offload_stats()``) reports.
    ``step_s``: the whole step, seconds; ``optimizer_step_s``: seconds inside ``optimizer.step()``."""
    if "wait_s" not in stats:
        raise OffloadError("step_values: the statistics hold no finished optimizer step "
                           "(call it after optimizer.step())")
    for name, v in (("step_s", step_s), ("optimizer_step_s", optimizer_step_s)):
        if not v >= 0:
            raise OffloadError(f"step_values: {name}={v!r} is not a duration in seconds")
    values: dict[str, float | int | None] = {
        f"moved/{direction}": int(n) for direction, n in stats.get("moved_bytes", {}).items()}
    activations = stats.get("activations")
    if activations is not None:
        values.update({f"moved/activations/{d}": int(n) for d, n in activations.get("bytes", {}).items() if n})
    if stats.get("collectives") is not None:
        values["collective_bytes"] = int(stats["collectives"].get("sent_bytes", 0))
    values["prefetch_hit_rate"] = stats.get("prefetch_hit_rate")
    values["chunk_fetches"] = int(stats.get("chunk_fetches", 0))

    wait = float(stats["wait_s"])
    activation_wait = float(activations.get("wait_s", 0.0)) if activations is not None else 0.0
    values["wait_s"] = wait
    values["optimizer_s"] = float(optimizer_step_s)
    # The rest of the step; a clock read in two places can leave it a hair below zero.
    values["compute_s"] = max(0.0, step_s - wait - optimizer_step_s - activation_wait)
    if activations is not None:
        values["activation_wait_s"] = activation_wait
    values["adam_s"] = float(stats.get("optimizer_s", 0.0))
    values["optimizer_wait_s"] = float(stats.get("optimizer_wait_s", 0.0))
    if stats.get("loss_scale") is not None:
        values["loss_scale"] = float(stats["loss_scale"])
    return values
