"""The planner: where a model's state goes on a box, what moves per step, how long a step takes, and
which way to a batch (activations kept, parked, or accumulated over micro-batches) is fastest.

``plan(model, Hardware(...), Policy(...))`` is pure arithmetic over figures someone measured or
stated: nothing in it measures, allocates or touches a device. It models what ``OffloadEngine``
does, for one rank under data parallelism (``Policy.world`` ranks, ``local_world`` of them on
this box; ZeRO-3 as ``offload.distributed`` does it): the chunk layout is the whole model's and
does not depend on world, the rank holds a 1/world piece of every chunk — its parameters,
gradients after the reduce-scatter, master, moments, NVMe slots and Adam work — and computes on
batch_tokens / world tokens per step; the device still sees every parameter chunk whole
(all-gathered before use), and the collectives' bytes cross the rank's link at ``net_gbps``. The
ranks on one box share its RAM, NVMe drives and CPU cores evenly; each has a GPU of its own.

Units: bytes, seconds, parameters (elements); bandwidths in GB/s and compute in TFLOPS, both
decimal (1 GB/s = 1e9 bytes/s).

Modules, in the order a plan is made:

* ``inputs`` — ``Hardware`` (the box) and ``Policy`` (how the engine would run), checked when
  built; ``rank_share`` (one rank's part of a shared box).
* ``model`` — the model's parameters in packing order and the chunks they fill, the whole
  model's and one rank's (``RankChunks``).
* ``activations`` — activation bytes per token, and where a micro-batch's activations sit (GPU,
  the pinned RAM area, NVMe).
* ``precision`` — bytes per element of the master and the Adam moments by their precision
  (fp32, bf16, 8-bit block-wise; issue 29).
* ``memory`` — the budgets ("auto" as the engine resolves it), the bytes each tier holds by kind,
  the NVMe space, and why a plan does not fit.
* ``step_time`` — the bytes a step moves (NVMe, PCIe, collectives) and the predicted step time
  with its bottleneck (compute, PCIe, NVMe, Adam or the interconnect).
* ``planner`` — ``plan``: runs the above and gathers them in a ``Plan`` (``to_json_dict`` is the
  JSON of ``offload plan --json``).
* ``choice`` — ``choose``: plans every way to the batch and takes the fastest that fits.

Pipeline stages on a cluster of boxes (``offload plan --boxes B --gpus-per-box G``, issue 28):

* ``schedule_theory`` — each pipeline schedule's bubble and activations in flight, from its paper.
* ``stage_layout`` — ``Cluster``, the links a (pp, dp) mesh crosses, the part of the model each
  pipeline rank holds.
* ``cluster`` — ``choose_cluster``: plans every pipeline rank with ``plan`` and chooses pp x dp x
  micro-batches x schedule, against sliced data parallelism over every GPU.
* ``cluster_report``, ``cluster_cli`` — the cluster plan as the command prints it, and its flags.

The ``offload plan`` command:

* ``cli`` — its flags and ``run``.
* ``defaults`` — the batch shape ``offload plan`` and the trainer both default to.
* ``flags`` — byte sizes and counts from the command line, and the models ``--model`` names.
* ``figures`` — the box's figures: given, read from bench JSON, measured or assumed
  (``hardware_for``, the trainer's call; ``gather_hardware``, the command's).
* ``probes`` — the measurements (NVMe, CPU Adam, GPU matmul and PCIe, a CPU compute probe).
* ``cache`` — the measurements kept on disk per machine and NVMe filesystem, so the next launch
  measures nothing.
* ``report`` — the plan and the ways as the command prints them.
"""

from .choice import Choice, choose
from .inputs import Hardware, Policy
from .planner import Plan, plan
from .report import format_choice, format_plan

__all__ = ["Choice", "Hardware", "Plan", "Policy", "choose", "format_choice", "format_plan", "plan"]
