"""What the tests share, imported as ``from tests.helpers.<module> import …``.

- ``tiny_gpt``: TinyGPT (tied embeddings, checkpointing, a root-level parameter) and its batches.
- ``reference``: plain PyTorch + ``torch.optim.AdamW`` runs of TinyGPT in fp32 and float64, and
  ``small_config``, the engine budgets that send every chunk through every tier.
- ``trajectory``: the rule fp32 runs are judged by (as close to float64 as plain PyTorch's fp32 run).
- ``hf_models``: tiny Hugging Face models built from configs (no download), saved sharded.
- ``sim_streams``: CUDA copy streams simulated on the CPU, to test the GPU path's ordering.
- ``processes``: the environment a child process needs to import this checkout.
- ``ranks``: the one launcher of multi-process runs (``launch``, ``free_port``);
  ``dp_worker`` is the data-parallel training rank most of them run.
- ``finetune_runs``: ``scripts/finetune_100b.py`` run from outside, its logs and checkpoints
  compared (shared with ``benchmarks/soak.py``).
"""
