"""Whole-model collectives are called on every rank: each call first checks that every rank came.

Under N ranks ``model.state_dict()`` and ``load_state_dict()`` are collectives (each chunk is
all-gathered from the ranks' pieces), as are ``save_checkpoint``, ``load_checkpoint`` and the exports. A call on some ranks only -- HF ``Trainer.save_model`` and ``save_pretrained``
run on rank 0 alone -- left the caller in a broadcast no peer issues while the peers went on:
to the end of the script (then a misleading "rank 1 failed"), or into a collective of their own
(accelerate's ``wait_for_everyone``, the next forward's gathers; the same after an
``export_pretrained`` under ``if rank == 0``), which pairs with the caller's
by position: a hang until the process group's timeout, or the wrong bytes.

``arrive`` runs before such a call's first collective. Every rank writes the call's name under
its own key for the call's sequence number in the process group's store (not a collective:
nothing pairs with it) and waits until every rank of the group has written that number. A rank
whose peer does not come within ``OFFLOAD_ARRIVAL_TIMEOUT_S`` seconds (default 300), or whose
peer's process has exited (a peer on this host; the store is not given a shorter timeout), or which finds a peer in another whole-model call, raises one
``DistributedError`` saying which rank is missing and that the call is a collective, and withdraws
its key so that the sequence numbers stay aligned (ranks in two different calls both raise).
"""

from __future__ import annotations

import os
import sys
import time

from ..errors import DistributedError, OffloadError

PREFIX = "offload/arrival"
TIMEOUT_ENV = "OFFLOAD_ARRIVAL_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 300.0
# After this long without every rank in, the waiting rank says so once: the timeout is long (a
# peer may be finishing a slow step), and a silent wait that long reads as a hang.
WAIT_NOTE_S = 10.0
HINT = "under several ranks it is a collective: call it on every rank"
HF_HINT = ("; HF Trainer.save_model and save_pretrained call it on rank 0 alone: set save_strategy=\"no\" "
           "and call offload.hf.export_pretrained(model, dir) or offload.save_checkpoint on every rank")

class MissingRank(DistributedError):
    """A whole-model collective that some rank did not call (``failed_rank``: the first missing)."""

    def __init__(self, rank: int, what: str, why: str, missing: int):
        self.rank, self.what, self.failed_rank = rank, what, missing
        hint = HINT + (HF_HINT if what in ("state_dict", "load_state_dict") else "")
        OffloadError.__init__(self, f"rank {rank}: {what}: {why}; {hint}")


_sequence: dict[tuple, int] = {}      # (store namespace, rank): whole-model calls this rank made


def timeout_s() -> float:
    raw = os.environ.get(TIMEOUT_ENV)
    try:
        return float(raw) if raw else DEFAULT_TIMEOUT_S
    except ValueError:
        return DEFAULT_TIMEOUT_S


def arrive(what: str, sharding) -> None:
    """Wait until every rank of ``sharding`` called whole-model collective ``what`` (a no-op for
    one process); ``DistributedError`` when one does not."""
    if sharding is None or sharding.world <= 1:
        return
    from torch.distributed import distributed_c10d

    from . import failure

    store = distributed_c10d._get_default_store()
    # One namespace per group: the data-parallel groups of pipeline stages count their calls apart.
    namespace = PREFIX if sharding.group is None else \
        f"{PREFIX}/{'-'.join(map(str, distributed_c10d.get_process_group_ranks(sharding.group)))}"
    wait_for(store, sharding.rank, sharding.world, what, timeout_s(),
             gone=failure.exited_peer, namespace=namespace)


def wait_for(store, rank: int, world: int, what: str, timeout: float, *, gone=None,
             namespace: str = PREFIX, note_after: float = WAIT_NOTE_S) -> None:
    """The rendezvous over ``store`` (``arrive`` without a process group, for tests): ``gone()``
    gives ``(rank, why)`` of a peer known to have failed or exited, else ``(None, "")``. Each rank
    polls one counter (backing off to 0.2 s), so the store's load does not grow with N squared;
    the names are read once, when everyone is in (or when giving up). After ``note_after``
    seconds it says once on stderr which ranks it waits for."""
    seq = _sequence.get((namespace, rank), 0)
    key = f"{namespace}/{seq}"
    mine, count = f"{key}/{rank}", f"{key}/count"
    store.set(mine, what)
    arrived = store.add(count, 1)
    peers = [r for r in range(world) if r != rank]
    deadline = time.monotonic() + timeout
    checked_gone, poll = time.monotonic(), 0.002
    note_at = time.monotonic() + note_after
    while arrived < world:
        now = time.monotonic()
        if now > note_at:
            note_at = float("inf")
            missing = ", ".join(f"rank {r}" for r in peers if not store.check([f"{key}/{r}"]))
            print(f"offload: rank {rank} waits in {what} for {missing or 'the other ranks'}: {HINT} "
                  f"(gives up after {timeout:g} s, {TIMEOUT_ENV})", file=sys.stderr, flush=True)
        if gone is not None and now - checked_gone > 1.0:
            checked_gone = now
            failed, why = gone()
            if failed is not None and not store.check([f"{key}/{failed}"]):
                _withdraw(store, mine, count)
                raise MissingRank(rank, what, f"rank {failed} did not call it ({why})", failed)
        if now > deadline:
            _withdraw(store, mine, count)
            missing = [r for r in peers if not store.check([f"{key}/{r}"])] or peers
            names = ", ".join(f"rank {r}" for r in missing)
            raise MissingRank(rank, what, f"{names} did not call it within {timeout:g} s ({TIMEOUT_ENV})",
                              missing[0])
        time.sleep(poll)
        poll = min(2 * poll, 0.2)
        arrived = store.add(count, 0)
    _sequence[(namespace, rank)] = seq + 1        # every rank is in: the number is used up
    for r in peers:
        theirs = store.get(f"{key}/{r}").decode(errors="replace") if store.check([f"{key}/{r}"]) else None
        if theirs != what:          # in another whole-model call (both ranks raise), or gave up just now
            raise MissingRank(rank, what, f"rank {r} called {theirs} instead" if theirs else
                              f"rank {r} gave up waiting", r)


def _withdraw(store, key: str, count: str) -> None:
    try:
        store.add(count, -1)
        store.delete_key(key)
    except Exception:
        pass
