"""The test suite, a package so that tests import their helpers as ``tests.helpers.…``.

- ``unit/``: fast, in-process, CPU-only — the bulk (``make test-fast`` runs these).
- ``integration/``: end-to-end runs, all marked ``slow``; some also ``nvme`` (real O_DIRECT files).
- ``gpu/``: marked ``gpu``; every test skips cleanly without CUDA.
- ``helpers/``: what several test modules share (models, reference runs, the launcher of ranks).

Every test that starts another process (ranks, scripts, ``python -c``) is marked ``slow``.
"""
