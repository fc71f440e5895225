"""Is a local Hugging Face tokenizer directory complete? Checked before a run allocates anything,
so a missing file is one line naming it rather than a transformers traceback an hour in."""

from __future__ import annotations

import json
import os
from pathlib import Path

from .errors import ConfigError

# What each tokenizer family reads; any one complete set will do.
FILE_SETS = (
    ("tokenizer.json",),                 # fast tokenizers of every family
    ("tokenizer.model",),                # SentencePiece (LLaMA, Mistral, T5)
    ("vocab.json", "merges.txt"),        # byte-level BPE (GPT-2, RoBERTa)
    ("vocab.txt",),                      # WordPiece (BERT)
)


def check_tokenizer_dir(path: str | os.PathLike, field: str = "--tokenizer") -> Path:
    """Raise ``ConfigError`` naming ``field``, the directory and what is missing or unreadable."""
    root = Path(path)
    if not root.exists():
        raise ConfigError(field, str(path), "does not exist")
    if not root.is_dir():
        raise ConfigError(field, str(path), "is not a directory (expected a Hugging Face tokenizer directory)")
    present = {p.name for p in root.iterdir() if p.is_file()}
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if name in present:
            try:
                json.loads((root / name).read_text(encoding="utf-8"))
            except (OSError, ValueError) as exc:
                raise ConfigError(field, str(path), f"{name} cannot be read as JSON: {exc}") from None
    for files in FILE_SETS:
        if all(f in present for f in files):
            for f in files:
                if not os.access(root / f, os.R_OK):
                    raise ConfigError(field, str(path), f"{f} is not readable")
            return root
    partial = [fs for fs in FILE_SETS if any(f in present for f in fs)]
    if partial:
        missing = [f for f in partial[0] if f not in present]
        raise ConfigError(field, str(path), f"has {', '.join(f for f in partial[0] if f in present)} "
                                            f"but not {', '.join(missing)}")
    wanted = " or ".join(" + ".join(fs) for fs in FILE_SETS)
    found = ", ".join(sorted(present)[:8]) or "nothing"
    raise ConfigError(field, str(path), f"is missing the tokenizer files (needs {wanted}; found {found})")
