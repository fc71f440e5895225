"""End-to-end runs: the engine against plain PyTorch, scripts, checkpoints, ranks (all ``slow``)."""
