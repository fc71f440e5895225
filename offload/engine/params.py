"""The chunked parameters: where each parameter lives in the chunks, their initial fill, and their values.

``ChunkedParams`` registers the ``param`` (compute dtype) and ``master`` (fp32) chunks of one
model in the store, fills them from the model (or from a ``lazy_init`` record, module by module)
and reads or writes parameter values by chunk (``gather_all``, ``scatter``: ``state_dict()``,
checkpoints, loaders). Under several ranks it keeps only the chunks this rank owns, and reading a
value is a collective. Parameters viewing their chunk on the device are ``pins.py``'s.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..chunks import ChunkLayout, ChunkState, ChunkStore, ParamSlot

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True, slots=True)
class ParamRef:
    index: int          # position in layout order (also the optimizer-state index)
    name: str
    slot: ParamSlot


class ChunkedParams:
    """Owns the ``param`` (compute dtype) and ``master`` (fp32) chunks of one model.

    ``placeholder``: what a parameter's ``.data`` is when no chunk is viewed (``ParamViews``).
    Under data parallelism, ``sharding`` says which chunks this rank keeps, and ``comms`` (on
    ``comm_device``) brings the others' values when they are read.
    """

    def __init__(self, named: list[tuple[str, nn.Parameter]], layout: ChunkLayout, store: ChunkStore,
                 compute_dtype: torch.dtype, *, placeholder: torch.Tensor, sharding=None, comms=None,
                 comm_device: torch.device = torch.device("cpu")):
        self.layout = layout
        self.store = store
        self.dtype = compute_dtype
        self.has_master = compute_dtype != torch.float32
        self.params: list[nn.Parameter] = [p for _, p in named]
        self.refs: dict[int, ParamRef] = {}
        for i, (name, p) in enumerate(named):
            self.refs[id(p)] = ParamRef(i, name, layout.slot(name))
        self.chunk_members: list[list[nn.Parameter]] = [[] for _ in range(layout.num_chunks)]
        for p in self.params:
            self.chunk_members[self.refs[id(p)].slot.chunk].append(p)
        self._placeholder = placeholder
        self.sharding = sharding
        self.comms = comms
        self.comm_device = comm_device
        self._register_chunks()

    def keeps(self, c: int) -> bool:
        """Whether this rank stores chunk ``c`` (its parameters, master and optimizer state)."""
        return self.sharding is None or self.sharding.owns(c)

    def ref(self, p: nn.Parameter) -> ParamRef:
        return self.refs[id(p)]

    def owns(self, p: nn.Parameter) -> bool:
        return id(p) in self.refs

    def _register_chunks(self) -> None:
        sizes = dict(enumerate(self.layout.sizes))
        self.store.register_chunks("param", {c: n for c, n in sizes.items() if self.keeps(c)}, self.dtype)
        borrowed = {c: n for c, n in sizes.items() if not self.keeps(c)}
        if borrowed:    # held only while gathered from their owners: never written down
            self.store.register_chunks("param", borrowed, self.dtype, nvme=False)
        if self.has_master:
            # Frozen chunks never change: their compute-precision parameters are all they need.
            self.store.register_chunks("master", self.trainable_sizes(kept_only=True), torch.float32)

    def trainable_sizes(self, kept_only: bool = False) -> dict[int, int]:
        """``{chunk: elements}`` of the chunks that hold trainable parameters (``kept_only``:
        those this rank stores)."""
        return {c: self.layout.sizes[c] for c in self.layout.trainable_chunks if not kept_only or self.keeps(c)}

    def master_kind(self, c: int) -> str:
        """The kind holding chunk ``c``'s most precise values: its fp32 master, or (fp32 compute,
        or a frozen chunk) its parameters."""
        return "master" if self.has_master and self.layout.trainable[c] else "param"

    def fill_from_model(self, tier: str) -> None:
        """Copy each parameter's current values into its chunks, chunk by chunk, then drop them.

        Only one chunk's worth of new storage exists at a time beyond what the tiers hold, so a
        model can be moved in even when its chunks do not all fit in memory at once.
        """
        for c, members in enumerate(self.chunk_members):
            values = {id(p): p.data for p in members}

            def fill(view, kind_dtype, values=values, members=members):
                for p in members:
                    s = self.ref(p).slot
                    view[s.offset:s.end].copy_(values[id(p)].reshape(-1).to(kind_dtype))

            if self.keeps(c):
                self.store.initialize(("param", c), tier, lambda v: fill(v, self.dtype))
                if self.master_kind(c) == "master":
                    self.store.initialize(("master", c), tier, lambda v: fill(v, torch.float32))
            for p in members:
                p.data = self._placeholder

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
            if not self.keeps(c):
                for p in real:
                    p.data = self._placeholder
                continue
            values = torch.zeros(self.layout.chunk_numel(c), dtype=torch.float32, device="cpu")
            for p in real:
                s = self.ref(p).slot
                values[s.offset:s.end].copy_(p.data.reshape(-1))
                p.data = self._placeholder
            self._initialize_chunk(c, values, tier)

    def names_of(self, c: int) -> list[str]:
        return [self.ref(p).name for p in self.chunk_members[c]]

    def _initialize_chunk(self, c: int, values: torch.Tensor, tier: str) -> None:
        if not self.keeps(c):
            return
        self.store.initialize(("param", c), tier, lambda v: v.copy_(values.to(self.dtype)))
        if self.master_kind(c) == "master":
            self.store.initialize(("master", c), tier, lambda v: v.copy_(values))

    # ---- values (state_dict) ------------------------------------------------
    def gather_all(self, kind: str | None = None, params=None) -> dict[int, torch.Tensor]:
        """Values of ``params`` (default: all) in chunk ``kind`` (default: the fp32 master, or the
        parameters themselves, as fp32), reading each chunk once: ``{id(param): tensor}``.
        A kind whose chunk holds nothing yet (exp_avg before the first step) reads as zeros, as
        does optimizer state of a frozen chunk (it has none).

        Under several ranks this is a collective (every rank calls it with the same arguments):
        each chunk comes from its owner by broadcast, and every rank gets every value."""
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
                if k not in bufs:
                    bufs[k] = self._staging(k)
                chunk = self._from_owner((k, c), bufs[k])
            for p in members:
                s = self.ref(p).slot
                value = chunk[s.offset:s.end].view(s.shape)
                out[id(p)] = value.float() if kind is None and value.dtype != torch.float32 else value.clone()
        return out

    def scatter(self, values: dict[int, torch.Tensor], kinds=None) -> None:
        """Write new values (``{id(param): tensor}``) into chunks of ``kinds`` (default: the param
        and master chunks), reading and writing each chunk once."""
        if kinds is None:
            kinds = ["param"] + (["master"] if self.has_master else [])
        by_chunk: dict[int, list] = {}
        for p in self.params:
            if id(p) in values:
                by_chunk.setdefault(self.ref(p).slot.chunk, []).append(p)
        bufs = {kind: self._staging(kind) for kind in kinds}
        for c, members in by_chunk.items():
            if not self.keeps(c):
                continue        # its owner writes it
            for kind in kinds:
                if (kind, c) not in self.store.records:
                    continue        # a frozen chunk has no master or optimizer state
                chunk = self._read_or_zeros((kind, c), bufs[kind])
                for p in members:
                    s = self.ref(p).slot
                    chunk[s.offset:s.end].copy_(values[id(p)].reshape(-1).to(chunk.dtype))
                self.store.write((kind, c), chunk)

    def _has_kind(self, kind: str, c: int) -> bool:
        """Whether chunk ``c`` has state of ``kind`` (on its owner): the same answer on every rank."""
        if kind == "param":
            return True
        if kind == "master":
            return self.has_master and self.layout.trainable[c]
        return self.layout.trainable[c]

    def _from_owner(self, key, buf: torch.Tensor) -> torch.Tensor:
        """Chunk ``key``'s values on the CPU: read here, or (another rank's) broadcast by its owner."""
        kind, c = key
        if self.sharding is None:
            return self._read_or_zeros(key, buf)
        if self.keeps(c):
            chunk = self._read_or_zeros(key, buf)
        else:
            dtype = self.dtype if kind == "param" else torch.float32
            chunk = torch.empty(self.layout.chunk_numel(c), dtype=dtype)
        moved = chunk if self.comm_device.type == "cpu" else chunk.to(self.comm_device)
        self.comms.wait(self.comms.broadcast(moved, self.sharding.owner(c)), f"gathering chunk {key}")
        return moved if moved is chunk else moved.cpu()

    def _staging(self, kind: str) -> torch.Tensor:
        # One buffer per call, reused chunk after chunk: the values are cloned out of it, and
        # store.write copies what it is given.
        return self.store.staging_buffers(self.store.largest_bytes(kind), count=1)[0]

    def _read_or_zeros(self, key, buf: torch.Tensor) -> torch.Tensor:
        rec = self.store.records[key]
        if rec.state is ChunkState.FREE:
            return torch.zeros(rec.numel, dtype=rec.dtype, device="cpu")
        return self.store.read_into(key, buf)
