"""Checkpoints of a wrapped model and its optimizer, streamed chunk by chunk from every tier.

``save_checkpoint(model, optimizer, root, step=n)`` writes ``root/step-0000000n/`` and points
``root/latest`` at it; ``load_checkpoint(model, optimizer, root)`` loads what ``latest`` names
(or ``root`` itself when it is one checkpoint, i.e. holds a ``manifest.json``).

A checkpoint directory holds::

    manifest.json          format version, layout, dtype, per-chunk CRC32C and file offsets,
                           per-parameter Adam step counts, loss scaler, engine step count,
                           optimizer hyper-parameters, the caller's ``extra``
    param.bin              raw chunk bytes of each kind, one file per kind: the chunks that
    master.bin             hold data, in chunk order, each ``chunk_size * itemsize`` bytes
    exp_avg.bin            (FREE chunks -- e.g. Adam state before the first step -- take no
    exp_avg_sq.bin         space and are recorded as ``null``)
    buffers.pt             persistent module buffers (only when the model has any)
    optimizer_state.pt     optimizer state of parameters the engine does not own (only if any)
    extra.pt               ``extra`` when it is not JSON-serializable

The ``.pt`` files hold tensors and plain data only and are read with ``torch.load(weights_only=True)``:
one carrying any other pickled object is refused naming it, and nothing of it runs (``plain``);
saving refuses such a value up front, naming it.

Under data parallelism (N ranks) every rank keeps a piece of every chunk (its span,
``ChunkInfo.span``) and writes its pieces into ``rank-0000r/param.bin`` and so on; the manifest
(version 3) records ``"world": N``, each kind's ``files`` (one per rank) and, per chunk, its
``numel`` and its ``pieces`` (rank, elements ``[lo, hi)``, file, offset, bytes, checksum); the
files written once (buffers, optimizer state, ``extra``) come from rank 0. Any world size loads
it: each rank of M fills its span of each chunk from the pieces that overlap it (``pieces``),
each read whole and verified. Checkpoints of one process (version 1) and of the former
round-robin ranks (version 2) hold whole chunks and load the same way, a chunk being one piece
``[0, numel)``. All ranks must share the filesystem the checkpoint root is on.

Gradients are not saved: a checkpoint is taken between ``optimizer.step()`` and the next
backward, and loading leaves a clean accumulation window.

Streaming: chunks (a rank's pieces) go through two reused staging buffers. Saving reads chunk i+1
(``engine.chunks.read``, from the device, pinned CPU or straight from NVMe) and checksums it on a
thread while chunk i is written to its file; loading reads and verifies chunk i+1 from its file
while chunk i goes into the engine (``engine.chunks.write``). The engine is seen through its
chunk interface (``offload.chunks.access``) only. Extra memory is two chunks (pieces) of the
largest kind, whatever the model size, and on loading at another world size one saved piece
that lies across the edge of this rank's span. Written data is synced every ``SYNC_EVERY`` bytes and dropped
from the page cache, so a 1 TB checkpoint does not push the training state out of RAM.

Atomicity: everything is written into ``root/.tmp-<name>-<pid>/``, each file fsynced, the
manifest last, the directory fsynced and renamed to ``root/<name>``; then ``latest`` is replaced
atomically (temp file + fsync + ``os.replace`` + fsync of ``root``). A process killed at any
point leaves the previous checkpoint and ``latest`` intact; the next save removes stale
``.tmp-*`` directories of dead processes. If ``latest`` is missing or names an incomplete
directory, loading falls back to the newest complete ``step-*`` checkpoint.

Layout: a checkpoint loads only into a model laid out with its ``chunk_size`` (recorded in the
manifest's ``layout``); ``saved_chunk_size(root)`` reads it from the checkpoint a resume would
load, so a run resumed under other budgets builds its model with it (the budgets choose the
chunk size only for a fresh start).

Fallback: a resume verifies as it loads and, when a checkpoint does not verify (checksum,
truncation, unreadable manifest), warns (``CheckpointSkipped``) naming it and why and loads
the next older one (``loading``). ``verify_checkpoint`` / ``offload checkpoint verify DIR``
check every checksum without a model.

Modules: ``format`` (names, manifest, checksums), ``files`` (durable writes, stale temp dirs),
``listing`` (which checkpoints exist, in which order a resume tries them, which one it starts
with and its chunk size), ``plain`` (tensors and plain data only, in and out), ``model_state``
(the model and optimizer side), ``ranks`` (how ranks agree), ``pieces`` (which saved pieces
fill a span: pure arithmetic), ``entries`` (the manifest's chunk entries from what each rank
wrote), ``reading`` (a piece read and verified, a span filled), ``compat`` (does a checkpoint
fit the model), ``saving``, ``loading``, ``verify``.
"""

from .files import SYNC_EVERY, write_file_atomic
from .format import FORMAT, LATEST, MANIFEST, SAVED_KINDS, SHARDED_VERSION, SLICED_VERSION, VERSION
from .listing import candidates, list_checkpoints, resolve_checkpoint, resumable, saved_chunk_size
from .loading import CheckpointSkipped, load_checkpoint, resume
from .model_state import persistent_buffers
from .saving import save_checkpoint
from .verify import Verdict, verify_checkpoint, verify_root

__all__ = [
    "FORMAT", "LATEST", "MANIFEST", "SAVED_KINDS", "SHARDED_VERSION", "SLICED_VERSION", "SYNC_EVERY", "VERSION",
    "CheckpointSkipped", "Verdict",
    "candidates", "list_checkpoints", "load_checkpoint", "persistent_buffers", "resolve_checkpoint",
    "resumable", "resume", "save_checkpoint", "saved_chunk_size", "verify_checkpoint", "verify_root",
    "write_file_atomic",
]
