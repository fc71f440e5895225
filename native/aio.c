/*
 * Asynchronous file I/O over Linux native AIO (libaio), plus the blocking primitives the
 * thread backend uses.
 *
 * One off_aio is one kernel AIO context with queue_depth request slots and its own
 * completion thread and a submission thread (pthreads, so they never wait for Python's GIL).
 * off_aio_submit accepts any number of requests and only queues them: the submission thread
 * gives them to the kernel, feeding every slot the moment the completion thread frees it, so
 * the device queue stays full however late the caller comes back, and the caller never pays
 * for io_submit (pinning the buffer's pages and building the requests takes ~0.1-0.4 ms per
 * MiB on a virtio disk: on the training thread that was tens of ms per step). Completions
 * collect in a list the caller drains with off_aio_reap, which waits with a timeout.
 *
 * Requests go to the kernel at most submit_batch per io_submit call. On the virtio disk this
 * was measured on, one per call wrote ~12 % faster than 32 per call (a batch is plugged and
 * merged into larger requests, which the host then serves with less parallelism); reads
 * did not care. The caller still hands over any number in one off_aio_submit.
 *
 * Two lanes. Urgent requests (off_aio_submit_urgent: data compute is waiting for) go to the
 * kernel before any background request still pending, and background requests may hold at
 * most bg_limit of the slots (off_aio_set_background_limit; all of them by default), so an
 * urgent read queues behind at most that many requests already in the device queue instead
 * of behind every write and prefetch handed over before it.
 *
 * Every completion's result is compared with the length asked for: a short transfer becomes
 * -EIO for that request (with the bytes actually moved in `done`), a negative result keeps
 * its errno (done = -1). A request the kernel refuses at submission completes with that
 * error. Nothing prints, exits or asserts. Without libaio the same functions return -ENOSYS.
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

#define REAP_TIMEOUT_NS 100000000LL   /* the completion thread looks at `closing` this often */

/* A growable FIFO of fixed-size items (pending requests, unreaped completions). */
typedef struct fifo {
    char *items;
    size_t item;
    long long cap, head, len;
} fifo;

static int fifo_grow(fifo *f, long long need)
{
    if (f->len + need <= f->cap)
        return 0;
    long long cap = f->cap ? f->cap : 64;
    while (cap < f->len + need)
        cap *= 2;
    char *items = malloc((size_t)cap * f->item);
    if (!items)
        return -ENOMEM;
    for (long long i = 0; i < f->len; i++)
        memcpy(items + i * f->item, f->items + ((f->head + i) % f->cap) * f->item, f->item);
    free(f->items);
    f->items = items;
    f->cap = cap;
    f->head = 0;
    return 0;
}

static void *fifo_at(fifo *f, long long i) { return f->items + ((f->head + i) % f->cap) * f->item; }

static void fifo_push(fifo *f, const void *x)   /* room ensured by fifo_grow */
{
    memcpy(fifo_at(f, f->len), x, f->item);
    f->len++;
}

static void fifo_push_front(fifo *f, const void *x)
{
    f->head = (f->head + f->cap - 1) % f->cap;
    memcpy(f->items + f->head * f->item, x, f->item);
    f->len++;
}

static void fifo_pop(fifo *f, void *x)
{
    memcpy(x, f->items + f->head * f->item, f->item);
    f->head = (f->head + 1) % f->cap;
    f->len--;
}

struct off_aio {
    io_context_t io;
    int depth;
    int submit_batch;           /* most iocbs per io_submit call */
    struct iocb *cbs;           /* one per slot */
    long long *lens;            /* requested bytes per slot */
    unsigned long long *tags;   /* caller's cookie per slot */
    int *free_slots;            /* stack of free slot indices */
    int nfree;
    fifo pending;               /* background off_io_req accepted, not yet given to the kernel */
    fifo urgent;                /* urgent ones: given to the kernel first */
    int bg_limit;               /* most background requests in the kernel at once */
    int bg_inkernel;
    char *slot_urgent;          /* per slot: its request came from the urgent lane */
    char *batch_urgent;         /* per batch entry, the same (submission thread's scratch) */
    fifo done;                  /* off_io_done not yet reaped by the caller */
    long long outstanding;      /* accepted by submit, not yet reaped */
    int closing;
    unsigned wakes;             /* bumped by off_aio_wake: waiting reapers return early */
    struct iocb **batch;        /* io_submit scratch of the submission thread */
    off_io_req *batch_reqs;
    struct io_event *events;    /* completion thread's scratch */
    pthread_mutex_t lock;       /* everything above except the scratch arrays */
    pthread_cond_t work_cv;     /* completion thread: something to wait for, or closing */
    pthread_cond_t submit_cv;   /* submission thread: pending requests and free slots, or closing */
    pthread_cond_t done_cv;     /* reapers: a completion arrived */
    pthread_t thread;
    int thread_started;
    pthread_t submitter;
    int submitter_started;
    int sync_made;
};

