#!/usr/bin/env python3
"""Fine-tune a Hugging Face checkpoint, or a LLaMA-architecture model of any size, on one GPU (or the CPU).

The same command as ``offload finetune`` (``offload/train/cli.py`` documents every flag, and
``offload finetune --help`` lists them), kept here so these keep working:

    python scripts/finetune_100b.py --model ./Llama-3-8B --data chat.jsonl --output ./tuned --nvme-path /mnt/nvme
    python scripts/finetune_100b.py --model ./Llama-3-8B --lora-rank 16 --output ./adapter   # peft format
    python scripts/finetune_100b.py --model ./Llama-3-8B --lora-rank 16 --merge --output ./merged
    python scripts/finetune_100b.py --preset tiny --steps 50 --nvme-path ./offload-nvme
    python scripts/finetune_100b.py --preset 100b --nvme-path /mnt/nvme0 --nvme-path /mnt/nvme1 --dry-run
    python scripts/finetune_100b.py --config run.toml --steps 10     # settings from TOML; flags win
    torchrun --nproc-per-node 8 scripts/finetune_100b.py --preset 70b --nvme-path '/mnt/nvme{local_rank}' ...

The library behind it is ``offload.train``: ``TrainConfig`` (readable from TOML), ``Trainer``
(subclass it to change a step), ``CheckpointManager``.
"""

from offload.train.cli import entry, main

__all__ = ["main"]

if __name__ == "__main__":
    entry()
