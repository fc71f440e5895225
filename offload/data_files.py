"""A training data file read into text or records: which format it is, decided from its suffix
and its content the way a user of Hugging Face ``datasets`` expects, and never guessed.

``data_format="auto"`` (the default) goes by the suffix, and the content must agree with it:

- ``.txt``: text, whatever it holds. JSON is text too, so no content contradicts the suffix
  (``datasets``' text builder reads a ``.txt`` the same way).
- ``.jsonl``: one JSON object a line (blank lines skipped). A file that starts with ``[`` is a
  JSON array, not JSON lines: an error saying so.
- ``.json``: a JSON array of records (``[`` first), or JSON lines (``{`` first: a renamed
  ``.jsonl``, as ``datasets``' json builder reads both). Anything else (one object spanning
  lines, text) is an error saying what was seen.
- any other suffix (``.csv``, ``.md``, none): an error naming the file.

``data_format="text"``, ``"jsonl"`` or ``"json"`` says the format outright, whatever the suffix.
A record is ``{"text"}``, ``{"prompt", "completion"}`` or ``{"messages": [{"role", "content"}]}``,
all of one kind a file. Every error is a ``ConfigError`` for ``--data`` naming the file and the
line (JSON lines) or record (an array) that is wrong, and one for ``--data-format`` for a format
that does not exist.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from .errors import ConfigError

FORMATS = ("auto", "text", "jsonl", "json")
SUFFIXES = {".txt": "text", ".jsonl": "jsonl", ".json": "json"}
RECORD_SHAPES = ("expected a JSON object with a string 'text', string 'prompt' and 'completion', "
                 "or a 'messages' list of {role, content}")
_AS_TEXT = "--data-format text reads it as text"


@dataclass(frozen=True)
class Record:
    """One record: its ``number`` (a line of JSON lines, 1-based; the position in an array,
    1-based), its ``kind`` ("text", "prompt/completion" or "messages") and its fields."""

    number: int
    kind: str
    fields: dict


@dataclass(frozen=True)
class DataFile:
    """What a data file holds: ``text`` (format "text") or ``records`` (format "jsonl": JSON
    lines, numbered by line; "json": an array, numbered by position)."""

    path: str
    format: str
    text: str | None = None
    records: tuple[Record, ...] = ()

    @property
    def kind(self) -> str:
        """"stream" for text; else the records' kind."""
        return "stream" if self.text is not None else self.records[0].kind

    def where(self, number: int) -> str:
        """``path:line`` (JSON lines) or ``path record N`` (an array): for errors."""
        return where(self.path, self.format, number)


def where(path, fmt: str, number: int) -> str:
    """Record ``number`` of a file of format ``fmt``, for an error: ``path:line`` or ``path record N``."""
    return f"{path}:{number}" if fmt == "jsonl" else f"{path} record {number}"


def read_data_file(path: str | os.PathLike, data_format: str = "auto") -> DataFile:
    """Read ``path`` as ``data_format`` (see the module docstring)."""
    if data_format not in FORMATS:
        raise ConfigError("--data-format", data_format, f"must be one of {', '.join(FORMATS)}")
    file = Path(path)
    if not file.is_file():
        raise ConfigError("--data", str(path), "is not a file")
    try:
        raw = file.read_bytes()
    except OSError as exc:
        raise ConfigError("--data", str(path), f"cannot be read: {exc.strerror}") from exc
    fmt = data_format if data_format != "auto" else _format_of(file)
    # A byte-order mark some editors write is the encoding's, not the data's (Python's utf-8-sig).
    text = _decode(raw, path, by_line=fmt != "text").removeprefix("\ufeff")
    if not text.strip():
        raise ConfigError("--data", str(path), "is empty")
    if fmt == "text":
        return DataFile(str(path), "text", text=text)
    first = text.lstrip()[:1]
    if first == "[":
        if fmt == "jsonl":
            raise ConfigError("--data", str(path), "starts with '[': a JSON array, not one JSON object a line "
                                                   "(an array is read from a .json file, or with --data-format json)")
        return _checked(DataFile(str(path), "json", records=_array(text, path)))
    if fmt == "json" and first != "{":
        raise ConfigError("--data", str(path), f"is neither a JSON array nor JSON lines: it starts with "
                                               f"{_glimpse(text.lstrip())} ({_AS_TEXT})")
    return _checked(DataFile(str(path), "jsonl", records=_lines(text, path)))


