"""Where the training step is: the one small object the engine's components share.

The accumulation window (micro-batches so far, which parameters and chunks have gradients, which
chunks' updates are queued or wait, the squared norms a clip needs), the backward running now
(whether its updates run as its gradient chunks complete: *eager*), and the chunks parked for the
next forward. Each field says which component writes it; the others only read it.
"""

from __future__ import annotations

import torch


class StepProgress:
    def __init__(self) -> None:
        # Chunks whose updates wait for the end of backward and overlap the next forward
        # (StepPipeline.begin_backward chooses them; they stay chosen until the next backward).
        self.parked: set[int] = set()
        self.new_window()
        self.new_backward()

    def new_window(self) -> None:
        """An accumulation window begins (after an applied step, or ``zero_grad``)."""
        self.micro_batches = 0                      # backward passes ended in this window (pipeline)
        self.with_grad: set[int] = set()            # parameters (layout index) with a gradient (capture)
        self.grad_chunks: set[int] = set()          # chunks with a gradient (capture)
        self.updated_chunks: set[int] = set()       # chunks whose update is queued or done (updates)
        self.ready: set[int] = set()                # final gradients whose update waits for the chunk (updates)
        self.sumsq: dict[int, torch.Tensor] = {}    # chunk -> its gradients' squared L2 norm (updates)
        self.applied = False                        # an update ran during backward: step() comes next
        self.reduced = False                        # data parallel: the window's last micro-batch was reduced

    def new_backward(self) -> None:
        """No backward is running (the last one ended, or was abandoned)."""
        self.in_backward = False
        self.eager = False                  # updates run as gradient chunks complete (pipeline)
        self.final_micro_batch = False      # the backward running ends the window (pipeline)
        # The backward running is a split backward's input pass: input gradients only, no
        # parameter's, so not one of the window's micro-batches (hooks.input_pass, pipeline).
        self.input_only = False
