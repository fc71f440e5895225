"""The only Python module that touches the cffi ``lib``/``ffi`` of ``offload._native``.

It loads the extension once, applies ``OFFLOAD_SIMD`` (which may lower the instruction set
for tests and never raise it), and turns ``-errno`` returns into exceptions.
"""

from __future__ import annotations

import errno
import functools
import os

from .errors import ConfigError, NativeError

SIMD_LEVELS = ("scalar", "avx2", "avx512")


@functools.lru_cache(maxsize=None)
def load():
    """Return ``(ffi, lib)``, loading the extension and applying ``OFFLOAD_SIMD`` once."""
    try:
        from . import _native  # type: ignore[attr-defined]
    except ImportError as exc:  # the package was imported from a tree that was never built
        raise NativeError(
            "offload._native is not built: install the package with `pip install -e .` "
            f"(or run `make test`), which compiles native/ ({exc})") from exc
    ffi, lib = _native.ffi, _native.lib
    lib.off_set_default_threads(physical_cores())
    wanted = os.environ.get("OFFLOAD_SIMD", "").strip().lower()
    if wanted:
        _apply_simd(lib, wanted, "OFFLOAD_SIMD")
    return ffi, lib


def physical_cores() -> int:
    """Physical cores this process may run on (the default thread count of the kernels)."""
    import psutil

    allowed = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    physical = psutil.cpu_count(logical=False) or allowed
    return max(1, min(physical, allowed))


def check_simd_name(name: str, field: str, available: list[str]) -> int:
    """The index of SIMD level ``name``; ConfigError naming ``field`` when unknown or not in
    ``available`` (the levels this CPU runs)."""
    if name not in SIMD_LEVELS:
        raise ConfigError(field, name, f"must be one of {', '.join(SIMD_LEVELS)}")
    if name not in available:
        raise ConfigError(field, name, f"this CPU supports at most {available[-1]!r}")
    return SIMD_LEVELS.index(name)


def _available(lib) -> list[str]:
    return list(SIMD_LEVELS[: lib.off_simd_supported() + 1])


def _apply_simd(lib, name: str, field: str) -> None:
    available = _available(lib)
    check(lib.off_simd_set_level(check_simd_name(name, field, available)), "off_simd_set_level")


def check(rc: int, what: str) -> int:
    """Return ``rc`` when non-negative; raise ``NativeError`` naming ``what`` and the errno."""
    if rc < 0:
        raise NativeError(f"{what} failed: {os.strerror(-rc)} (errno {-rc})")
    return rc


def simd_level() -> str:
    """The instruction set the native kernels use now."""
    _, lib = load()
    return SIMD_LEVELS[lib.off_simd_level()]


def simd_supported() -> str:
    """The best instruction set this CPU runs."""
    _, lib = load()
    return SIMD_LEVELS[lib.off_simd_supported()]


def set_simd_level(name: str) -> None:
    """Lower (or restore) the instruction set; asking above what the CPU runs is an error."""
    _, lib = load()
    _apply_simd(lib, name, "simd_level")


def libaio_linked() -> bool:
    _, lib = load()
    return bool(lib.off_libaio_linked())


def version() -> str:
    _, lib = load()
    v = lib.off_version()
    return f"{v // 10000}.{v // 100 % 100}.{v % 100}"


def native_info() -> dict:
    """Native facts as a dict: ``simd_level``, ``simd_supported``, ``libaio``, ``version``, ``default_threads``."""
    _, lib = load()
    return {
        "version": version(),
        "simd_level": simd_level(),
        "simd_supported": simd_supported(),
        "libaio": libaio_linked(),
        "default_threads": int(lib.off_default_threads()),
    }


# ---- I/O layer (offload/aio): aligned buffers, CRC32C, libaio contexts, blocking pread/pwrite.
# Section owned by the I/O layer. Per-request I/O failures are data here (a result code per
# completion); `io_error` is where an errno becomes an NvmeIOError.

IO_READ = 0
IO_WRITE = 1
BUF_HUGEPAGE = 1
BUF_POPULATE = 2


def io_error(err: int, path: str, offset: int, length: int, what: str = ""):
    """The ``NvmeIOError`` for errno ``err`` (positive or negative) on ``length`` bytes at ``offset``."""
    from .errors import NvmeIOError

    return NvmeIOError(abs(int(err)), path, offset, length, what)


