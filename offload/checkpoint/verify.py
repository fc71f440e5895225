"""Checking checkpoints without a model: every chunk's and every file's checksum, file sizes,
the manifest; ``offload checkpoint verify DIR`` prints the summary."""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import ConfigError, OffloadError
from .format import (DTYPES, LATEST, STEP_NAME, TEMP_NAME, check_kind_file_size, chunk_numel, chunk_pieces, kind_files,
                     read_checked_file, read_manifest, small_files)
from .listing import candidates, is_complete
from .pieces import Piece, tiling_error
from .reading import OpenFiles, read_piece


@dataclass(slots=True)
class Verdict:
    """What verifying one checkpoint directory found."""

    path: str
    step: int | None = None
    world: int = 1               # ranks that saved it (one file per kind and rank)
    chunks: int = 0              # chunks all of whose pieces verified
    pieces: int = 0              # pieces whose checksum was checked (a whole chunk is one)
    files: int = 0               # files read
    bytes: int = 0               # bytes read
    problems: list[str] = field(default_factory=list)   # one line each; empty: it verifies

    @property
    def ok(self) -> bool:
        return not self.problems


def verify_checkpoint(path: str | os.PathLike) -> Verdict:
    """Read every file of checkpoint ``path`` (every rank's, when several ranks saved it) and check
    every checksum; never raises for a damaged checkpoint (its problems are listed), only for a
    missing directory."""
    ckpt = Path(path)
    if not ckpt.is_dir():
        raise ConfigError("checkpoint", str(ckpt), "is not a directory")
    verdict = Verdict(str(ckpt))
    try:
        manifest = read_manifest(ckpt)
        verdict.step = int(manifest["step"])
        verdict.world = int(manifest.get("world", 1))
        algorithm = manifest["checksum"]
        kinds = manifest["kinds"]
    except (OffloadError, KeyError, TypeError, ValueError) as exc:
        verdict.problems.append(f"manifest: {exc}")
        return verdict
    for kind, info in kinds.items():
        try:
            _verify_kind(ckpt, kind, info, algorithm, verdict)
        except (OffloadError, KeyError, TypeError, ValueError, IndexError) as exc:
            verdict.problems.append(f"manifest: {kind} entries malformed ({type(exc).__name__}: {exc})")
    for entry in small_files(manifest):
        try:
            verdict.bytes += len(read_checked_file(ckpt, entry, algorithm))
            verdict.files += 1
        except OffloadError as exc:
            verdict.problems.append(str(exc))
    return verdict


def _verify_kind(ckpt: Path, kind: str, info: dict, algorithm: str, verdict: Verdict) -> None:
    """Check that each chunk's pieces tile it, then the size and every piece's checksum of each
    file of ``kind`` (one per saving rank); a chunk counts as checked when all its pieces are."""
    itemsize = DTYPES[info["dtype"]].itemsize
    by_file: dict[str, list[tuple[int, Piece, bool]]] = {name: [] for name in kind_files(info)}
    bad: set[int] = set()
    entries = [(c, e) for c, e in enumerate(info["chunks"]) if e is not None]
    for c, entry in entries:
        pieces = chunk_pieces(info, entry, algorithm)
        why = tiling_error([(p.lo, p.hi) for p in pieces], chunk_numel(info, entry))
        sizes = [p for p in pieces if p.stored and p.nbytes != p.numel * itemsize]
        if why is not None or sizes:
            verdict.problems.append(f"manifest: chunk {kind}[{c}]: " + (why or f"{sizes[0].nbytes} bytes for elements "
                                                                               f"[{sizes[0].lo}, {sizes[0].hi})"))
            bad.add(c)
        for p in pieces:
            if p.stored:
                by_file.setdefault(p.file, []).append((c, p, len(pieces) == 1))
    for name, stored in by_file.items():
        try:
            check_kind_file_size(ckpt, kind, info, [name])
        except OffloadError as exc:
            verdict.problems.append(str(exc))
            if not (ckpt / name).is_file():
                bad.update(c for c, _, _ in stored)
                continue
        buf = torch.empty(max((p.nbytes for _, p, _ in stored), default=0), dtype=torch.uint8, device="cpu")
        verdict.files += 1
        with OpenFiles(ckpt) as files:
            try:
                fd = files.fd(name)
            except OffloadError as exc:
                verdict.problems.append(str(exc))
                bad.update(c for c, _, _ in stored)
                continue
            for c, piece, whole in stored:
                try:
                    read_piece(fd, ckpt / name, kind, c, piece, buf, algorithm, whole=whole)
                    verdict.pieces += 1
                    verdict.bytes += piece.nbytes
                except OffloadError as exc:
                    bad.add(c)
                    sliced = "pieces" in info["chunks"][c]
                    verdict.problems.append(f"rank {piece.rank}: {exc}" if sliced or "rank" in info["chunks"][c]
                                            else str(exc))
    verdict.chunks += sum(c not in bad for c, _ in entries)


