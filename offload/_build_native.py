"""Declares the one native extension, ``offload._native`` (cffi, out-of-line API mode).

setuptools runs this through ``cffi_modules`` at install time, so the C code is compiled
by the package's own build: there is no JIT compile at first use. Instruction sets are
chosen at run time (native/dispatch.c); every x86 kernel file carries its own
``#pragma GCC target``, so the compile line never names an architecture. libaio is
linked when a trial compile finds its header and library; otherwise the build still
succeeds and ``off_libaio_linked()`` reports 0 (the I/O layer then uses its thread
backend).
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

from cffi import FFI

_ROOT = Path(__file__).resolve().parent.parent
_NATIVE = _ROOT / "native"
_HEADER = _NATIVE / "offload.h"

# -O3 is the whole optimisation story; target features live in each file's pragma.
# -ffp-contract=off: the scalar kernels are the bit-for-bit reference of the SIMD ones, so no
# a*b+c may become an FMA behind their back (GCC contracts by default wherever FMA exists).
COMPILE_ARGS = ["-O3", "-std=gnu11", "-pthread", "-fvisibility=hidden", "-ffp-contract=off",
                "-Wall", "-Wno-unused-function"]


def _compiler() -> list[str]:
    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    return cc.split()


def libaio_available() -> bool:
    """True when ``#include <libaio.h>`` compiles and ``-laio`` links."""
    if os.environ.get("OFFLOAD_NO_LIBAIO") == "1":
        return False
    program = "#include <libaio.h>\nint main(void){io_context_t c = 0; return io_setup(1, &c) < -1000;}\n"
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "probe.c"
        src.write_text(program)
        cmd = [*_compiler(), str(src), "-o", str(Path(tmp) / "probe"), "-laio"]
        try:
            done = subprocess.run(cmd, capture_output=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            return False
        return done.returncode == 0


def _rel(path: Path) -> str:
    # setuptools builds from the project root and prefers relative paths there.
    return os.path.relpath(path, Path.cwd()) if Path.cwd().resolve() == _ROOT else str(path)


def make_builder() -> FFI:
    have_aio = libaio_available()
    if not have_aio:
        print("offload build: libaio not found (install libaio-dev); building without it, "
              "the I/O layer will use its thread backend", file=sys.stderr)
    builder = FFI()
    builder.cdef(_HEADER.read_text())
    builder.set_source(
        "offload._native",
        '#include "offload.h"\n',
        sources=[_rel(f) for f in sorted(_NATIVE.glob("*.c"))],
        include_dirs=[_rel(_NATIVE)],
        define_macros=[("OFF_HAVE_LIBAIO", "1")] if have_aio else [],
        libraries=["aio"] if have_aio else [],
        extra_compile_args=COMPILE_ARGS,
        extra_link_args=["-pthread"],
    )
    return builder


ffibuilder = make_builder()

if __name__ == "__main__":
    ffibuilder.compile(tmpdir=str(_ROOT), verbose=True)
