"""Under ``TORCH_CUDA_SANITIZER=1``: the sanitizer also watches the engine's own threads.

CUDA's stream sanitizer (CSAN) sees a kernel or copy through a torch dispatch mode, and dispatch
modes are per thread: entered by torch at import on the main thread, it never sees what the
engine's threads issue (the Adam worker's gradient downloads and parameter uploads, the
checkpoint writer's copies). Here every thread the engine starts (named ``offload-...``) enters
a mode of its own that reports to the same event handler, so accesses from all threads land in
one record and an unordered pair across threads is a race like any other. The CUDA events,
streams and synchronisations CSAN orders by come from CUDA's trace callbacks, which are global.

What it still cannot see: copies made inside C (none: the native code never touches CUDA), and
host-side races on pinned buffers (a CPU read of a host buffer is no CUDA access; the simulated
stream tests in tests/integration/test_gpu_path_simulated.py cover those orderings).
"""

from __future__ import annotations

import os
import threading

import pytest

ENGINE_THREADS = "offload-"


def _watch_engine_threads(monkeypatch) -> None:
    from torch.cuda import _sanitizer as csan
    from torch.utils._python_dispatch import TorchDispatchMode

    main = csan.cuda_sanitizer
    if not main.enabled:
        return
    original_run = threading.Thread.run

    def run(self):
        if not self.name.startswith(ENGINE_THREADS):
            return original_run(self)
        # A second mode object sharing the main one's handler (a new CUDASanitizerDispatchMode
        # would register a second set of trace callbacks and count every event twice).
        mode = csan.CUDASanitizerDispatchMode.__new__(csan.CUDASanitizerDispatchMode)
        TorchDispatchMode.__init__(mode)
        mode.event_handler = main.dispatch.event_handler
        with mode:
            return original_run(self)

    monkeypatch.setattr(threading.Thread, "run", run)


@pytest.fixture(autouse=True)
def sanitizer_sees_engine_threads(monkeypatch):
    if os.environ.get("TORCH_CUDA_SANITIZER"):
        _watch_engine_threads(monkeypatch)
    yield
