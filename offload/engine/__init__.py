"""The engine: one wrapped model's training step, as a few components (``engine.py`` builds them).

The components, and who holds what:

- ``ChunkStore`` (``offload.chunks``): every chunk of every kind — ``param``, ``master``, ``grad``,
  ``exp_avg``, ``exp_avg_sq`` — on the device, pinned CPU memory or NVMe.
- ``ChunkedParams`` (``params.py``): where each parameter lives in the chunks; fill and values.
- ``ParamViews`` and ``DevicePins`` (``pins.py``): parameters as views into their chunk's device
  copy, pins around its use, and the trace prefetcher (``offload.scheduler``) fed by each pin.
- ``StepProgress`` (``progress.py``): where the step is — the accumulation window, the backward
  running, the parked chunks — read by the components below.
- ``ChunkAdam`` and ``LossScaler`` (``stepper.py``): the CPU Adam worker over whole chunks.
- ``UpdateQueue`` and ``ReadyGradients`` (``updates.py``): when each chunk's update runs.
- ``GradCapture`` (``gradients.py``): autograd's gradients into gradient chunks.
- ``GroupGather`` and ``GradReducer`` (``offload.distributed``), under several ranks.
- ``SavedParameterViews`` (``saved.py``) with the ``ActivationStore`` (``activation_hooks.py``):
  autograd's saved tensors, by reference into chunks or parked off the device.
- ``StepPipeline`` and ``Parking`` (``pipeline.py``): each backward's optimizer side, ``step()``.
- ``ModuleHooks`` (``module_hooks.py``): the hooks on the model, which drive all of the above.

A step through them reads like the paper, ``prefetch(j + 1); compute(j); evict(j - 1)``:

1. **Forward.** The root module's pre-hook begins an iteration: the last one's chunk order
   becomes the trace. Before each module runs, its chunks are pinned on the device — first
   waiting for any update of theirs still queued from the last step (``UpdateQueue.wait``) and,
   under several ranks, all-gathering them from the ranks' pieces. Each first pin is an access in the
   trace: the prefetcher names the chunks that come next and the store starts fetching them,
   evicting by next use (``DevicePins``). After the module, its pins go; its parameters keep
   viewing the device copy until the store reuses that buffer (then ``ParamViews`` detaches them).
   Saved tensors that live in parameter chunks are kept as references; checkpoint boundaries may
   be parked in host memory or on NVMe.
2. **Backward.** The outputs were wrapped so that each module's backward first pins its chunks
   again. The first of these decides how this backward's updates go (``StepPipeline.begin_backward``):
   *eager* when nothing needs every gradient first, and which updates to park. As autograd
   accumulates each parameter's gradient, ``GradCapture`` copies it into the chunk's gradient
   buffer on the device; a chunk whose gradients are complete (and reduce-scattered into the
   ranks' pieces, under several ranks) goes to ``ReadyGradients``: its squared norm is kept, or, eager, its update is
   queued on the CPU Adam as soon as no module pins the chunk — while backward goes on with earlier
   layers. A module's pins go once all its parameters have their gradients.
3. **End of backward.** An autograd callback completes the remaining gradient chunks, lets go of
   every pin, and queues the updates still waiting and the parked ones in the order the next
   forward uses the chunks (``StepPipeline.end_backward``).
4. **``optimizer.step()``.** If every update is queued already, it returns: those still running
   finish while the next forward runs, each before that forward uses its chunk. Otherwise
   (clipping, fp16 overflow checks, accumulation) it computes the global norm from the kept
   squares and updates chunk by chunk, fetching the next chunks' state ahead. Either way the step's
   statistics are taken (``StepStats``) and the window's gradients are consumed.

Both orders of update give the same numbers.

A pipeline schedule (``offload.pipeline``) runs several forwards before their backwards, and
may split a backward in two (zero-bubble): ``engine.input_pass()`` around the input gradients
(``autograd.grad`` by the stage's inputs: no parameter gets a gradient, so it is not one of the
window's micro-batches) and ``engine.weight_pass()`` around the weight gradients (torch assigns
them to ``.grad`` with no accumulation hook: they are captured when the pass ends, which ends
the backward). The engine's data-parallel group is the default group or the one given to
``offload.wrap(..., process_group=)`` (a stage's; a group of one rank is a single process).
"""

from .engine import OffloadEngine

__all__ = ["OffloadEngine"]
