"""The tokenizer a run reads its data with: a local Hugging Face tokenizer directory, or raw bytes
when asked for them.

``check_tokenizer_dir`` checks a directory before a run allocates anything, so a missing file is
one line naming it rather than a transformers traceback an hour in. ``load_tokenizer`` loads one:
a directory without tokenizer files is an error naming it, what was looked for and the two ways
out (``--tokenizer DIR``; ``--byte-tokens``), never a silent switch to bytes — 256 byte ids fed to
a model with a 128k vocabulary train garbage. ``ByteTokenizer`` is the raw-bytes tokenizer
(ids 0..255), for a run that asks for it (a preset built for bytes, an experiment).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from .errors import ConfigError, one_line

# What each tokenizer family reads; any one complete set will do.
FILE_SETS = (
    ("tokenizer.json",),                 # fast tokenizers of every family
    ("tokenizer.model",),                # SentencePiece (LLaMA, Mistral, T5)
    ("vocab.json", "merges.txt"),        # byte-level BPE (GPT-2, RoBERTa)
    ("vocab.txt",),                      # WordPiece (BERT)
)
# A tokenizer needing no vocabulary file (ByT5, CANINE) has only this; transformers decides.
CONFIG_FILE = "tokenizer_config.json"
WANTED = " or ".join(" + ".join(fs) for fs in FILE_SETS)


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255, no special tokens, no chat template: the slice of a
    transformers tokenizer's interface the data loader uses (``len``, call, ``pad_token_id``,
    ``eos_token_id``, ``chat_template``)."""

    vocab_size = 256
    pad_token_id = None
    eos_token_id = None
    chat_template = None

    def __len__(self) -> int:
        return self.vocab_size

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": list(text.encode("utf-8"))}

    def __repr__(self) -> str:
        return "ByteTokenizer()"


def check_tokenizer_dir(path: str | os.PathLike, field: str = "--tokenizer") -> Path:
    """Raise ``ConfigError`` naming ``field``, the directory and what is missing or unreadable."""
    root = _directory(path, field)
    present = {p.name for p in root.iterdir() if p.is_file()}
    for name in ("tokenizer.json", CONFIG_FILE):
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
    found = ", ".join(sorted(present)[:8]) or "nothing"
    raise ConfigError(field, str(path), f"is missing the tokenizer files (needs {WANTED}; found {found})")


def has_tokenizer_files(path: str | os.PathLike) -> bool:
    """Whether directory ``path`` holds any file a tokenizer is read from (complete or not)."""
    root = Path(path)
    names = {name for files in FILE_SETS for name in files} | {CONFIG_FILE}
    return root.is_dir() and any((root / n).is_file() for n in names)


def load_tokenizer(directory: str | os.PathLike | None, flag: str = "--tokenizer", allow_bytes: bool = False,
                   *, vocab_size: int | None = None):
    """The tokenizer of ``directory``: a transformers tokenizer, or ``ByteTokenizer()``.

    ``flag``: the flag or field that named ``directory``, for errors (``--tokenizer``, ``--model``).
    ``allow_bytes``: where ``directory`` has no tokenizer files (or is None), return the byte
    tokenizer instead of raising ``ConfigError``; a directory that has a tokenizer still gives it
    (pass ``None`` to train on bytes whatever the model directory holds). ``vocab_size``: the
    model's vocabulary (tokens); a tokenizer with more ids than that is refused."""
    if directory is None:
        if not allow_bytes:
            raise ConfigError(flag, None, "no tokenizer given: pass --tokenizer DIR, or --byte-tokens to train "
                                          "on raw bytes (ids 0-255) on purpose")
        return _fitting(ByteTokenizer(), vocab_size, "--byte-tokens", True)
    root = _directory(directory, flag)
    if not has_tokenizer_files(root):
        if allow_bytes:
            return _fitting(ByteTokenizer(), vocab_size, "--byte-tokens", True)
        found = ", ".join(sorted(p.name for p in root.iterdir())[:8]) or "nothing"
        raise ConfigError(flag, str(directory), f"has no tokenizer files (looked for {WANTED} or {CONFIG_FILE}; "
                                                f"found {found}): pass --tokenizer DIR, or --byte-tokens to "
                                                "train on raw bytes (ids 0-255) on purpose")
    if any((root / f).is_file() for files in FILE_SETS for f in files):
        check_tokenizer_dir(root, flag)      # a half set names its missing file, not a transformers trace
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:
        raise ConfigError(flag, str(directory), "needs `pip install transformers`") from exc
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except Exception as exc:
        raise ConfigError(flag, str(directory), f"has no tokenizer transformers can load ({one_line(exc)})") from exc
    return _fitting(tokenizer, vocab_size, flag, str(directory))


def _fitting(tokenizer, vocab_size: int | None, field: str, value):
    """``tokenizer``, when its ids all fit a model of ``vocab_size`` tokens."""
    if vocab_size is not None and len(tokenizer) > vocab_size:
        what = "raw bytes need 256 token ids" if isinstance(tokenizer, ByteTokenizer) \
            else f"has {len(tokenizer)} tokens"
        raise ConfigError(field, value, f"{what}; the model's vocabulary is {vocab_size}")
    return tokenizer


def _directory(path: str | os.PathLike, field: str) -> Path:
    root = Path(path)
    if not root.exists():
        raise ConfigError(field, str(path), "does not exist")
    if not root.is_dir():
        raise ConfigError(field, str(path), "is not a directory (expected a Hugging Face tokenizer directory)")
    return root
