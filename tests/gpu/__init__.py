"""Tests that need a CUDA device (``pytest -m gpu``); each skips cleanly without one."""
