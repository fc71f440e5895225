/*
 * Asynchronous file I/O over Linux native AIO (libaio), plus the blocking primitives the
 * thread backend uses.
 *
 * One off_aio is one kernel AIO context with a fixed number of request slots (the queue
 * depth). off_aio_submit queues a batch with a single io_submit; off_aio_reap collects
 * completions with a timeout, so a caller can always come back to check for shutdown. Every
 * completion's result is compared with the length asked for: a short transfer becomes -EIO
 * for that request (with the bytes actually moved in `done`), a negative result keeps its
 * errno. Submitting and reaping may happen on different threads; each side has its own lock.
 * Without libaio the same functions exist and return -ENOSYS.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common.h"

#ifdef OFF_HAVE_LIBAIO
#include <libaio.h>

struct off_aio {
    io_context_t io;
    int depth;
    struct iocb *cbs;          /* one per slot */
    long long *lens;           /* requested bytes per slot */
    unsigned long long *tags;  /* caller's cookie per slot */
    int *free_slots;           /* stack of free slot indices */
    int nfree;
    struct iocb **batch;       /* scratch for io_submit */
    struct io_event *events;   /* scratch for io_getevents */
    pthread_mutex_t submit_lock; /* slots, batch */
    pthread_mutex_t reap_lock;   /* events: one reaper at a time */
};

OFF_EXPORT int off_aio_create(off_aio **out, int queue_depth)
{
    if (!out || queue_depth < 1)
        return -EINVAL;
    *out = NULL;
    off_aio *c = calloc(1, sizeof(*c));
    if (!c)
        return -ENOMEM;
    c->depth = queue_depth;
    c->cbs = calloc((size_t)queue_depth, sizeof(*c->cbs));
    c->lens = calloc((size_t)queue_depth, sizeof(*c->lens));
    c->tags = calloc((size_t)queue_depth, sizeof(*c->tags));
    c->free_slots = calloc((size_t)queue_depth, sizeof(*c->free_slots));
    c->batch = calloc((size_t)queue_depth, sizeof(*c->batch));
    c->events = calloc((size_t)queue_depth, sizeof(*c->events));
    if (!c->cbs || !c->lens || !c->tags || !c->free_slots || !c->batch || !c->events) {
        off_aio_destroy(c);
        return -ENOMEM;
    }
    for (int i = 0; i < queue_depth; i++)
        c->free_slots[i] = queue_depth - 1 - i;
    c->nfree = queue_depth;
    int rc = io_setup(queue_depth, &c->io);   /* libaio returns -errno itself */
    if (rc < 0) {
        c->io = 0;
        off_aio_destroy(c);
        return rc;
    }
    pthread_mutex_init(&c->submit_lock, NULL);
    pthread_mutex_init(&c->reap_lock, NULL);
    *out = c;
    return 0;
}

OFF_EXPORT void off_aio_destroy(off_aio *c)
{
    if (!c)
        return;
    if (c->io) {
        /* io_destroy waits for requests still in flight, so no buffer is written after this. */
        io_destroy(c->io);
        pthread_mutex_destroy(&c->submit_lock);
        pthread_mutex_destroy(&c->reap_lock);
    }
    free(c->cbs);
    free(c->lens);
    free(c->tags);
    free(c->free_slots);
    free(c->batch);
    free(c->events);
    free(c);
}

OFF_EXPORT int off_aio_submit(off_aio *c, const off_io_req *reqs, int n)
{
    if (!c || (n > 0 && !reqs) || n < 0)
        return -EINVAL;
    for (int i = 0; i < n; i++) {
        const off_io_req *r = &reqs[i];
        if (r->fd < 0 || !r->buf || r->length <= 0 || r->offset < 0
            || (r->op != OFF_IO_READ && r->op != OFF_IO_WRITE))
            return -EINVAL;
    }
    pthread_mutex_lock(&c->submit_lock);
    int k = n < c->nfree ? n : c->nfree;
    if (k == 0) {
        pthread_mutex_unlock(&c->submit_lock);
        return n == 0 ? 0 : -EAGAIN;
    }
    for (int i = 0; i < k; i++) {
        const off_io_req *r = &reqs[i];
        int slot = c->free_slots[--c->nfree];
        struct iocb *cb = &c->cbs[slot];
        if (r->op == OFF_IO_READ)
            io_prep_pread(cb, r->fd, r->buf, (size_t)r->length, r->offset);
        else
            io_prep_pwrite(cb, r->fd, r->buf, (size_t)r->length, r->offset);
        c->lens[slot] = r->length;
        c->tags[slot] = r->tag;
        c->batch[i] = cb;
    }
    int rc = io_submit(c->io, k, c->batch);
    int queued = rc > 0 ? rc : 0;
    /* io_submit stops at the first request it cannot queue: give the rest their slots back. */
    for (int i = k - 1; i >= queued; i--)
        c->free_slots[c->nfree++] = (int)(c->batch[i] - c->cbs);
    pthread_mutex_unlock(&c->submit_lock);
    if (rc < 0)
        return rc;
    return queued;
}

