/*
 * CRC32C (Castagnoli), the checksum of iSCSI/ext4/btrfs. The SSE4.2 crc32 instruction does
 * 8 bytes a step; it is chosen at run time with __builtin_cpu_supports, never at build time,
 * and a slicing-by-8 table covers every other CPU. Both give the same value (tests check).
 */
#include <stdint.h>
#include <string.h>

#include "common.h"

static uint32_t table[8][256];

__attribute__((constructor)) static void crc32c_init(void)
{
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++)
            c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1u)));
        table[0][i] = c;
    }
    for (int t = 1; t < 8; t++)
        for (uint32_t i = 0; i < 256; i++)
            table[t][i] = (table[t - 1][i] >> 8) ^ table[0][table[t - 1][i] & 0xff];
}

static uint32_t crc_table(uint32_t crc, const unsigned char *p, size_t n)
{
    while (n && ((uintptr_t)p & 7)) {
        crc = (crc >> 8) ^ table[0][(crc ^ *p++) & 0xff];
        n--;
    }
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        w ^= crc;
        crc = table[7][w & 0xff] ^ table[6][(w >> 8) & 0xff] ^ table[5][(w >> 16) & 0xff]
              ^ table[4][(w >> 24) & 0xff] ^ table[3][(w >> 32) & 0xff] ^ table[2][(w >> 40) & 0xff]
              ^ table[1][(w >> 48) & 0xff] ^ table[0][w >> 56];
        p += 8;
        n -= 8;
    }
    while (n--)
        crc = (crc >> 8) ^ table[0][(crc ^ *p++) & 0xff];
    return crc;
}

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("sse4.2")
static uint32_t crc_sse42(uint32_t crc, const unsigned char *p, size_t n)
{
    uint64_t c = crc;
    while (n && ((uintptr_t)p & 7)) {
        c = __builtin_ia32_crc32qi((uint32_t)c, *p++);
        n--;
    }
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        c = __builtin_ia32_crc32di(c, w);
        p += 8;
        n -= 8;
    }
    while (n--)
        c = __builtin_ia32_crc32qi((uint32_t)c, *p++);
    return (uint32_t)c;
}
#pragma GCC pop_options
#endif

static int have_sse42 = -1;

static int use_sse42(void)
{
#if defined(__x86_64__)
    if (have_sse42 < 0) {
        __builtin_cpu_init();
        have_sse42 = __builtin_cpu_supports("sse4.2") ? 1 : 0;
    }
    return have_sse42;
#else
    return 0;
#endif
}

OFF_EXPORT unsigned int off_crc32c(unsigned int crc, const void *data, long long size)
{
    if (!data || size <= 0)
        return crc;
    uint32_t c = ~crc;
#if defined(__x86_64__)
    if (use_sse42())
        return ~crc_sse42(c, data, (size_t)size);
#endif
    return ~crc_table(c, data, (size_t)size);
}

OFF_EXPORT unsigned int off_crc32c_portable(unsigned int crc, const void *data, long long size)
{
    if (!data || size <= 0)
        return crc;
    return ~crc_table(~crc, data, (size_t)size);
}

OFF_EXPORT int off_crc32c_hw(void) { return use_sse42(); }
