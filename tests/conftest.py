"""Shared fixtures: a measurement cache of its own for every test, a temp directory on a real (disk-backed) filesystem, and the GPU skip."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import settings

# CI must be reproducible: the same examples every run (a new failure shows up in development,
# where hypothesis explores with fresh seeds).
settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _measurement_cache(tmp_path_factory, monkeypatch):
    """Each test its own planner measurement cache: a measurement faked in one test is never read by
    another, nor by a real run (the default is ~/.cache/offload)."""
    monkeypatch.setenv("OFFLOAD_CACHE_DIR", str(tmp_path_factory.mktemp("offload-cache")))


@pytest.fixture
def disk_tmp():
    """A temp dir under the repo (a real disk, where O_DIRECT works), removed afterwards."""
    base = ROOT / ".pytest-tmp"
    base.mkdir(exist_ok=True)
    path = Path(tempfile.mkdtemp(dir=base))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
