"""Hugging Face checkpoints in and out: a local model directory in (``load_pretrained``), an HF
directory out (``export_pretrained``), LoRA adapters through peft (``offload.hf.lora``).

Modules: ``load`` (a model directory: config, shard headers, meta model, streaming into chunks),
``sources`` (which checkpoint tensors make each model tensor, transformers' conversions applied),
``tensor_files`` (safetensors file names, reading tensors in row blocks), ``export`` (an HF
directory out), ``lora``, ``describe`` (a model's shape for the planner), ``output`` (what a
fine-tuning run writes at its end: the source's dtype and config unless asked), ``preset`` (a
from-scratch ``offload.models.llama`` model as a transformers Llama). Chunk I/O for weight files, through the chunk interface
(``engine.chunks``): ``safetensors_export`` (``offload.export_safetensors``, streamed shards),
``chunk_source`` (an export's chunks gathered from the ranks' pieces), ``safetensors_load``
(``offload.load_safetensors``), ``chunk_fill`` (a chunk's values assembled from tensors).
``accelerate_ranks``: HF Trainer and accelerate on N ranks (a model ``offload.wrap`` shards needs
no DDP, and they are told so).
"""

from .export import export_pretrained
from .load import load_pretrained, read_checkpoint

__all__ = ["export_pretrained", "load_pretrained", "read_checkpoint"]
