"""Pieces every benchmark command shares: a scratch directory that is cleaned up on any exit
(Ctrl-C and ``kill`` included), and the JSON report file."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from contextlib import contextmanager

from ..errors import ConfigError


def seconds_per_call(fn, min_s: float = 0.3, sync=lambda: None) -> float:
    """Seconds per call of ``fn`` after two warm-up calls, over at least ``min_s``; ``sync``
    waits for queued device work (checked every 4 calls)."""
    fn(), fn()
    sync()
    calls, t0 = 0, time.perf_counter()
    while True:
        fn()
        calls += 1
        if calls % 4 == 0:
            sync()
            elapsed = time.perf_counter() - t0
            if elapsed >= min_s:
                return elapsed / calls


def _sigterm(signum, frame):
    raise KeyboardInterrupt


@contextmanager
def scratch_dir(path_arg: str, flag: str = "--path", *, remove_tree: bool = False):
    """Yield ``path_arg`` as an absolute directory, creating it (0700) when missing.

    A directory created here is removed on the way out — only if empty, unless ``remove_tree``.
    SIGTERM is turned into KeyboardInterrupt meanwhile, so ``kill`` cleans up like Ctrl-C does.
    """
    path = os.path.abspath(path_arg)
    made = False
    if not os.path.exists(path):
        if not os.path.isdir(os.path.dirname(path)):
            raise ConfigError(flag, path_arg, "neither it nor its parent directory exists")
        os.mkdir(path, 0o700)
        made = True
    old = signal.signal(signal.SIGTERM, _sigterm)
    try:
        yield path
    finally:
        signal.signal(signal.SIGTERM, old)
        if made:
            if remove_tree:
                shutil.rmtree(path, ignore_errors=True)
            else:
                try:
                    os.rmdir(path)
                except OSError:
                    pass


def write_json(path: str | None, report: dict) -> None:
    """Write ``report`` to ``path`` (nothing when None); a bad path is a ConfigError naming --json."""
    if not path:
        return
    try:
        with open(path, "w") as fh:
            json.dump(report, fh, indent=2)
            fh.write("\n")
    except OSError as exc:
        raise ConfigError("--json", path, f"cannot be written: {exc.strerror}") from exc