/* Record a finished request (lock held). off_aio_submit made room for every outstanding one. */
static void post_done(off_aio *c, unsigned long long tag, long long result, long long done)
{
    off_io_done d = {tag, result, done};
    fifo_push(&c->done, &d);
}

/* Requests the submission thread may give the kernel now (lock held). */
static long long submittable(const off_aio *c)
{
    long long bg = c->bg_limit - c->bg_inkernel;
    if (bg > c->pending.len)
        bg = c->pending.len;
    if (bg < 0)
        bg = 0;
    long long n = c->urgent.len + bg;
    return n < c->nfree ? n : c->nfree;
}

static int has_pending(const off_aio *c) { return c->pending.len || c->urgent.len; }

/* Give pending requests to the kernel while slots are free, urgent ones first. Called with
 * `lock` held, which it drops around io_submit; only the submission thread calls it. Returns
 * 1 when the kernel said EAGAIN with requests in flight: try again once a completion frees
 * resources. */
static int pump(off_aio *c)
{
    int again = 0;
    for (;;) {
        long long k = submittable(c);
        if (k > c->submit_batch)
            k = c->submit_batch;
        if (k == 0)
            break;
        for (int i = 0; i < k; i++) {
            off_io_req *r = &c->batch_reqs[i];
            int urgent = c->urgent.len > 0;
            fifo_pop(urgent ? &c->urgent : &c->pending, r);
            c->batch_urgent[i] = (char)urgent;
            if (!urgent)
                c->bg_inkernel++;
            int slot = c->free_slots[--c->nfree];
            c->slot_urgent[slot] = (char)urgent;
            struct iocb *cb = &c->cbs[slot];
            if (r->op == OFF_IO_READ)
                io_prep_pread(cb, r->fd, r->buf, (size_t)r->length, r->offset);
            else
                io_prep_pwrite(cb, r->fd, r->buf, (size_t)r->length, r->offset);
            c->lens[slot] = r->length;
            c->tags[slot] = r->tag;
            c->batch[i] = cb;
        }
        pthread_mutex_unlock(&c->lock);
        int rc = io_submit(c->io, (long)k, c->batch);     /* may block: without `lock` */
        pthread_mutex_lock(&c->lock);
        int queued = rc > 0 ? rc : 0;
        if (queued)
            pthread_cond_signal(&c->work_cv);
        /* io_submit stops at the first request it cannot queue: slots back, requests back in front. */
        for (int i = (int)k - 1; i >= queued; i--) {
            c->free_slots[c->nfree++] = (int)(c->batch[i] - c->cbs);
            if (!c->batch_urgent[i])
                c->bg_inkernel--;
            /* room: just popped */
            fifo_push_front(c->batch_urgent[i] ? &c->urgent : &c->pending, &c->batch_reqs[i]);
        }
        if (rc < 0) {
            int inflight = c->depth - c->nfree;
            if (rc == -EAGAIN && inflight > 0) {
                again = 1;                      /* retried when a completion frees resources */
                break;
            }
            /* The kernel refused this request: it completes with the error, never retried. */
            off_io_req r;
            fifo_pop(c->batch_urgent[queued] ? &c->urgent : &c->pending, &r);
            post_done(c, r.tag, rc, -1);
            pthread_cond_broadcast(&c->done_cv);
        }
    }
    return again;
}

static void *completion_thread(void *arg)
{
    off_aio *c = arg;
    pthread_mutex_lock(&c->lock);
    for (;;) {
        int inkernel = c->depth - c->nfree;
        if (inkernel == 0 && !has_pending(c)) {
            if (c->closing)
                break;
            pthread_cond_wait(&c->work_cv, &c->lock);
            continue;
        }
        if (inkernel == 0) {                    /* pending: the submission thread is on it */
            pthread_cond_signal(&c->submit_cv);
            pthread_cond_wait(&c->work_cv, &c->lock);
            continue;
        }
        pthread_mutex_unlock(&c->lock);
        struct timespec ts = {REAP_TIMEOUT_NS / 1000000000LL, REAP_TIMEOUT_NS % 1000000000LL};
        int got = io_getevents(c->io, 1, c->depth, c->events, &ts);
        pthread_mutex_lock(&c->lock);
        if (got <= 0)
            continue;                           /* timeout or EINTR: look again */
        for (int i = 0; i < got; i++) {
            struct io_event *ev = &c->events[i];
            int slot = (int)(ev->obj - c->cbs);
            long long want = c->lens[slot];
            long long res = (long long)(long)ev->res;
            if (res < 0)
                post_done(c, c->tags[slot], res, -1);
            else if (res != want)
                post_done(c, c->tags[slot], -EIO, res);   /* short: never partial data as success */
            else
                post_done(c, c->tags[slot], res, res);
            c->free_slots[c->nfree++] = slot;
            if (!c->slot_urgent[slot])
                c->bg_inkernel--;
        }
        pthread_cond_broadcast(&c->done_cv);
        if (has_pending(c))
            pthread_cond_signal(&c->submit_cv);  /* slots just freed */
    }
    pthread_mutex_unlock(&c->lock);
    return NULL;
}

