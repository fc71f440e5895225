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
enum off_dtype {
    OFF_DTYPE_NONE = 0,
    OFF_DTYPE_FP32 = 1,
    OFF_DTYPE_BF16 = 2,
    OFF_DTYPE_FP16 = 3
};

/* Doubles, as torch derives its scalars from Python floats; the kernels round each derived
 * constant (1 - beta1, lr / (1 - beta1^t), ...) to float once. */
typedef struct off_adam_hparams {
    double lr;
    double beta1;
    double beta2;
    double eps;
    double weight_decay;
    double grad_scale;     /* every gradient is multiplied by this first (1/loss_scale * clip) */
    long long step;        /* the step being taken, >= 1 (bias correction uses it) */
    int decoupled;         /* 1: AdamW (decoupled decay); 0: Adam (L2 added to the gradient) */
    int maximize;          /* 1: ascend (torch's maximize=True) */
} off_adam_hparams;

/*
 * One Adam/AdamW step over n elements, in place on param/exp_avg/exp_avg_sq (fp32).
 * grad has grad_dtype (FP32/BF16/FP16). When out_dtype is BF16 or FP16, the updated
 * parameters are also written, rounded to nearest even, into out (n elements);
 * OFF_DTYPE_NONE leaves out untouched (may be NULL). threads <= 0 means the default.
 * Every level and every thread count give the same bits.
 * Returns 0, or -EINVAL for a bad argument (nothing modified).
 */
int off_adam_step(const off_adam_hparams *hp, float *param, const void *grad, int grad_dtype,
                  float *exp_avg, float *exp_avg_sq, void *out, int out_dtype,
                  long long n, int threads);
/* Same, forcing one SIMD level (tests and benchmarks); -ENOTSUP if the CPU lacks it. */
int off_adam_step_level(int level, const off_adam_hparams *hp, float *param, const void *grad,
                        int grad_dtype, float *exp_avg, float *exp_avg_sq, void *out,
                        int out_dtype, long long n, int threads);

/*
 * Memory-traffic probe with Adam's access pattern, the roofline: a, b, c (fp32) read and
 * written, d read (d_dtype FP32/BF16/FP16, like the gradient), e written (e_dtype BF16/FP16,
 * like the low-precision copy, or NONE), with the same conversions and next to no
 * arithmetic. Returns 0 or -EINVAL.
 */
int off_stream_probe(float *a, float *b, float *c, const void *d, int d_dtype, void *e,
                     int e_dtype, long long n, int threads);
int off_stream_probe_level(int level, float *a, float *b, float *c, const void *d, int d_dtype,
                           void *e, int e_dtype, long long n, int threads);

/* ---- 8-bit Adam state (adam8*.c): section owned by the 8-bit Adam kernels ---------
 * Block-wise dynamic quantization (Dettmers et al. 2022, bitsandbytes' AdamW8bit): exp_avg
 * as codes of the signed dynamic map, exp_avg_sq of the unsigned one, each block of `block`
 * elements with one fp32 absmax scale: value = map[code] * absmax. A block whose updated
 * moment holds a NaN or an infinity stores a NaN scale (its codes those of zero), so the
 * poison is never dropped; a block whose absmax is below FLT_MIN is stored as zeros. */
enum off_qmap {
    OFF_QMAP_SIGNED = 0,               /* 256 values in [-1, 1]: exp_avg */
    OFF_QMAP_UNSIGNED = 1              /* 256 values in [0, 1]: exp_avg_sq */
};
/* The 256 values of a map, ascending, into out (built once in the library): 0 or -EINVAL. */
int off_qmap_values(int map, float *out);

typedef struct off_adam8_state {
    unsigned char *exp_avg;            /* n codes (signed map) */
    float *exp_avg_absmax;             /* ceil(n / block) scales */
    unsigned char *exp_avg_sq;         /* n codes (unsigned map) */
    float *exp_avg_sq_absmax;          /* ceil(n / block) scales */
    long long block;                   /* elements per block: a multiple of 64 in [64, 4096] */
} off_adam8_state;

/*
 * One Adam/AdamW step over n elements with 8-bit moments: dequantise, update (the fp32
 * kernel's arithmetic, hp as there), requantise with a new absmax per block, in place.
 * The slice starts at a block boundary; its last block may be short. master_dtype FP32, or
 * BF16 (stochastic rounding with bits hashed from seed, hp->step and index_base + i, i the
 * element's index in the slice). out_dtype FP32/BF16/FP16 receives the stored parameters
 * (nearest even from the fp32 master; from a bf16 master its exact value, rounded for FP16),
 * NONE leaves out alone. Every level and thread count give the same bits.
 * Returns 0, or -EINVAL for a bad argument (nothing modified).
 */
int off_adam8_step(const off_adam_hparams *hp, void *master, int master_dtype, const void *grad,
                   int grad_dtype, const off_adam8_state *state, void *out, int out_dtype,
                   long long n, unsigned long long seed, long long index_base, int threads);
int off_adam8_step_level(int level, const off_adam_hparams *hp, void *master, int master_dtype,
                         const void *grad, int grad_dtype, const off_adam8_state *state,
                         void *out, int out_dtype, long long n, unsigned long long seed,
                         long long index_base, int threads);
/* Quantise n floats block by block (nearest code, ties to the lower one), forcing a level
 * (-1: the one in use): 0, -EINVAL or -ENOTSUP. Dequantise: value = map[code] * absmax. */
int off_blockwise_quantize(int level, int map, const float *x, unsigned char *codes,
                           float *absmax, long long block, long long n, int threads);
