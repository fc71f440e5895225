/*
 * offload native library: the one public header.
 *
 * cffi's cdef reads this file (see offload/_build_native.py), so it holds only
 * declarations cffi can parse: no macros with arguments, no includes, no inline code.
 * Conventions (liburing's): every function returns a count or -errno; opaque
 * handles are created and destroyed in pairs; nothing prints, exits or asserts.
 * The C code never sees torch: buffers are raw pointers plus element counts.
 */

/* ---- library facts ---------------------------------------------------- */
int off_version(void);                 /* major*10000 + minor*100 + patch */
int off_libaio_linked(void);           /* 1 when built against libaio, else 0 */

/* ---- SIMD dispatch (dispatch.c) --------------------------------------- */
enum off_simd {
    OFF_SIMD_SCALAR = 0,
    OFF_SIMD_AVX2 = 1,                 /* AVX2 + FMA + F16C */
    OFF_SIMD_AVX512 = 2                /* AVX-512F (+ AVX2/FMA/F16C) */
};
int off_simd_supported(void);          /* highest level this CPU runs */
int off_simd_level(void);              /* level in use (chosen once at load) */
int off_simd_set_level(int level);     /* 0, or -ENOTSUP above supported, -EINVAL unknown */
const char *off_simd_name(int level);  /* "scalar", "avx2", "avx512"; NULL if unknown */
int off_default_threads(void);         /* worker threads a kernel uses when asked for <= 0 */
int off_set_default_threads(int threads);   /* 0, or -EINVAL for threads < 1 */

/* ---- CPU Adam (adam_*.c): section owned by the Adam kernels ---------- */

/* ---- I/O (aio.c, buffers.c, crc32c.c): section owned by the I/O layer -- */