/* Gives pending requests to the kernel whenever there are free slots; exits once closing and
 * nothing is pending (the completion thread then finishes what is in the kernel). */
static void *submission_thread(void *arg)
{
    off_aio *c = arg;
    int again = 0;      /* the kernel said EAGAIN: wait for a completion before retrying */
    pthread_mutex_lock(&c->lock);
    for (;;) {
        if (submittable(c) && !again) {
            again = pump(c);
            continue;
        }
        if (c->closing && !has_pending(c))
            break;
        pthread_cond_wait(&c->submit_cv, &c->lock);
        again = 0;
    }
    pthread_mutex_unlock(&c->lock);
    return NULL;
}

OFF_EXPORT void off_aio_destroy(off_aio *c)
{
    if (!c)
        return;
    if (c->submitter_started || c->thread_started) {
        /* The two threads finish every accepted request before they exit. */
        pthread_mutex_lock(&c->lock);
        c->closing = 1;
        pthread_cond_signal(&c->submit_cv);
        pthread_cond_signal(&c->work_cv);
        pthread_mutex_unlock(&c->lock);
        if (c->submitter_started)
            pthread_join(c->submitter, NULL);
        if (c->thread_started)
            pthread_join(c->thread, NULL);
    }
    if (c->io)
        io_destroy(c->io);
    if (c->sync_made) {
        pthread_mutex_destroy(&c->lock);
        pthread_cond_destroy(&c->work_cv);
        pthread_cond_destroy(&c->submit_cv);
        pthread_cond_destroy(&c->done_cv);
    }
    free(c->cbs);
    free(c->lens);
    free(c->tags);
    free(c->free_slots);
    free(c->batch);
    free(c->batch_reqs);
    free(c->events);
    free(c->pending.items);
    free(c->urgent.items);
    free(c->done.items);
    free(c->slot_urgent);
    free(c->batch_urgent);
    free(c);
}

