/*
 * Aligned host buffers for O_DIRECT I/O.
 *
 * Buffers come straight from mmap so they are page-aligned, zero-filled and returned to the
 * kernel on free. With OFF_BUF_HUGEPAGE the mapping is trimmed to a 2 MiB boundary and
 * madvise(MADV_HUGEPAGE)d: a 1 MiB O_DIRECT request into 4 KiB pages needs 256 segments and
 * virtio disks take 254, so the kernel splits it; over huge pages it goes through whole.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdint.h>
#include <sys/mman.h>
#include <unistd.h>

#include "common.h"

#define HUGE_2M (2LL << 20)

static long long round_up(long long n, long long to) { return (n + to - 1) / to * to; }

/* Bytes actually mapped for a request: the free side recomputes it from the same inputs. */
static long long mapped_size(long long size, int flags)
{
    long long page = (flags & OFF_BUF_HUGEPAGE) ? HUGE_2M : 4096;
    return round_up(size > 0 ? size : 1, page);
}

OFF_EXPORT long long off_buffer_mapped_size(long long size, int flags)
{
    if (size < 0)
        return -EINVAL;
    return mapped_size(size, flags);
}

OFF_EXPORT int off_buffer_alloc(void **out, long long size, int flags)
{
    if (!out || size < 0)
        return -EINVAL;
    *out = NULL;
    long long len = mapped_size(size, flags);
    int huge = (flags & OFF_BUF_HUGEPAGE) != 0;
    /* Over-map by one huge page so an aligned start always fits, then trim both ends. */
    long long want = huge ? len + HUGE_2M : len;
    void *raw = mmap(NULL, (size_t)want, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED)
        return -errno;
    char *start = raw;
    if (huge) {
        uintptr_t a = ((uintptr_t)raw + HUGE_2M - 1) & ~(uintptr_t)(HUGE_2M - 1);
        start = (char *)a;
        size_t head = (size_t)(start - (char *)raw);
        size_t tail = (size_t)want - head - (size_t)len;
        if (head)
            munmap(raw, head);
        if (tail)
            munmap(start + len, tail);
#ifdef MADV_HUGEPAGE
        /* Advice only: without THP the buffer still works, just with 4 KiB pages. */
        madvise(start, (size_t)len, MADV_HUGEPAGE);
#endif
    }
    if (flags & OFF_BUF_POPULATE) {
        /* Touch every page now so the first timed use does not pay for page faults. */
        long long step = huge ? HUGE_2M : 4096;
        for (long long off = 0; off < len; off += step)
            ((volatile char *)start)[off] = 0;
    }
    *out = start;
    return 0;
}

OFF_EXPORT void off_buffer_free(void *ptr, long long size, int flags)
{
    if (ptr && size >= 0)
        munmap(ptr, (size_t)mapped_size(size, flags));
}

OFF_EXPORT int off_buffer_lock(void *ptr, long long size)
{
    if (!ptr || size < 0)
        return -EINVAL;
    return mlock(ptr, (size_t)size) ? -errno : 0;
}

OFF_EXPORT int off_buffer_unlock(void *ptr, long long size)
{
    if (!ptr || size < 0)
        return -EINVAL;
    return munlock(ptr, (size_t)size) ? -errno : 0;
}