int off_blockwise_dequantize(int map, const unsigned char *codes, const float *absmax,
                             long long block, float *x, long long n);

/* ---- 16-bit Adam state (adam16*.c): section owned by the bf16-moment Adam kernels ----
 * The fp32 update of off_adam8_step (the denominator's bias correction folded into two
 * constants) with exp_avg/exp_avg_sq held in moment_dtype (BF16 or FP32) and the master in
 * master_dtype (FP32 or BF16), but not both FP32 (that is off_adam_step). Every bf16 store is a
 * stochastic rounding: the master's bits are off_adam8_step's (seed, hp->step, index_base + i),
 * exp_avg uses the high half of the same hash, exp_avg_sq a second hash. out_dtype as in
 * off_adam8_step. Any split at any element gives the same bits; every level and thread count
 * give the same bits. Returns 0, or -EINVAL for a bad argument (nothing modified). */
int off_adam16_step(const off_adam_hparams *hp, void *master, int master_dtype, const void *grad,
                    int grad_dtype, void *exp_avg, void *exp_avg_sq, int moment_dtype, void *out,
                    int out_dtype, long long n, unsigned long long seed, long long index_base,
                    int threads);
int off_adam16_step_level(int level, const off_adam_hparams *hp, void *master, int master_dtype,
                          const void *grad, int grad_dtype, void *exp_avg, void *exp_avg_sq,
                          int moment_dtype, void *out, int out_dtype, long long n,
                          unsigned long long seed, long long index_base, int threads);

/* ---- I/O (aio.c, buffers.c, crc32c.c): section owned by the I/O layer -- */
/* Aligned host buffers (buffers.c). Memory comes from mmap: page-aligned, zero-filled. */
enum off_buffer_flags {
    OFF_BUF_HUGEPAGE = 1,              /* 2 MiB-aligned and madvise(MADV_HUGEPAGE) */
    OFF_BUF_POPULATE = 2               /* touch every page before returning */
};
int off_buffer_alloc(void **out, long long size, int flags);       /* 0 or -errno */
void off_buffer_free(void *ptr, long long size, int flags);         /* same size and flags */
long long off_buffer_mapped_size(long long size, int flags);        /* bytes really mapped */
int off_buffer_lock(void *ptr, long long size);                     /* mlock: 0 or -errno */
int off_buffer_unlock(void *ptr, long long size);

/* CRC32C (crc32c.c): SSE4.2 when the CPU has it (chosen at run time), else a table. */
unsigned int off_crc32c(unsigned int crc, const void *data, long long size);
unsigned int off_crc32c_portable(unsigned int crc, const void *data, long long size);
int off_crc32c_hw(void);               /* 1 when the SSE4.2 path is in use */

/* Asynchronous I/O (aio.c). */
enum off_io_op {
    OFF_IO_READ = 0,
    OFF_IO_WRITE = 1
};

typedef struct off_io_req {
    int fd;
    int op;                            /* OFF_IO_READ / OFF_IO_WRITE */
    void *buf;
    long long offset;                  /* bytes into the file */
    long long length;                  /* bytes */
    unsigned long long tag;            /* caller's cookie, returned with the completion */
} off_io_req;

typedef struct off_io_done {
    unsigned long long tag;
    long long result;                  /* == length on success, else -errno; short = -EIO */
    long long done;                    /* bytes moved; with result -EIO and done >= 0 the
                                          transfer was short, done == -1 marks an error */
} off_io_done;

typedef struct off_aio off_aio;        /* opaque: one kernel AIO context + completion thread */

/* A context with queue_depth request slots and its own completion thread (a pthread that
 * refills freed slots from the pending list without waiting for the caller), giving the
 * kernel at most submit_batch requests per io_submit call: 0 or -errno (-ENOSYS without
 * libaio). */
int off_aio_create(off_aio **out, int queue_depth, int submit_batch);
/* Finishes every accepted request, stops the thread, frees the context. No reap may be
 * running on it. */
void off_aio_destroy(off_aio *ctx);
/* Accept n requests (any number): what fits is given to the kernel now in one io_submit,
 * the rest as slots free up. Returns n, or -errno with none accepted (-EINVAL for a bad
 * request, -ENOMEM). Each accepted request completes exactly once through off_aio_reap;
 * one the kernel refuses completes with its error. */
int off_aio_submit(off_aio *ctx, const off_io_req *reqs, int n);
/* The same for requests something is waiting for: they go to the kernel ahead of every
 * background request not yet there. */
int off_aio_submit_urgent(off_aio *ctx, const off_io_req *reqs, int n);
/* Let background requests hold at most n (>= 1) of the kernel slots (default: all): 0 or -errno. */
int off_aio_set_background_limit(off_aio *ctx, int n);
/* Take min_nr..max_nr completions, waiting up to timeout_ns (< 0: forever): count (0 on
 * timeout) or -errno. */
int off_aio_reap(off_aio *ctx, off_io_done *out, int min_nr, int max_nr, long long timeout_ns);
/* Requests accepted and not yet reaped. */
int off_aio_inflight(off_aio *ctx);
/* Make every off_aio_reap now waiting on ctx return what it has (maybe 0): 0 or -errno. */
int off_aio_wake(off_aio *ctx);

/* Blocking pread/pwrite of the whole range (EINTR and partial transfers handled): bytes
 * moved (< length only at end of file) or -errno. Used by the thread backend. */
long long off_pio(int fd, int op, void *buf, long long length, long long offset);
/* fallocate(fd, 0, 0, length): 0 or -errno (-EOPNOTSUPP where the filesystem lacks it). */
int off_preallocate(int fd, long long length);
