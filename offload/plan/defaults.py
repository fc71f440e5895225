"""The run's default batch shape, the one place ``offload plan`` and the trainer (``offload
finetune``, ``scripts/finetune_100b.py``) take it from, so a plan made with the defaults is the
plan of a run made with them."""

BATCH_TOKENS = 2048
"""Tokens per optimizer step, over all ranks."""

SEQ_LEN = 256
"""Tokens per sequence (the planner caps it at the model's maximum)."""
