"""Training data from one file, tokenized into batches: a token stream, or examples with labels.

What a file holds is ``data_files``' job (the format from its suffix and its content: ``.txt``
text, ``.jsonl`` JSON lines, ``.json`` a JSON array or JSON lines; ``data_format`` says it
outright); which tokenizer reads it is ``tokenizer_files``' (``load_tokenizer``, re-exported here).
This module turns records into tokens:

- text, and ``{"text": ...}`` records joined by blank lines: one stream; batches are consecutive
  windows of it;
- ``{"prompt": ..., "completion": ...}``: one example each, loss on the completion's tokens only;
- ``{"messages": [{"role": ..., "content": ...}, ...]}``: rendered by the tokenizer's chat
  template, loss on the assistant turns only. A tokenizer without a chat template is refused
  here, when the data is loaded, so a run checks it before planning anything.
  An example is cut to ``seq_len`` tokens and padded after its end; padding and the tokens
  without loss carry label -100 (ignored by the cross-entropy of HF models and of offload's own).
  Right padding needs no attention mask: a causal model never looks ahead at it.

Tokens are bytes (``ByteTokenizer``, vocabulary 256) when no tokenizer is given. A bad file is a
``ConfigError`` naming the file and the line or record. ``Batches`` walks the data in a fixed order
and its ``state()`` (the next batch's index and what file it was) goes into each checkpoint, so a
resumed run continues with the next batch. Under data parallelism each rank takes its own slice of
every global batch (``shard_rows``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from .data_files import FORMATS, DataFile, read_data_file
from .errors import ConfigError, one_line
from .tokenizer_files import ByteTokenizer, load_tokenizer

__all__ = ["FORMATS", "IGNORE", "Batches", "Dataset", "load_data", "load_tokenizer", "shard_rows"]

IGNORE = -100


@dataclass(frozen=True)
class Dataset:
    """Tokenized data: one token ``stream`` or a list of ``examples`` ((ids, labels) pairs)."""

    path: str
    kind: str                                     # "stream" or a record kind (data_files.record_kind)
    vocab_size: int
    stream: torch.Tensor | None = None            # 1-D int64 tokens
    examples: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()
    pad_id: int = 0
    skipped: int = 0                              # examples with no loss token within seq_len

    @property
    def size(self) -> int:
        return self.stream.numel() if self.stream is not None else len(self.examples)

    def batch(self, index: int, rows: int, seq_len: int,
              part: range | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``index``-th batch of ``rows`` x ``seq_len``: ``(input_ids, labels)``, wrapping around;
        ``part``: only these of its rows (one rank's slice, ``shard_rows``)."""
        which = range(rows) if part is None else part
        if self.stream is not None:
            n = max(self.stream.numel() - seq_len, 1)
            ids = torch.stack([self.stream[s:s + seq_len] for s in
                               (((index * rows + r) * seq_len) % n for r in which)])
            if ids.shape[1] < seq_len:       # a stream shorter than one sequence: pad it
                ids, labels = _pad([(row, row) for row in ids], seq_len, self.pad_id)
                return ids, labels
            return ids, ids.clone()
        picked = [self.examples[(index * rows + r) % len(self.examples)] for r in which]
        return _pad(picked, seq_len, self.pad_id)


def shard_rows(rows: int, rank: int, world: int) -> range:
    """Rank ``rank``'s rows of a global batch of ``rows`` split evenly over ``world`` ranks: the
    contiguous slice ``rank*rows/world .. (rank+1)*rows/world``. Together the ranks see exactly the
    batch one process would, so a run's results do not depend on how many ranks share it."""
    if world < 1 or not 0 <= rank < world:
        raise ConfigError("rank", rank, f"must be in [0, {world})")
    if rows % world:
        raise ConfigError("--batch-tokens", rows, f"sequences per step must split evenly over {world} ranks")
    per = rows // world
    return range(rank * per, (rank + 1) * per)


def _pad(pairs, seq_len: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.full((len(pairs), seq_len), pad_id, dtype=torch.long)
    labels = torch.full((len(pairs), seq_len), IGNORE, dtype=torch.long)
    for r, (i, l) in enumerate(pairs):
        n = min(seq_len, i.numel())
        ids[r, :n] = i[:n]
        labels[r, :n] = l[:n]
    return ids, labels


class Tokens:
    """A Hugging Face tokenizer (or ``ByteTokenizer``) as the loader uses it: ``encode(text)``,
    ``vocab_size``, the padding and end ids, chat templates."""

    def __init__(self, tokenizer=None):
        self.tokenizer = ByteTokenizer() if tokenizer is None else tokenizer

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    @property
    def pad_id(self) -> int:
        for tid in (self.tokenizer.pad_token_id, self.tokenizer.eos_token_id):
            if tid is not None:
                return int(tid)
        return 0

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def encode(self, text: str, *, special: bool = True) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=special)["input_ids"])

    def eos(self) -> list[int]:
        eos = self.tokenizer.eos_token_id
        return [] if eos is None else [int(eos)]

    def chat(self, messages, *, generation_prompt: bool = False) -> list[int]:
        out = self.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation_prompt,
                                                 return_dict=True)
        return list(out["input_ids"])