def buffer_alloc(nbytes: int, *, hugepage: bool, populate: bool):
    """An mmap'd, page-aligned (2 MiB with ``hugepage``), zero-filled buffer of ``nbytes`` bytes.

    Returns ``(buf, address)``: ``buf`` supports the buffer protocol and owns the memory,
    which is unmapped when ``buf`` and everything viewing it are gone.
    """
    from .errors import PinnedMemoryError

    ffi, lib = load()
    flags = (BUF_HUGEPAGE if hugepage else 0) | (BUF_POPULATE if populate else 0)
    out = ffi.new("void **")
    rc = lib.off_buffer_alloc(out, nbytes, flags)
    if rc < 0:
        raise PinnedMemoryError(f"cannot map {nbytes} bytes of aligned host memory: "
                                f"{os.strerror(-rc)} (errno {-rc})")
    size = int(nbytes)
    ptr = ffi.gc(ffi.cast("char *", out[0]), lambda p: lib.off_buffer_free(p, size, flags))
    return ffi.buffer(ptr, max(size, 1)), int(ffi.cast("uintptr_t", ptr))


def buffer_lock(address: int, nbytes: int) -> int:
    """mlock ``nbytes`` at ``address``: 0 or -errno (the caller decides what a refusal means)."""
    ffi, lib = load()
    return int(lib.off_buffer_lock(ffi.cast("void *", address), nbytes))


def buffer_unlock(address: int, nbytes: int) -> int:
    """munlock ``nbytes`` at ``address``: 0 or -errno."""
    ffi, lib = load()
    return int(lib.off_buffer_unlock(ffi.cast("void *", address), nbytes))


def crc32c(address: int, nbytes: int, crc: int = 0, *, portable: bool = False) -> int:
    """CRC32C of ``nbytes`` bytes at ``address``, continuing from ``crc`` (SSE4.2 unless ``portable``)."""
    ffi, lib = load()
    fn = lib.off_crc32c_portable if portable else lib.off_crc32c
    return int(fn(crc, ffi.cast("void *", address), nbytes))


def pio(fd: int, op: int, address: int, length: int, offset: int) -> int:
    """Blocking pread/pwrite of the whole range (GIL released): bytes moved, or -errno."""
    ffi, lib = load()
    return int(lib.off_pio(fd, op, ffi.cast("void *", address), length, offset))


def preallocate(fd: int, length: int) -> int:
    """fallocate the first ``length`` bytes of ``fd``: 0 or -errno (-EOPNOTSUPP: not supported)."""
    return int(load()[1].off_preallocate(fd, length))


class AioContext:
    """One kernel AIO context (``off_aio``): ``depth`` requests in the kernel, any number accepted.

    A native completion thread keeps the kernel queue full from its pending list, so Python
    latency never drains it. ``submit`` takes ``(tag, fd, op, address, offset, length)``
    tuples and returns their number or -errno (none accepted); ``reap`` returns ``(tag,
    result, done)`` tuples (result == length on success, else -errno; a short transfer is
    -EIO with ``done`` >= 0 bytes, an error has ``done`` -1). Native calls release the GIL.
    """

    REAP_BATCH = 256

    def __init__(self, depth: int, submit_batch: int = 1):
        ffi, lib = load()
        out = ffi.new("off_aio **")
        rc = lib.off_aio_create(out, depth, submit_batch)
        if rc < 0:
            from .errors import NvmeIOError

            raise NvmeIOError(-rc, "<aio context>", 0, 0,
                              f"io_setup({depth}) failed" + (" (built without libaio)" if rc == -errno.ENOSYS else
                                                             "; see /proc/sys/fs/aio-max-nr"))
        self._ffi, self._lib, self._ctx, self.depth = ffi, lib, out[0], depth
        self._done = ffi.new("off_io_done[]", self.REAP_BATCH)

    def set_background_limit(self, n: int) -> int:
        """Let background requests hold at most ``n`` (>= 1) of the kernel slots: 0 or -errno."""
        return int(self._lib.off_aio_set_background_limit(self._ctx, n))

    def submit(self, reqs, urgent: bool = False) -> int:
        """``urgent`` requests go to the kernel ahead of every background one still pending."""
        n = len(reqs)
        if n == 0:
            return 0
        arr = self._ffi.new("off_io_req[]", n)
        cast = self._ffi.cast
        for r, (tag, fd, op, address, offset, length) in zip(arr, reqs):
            r.tag, r.fd, r.op, r.offset, r.length = tag, fd, op, offset, length
            r.buf = cast("void *", address)
        submit = self._lib.off_aio_submit_urgent if urgent else self._lib.off_aio_submit
        return int(submit(self._ctx, arr, n))

    def reap(self, min_nr: int, max_nr: int, timeout_ns: int):
        """Completions as a list, or an int -errno when reaping itself failed."""
        max_nr = min(max_nr, self.REAP_BATCH)
        got = self._lib.off_aio_reap(self._ctx, self._done, min(min_nr, max_nr), max_nr, timeout_ns)
        if got < 0:
            return int(got)
        d = self._done
        return [(int(d[i].tag), int(d[i].result), int(d[i].done)) for i in range(got)]

    def inflight(self) -> int:
        return int(self._lib.off_aio_inflight(self._ctx))

    def wake(self) -> None:
        """Make a ``reap`` waiting now return early (used to stop a collector thread)."""
        self._lib.off_aio_wake(self._ctx)

    def destroy(self) -> None:
        """Finish accepted requests and free the context (idempotent; no reap may be running)."""
        if self._ctx is not None:
            self._lib.off_aio_destroy(self._ctx)
            self._ctx = None