OFF_EXPORT int off_aio_reap(off_aio *c, off_io_done *out, int min_nr, int max_nr, long long timeout_ns)
{
    if (!c || !out || max_nr < 1 || min_nr < 0 || min_nr > max_nr)
        return -EINVAL;
    if (max_nr > c->depth)
        max_nr = c->depth;
    if (min_nr > max_nr)
        min_nr = max_nr;
    struct timespec ts, *tp = NULL;
    if (timeout_ns >= 0) {
        ts.tv_sec = timeout_ns / 1000000000LL;
        ts.tv_nsec = timeout_ns % 1000000000LL;
        tp = &ts;
    }
    pthread_mutex_lock(&c->reap_lock);
    int got = io_getevents(c->io, min_nr, max_nr, c->events, tp);
    if (got < 0) {
        pthread_mutex_unlock(&c->reap_lock);
        return got;
    }
    int slots[got > 0 ? got : 1];
    for (int i = 0; i < got; i++) {
        struct io_event *ev = &c->events[i];
        int slot = (int)(ev->obj - c->cbs);
        long long want = c->lens[slot];
        long long res = (long long)(long)ev->res;
        out[i].tag = c->tags[slot];
        if (res < 0) {
            out[i].result = res;
            out[i].done = -1;          /* an error, not a short transfer */
        } else if (res != want) {
            out[i].result = -EIO;      /* short transfer: never hand back partial data as success */
            out[i].done = res;
        } else {
            out[i].result = res;
            out[i].done = res;
        }
        slots[i] = slot;
    }
    pthread_mutex_unlock(&c->reap_lock);
    pthread_mutex_lock(&c->submit_lock);
    for (int i = 0; i < got; i++)
        c->free_slots[c->nfree++] = slots[i];
    pthread_mutex_unlock(&c->submit_lock);
    return got;
}

OFF_EXPORT int off_aio_inflight(off_aio *c)
{
    if (!c)
        return -EINVAL;
    pthread_mutex_lock(&c->submit_lock);
    int n = c->depth - c->nfree;
    pthread_mutex_unlock(&c->submit_lock);
    return n;
}

#else /* !OFF_HAVE_LIBAIO: same symbols, honest refusal */

OFF_EXPORT int off_aio_create(off_aio **out, int queue_depth)
{
    (void)queue_depth;
    if (out)
        *out = NULL;
    return -ENOSYS;
}
OFF_EXPORT void off_aio_destroy(off_aio *c) { (void)c; }
OFF_EXPORT int off_aio_submit(off_aio *c, const off_io_req *reqs, int n)
{
    (void)c; (void)reqs; (void)n;
    return -ENOSYS;
}
OFF_EXPORT int off_aio_reap(off_aio *c, off_io_done *out, int min_nr, int max_nr, long long timeout_ns)
{
    (void)c; (void)out; (void)min_nr; (void)max_nr; (void)timeout_ns;
    return -ENOSYS;
}
OFF_EXPORT int off_aio_inflight(off_aio *c)
{
    (void)c;
    return -ENOSYS;
}

#endif

OFF_EXPORT long long off_pio(int fd, int op, void *buf, long long length, long long offset)
{
    if (fd < 0 || !buf || length < 0 || offset < 0 || (op != OFF_IO_READ && op != OFF_IO_WRITE))
        return -EINVAL;
    long long done = 0;
    while (done < length) {
        ssize_t r = op == OFF_IO_READ
            ? pread(fd, (char *)buf + done, (size_t)(length - done), (off_t)(offset + done))
            : pwrite(fd, (char *)buf + done, (size_t)(length - done), (off_t)(offset + done));
        if (r < 0) {
            if (errno == EINTR)
                continue;
            return -errno;
        }
        if (r == 0)
            break;              /* end of file: the caller sees done < length */
        done += r;
    }
    return done;
}

OFF_EXPORT int off_preallocate(int fd, long long length)
{
    if (fd < 0 || length < 0)
        return -EINVAL;
    if (length == 0)
        return 0;
    return fallocate(fd, 0, 0, (off_t)length) ? -errno : 0;
}
