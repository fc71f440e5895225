"""Hugging Face checkpoints in and out: a local model directory in (``load_pretrained``), an HF
directory out (``export_pretrained``), LoRA adapters through peft (``offload.hf.lora``)."""

from .export import export_pretrained
from .load import load_pretrained, read_checkpoint

__all__ = ["export_pretrained", "load_pretrained", "read_checkpoint"]
