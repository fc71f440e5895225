"""A rank that fails says so in the process group's store, so its peers can name it.

When one rank dies (an exception it does not catch, a signal), the others are blocked in a
collective: gloo sees the connection close, NCCL the watchdog's timeout, and both report it
without saying which rank went first. ``install`` chains ``sys.excepthook`` (and the threading
one) so that a rank ending on an uncaught exception first writes ``offload/failed`` =
``"<rank>: <error>"`` into the default store; ``failed_peer`` reads it when a collective fails.
A rank that ends without running the hook (a child of ``multiprocessing``, a kill) is found
another way: each rank records its host and pid at ``install``; a peer on the same host whose
process is gone (or a zombie) is the failed one. The store may be gone with the rank that
hosts it (rank 0 under ``mp.spawn``; under torchrun the agent hosts it): then the failed rank
is unknown and the error says so.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
from datetime import timedelta

KEY = "offload/failed"
HOSTS = "offload/host"
_installed = False


def _store():
    try:
        from torch.distributed import distributed_c10d

        return distributed_c10d._get_default_store()
    except Exception:
        return None


def mark_failed(rank: int, exc: BaseException) -> None:
    """Leave ``rank``'s failure in the store for its peers (best effort: never raises)."""
    store = _store()
    if store is None:
        return
    try:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        store.set(KEY, f"{rank}: {type(exc).__name__}: {first}"[:500])
    except Exception:
        pass


def failed_peer(timeout_s: float = 2.0) -> tuple[int | None, str]:
    """(rank, its error) of a peer that marked itself failed or whose process is gone, or (None, "")."""
    store = _store()
    if store is None:
        return None, ""
    try:
        store.set_timeout(timedelta(seconds=timeout_s))
        if store.check([KEY]):
            text = store.get(KEY).decode(errors="replace")
            rank, _, why = text.partition(": ")
            try:
                return int(rank), why
            except ValueError:
                return None, text
        return _exited_peer(store)
    except Exception:
        return None, ""


def exited_peer() -> tuple[int | None, str]:
    """(rank, why) of a peer on this host whose process is gone, or (None, ""): a fact, unlike a
    failure mark (which a thread's error may leave while its process goes on)."""
    store = _store()
    if store is None:
        return None, ""
    try:
        return _exited_peer(store)
    except Exception:
        return None, ""


def _exited_peer(store) -> tuple[int | None, str]:
    from torch import distributed as dist

    me, host = dist.get_rank(), socket.gethostname()
    for r in range(dist.get_world_size()):
        if r == me or not store.check([f"{HOSTS}/{r}"]):
            continue
        where, _, pid = store.get(f"{HOSTS}/{r}").decode().rpartition(" ")
        if where == host and not _running(int(pid)):
            return r, f"its process (pid {pid}) has exited"
    return None, ""


def _running(pid: int) -> bool:
    """Alive and not a zombie (an exited child its parent has not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def install(rank: int) -> None:
    """Chain the process's exception hooks to ``mark_failed`` (once per process)."""
    global _installed
    store = _store()
    if store is not None:
        try:
            store.set(f"{HOSTS}/{rank}", f"{socket.gethostname()} {os.getpid()}")
        except Exception:
            pass
    if _installed:
        return
    _installed = True
    previous = sys.excepthook

    def excepthook(kind, value, tb):
        if not issubclass(kind, KeyboardInterrupt):
            mark_failed(rank, value)
        previous(kind, value, tb)

    sys.excepthook = excepthook
    previous_thread = threading.excepthook

    def thread_hook(args):
        if args.exc_value is not None and not isinstance(args.exc_value, KeyboardInterrupt):
            mark_failed(rank, args.exc_value)
        previous_thread(args)

    threading.excepthook = thread_hook
