"""The ranks that save, load or export one model together, and how they agree.

Under data parallelism (the engine's ``chunks.sharding`` set) every rank keeps a piece of every
chunk (its span, ``ChunkInfo.span``); a checkpoint is written by all of them at once and read
back by all of them at once, perhaps at another world size. Each step that can fail on one
rank only (a full disk, a checksum mismatch in one rank's file) ends in ``settle``: every rank
says how its part went, and then either every rank goes on or every rank raises -- never one
raising while the others wait in the next collective. Without a process group (``sharding`` None) there is one rank and every
collective is the identity.
"""

from __future__ import annotations

from ..errors import ConfigError, OffloadError

SHARD_DIR = "rank-{:05d}"


def shard_dir(rank: int) -> str:
    """The subdirectory of a checkpoint of several ranks that holds rank ``rank``'s chunk files."""
    return SHARD_DIR.format(rank)


class PeerFailed(OffloadError):
    """Another rank failed in a step all ranks take together; this rank stops with it."""


class Ranks:
    """This process's place among the ranks of a ``Sharding`` (rank 0 of 1 without one)."""

    def __init__(self, sharding=None):
        self.sharding = sharding
        self.rank = 0 if sharding is None else int(sharding.rank)
        self.world = 1 if sharding is None else int(sharding.world)
        self.group = None if sharding is None else getattr(sharding, "group", None)

    @classmethod
    def of(cls, engine) -> "Ranks":
        """The ranks of ``engine``'s model (its ``chunks.sharding``)."""
        return cls(engine.chunks.sharding)

    @property
    def sharded(self) -> bool:
        return self.world > 1

    @property
    def lead(self) -> bool:
        """Rank 0: the one that writes what is written once (manifest, buffers, exports)."""
        return self.rank == 0

    # ---- collectives (identity on one rank) -----------------------------------------------
    def gather(self, obj) -> list:
        """``obj`` of every rank, in rank order, on every rank."""
        if not self.sharded:
            return [obj]
        import torch.distributed as dist

        out = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast(self, obj, src: int = 0):
        """Rank ``src``'s ``obj`` on every rank."""
        if not self.sharded:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=src, group=self.group)
        return box[0]

    def settle(self, error: BaseException | None, what: str, value=None) -> list:
        """End a step every rank takes: raise ``error`` here if this rank failed, ``PeerFailed`` (or
        ``ConfigError`` when the peer's was one) naming the first failed rank when another did;
        when all succeeded, return every rank's ``value`` (in rank order) on every rank."""
        reports = self.gather((None if error is None else report(error), None if error else value))
        if error is not None:
            raise error
        for r, (failed, _) in enumerate(reports):
            if failed is not None:
                raise peer_error(r, failed, what)
        return [v for _, v in reports]


def report(error: BaseException) -> tuple[str, str, tuple]:
    """What a rank tells the others of its failure (picklable; ``peer_error`` turns it back)."""
    if isinstance(error, ConfigError):
        value = error.value if isinstance(error.value, (str, int, float, bool, type(None))) else repr(error.value)
        return ("config", str(error), (error.field, value, error.why))
    return (type(error).__name__, str(error), ())


def peer_error(rank: int, report: tuple, what: str) -> OffloadError:
    """The exception a rank raises for another rank's failure ``report`` (see ``settle``)."""
    kind, message, args = report
    if kind == "config":
        field, value, why = args
        return ConfigError(field, value, f"{why} (on rank {rank}, while {what})")
    return PeerFailed(f"rank {rank} failed while {what}: {kind}: {message}")
