"""Benchmarks behind ``offload bench``: each reports ratios measured side by side in one run.

* ``nvme`` — ``offload bench nvme``: disk throughput through ``offload.aio`` against fio
  (``fio``: the reference command; ``--sweep`` finds the best ``AioConfig``).
* ``adam`` — ``offload bench adam``: CPU Adam parameters/s against torch and the memory roofline.
* ``step`` — ``offload bench step``: an offloaded training step against its lower bound. Its parts:
  ``workload`` (the model, batch and sample timing, shared with ``--nproc``), ``step_bound`` (the
  bound's arithmetic), ``in_memory`` (the everything-fits comparison with torch), ``replay`` (a
  step's NVMe requests replayed alone), ``pcie`` (host<->device copy rates), ``step_report``
  (the printed lines); ``step_precision`` (``--state A,B --master X,Y``: optimizer-state
  precisions side by side, taking turns).
* ``distributed`` — ``offload bench step --nproc N``: the launcher and the run;
  ``distributed_rank`` one rank's work, ``collectives`` the byte counter both systems are measured
  with, ``distributed_report`` the figures over ranks, their ratios and the printed lines.
* ``common`` — a scratch directory cleaned up on any exit, the JSON report file, a call timer.
"""
