"""Training data from one file: plain text, or JSON lines of text, prompt/completion or chat messages.

- ``.txt`` (any other suffix too): one stream of text; batches are consecutive windows of it.
- ``.jsonl``, one JSON object a line, all of one kind:
  ``{"text": ...}`` — joined into one stream, like a .txt file;
  ``{"prompt": ..., "completion": ...}`` — one example each, loss on the completion's tokens only;
  ``{"messages": [{"role": ..., "content": ...}, ...]}`` — rendered by the tokenizer's chat
  template, loss on the assistant turns only.
  An example is cut to ``seq_len`` tokens and padded after its end; padding and the tokens
  without loss carry label -100 (ignored by the cross-entropy of HF models and of offload's own).
  Right padding needs no attention mask: a causal model never looks ahead at it.

Tokens are bytes (vocabulary 256) unless a Hugging Face tokenizer is given. A bad file — absent,
unreadable, empty, a line that is not a usable record — is a ``ConfigError`` naming the file and
the line. ``Batches`` walks the data in a fixed order and its ``state()`` (the next batch's index and
what file it was) goes into each checkpoint, so a resumed run continues with the next batch. Under
data parallelism each rank takes its own slice of every global batch (``shard_rows``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import ConfigError

IGNORE = -100
_KINDS = ("text", "prompt/completion", "messages")


@dataclass(frozen=True)
class Dataset:
    """Tokenized data: one token ``stream`` or a list of ``examples`` ((ids, labels) pairs)."""

    path: str
    kind: str                                     # "stream" or one of the jsonl kinds
    vocab_size: int
    stream: torch.Tensor | None = None            # 1-D int64 tokens
    examples: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()
    pad_id: int = 0

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
    """Bytes, or a Hugging Face tokenizer: ``encode(text)``, ``vocab_size``, chat templates."""

    def __init__(self, tokenizer=None):
        self.tokenizer = tokenizer

    @property
    def vocab_size(self) -> int:
        return 256 if self.tokenizer is None else len(self.tokenizer)

    @property
    def pad_id(self) -> int:
        t = self.tokenizer
        if t is None:
            return 0
        for tid in (t.pad_token_id, t.eos_token_id):
            if tid is not None:
                return int(tid)
        return 0

    def encode(self, text: str, *, special: bool = True) -> list[int]:
        if self.tokenizer is None:
            return list(text.encode("utf-8"))
        return list(self.tokenizer(text, add_special_tokens=special)["input_ids"])

    def eos(self) -> list[int]:
        t = self.tokenizer
        return [] if t is None or t.eos_token_id is None else [int(t.eos_token_id)]

    def chat(self, messages, *, generation_prompt: bool = False) -> list[int]:
        out = self.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation_prompt,
                                                 return_dict=True)
        return list(out["input_ids"])


def load_tokenizer(directory: str | os.PathLike, flag: str = "--tokenizer"):
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:
        raise ConfigError(flag, str(directory), "needs `pip install transformers`") from exc
    try:
        return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ConfigError(flag, str(directory), f"has no tokenizer transformers can load ({first})") from exc


def load_data(path: str | os.PathLike, tokenizer=None) -> Dataset:
    """Read and tokenize ``path`` (see the module docstring); ``tokenizer``: an HF tokenizer or None (bytes)."""
    tokens = Tokens(tokenizer)
    file = Path(path)
    if not file.is_file():
        raise ConfigError("--data", str(path), "is not a file")
    try:
        raw = file.read_bytes()
    except OSError as exc:
        raise ConfigError("--data", str(path), f"cannot be read: {exc.strerror}") from exc
    if not raw.strip():
        raise ConfigError("--data", str(path), "is empty")
    if file.suffix != ".jsonl":
        text = _decode(raw, path)
        ids = tokens.encode(text)
        if len(ids) < 2:
            raise ConfigError("--data", str(path), "holds fewer than 2 tokens")
        return Dataset(str(path), "stream", tokens.vocab_size, stream=torch.tensor(ids, dtype=torch.long),
                       pad_id=tokens.pad_id)
    records = _records(raw, path)
    kind = records[0][1]
    if kind == "text":
        ids = tokens.encode("\n\n".join(r["text"] for _, _, r in records))
        return Dataset(str(path), kind, tokens.vocab_size, stream=torch.tensor(ids, dtype=torch.long),
                       pad_id=tokens.pad_id)
    if kind == "messages" and (tokenizer is None or not getattr(tokenizer, "chat_template", None)):
        raise ConfigError("--data", f"{path}:{records[0][0]}", "has chat 'messages': they need a tokenizer "
                          "with a chat template (--tokenizer DIR, or a --model DIR whose tokenizer has one)")
    examples = []
    for line, _, record in records:
        pair = _prompt_completion(tokens, record) if kind == "prompt/completion" else _chat(tokens, record, path, line)
        if (pair[1] != IGNORE).any():
            examples.append(pair)
    if not examples:
        raise ConfigError("--data", str(path), f"has no usable record ({kind} records with no tokens to learn)")
    return Dataset(str(path), kind, tokens.vocab_size, examples=tuple(examples), pad_id=tokens.pad_id)


def _decode(raw: bytes, path, line: int | None = None) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        where = f"{path}:{line}" if line is not None else f"{path} (byte {exc.start})"
        raise ConfigError("--data", where, "is not UTF-8 text") from exc


def _records(raw: bytes, path) -> list[tuple[int, str, dict]]:
    """``[(line number, kind, record)]`` of the non-blank lines, all of one kind."""
    out = []
    for i, line in enumerate(raw.split(b"\n"), 1):
        text = _decode(line, path, i).strip()
        if not text:
            continue
        try:
            record = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError("--data", f"{path}:{i}", f"is not JSON ({exc.msg} at column {exc.colno})") from exc
        kind = _kind(record)
        if kind is None:
            raise ConfigError("--data", f"{path}:{i}", "expected a JSON object with a string 'text', string "
                              "'prompt' and 'completion', or a 'messages' list of {role, content}")
        if out and kind != out[0][1]:
            raise ConfigError("--data", f"{path}:{i}", f"is a {kind} record; line {out[0][0]} was {out[0][1]} "
                              "(one kind per file)")
        out.append((i, kind, record))
    if not out:
        raise ConfigError("--data", str(path), "has no records (only blank lines)")
    if all(not r.get("text", "x") for _, _, r in out):
        raise ConfigError("--data", str(path), "has no usable record (every 'text' is empty)")
    return out


def _kind(record) -> str | None:
    if not isinstance(record, dict):
        return None
    if isinstance(record.get("text"), str):
        return "text"
    if isinstance(record.get("prompt"), str) and isinstance(record.get("completion"), str):
        return "prompt/completion"
    msgs = record.get("messages")
    if isinstance(msgs, list) and msgs and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                               and isinstance(m.get("content"), str) for m in msgs):
        return "messages"
    return None


def _prompt_completion(tokens: Tokens, record: dict) -> tuple[torch.Tensor, torch.Tensor]:
    prompt = tokens.encode(record["prompt"])
    completion = tokens.encode(record["completion"], special=False) + (tokens.eos() if record["completion"] else [])
    ids = torch.tensor(prompt + completion, dtype=torch.long)
    labels = ids.clone()
    labels[:len(prompt)] = IGNORE
    return ids, labels


def _chat(tokens: Tokens, record: dict, path, line: int) -> tuple[torch.Tensor, torch.Tensor]:
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
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ConfigError("--data", f"{path}:{line}", f"the chat template cannot render these messages ({first})") from exc
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