def load_data(path: str | os.PathLike, tokenizer=None, data_format: str = "auto",
              seq_len: int | None = None) -> Dataset:
    """Read and tokenize ``path`` (see the module docstring).

    ``tokenizer``: a Hugging Face tokenizer (``load_tokenizer``), or None for bytes.
    ``data_format``: "auto" (from the suffix and the content), "text", "jsonl" or "json".
    ``seq_len``: the length examples are cut to; an example with no loss token left after the
    cut (the model predicts positions 1..seq_len-1) is skipped and counted in ``skipped``: a
    batch of such rows has no target and its loss is nan. None of them left is an error naming
    ``--seq-len``."""
    tokens = Tokens(tokenizer)
    data = read_data_file(path, data_format)
    if data.text is not None:
        ids = tokens.encode(data.text)
        if len(ids) < 2:
            raise ConfigError("--data", str(path), "holds fewer than 2 tokens")
        return _stream(data, tokens, ids)
    if data.kind == "text":
        return _stream(data, tokens, tokens.encode("\n\n".join(r.fields["text"] for r in data.records)))
    if data.kind == "messages" and not tokens.has_chat_template:
        raise ConfigError("--data", data.where(data.records[0].number),
                          "has chat 'messages': they need a tokenizer with a chat template (--tokenizer DIR, "
                          "or a --model DIR whose tokenizer has one)")
    examples = []
    for record in data.records:
        pair = _prompt_completion(tokens, record.fields) if data.kind == "prompt/completion" \
            else _chat(tokens, record.fields, data.where(record.number))
        if (pair[1] != IGNORE).any():
            examples.append(pair)
    if not examples:
        raise ConfigError("--data", str(path), f"has no usable record ({data.kind} records with no tokens to learn)")
    kept = [e for e in examples if seq_len is None or (e[1][1:seq_len] != IGNORE).any()]
    if not kept:
        first = min(int((e[1] != IGNORE).nonzero()[0]) for e in examples)
        raise ConfigError("--seq-len", seq_len, f"cuts every example of {path} before its first token with loss "
                                                f"(the earliest is token {first + 1}: --seq-len {max(first + 1, 2)} keeps it)")
    return Dataset(str(path), data.kind, tokens.vocab_size, examples=tuple(kept), pad_id=tokens.pad_id,
                   skipped=len(examples) - len(kept))


def _stream(data: DataFile, tokens: Tokens, ids: list[int]) -> Dataset:
    return Dataset(data.path, data.kind, tokens.vocab_size, stream=torch.tensor(ids, dtype=torch.long),
                   pad_id=tokens.pad_id)


def _prompt_completion(tokens: Tokens, record: dict) -> tuple[torch.Tensor, torch.Tensor]:
    prompt = tokens.encode(record["prompt"])
    completion = tokens.encode(record["completion"], special=False) + (tokens.eos() if record["completion"] else [])
    ids = torch.tensor(prompt + completion, dtype=torch.long)
    labels = ids.clone()
    labels[:len(prompt)] = IGNORE
    return ids, labels


def _chat(tokens: Tokens, record: dict, where: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids of the rendered conversation; labels only on each assistant turn's tokens.

    A turn's tokens are those between the conversation rendered up to it (with the generation
    prompt: the assistant header is context, not target) and rendered through it."""
    msgs = record["messages"]
    try:
        ids = tokens.chat(msgs)
        labels = [IGNORE] * len(ids)
        for i, m in enumerate(msgs):
            if m["role"] != "assistant":
                continue
            start = len(tokens.chat(msgs[:i], generation_prompt=True)) if i else 0
            end = len(tokens.chat(msgs[:i + 1]))
            labels[start:end] = ids[start:end]
    except Exception as exc:
        raise ConfigError("--data", where, f"the chat template cannot render these messages ({one_line(exc)})") from exc
    return torch.tensor(ids, dtype=torch.long), torch.tensor(labels, dtype=torch.long)


def fingerprint(path: str | os.PathLike) -> dict:
    st = Path(path).stat()
    return {"path": str(Path(path).resolve()), "bytes": st.st_size}


class Batches:
    """The batches of a run in a fixed order; ``state()`` / ``restore()`` carry the position.

    ``rows`` is the global batch; with ``world`` > 1 ``next()`` gives rank ``rank``'s slice of it
    (``shard_rows``). The position counts global batches, so a checkpoint's data state resumes
    at any number of ranks."""

    def __init__(self, data: Dataset, rows: int, seq_len: int, *, rank: int = 0, world: int = 1):
        self.data, self.rows, self.seq_len = data, rows, seq_len
        self.part = None if world == 1 else shard_rows(rows, rank, world)
        self.position = 0               # index of the next batch

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.data.batch(self.position, self.rows, self.seq_len, self.part)
        self.position += 1
        return out

    def state(self) -> dict:
        return {"next_batch": self.position, "rows": self.rows, "seq_len": self.seq_len,
                **fingerprint(self.data.path)}

    def restore(self, state: dict) -> str | None:
        """Continue from a checkpoint's ``state()``; returns a warning when the data changed."""
        self.position = int(state["next_batch"])
        now = fingerprint(self.data.path)
        changed = [k for k in ("path", "bytes") if state.get(k) != now[k]] + \
                  [k for k in ("rows", "seq_len") if state.get(k) != getattr(self, k)]
        if changed:
            return (f"the data differs from the checkpoint's ({', '.join(changed)}): continuing at batch "
                    f"{self.position} of the new data")
        return None
