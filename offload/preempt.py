"""Preemption: SIGTERM (Slurm, Kubernetes, spot instances) or SIGINT ends a run with a checkpoint.

    with offload.on_preempt(lambda: offload.save_checkpoint(model, opt, "ckpt", extra=...)) as preempt:
        for batch in data:
            loss = model(batch).loss; loss.backward(); opt.step(); opt.zero_grad()
            preempt.after_step()       # a signal came: save, then exit with its status

The first signal only sets a flag: the step in flight finishes (nothing is torn mid-update),
``after_step`` calls the save function and raises ``SystemExit`` with the status below, so
``finally`` blocks (closing the engine) still run. A second signal exits at once with
``os._exit`` -- the previous checkpoint is intact, because a save writes into a temp
directory and renames it into place only when complete.

Exit status: 128 + the signal number, the shell's convention for "ended by a signal", which
schedulers read as such: **143 for SIGTERM, 130 for SIGINT** (also for the second signal).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Callable, Iterable

from .errors import ConfigError

DEFAULT_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def exit_status(signum: int) -> int:
    """The documented exit status for a run ended by ``signum``: 128 + signum (SIGTERM 143, SIGINT 130)."""
    return 128 + int(signum)


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class Preemption:
    """Catches ``signals`` while active (a context manager); see the module docstring.

    ``save``: called by ``after_step`` once a signal has come (None: nothing to save).
    ``notify``: receives one line for the user when a signal arrives (default: stderr).
    """

    def __init__(self, save: Callable[[], object] | None = None, *,
                 signals: Iterable[int] = DEFAULT_SIGNALS, notify: Callable[[str], None] | None = _say,
                 name: str = "offload"):
        self.save = save
        self.signals = tuple(signals)
        if not self.signals:
            raise ConfigError("signals", self.signals, "expected at least one signal")
        self.notify = notify
        self.name = name
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        """A signal arrived: finish the step, save, exit."""
        return self.signum is not None

    @property
    def status(self) -> int | None:
        return None if self.signum is None else exit_status(self.signum)

    def _handle(self, signum, frame) -> None:
        if self.signum is not None:
            if self.notify:
                self.notify(f"{self.name}: {signal.Signals(signum).name} again: exiting now "
                            f"({exit_status(signum)}); the previous checkpoint is intact")
            os._exit(exit_status(signum))
        self.signum = signum
        if self.notify:
            self.notify(f"{self.name}: {signal.Signals(signum).name} received: finishing this step, "
                        f"{'saving a checkpoint, ' if self.save else ''}then exiting with status "
                        f"{exit_status(signum)} (send it again to exit at once)")

    def install(self) -> "Preemption":
        """Catch the signals from now on (``with`` does this)."""
        if threading.current_thread() is not threading.main_thread():
            raise ConfigError("on_preempt", threading.current_thread().name,
                              "signal handlers can only be installed from the main thread")
        for s in self.signals:
            self._previous[s] = signal.signal(s, self._handle)
        return self

    def uninstall(self) -> None:
        """Put the previous handlers back (``with`` does this)."""
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()

    def __enter__(self) -> "Preemption":
        return self.install()

    def __exit__(self, *exc) -> None:
        self.uninstall()

    def after_step(self, save: Callable[[], object] | None = None) -> None:
        """Call between steps: when a signal has come, run ``save`` (or the constructor's) and
        raise ``SystemExit`` with the documented status; otherwise return at once.

        Under several ranks (torch.distributed) this is a collective: the ranks agree whether any
        of them got a signal (one all-reduce), so all of them save the same step together (a
        checkpoint is itself collective) rather than one leaving the others waiting."""
        self.signum = _agreed_signum(self.signum)
        if self.signum is None:
            return
        save = save if save is not None else self.save
        if save is not None:
            save()
        raise SystemExit(exit_status(self.signum))


def _agreed_signum(signum: int | None) -> int | None:
    """The largest signal number any rank has seen (None when none has); ``signum`` itself
    without a process group of several ranks."""
    try:
        import torch
        import torch.distributed as dist
    except ImportError:         # offload is importable without torch for its CLI tools
        return signum
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() <= 1:
        return signum
    from .distributed.comms import collective_device

    flag = torch.tensor([signum or 0], dtype=torch.int64, device=collective_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag.item()) or None


def on_preempt(save: Callable[[], object] | None = None, *, signals: Iterable[int] = DEFAULT_SIGNALS,
               notify: Callable[[str], None] | None = _say, name: str = "offload") -> Preemption:
    """A ``Preemption`` context for a user's own loop (see the module docstring)."""
    return Preemption(save, signals=signals, notify=notify, name=name)