OFF_EXPORT int off_aio_create(off_aio **out, int queue_depth, int submit_batch)
{
    if (!out || queue_depth < 1 || submit_batch < 1)
        return -EINVAL;
    *out = NULL;
    off_aio *c = calloc(1, sizeof(*c));
    if (!c)
        return -ENOMEM;
    c->depth = queue_depth;
    c->submit_batch = submit_batch < queue_depth ? submit_batch : queue_depth;
    c->bg_limit = queue_depth;
    c->pending.item = sizeof(off_io_req);
    c->urgent.item = sizeof(off_io_req);
    c->done.item = sizeof(off_io_done);
    size_t n = (size_t)queue_depth;
    c->cbs = calloc(n, sizeof(*c->cbs));
    c->lens = calloc(n, sizeof(*c->lens));
    c->tags = calloc(n, sizeof(*c->tags));
    c->free_slots = calloc(n, sizeof(*c->free_slots));
    c->batch = calloc(n, sizeof(*c->batch));
    c->batch_reqs = calloc(n, sizeof(*c->batch_reqs));
    c->events = calloc(n, sizeof(*c->events));
    c->slot_urgent = calloc(n, 1);
    c->batch_urgent = calloc(n, 1);
    if (!c->cbs || !c->lens || !c->tags || !c->free_slots || !c->batch || !c->batch_reqs || !c->events
        || !c->slot_urgent || !c->batch_urgent || fifo_grow(&c->pending, queue_depth)
        || fifo_grow(&c->urgent, queue_depth) || fifo_grow(&c->done, queue_depth)) {
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
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_mutex_init(&c->lock, NULL);
    pthread_cond_init(&c->work_cv, NULL);
    pthread_cond_init(&c->submit_cv, NULL);
    pthread_cond_init(&c->done_cv, &ca);
    pthread_condattr_destroy(&ca);
    c->sync_made = 1;
    rc = pthread_create(&c->thread, NULL, completion_thread, c);
    if (rc) {
        off_aio_destroy(c);
        return -rc;
    }
    c->thread_started = 1;
    rc = pthread_create(&c->submitter, NULL, submission_thread, c);
    if (rc) {
        off_aio_destroy(c);
        return -rc;
    }
    c->submitter_started = 1;
    *out = c;
    return 0;
}

static int submit_to(off_aio *c, const off_io_req *reqs, int n, int urgent)
{
    if (!c || (n > 0 && !reqs) || n < 0)
        return -EINVAL;
    for (int i = 0; i < n; i++) {
        const off_io_req *r = &reqs[i];
        if (r->fd < 0 || !r->buf || r->length <= 0 || r->offset < 0
            || (r->op != OFF_IO_READ && r->op != OFF_IO_WRITE))
            return -EINVAL;
    }
    if (n == 0)
        return 0;
    pthread_mutex_lock(&c->lock);
    if (c->closing) {
        pthread_mutex_unlock(&c->lock);
        return -EBADF;
    }
    /* Room for every completion up front, so the completion thread never has to allocate. */
    fifo *lane = urgent ? &c->urgent : &c->pending;
    /* Room for submit_batch more than n: pump pops up to that many, drops the lock, and pushes
     * back what the kernel did not take; submissions meanwhile must leave it that room. */
    if (fifo_grow(lane, (long long)n + c->submit_batch)
        || fifo_grow(&c->done, c->outstanding + n - c->done.len)) {
        pthread_mutex_unlock(&c->lock);
        return -ENOMEM;
    }
    for (int i = 0; i < n; i++)
        fifo_push(lane, &reqs[i]);
    c->outstanding += n;
    pthread_cond_signal(&c->submit_cv);
    pthread_mutex_unlock(&c->lock);
    return n;
}

OFF_EXPORT int off_aio_submit(off_aio *c, const off_io_req *reqs, int n)
{
    return submit_to(c, reqs, n, 0);
}

OFF_EXPORT int off_aio_submit_urgent(off_aio *c, const off_io_req *reqs, int n)
{
    return submit_to(c, reqs, n, 1);
}

OFF_EXPORT int off_aio_set_background_limit(off_aio *c, int n)
{
    if (!c || n < 1)
        return -EINVAL;
    pthread_mutex_lock(&c->lock);
    c->bg_limit = n < c->depth ? n : c->depth;
    pthread_cond_signal(&c->submit_cv);     /* a raised limit may free requests to submit */
    pthread_mutex_unlock(&c->lock);
    return 0;
}

OFF_EXPORT int off_aio_reap(off_aio *c, off_io_done *out, int min_nr, int max_nr, long long timeout_ns)
{
    if (!c || !out || max_nr < 1 || min_nr < 0 || min_nr > max_nr)
        return -EINVAL;
    struct timespec deadline;
    if (timeout_ns >= 0) {
        clock_gettime(CLOCK_MONOTONIC, &deadline);
        deadline.tv_sec += timeout_ns / 1000000000LL;
        deadline.tv_nsec += timeout_ns % 1000000000LL;
        if (deadline.tv_nsec >= 1000000000L) {
            deadline.tv_sec++;
            deadline.tv_nsec -= 1000000000L;
        }
    }
    pthread_mutex_lock(&c->lock);
    unsigned wakes = c->wakes;
    while (c->done.len < min_nr && c->wakes == wakes) {
        if (timeout_ns < 0)
            pthread_cond_wait(&c->done_cv, &c->lock);
        else if (pthread_cond_timedwait(&c->done_cv, &c->lock, &deadline) == ETIMEDOUT)
            break;
    }
    int got = c->done.len < max_nr ? (int)c->done.len : max_nr;
    for (int i = 0; i < got; i++)
        fifo_pop(&c->done, &out[i]);
    c->outstanding -= got;
    pthread_mutex_unlock(&c->lock);
    return got;
}

OFF_EXPORT int off_aio_wake(off_aio *c)
{
    if (!c)
        return -EINVAL;
    pthread_mutex_lock(&c->lock);
    c->wakes++;
    pthread_cond_broadcast(&c->done_cv);
    pthread_mutex_unlock(&c->lock);
    return 0;
}

OFF_EXPORT int off_aio_inflight(off_aio *c)
{
    if (!c)
        return -EINVAL;
    pthread_mutex_lock(&c->lock);
    long long n = c->outstanding;
    pthread_mutex_unlock(&c->lock);
    return n > 0x7fffffff ? 0x7fffffff : (int)n;
}

#else /* !OFF_HAVE_LIBAIO: same symbols, honest refusal */

OFF_EXPORT int off_aio_create(off_aio **out, int queue_depth, int submit_batch)
{
    (void)queue_depth;
    (void)submit_batch;
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
OFF_EXPORT int off_aio_submit_urgent(off_aio *c, const off_io_req *reqs, int n)
{
    (void)c; (void)reqs; (void)n;
    return -ENOSYS;
}
OFF_EXPORT int off_aio_set_background_limit(off_aio *c, int n)
{
    (void)c; (void)n;
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
OFF_EXPORT int off_aio_wake(off_aio *c)
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
