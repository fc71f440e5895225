"""What a test needs to start another Python process that imports this checkout.

A child process does not inherit pytest's ``sys.path``: ``python_env`` puts the repository root
first on its PYTHONPATH, so it imports this tree's ``offload`` (not an installed copy) and the
helpers as ``tests.helpers.…``, as the tests themselves do.
"""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def python_env(**extra: str) -> dict:
    """This process's environment with the repository root first on PYTHONPATH, plus ``extra``."""
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": str(ROOT) + (os.pathsep + path if path else ""), **extra}