# ---- CPU Adam (offload/optim, offload/bench/adam): section owned by the Adam kernels ----

DTYPE_CODES = {"none": 0, "fp32": 1, "bf16": 2, "fp16": 3}   # enum off_dtype


def adam_step_raw(*, param: int, grad: int, grad_dtype: str, exp_avg: int, exp_avg_sq: int,
                  out: int, out_dtype: str, n: int, lr: float, beta1: float, beta2: float,
                  eps: float, weight_decay: float, grad_scale: float, step: int,
                  decoupled: bool, maximize: bool, threads: int, level: str | None) -> None:
    """One Adam step over ``n`` elements at raw addresses (ints); callers validate first.

    ``level`` forces an instruction set (``None``: the one in use). ``threads`` <= 0 means the
    default. The GIL is released for the whole call.
    """
    ffi, lib = load()
    hp = ffi.new("off_adam_hparams *", {
        "lr": lr, "beta1": beta1, "beta2": beta2, "eps": eps, "weight_decay": weight_decay,
        "grad_scale": grad_scale, "step": step, "decoupled": int(bool(decoupled)),
        "maximize": int(bool(maximize))})
    args = (hp, ffi.cast("float *", param), ffi.cast("void *", grad), DTYPE_CODES[grad_dtype],
            ffi.cast("float *", exp_avg), ffi.cast("float *", exp_avg_sq),
            ffi.cast("void *", out), DTYPE_CODES[out_dtype], n, threads)
    if level is None:
        rc = lib.off_adam_step(*args)
    else:
        rc = lib.off_adam_step_level(SIMD_LEVELS.index(level), *args)
    check(rc, "off_adam_step")


def stream_probe_raw(*, a: int, b: int, c: int, d: int, d_dtype: str, e: int, e_dtype: str,
                     n: int, threads: int, level: str | None = None) -> None:
    """The roofline loop over ``n`` elements: a, b, c (fp32) read and written, d read
    (``d_dtype``: fp32/bf16/fp16), e written (``e_dtype``: bf16/fp16, or "none")."""
    ffi, lib = load()
    args = (ffi.cast("float *", a), ffi.cast("float *", b), ffi.cast("float *", c),
            ffi.cast("void *", d), DTYPE_CODES[d_dtype], ffi.cast("void *", e),
            DTYPE_CODES[e_dtype], n, threads)
    if level is None:
        rc = lib.off_stream_probe(*args)
    else:
        rc = lib.off_stream_probe_level(SIMD_LEVELS.index(level), *args)
    check(rc, "off_stream_probe")


def simd_available() -> list[str]:
    """Every instruction set this CPU runs, lowest first (what tests and benchmarks sweep)."""
    return _available(load()[1])


# ---- 8-bit Adam state (offload/optim/quantized.py): section owned by the 8-bit kernels ----

QMAPS = {"signed": 0, "unsigned": 1}   # enum off_qmap


def qmap_values(map_name: str) -> list[float]:
    """The 256 values of the ``"signed"`` or ``"unsigned"`` dynamic map, ascending (the table
    the library quantises with; it is built once inside the library)."""
    ffi, lib = load()
    out = ffi.new("float[]", 256)
    check(lib.off_qmap_values(QMAPS[map_name], out), "off_qmap_values")
    return list(out)


