"""Engines still open when the interpreter exits are closed first, while their threads still run.

A script that ends right after ``optimizer.step()`` leaves that step's updates queued on the Adam
worker (a daemon thread: it must never keep a process alive by itself). At exit Python stops
daemon threads before it collects what is left, so an engine closed by the garbage collector
then waited for a worker that no longer ran: the process hung for good. ``atexit`` callbacks run
before that point: the one here drains and closes every engine left open, as ``engine.close()``
would (the last step's updates land, the swap files go).
"""

from __future__ import annotations

import atexit
import logging
import weakref

log = logging.getLogger(__name__)

_open = weakref.WeakSet()


def track(engine) -> None:
    """Close ``engine`` at interpreter exit unless it is closed (or collected) before."""
    _open.add(engine)


def forget(engine) -> None:
    _open.discard(engine)


@atexit.register
def close_open_engines() -> None:
    for engine in list(_open):
        try:
            engine.close()
        except Exception as exc:       # the process is ending: say so, close the others
            log.warning("offload: closing an engine at exit failed: %s", exc)
