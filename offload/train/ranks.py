"""This process's place among the ranks torchrun started, and how the ranks of a run agree.

The run's log is rank 0's (``say``); stretches every rank must finish together (validation,
planning, loading data) run inside ``together()``, so a failure on one rank stops them all at the
same point with one line from rank 0 instead of leaving the others waiting in a collective.
(``offload/checkpoint/ranks.py`` is the same idea for a wrapped model's ``Sharding``; this one
exists before any model or process group does, from torchrun's environment.)
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager

from ..errors import ConfigError, DistributedError, OffloadError


class QuietExit(SystemExit):
    """This rank stops with status 1 and says nothing: rank 0 reports what went wrong."""

    def __init__(self):
        super().__init__(1)


class Ranks:
    """This process's place among the ranks torchrun started (world 1: a single process)."""

    __slots__ = ("rank", "world", "local_rank", "local_world")

    def __init__(self, rank: int = 0, world: int = 1, local_rank: int = 0, local_world: int = 1):
        self.rank, self.world, self.local_rank, self.local_world = rank, world, local_rank, local_world

    @classmethod
    def from_env(cls) -> "Ranks":
        """From torchrun's RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE (absent: one process)."""
        env = os.environ
        values = {}
        for name, default in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("LOCAL_WORLD_SIZE", None)):
            raw = env.get(name, default)
            if raw is None:
                continue
            try:
                values[name] = int(raw)
            except ValueError:
                raise ConfigError(name, raw, "(an environment variable torchrun sets) must be an integer") from None
        world = values["WORLD_SIZE"]
        if world < 1 or not 0 <= values["RANK"] < world:
            raise ConfigError("RANK", values["RANK"], f"must be in [0, WORLD_SIZE={world})")
        local_world = values.get("LOCAL_WORLD_SIZE", world)
        return cls(values["RANK"], world, values["LOCAL_RANK"], max(1, min(local_world, world)))

    @property
    def lead(self) -> bool:
        return self.rank == 0

    @property
    def many(self) -> bool:
        return self.world > 1

    def say(self, message: str = "", end: str = "\n") -> None:
        """One log for the whole run: rank 0 prints, the others stay quiet."""
        if self.lead:
            print(message, end=end, file=sys.stderr, flush=True)

    def start(self) -> None:
        """Join the process group: NCCL with a GPU per rank (``cuda:LOCAL_RANK``), else gloo."""
        import torch
        import torch.distributed as dist

        if torch.cuda.is_available():
            torch.cuda.set_device(self.local_rank)
            backend = "nccl"
        else:
            backend = "gloo"
        dist.init_process_group(backend)
        from ..distributed import failure

        failure.install(self.rank)          # a peer blocked on this rank can then name it

    def _collective(self, what: str, call):
        """Run a collective; a peer's failure becomes a one-line DistributedError naming it."""
        from ..distributed import failure

        try:
            return call()
        except Exception as exc:
            failed, why = failure.failed_peer()
            detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise DistributedError(self.rank, what, f"{why} (here: {detail})" if why else detail, failed) from exc

    def failed(self, exc: BaseException) -> None:
        """Leave this rank's failure where its peers, blocked in a collective, can name it."""
        if self.many and not isinstance(exc, (SystemExit, KeyboardInterrupt)):
            from ..distributed import failure

            failure.mark_failed(self.rank, exc)

    def stop(self, clean: bool = True) -> None:
        """Leave the process group. After a failure NCCL may still hold collectives that wait for
        this rank: then the process just ends (torchrun stops the others)."""
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and (clean or dist.get_backend() != "nccl"):
            dist.destroy_process_group()

    @contextmanager
    def together(self):
        """A stretch every rank runs up to the same point: when it fails on any rank, every rank
        stops there — rank 0 with the first failure's one-line error, the others quietly (a rank's
        own programming error keeps its traceback). No rank is left waiting in a collective."""
        if not self.many:
            yield
            return
        try:
            yield
        except BaseException as exc:
            self._agree(exc)
            raise
        self._agree(None)

    def _agree(self, error: BaseException | None) -> None:
        import torch.distributed as dist

        mine = None if error is None else (isinstance(error, OffloadError), f"{error}" if isinstance(
            error, OffloadError) else f"{type(error).__name__}: {error}")
        everyone = [None] * self.world
        self._collective("all_gather_object (setup)", lambda: dist.all_gather_object(everyone, mine))
        failed = [(r, e) for r, e in enumerate(everyone) if e is not None]
        if not failed:
            return
        if error is not None and (self.lead or not isinstance(error, OffloadError)):
            return                                    # the caller raises its own error
        if not self.lead:
            raise QuietExit()
        rank, (_, message) = failed[0]
        raise OffloadError(f"rank {rank}: {message}")

    def broadcast(self, value):
        """Rank 0's ``value`` on every rank (a picklable object)."""
        if not self.many:
            return value
        import torch.distributed as dist

        box = [value]
        self._collective("broadcast_object_list (the plan)", lambda: dist.broadcast_object_list(box, src=0))
        return box[0]

    def mean(self, value: float, device) -> float:
        """The mean of ``value`` over the ranks (every rank calls it)."""
        if not self.many:
            return value
        import torch
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.float64, device=device)
        self._collective("all_reduce (the logged loss)", lambda: dist.all_reduce(t))
        return t.item() / self.world

