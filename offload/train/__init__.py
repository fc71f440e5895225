"""The trainer as a library: configuration, the training loop, checkpoints of a run, and its metrics."""