# offload.pipeline.checkpoint's manifest of a `finetune --pp` checkpoint step-N/ (stage-*/ below it hold
# engine checkpoints): named here, not imported, since that package sits above this one.
PIPELINE_MANIFEST = "pipeline.json"


def _verify_pipeline(step: Path) -> list[Verdict]:
    """One verdict per stage of pipeline checkpoint ``step`` (each stage-*/ is its own checkpoint
    root): the stages pipeline.json lists, else those present."""
    try:
        dirs = [str(s["dir"]) for s in json.loads((step / PIPELINE_MANIFEST).read_text())["stages"]]
    except (OSError, ValueError, KeyError, TypeError):
        dirs = sorted(p.name for p in step.glob("stage-*") if p.is_dir())
    if not dirs:
        return [Verdict(str(step), problems=[f"{PIPELINE_MANIFEST}: no stages listed or present"])]
    verdicts = []
    for name in dirs:
        stage = step / name
        found = verify_root(stage)[0] if stage.is_dir() else []
        verdicts += found or [Verdict(str(stage), problems=[f"{name}: no complete checkpoint of this stage"])]
    return verdicts


def verify_root(directory: str | os.PathLike) -> tuple[list[Verdict], list[str]]:
    """Verdicts of every complete checkpoint under ``directory`` (oldest first; or of
    ``directory`` itself when it is one checkpoint), and notes on the rest (incomplete
    ``step-*`` directories, temp directories of interrupted saves, the ``latest`` pointer)."""
    root = Path(directory)
    if not root.is_dir():
        raise ConfigError("DIR", str(root), "is not a directory")
    if is_complete(root):
        return [verify_checkpoint(root)], []
    if (root / PIPELINE_MANIFEST).is_file():
        return _verify_pipeline(root), []
    notes = []
    found = []
    staged = []
    for entry in sorted(root.iterdir()):
        m = STEP_NAME.match(entry.name)
        if m and entry.is_dir():
            if (entry / PIPELINE_MANIFEST).is_file():
                staged.append((int(m.group(1)), entry))
            elif is_complete(entry):
                found.append((int(m.group(1)), entry))
            else:
                notes.append(f"{entry.name}: incomplete (no manifest), ignored by --resume")
        elif TEMP_NAME.match(entry.name):
            notes.append(f"{entry.name}: left by an interrupted save, removed by the next save")
    verdicts = [verify_checkpoint(p) for _, p in sorted(found)]
    for _, p in sorted(staged):
        verdicts += _verify_pipeline(p)
    latest = root / LATEST
    if latest.is_file():
        notes.append(f"{LATEST} -> {latest.read_text().strip()}")
    if staged:
        # A resume loads the newest checkpoint when it is a pipeline one, without falling back.
        notes.append(f"pipeline checkpoints: {', '.join(p.name for _, p in sorted(staged))} (per stage above); "
                     "--resume loads the newest checkpoint and does not fall back when it is one of them")
    elif verdicts:
        # Which one a resume loads: the first candidate that verifies.
        good = {v.path for v in verdicts if v.ok}
        chosen = next((p for p in candidates(root) if str(p) in good), None)
        notes.append(f"--resume loads {chosen.name}" if chosen else
                     "--resume refuses: no checkpoint verifies (move the directory aside to start fresh)")
    return verdicts, notes


# ---- the `offload checkpoint verify` command ---------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", metavar="DIR", help="a checkpoint root (--checkpoint-dir) or one step-* checkpoint")


def run(args: argparse.Namespace) -> int:
    from ..units import format_bytes

    verdicts, notes = verify_root(args.dir)
    if not verdicts:
        raise OffloadError(f"no complete checkpoint in {args.dir}")
    for v in verdicts:
        name = Path(v.path).name
        if Path(v.path).parent.parent.joinpath(PIPELINE_MANIFEST).is_file():      # step-N/stage-S/step-N
            name = str(Path(v.path).relative_to(Path(v.path).parent.parent.parent))
        elif Path(v.path).parent.joinpath(PIPELINE_MANIFEST).is_file():             # a stage without one
            name = str(Path(v.path).relative_to(Path(v.path).parent.parent))
        if v.ok:
            ranks = f" of {v.world} ranks" if v.world > 1 else ""
            pieces = f" ({v.pieces} pieces)" if v.pieces != v.chunks else ""
            print(f"ok       {name}: {v.chunks} chunks{pieces}, {v.files} files{ranks}, {format_bytes(v.bytes)} verified")
        else:
            print(f"CORRUPT  {name}: {len(v.problems)} problem(s)")
            for p in v.problems:
                print(f"           {p}")
    for n in notes:
        print(f"note     {n}")
    bad = sum(not v.ok for v in verdicts)
    print(f"{len(verdicts) - bad} of {len(verdicts)} checkpoint(s) verify" + (f"; {bad} corrupt" if bad else ""))
    return 1 if bad else 0
