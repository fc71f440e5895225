"""The chunked parameters: where each parameter lives in the chunks, their initial fill, and their values.

``ChunkedParams`` registers the ``param`` (compute dtype) and ``master`` (fp32) chunks of one
model in the store, fills them from the model (or from a ``lazy_init`` record, module by module)
and reads or writes parameter values by chunk (``gather_all``, ``scatter``: ``state_dict()``,
checkpoints, loaders). Under several ranks every record of state is this rank's *piece* of its
chunk (``offload.distributed.sharding``): reading a value is a collective that all-gathers the
pieces, and the whole chunk modules compute with is a separate ``gathered`` record. Parameters
viewing their chunk on the device are ``pins.py``'s.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from ..chunks import ChunkLayout, ChunkState, ChunkStore, ParamSlot
from ..optim.quantized import dequantize, quantize
from .precision import SCALE_KINDS, SIGNED, StatePrecision

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True, slots=True)
class ParamRef:
    index: int          # position in layout order (also the optimizer-state index)
    name: str
    slot: ParamSlot


class ChunkedParams:
    """Owns the ``param`` (compute dtype) and ``master`` (fp32, or bf16: ``precision``) chunks of one model.

    ``placeholder(ndim)``: what a parameter's ``.data`` is when no chunk is viewed (``ParamViews``).
    Under data parallelism, ``sharding`` says which piece of every chunk this rank keeps, and
    ``comms`` (on ``comm_device``) gathers the others' pieces when values are read.
    """

    def __init__(self, named: list[tuple[str, nn.Parameter]], layout: ChunkLayout, store: ChunkStore,
                 compute_dtype: torch.dtype, *, placeholder: Callable[[int], torch.Tensor], sharding=None, comms=None,
                 comm_device: torch.device = torch.device("cpu"), precision: StatePrecision | None = None):
        self.layout = layout
        self.store = store
        self.dtype = compute_dtype
        self.precision = precision if precision is not None else StatePrecision("fp32", "fp32", compute_dtype)
        # A bf16 master under bf16 compute is the parameters themselves (updated in place).
        self.has_master = self.precision.separate_master
        self.master_dtype = self.precision.master_dtype
        self.params: list[nn.Parameter] = [p for _, p in named]
        self.refs: dict[int, ParamRef] = {}
        for i, (name, p) in enumerate(named):
            self.refs[id(p)] = ParamRef(i, name, layout.slot(name))
        # Where each chunk starts in the whole layout: the bf16 master's rounding bits follow it.
        self.chunk_base = [0, *itertools.accumulate(layout.sizes)][:layout.num_chunks]
        self.chunk_members: list[list[nn.Parameter]] = [[] for _ in range(layout.num_chunks)]
        for p in self.params:
            self.chunk_members[self.refs[id(p)].slot.chunk].append(p)
        self._placeholder = placeholder
        self.sharding = sharding
        self.comms = comms
        self.comm_device = comm_device
        sized = [layout.chunk_numel(c) for c in range(layout.num_chunks)]
        self.spans = [(0, n) if sharding is None else sharding.span(n) for n in sized]
        # Per chunk: (param, start, end) of each parameter's part in this rank's piece, in offset order.
        self._pieces = [self._clip_members(c) for c in range(layout.num_chunks)]
        # What modules compute with and gradients are captured into: the chunk itself in one
        # process, a whole (padded) chunk gathered from the pieces under several ranks.
        self.compute_kind = "param" if sharding is None else "gathered"
        self.capture_kind = "grad" if sharding is None else "grad_full"
        self._register_chunks()

    # ---- geometry ------------------------------------------------------------
    def span(self, c: int) -> tuple[int, int]:
        """The elements of chunk ``c`` this rank's records hold (``(0, numel)`` in one process)."""
        return self.spans[c]

    def piece_numel(self, c: int) -> int:
        lo, hi = self.spans[c]
        return hi - lo

    def whole_numel(self, c: int) -> int:
        """Elements of chunk ``c`` as modules see it (padded to N equal pieces under N ranks)."""
        n = self.layout.chunk_numel(c)
        return n if self.sharding is None else self.sharding.padded(n)

    def piece_members(self, c: int) -> list[tuple[nn.Parameter, int, int]]:
        """``(param, start, end)``: the part of each of chunk ``c``'s parameters in this rank's
        piece, as offsets into the piece, in offset order (parameters outside it left out)."""
        return self._pieces[c]

    def _clip_members(self, c: int) -> list[tuple[nn.Parameter, int, int]]:
        lo, hi = self.spans[c]
        out = []
        for p in self.chunk_members[c]:
            s = self.refs[id(p)].slot
            a, b = max(s.offset, lo), min(s.end, hi)
            if a < b:
                out.append((p, a - lo, b - lo))
        return out

    def ref(self, p: nn.Parameter) -> ParamRef:
        return self.refs[id(p)]

    def owns(self, p: nn.Parameter) -> bool:
        return id(p) in self.refs

    def _register_chunks(self) -> None:
        chunks = range(self.layout.num_chunks)
        self.store.register_chunks("param", {c: self.piece_numel(c) for c in chunks}, self.dtype)
        if self.sharding is not None:   # held only while gathered: never written down
            self.store.register_chunks(self.compute_kind, {c: self.whole_numel(c) for c in chunks}, self.dtype,
                                       nvme=False)
        if self.has_master:
            # Frozen chunks never change: their compute-precision parameters are all they need.
            self.store.register_chunks("master", self.trainable_sizes(), self.master_dtype)

    def trainable_sizes(self) -> dict[int, int]:
        """``{chunk: elements of this rank's piece}`` of the chunks that hold trainable parameters."""
        return {c: self.piece_numel(c) for c in self.layout.trainable_chunks}

    def trainable_whole_sizes(self) -> dict[int, int]:
        """``{chunk: elements as modules see it}`` of the chunks that hold trainable parameters."""
        return {c: self.whole_numel(c) for c in self.layout.trainable_chunks}

    def master_kind(self, c: int) -> str:
        """The kind holding chunk ``c``'s most precise values: its fp32 master, or (fp32 compute,
        or a frozen chunk) its parameters."""
        return "master" if self.has_master and self.layout.trainable[c] else "param"

    def fill_from_model(self, tier: str) -> None:
        """Copy each parameter's current values into its chunks, chunk by chunk, then drop them.

        Only one chunk's worth of new storage exists at a time beyond what the tiers hold, so a
        model can be moved in even when its chunks do not all fit in memory at once. Under
        several ranks every rank has the whole model: each copies in its piece.
        """
        for c in range(self.layout.num_chunks):
            lo = self.spans[c][0]

            def fill(view, kind_dtype, c=c, lo=lo):
                view.zero_()        # padding and gaps: zeros in every kind
                for p, start, end in self._pieces[c]:
                    s = self.ref(p).slot
                    src = p.data.reshape(-1)[start + lo - s.offset:end + lo - s.offset]
                    view[start:end].copy_(src.to(kind_dtype))

            self.store.initialize(("param", c), tier, lambda v: fill(v, self.dtype))
            if self.master_kind(c) == "master":
                self.store.initialize(("master", c), tier, lambda v: fill(v, self.master_dtype))
            for p in self.chunk_members[c]:
                p.data = self._placeholder(len(self.ref(p).slot.shape))

    def fill_lazily(self, tier: str, record, model: nn.Module) -> None:
        """Materialize a ``lazy_init`` model module by module into its chunks (see offload.lazy)."""
        from ..errors import ConfigError

        if not record.initialize:
            self.fill_real_only(tier)
            return
        remaining = [len(m) for m in self.chunk_members]
        staging: dict[int, torch.Tensor] = {}
        done: set[int] = set()
        in_model = {id(m) for m in model.modules()}
        order = [m for m in record.modules if id(m) in in_model]
        recorded = {id(m) for m in order}
        order += [m for m in model.modules() if id(m) not in recorded]
        rng = torch.random.get_rng_state()
        torch.random.set_rng_state(record.rng_state)
        try:
            for module in order:
                own = [(n, p) for n, p in module.named_parameters(recurse=False, remove_duplicate=False)
                       if self.owns(p) and id(p) not in done]
                if not own:
                    continue
                if not hasattr(module, "reset_parameters"):
                    raise ConfigError("model", type(module).__name__,
                                      "was built under lazy_init but has no reset_parameters() to "
                                      "initialize its parameters " + ", ".join(n for n, _ in own))
                temps = {}
                for name, p in own:
                    s = self.ref(p).slot
                    # On the CPU, whatever the default device: the recorded RNG state is the CPU generator's.
                    temps[name] = nn.Parameter(torch.empty(s.shape, device="cpu"), requires_grad=False)
                    setattr(module, name, temps[name])
                try:
                    with torch.no_grad():
                        module.reset_parameters()
                finally:
                    for name, p in own:
                        setattr(module, name, p)
                for name, p in own:
                    ref = self.ref(p)
                    c = ref.slot.chunk
                    if c not in staging:
                        staging[c] = torch.zeros(self.layout.chunk_numel(c), dtype=torch.float32, device="cpu")
                    staging[c][ref.slot.offset:ref.slot.end].copy_(temps[name].reshape(-1))
                    done.add(id(p))
                    remaining[c] -= 1
                    if remaining[c] == 0:
                        self._initialize_chunk(c, staging.pop(c), tier)
                del temps
        finally:
            torch.random.set_rng_state(rng)
        missing = [self.names_of(c) for c, n in enumerate(remaining) if n]
        if missing:
            raise ConfigError("model", missing[0], "these parameters were never initialized by reset_parameters()")

    def fill_real_only(self, tier: str) -> None:
        """Copy in the parameters that have values (zeros beside them); chunks of meta-built
        parameters only stay empty (FREE) until a loader writes them (``lazy_init(initialize=False)``)."""
        for c, members in enumerate(self.chunk_members):
            real = [p for p in members if p.numel() == self.ref(p).slot.numel and p.numel() > 0]
            if not real:
                continue
            values = torch.zeros(self.layout.chunk_numel(c), dtype=torch.float32, device="cpu")
            for p in real:
                s = self.ref(p).slot
                values[s.offset:s.end].copy_(p.data.reshape(-1))
                p.data = self._placeholder(len(s.shape))
            self._initialize_chunk(c, values, tier)

    def names_of(self, c: int) -> list[str]:
        return [self.ref(p).name for p in self.chunk_members[c]]

    def _initialize_chunk(self, c: int, values: torch.Tensor, tier: str) -> None:
        """Chunk ``c``'s records from ``values``, the whole chunk in fp32 (this rank's piece of it)."""
        piece = self.piece_of(c, values)
        self.store.initialize(("param", c), tier, lambda v: v.copy_(piece.to(self.dtype)))
        if self.master_kind(c) == "master":
            self.store.initialize(("master", c), tier, lambda v: v.copy_(piece))

    def piece_of(self, c: int, whole: torch.Tensor) -> torch.Tensor:
        """This rank's piece of ``whole`` (chunk ``c``'s values, ``numel`` of them), zeros past its end."""
        lo, hi = self.spans[c]
        if lo == 0 and hi == whole.numel():
            return whole
        piece = torch.zeros(hi - lo, dtype=whole.dtype, device=whole.device)
        end = min(hi, whole.numel())
        if end > lo:
            piece[:end - lo].copy_(whole[lo:end])
        return piece

    # ---- values (state_dict) ------------------------------------------------
    def gather_all(self, kind: str | None = None, params=None) -> dict[int, torch.Tensor]:
        """Values of ``params`` (default: all) in chunk ``kind`` (default: the fp32 master, or the
        parameters themselves, as fp32), reading each chunk once: ``{id(param): tensor}``.
        A kind whose chunk holds nothing yet (exp_avg before the first step) reads as zeros, as
        does optimizer state of a frozen chunk (it has none).

        Under several ranks this is a collective (every rank calls it with the same arguments):
        each chunk is all-gathered from the pieces, and every rank gets every value."""
        wanted = None if params is None else {id(p) for p in params}
        out = {}
        bufs: dict[str, torch.Tensor] = {}
        for c, members in enumerate(self.chunk_members):
            members = [p for p in members if wanted is None or id(p) in wanted]
            if not members:
                continue
            k = kind or self.master_kind(c)
            if not self._has_kind(k, c):
                k = "param" if k == "master" else None
            if k is None:
                chunk = torch.zeros(self.layout.chunk_numel(c), dtype=torch.float32)
            else:
                chunk = self._whole((k, c), bufs)
            for p in members:
                s = self.ref(p).slot
                value = chunk[s.offset:s.end].view(s.shape)
                out[id(p)] = value.float() if kind is None and value.dtype != torch.float32 else value.clone()
        return out

    def scatter(self, values: dict[int, torch.Tensor], kinds=None) -> None:
        """Write new values (``{id(param): tensor}``, on every rank under several ranks) into
        chunks of ``kinds`` (default: the param and master chunks), reading and writing each
        chunk (this rank's piece of it) once."""
        if kinds is None:
            kinds = ["param"] + (["master"] if self.has_master else [])
        by_chunk: dict[int, list] = {}
        for p in self.params:
            if id(p) in values:
                by_chunk.setdefault(self.ref(p).slot.chunk, []).append(p)
        bufs = {kind: self._staging(kind) for kind in kinds}
        for c, members in by_chunk.items():
            wanted = {id(p) for p in members}
            lo = self.spans[c][0]
            for kind in kinds:
                if (kind, c) not in self.store.records:
                    continue        # a frozen chunk has no master or optimizer state
                chunk = self._piece_values((kind, c), bufs)
                for p, start, end in self._pieces[c]:
                    if id(p) in wanted:
                        s = self.ref(p).slot
                        src = values[id(p)].reshape(-1)[start + lo - s.offset:end + lo - s.offset]
                        chunk[start:end].copy_(src.to(chunk.dtype))
                if self._quantized(kind):
                    # The moments of the whole piece are quantised again: a block's scale
                    # follows every value in it, the ones just written included.
                    codes, absmax = quantize(chunk, SIGNED[kind])
                    self.store.write((kind, c), codes)
                    self.store.write((SCALE_KINDS[kind], c), absmax)
                else:
                    self.store.write((kind, c), chunk)

    def _has_kind(self, kind: str, c: int) -> bool:
        """Whether chunk ``c`` has state of ``kind``: the same answer on every rank."""
        if kind == "param":
            return True
        if kind == "master":
            return self.has_master and self.layout.trainable[c]
        return self.layout.trainable[c]

    def read_whole(self, key, buf: torch.Tensor | None = None) -> torch.Tensor:
        """Chunk ``key``'s values on the CPU, all ``numel`` of them: read here, or (several ranks,
        a collective) all-gathered from every rank's piece. A FREE record reads as zeros."""
        return self._whole(key, {} if buf is None else {key[0]: buf})

    def _whole(self, key, bufs: dict) -> torch.Tensor:
        kind, c = key
        piece = self._piece_values(key, bufs)
        if self.sharding is None:
            return piece
        block = 1 if self._quantized(kind) else self.precision.kind_block(kind)   # a scale kind: per block
        whole = torch.empty(self.whole_numel(c) // block, dtype=piece.dtype, device=self.comm_device)
        moved = piece if self.comm_device.type == "cpu" else piece.to(self.comm_device)
        self.comms.wait(self.comms.all_gather(whole, moved), f"gathering chunk {key}")
        return whole[:self.layout.chunk_numel(c) // block].cpu()

    def _quantized(self, kind: str) -> bool:
        return self.precision.quantized and kind in SCALE_KINDS

    def _piece_values(self, key, bufs: dict) -> torch.Tensor:
        """This rank's piece of chunk ``key``'s values (zeros when FREE); 8-bit moments dequantised
        to fp32 from their codes and scales. ``bufs``: staging buffers by kind, added to as needed."""
        kind, c = key
        kinds = [kind, SCALE_KINDS[kind]] if self._quantized(kind) else [kind]
        for k in kinds:
            if k not in bufs:
                bufs[k] = self._staging(k)
        if len(kinds) == 1:
            return self._read_or_zeros(key, bufs[kind])
        codes = self._read_or_zeros(key, bufs[kind])
        absmax = self._read_or_zeros((kinds[1], c), bufs[kinds[1]])
        return dequantize(codes, absmax, SIGNED[kind])

    def _staging(self, kind: str) -> torch.Tensor:
        # One buffer per call, reused chunk after chunk: the values are cloned out of it, and
        # store.write copies what it is given.
        return self.store.staging_buffers(self.store.largest_bytes(kind), count=1)[0]

    def _read_or_zeros(self, key, buf: torch.Tensor) -> torch.Tensor:
        rec = self.store.records[key]
        if rec.state is ChunkState.FREE:
            return torch.zeros(rec.numel, dtype=rec.dtype, device="cpu")
        return self.store.read_into(key, buf)