def adam8_step_raw(*, master: int, master_dtype: str, grad: int, grad_dtype: str, exp_avg: int,
                   exp_avg_absmax: int, exp_avg_sq: int, exp_avg_sq_absmax: int, block: int,
                   out: int, out_dtype: str, n: int, lr: float, beta1: float, beta2: float,
                   eps: float, weight_decay: float, grad_scale: float, step: int,
                   decoupled: bool, maximize: bool, seed: int, index_base: int, threads: int,
                   level: str | None) -> None:
    """One 8-bit Adam step over ``n`` elements at raw addresses (ints); callers validate
    first. ``level`` forces an instruction set (``None``: the one in use). GIL released."""
    ffi, lib = load()
    hp = ffi.new("off_adam_hparams *", {
        "lr": lr, "beta1": beta1, "beta2": beta2, "eps": eps, "weight_decay": weight_decay,
        "grad_scale": grad_scale, "step": step, "decoupled": int(bool(decoupled)),
        "maximize": int(bool(maximize))})
    st = ffi.new("off_adam8_state *", {
        "exp_avg": ffi.cast("unsigned char *", exp_avg),
        "exp_avg_absmax": ffi.cast("float *", exp_avg_absmax),
        "exp_avg_sq": ffi.cast("unsigned char *", exp_avg_sq),
        "exp_avg_sq_absmax": ffi.cast("float *", exp_avg_sq_absmax), "block": block})
    args = (hp, ffi.cast("void *", master), DTYPE_CODES[master_dtype], ffi.cast("void *", grad),
            DTYPE_CODES[grad_dtype], st, ffi.cast("void *", out), DTYPE_CODES[out_dtype], n,
            seed, index_base, threads)
    if level is None:
        rc = lib.off_adam8_step(*args)
    else:
        rc = lib.off_adam8_step_level(SIMD_LEVELS.index(level), *args)
    check(rc, "off_adam8_step")


def blockwise_quantize_raw(*, map_name: str, x: int, codes: int, absmax: int, block: int, n: int,
                           threads: int, level: str | None = None) -> None:
    """Quantise ``n`` fp32 values at ``x`` into codes and one absmax per block."""
    ffi, lib = load()
    rc = lib.off_blockwise_quantize(-1 if level is None else SIMD_LEVELS.index(level),
                                    QMAPS[map_name], ffi.cast("float *", x),
                                    ffi.cast("unsigned char *", codes), ffi.cast("float *", absmax),
                                    block, n, threads)
    check(rc, "off_blockwise_quantize")


def blockwise_dequantize_raw(*, map_name: str, codes: int, absmax: int, block: int, x: int,
                             n: int) -> None:
    """``x[i] = map[codes[i]] * absmax[i // block]`` for ``n`` elements."""
    ffi, lib = load()
    rc = lib.off_blockwise_dequantize(QMAPS[map_name], ffi.cast("unsigned char *", codes),
                                      ffi.cast("float *", absmax), block, ffi.cast("float *", x), n)
    check(rc, "off_blockwise_dequantize")


# ---- 16-bit Adam state (offload/optim/kernel.py): section owned by the bf16-moment kernels ----

def adam16_step_raw(*, master: int, master_dtype: str, grad: int, grad_dtype: str, exp_avg: int,
                    exp_avg_sq: int, moment_dtype: str, out: int, out_dtype: str, n: int,
                    lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                    grad_scale: float, step: int, decoupled: bool, maximize: bool, seed: int,
                    index_base: int, threads: int, level: str | None) -> None:
    """One Adam step with bf16 moments and/or a bf16 master over ``n`` elements at raw
    addresses (ints); callers validate first. ``level`` forces an instruction set (``None``:
    the one in use). GIL released."""
    ffi, lib = load()
    hp = ffi.new("off_adam_hparams *", {
        "lr": lr, "beta1": beta1, "beta2": beta2, "eps": eps, "weight_decay": weight_decay,
        "grad_scale": grad_scale, "step": step, "decoupled": int(bool(decoupled)),
        "maximize": int(bool(maximize))})
    args = (hp, ffi.cast("void *", master), DTYPE_CODES[master_dtype], ffi.cast("void *", grad),
            DTYPE_CODES[grad_dtype], ffi.cast("void *", exp_avg), ffi.cast("void *", exp_avg_sq),
            DTYPE_CODES[moment_dtype], ffi.cast("void *", out), DTYPE_CODES[out_dtype], n, seed,
            index_base, threads)
    if level is None:
        rc = lib.off_adam16_step(*args)
    else:
        rc = lib.off_adam16_step_level(SIMD_LEVELS.index(level), *args)
    check(rc, "off_adam16_step")
