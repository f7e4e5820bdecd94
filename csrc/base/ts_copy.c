/* ts_copy.c - streaming (non-temporal) copies for large slot fills.
 *
 * A producer writes a slot once and never reads it back; its consumers read it from other
 * cores. A cached copy of a run larger than the cache first reads every destination line
 * (read-for-ownership) and evicts what the producer still uses; streaming stores do
 * neither. Measured on the development machine (2-core AMD EPYC, 32 MiB L3), 32 MiB runs
 * rotating over four slots: memcpy 9-15 GB/s, streaming 14-26 GB/s; runs that fit the
 * cache four times over are faster with memcpy (4 MiB: 49 vs 31 GB/s), hence the threshold. */
#define _GNU_SOURCE
#include "base/ts_copy.h"

#include <stdio.h>
#include <string.h>
#include <unistd.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#define TS_HAVE_STREAM 1
#else
#define TS_HAVE_STREAM 0
#endif

/* Copy n bytes with non-temporal stores (SSE2, baseline on x86-64), else memcpy. */
void ts_copy_stream(void *dst, const void *src, size_t n)
{
#if TS_HAVE_STREAM
    unsigned char *d = dst;
    const unsigned char *s = src;
    /* Head: up to the destination's next 16-byte boundary. */
    size_t head = (16 - ((uintptr_t)d & 15)) & 15;
    if (head > n) head = n;
    memcpy(d, s, head);
    d += head;
    s += head;
    n -= head;
    size_t body = n & ~(size_t)63;
    for (size_t i = 0; i < body; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(s + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(s + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(s + i + 32));
        __m128i e = _mm_loadu_si128((const __m128i *)(s + i + 48));
        _mm_stream_si128((__m128i *)(d + i), a);
        _mm_stream_si128((__m128i *)(d + i + 16), b);
        _mm_stream_si128((__m128i *)(d + i + 32), c);
        _mm_stream_si128((__m128i *)(d + i + 48), e);
    }
    /* Streaming stores are weakly ordered: make them visible before the slot is
     * published (the release store of its sequence number follows). */
    _mm_sfence();
    memcpy(d + body, s + body, n - body);
#else
    memcpy(dst, src, n);
#endif
}

/* 1 if ts_copy_stream streams on this build. */
int ts_copy_can_stream(void)
{
    return TS_HAVE_STREAM;
}

/* Size in bytes of cache `index` of CPU 0 from sysfs (0 if unknown); its level in *level. */
static uint64_t ts_sysfs_cache(int index, int *level)
{
    char path[96], buf[32];
    unsigned long long value = 0;
    char unit = 0;
    FILE *f;
    *level = 0;
    snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu0/cache/index%d/level", index);
    if ((f = fopen(path, "r")) == NULL) return 0;
    if (fscanf(f, "%d", level) != 1) *level = 0;
    fclose(f);
    snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu0/cache/index%d/size", index);
    if ((f = fopen(path, "r")) == NULL) return 0;
    int n = fgets(buf, sizeof buf, f) != NULL ? sscanf(buf, "%llu%c", &value, &unit) : 0;
    fclose(f);
    if (n < 1) return 0;
    if (n == 2 && (unit == 'K' || unit == 'k')) value <<= 10;
    if (n == 2 && (unit == 'M' || unit == 'm')) value <<= 20;
    return value;
}

/* Bytes of the last-level cache: sysfs (what this machine, or VM, sees), else sysconf,
 * else 32 MiB. glibc's sysconf can report the whole host's L3 inside a VM (384 MiB on
 * the development VM, whose sysfs says 32 MiB). */
uint64_t ts_copy_cache_bytes(void)
{
    uint64_t best = 0;
    int best_level = 0;
    for (int i = 0; i < 8; i++) {
        int level;
        uint64_t bytes = ts_sysfs_cache(i, &level);
        if (bytes > 0 && level >= best_level) {
            best = level > best_level ? bytes : (bytes > best ? bytes : best);
            best_level = level;
        }
    }
    if (best > 0) return best;
    long bytes = -1;
#ifdef _SC_LEVEL3_CACHE_SIZE
    bytes = sysconf(_SC_LEVEL3_CACHE_SIZE);
#endif
#ifdef _SC_LEVEL2_CACHE_SIZE
    if (bytes <= 0) bytes = sysconf(_SC_LEVEL2_CACHE_SIZE);
#endif
    return bytes > 0 ? (uint64_t)bytes : (uint64_t)32 << 20;
}

/* The smallest run to stream in a ring of data_bytes of slot data (UINT64_MAX: never). */
uint64_t ts_copy_stream_threshold(uint64_t data_bytes)
{
    if (!TS_HAVE_STREAM || data_bytes <= ts_copy_cache_bytes()) return UINT64_MAX;
    return TS_STREAM_MIN_RUN;
}