def _format_of(file: Path) -> str:
    fmt = SUFFIXES.get(file.suffix.lower())
    if fmt is None:
        said = f"has the suffix {file.suffix!r}" if file.suffix else "has no suffix"
        raise ConfigError("--data", str(file), f"{said}: the format is known from .txt (text), .jsonl (JSON lines) "
                                               f"or .json (a JSON array or JSON lines); {_AS_TEXT}")
    return fmt


def _decode(raw: bytes, path, *, by_line: bool) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        at = f"{path}:{line}" if by_line else f"{path} (byte {exc.start})"
        raise ConfigError("--data", at, "is not UTF-8 text") from exc


def _glimpse(text: str, n: int = 40) -> str:
    """The start of ``text`` for an error: one line, at most ``n`` characters."""
    head = text.split("\n", 1)[0]
    return repr(head[:n] + ("..." if len(head) > n else ""))


def _lines(text: str, path) -> tuple[Record, ...]:
    out: list[Record] = []
    for i, line in enumerate(text.split("\n"), 1):
        line = line.strip()
        if not line:
            continue
        try:
            fields = json.loads(line)
        except json.JSONDecodeError as exc:
            hint = "" if out else f"; {_AS_TEXT}"       # the first record: perhaps not a JSON file at all
            if not out and line.startswith("{") and _one_object(text):
                raise ConfigError("--data", str(path), f"holds one JSON object spanning lines, not records: "
                                                       f"{RECORD_SHAPES}, one a line or in a JSON array") from exc
            raise ConfigError("--data", f"{path}:{i}", f"is not JSON ({exc.msg} at column {exc.colno}): "
                                                       f"{_glimpse(line)}{hint}") from exc
        out.append(_record(i, fields, where(path, "jsonl", i), out, "line"))
    return tuple(out)


def _one_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except json.JSONDecodeError:
        return False


def _array(text: str, path) -> tuple[Record, ...]:
    try:
        items = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError("--data", f"{path}:{exc.lineno}", f"is not a JSON array ({exc.msg} at column "
                                                            f"{exc.colno})") from exc
    if not items:
        raise ConfigError("--data", str(path), "has no records (an empty JSON array)")
    out: list[Record] = []
    for n, fields in enumerate(items, 1):
        out.append(_record(n, fields, where(path, "json", n), out, "record"))
    return tuple(out)


def _record(number: int, fields, where: str, before: list[Record], unit: str) -> Record:
    kind = record_kind(fields)
    if kind is None:
        raise ConfigError("--data", where, RECORD_SHAPES)
    if before and kind != before[0].kind:
        raise ConfigError("--data", where, f"is a {kind} record; {unit} {before[0].number} was "
                                           f"{before[0].kind} (one kind per file)")
    return Record(number, kind, fields)


def _checked(data: DataFile) -> DataFile:
    if not data.records:
        raise ConfigError("--data", data.path, "has no records (only blank lines)")
    if all(not r.fields.get("text", "x") for r in data.records):
        raise ConfigError("--data", data.path, "has no usable record (every 'text' is empty)")
    return data


def record_kind(fields) -> str | None:
    """"text", "prompt/completion" or "messages"; None for anything else."""
    if not isinstance(fields, dict):
        return None
    if isinstance(fields.get("text"), str):
        return "text"
    if isinstance(fields.get("prompt"), str) and isinstance(fields.get("completion"), str):
        return "prompt/completion"
    msgs = fields.get("messages")
    if isinstance(msgs, list) and msgs and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                               and isinstance(m.get("content"), str) for m in msgs):
        return "messages"
    return None
