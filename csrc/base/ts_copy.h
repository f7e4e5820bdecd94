/* ts_copy.h - the copy that fills a slot: plain memcpy, or streaming stores for large runs
 * into a ring too big for the cache. */
#ifndef TS_COPY_H
#define TS_COPY_H

#include <stddef.h>
#include <stdint.h>

/* Runs at least this long are worth streaming (the fence and set-up are then noise). */
#define TS_STREAM_MIN_RUN (1u << 20)

/* Copy n bytes with non-temporal stores where the CPU has them (x86-64), else memcpy.
 * The destination does not come into this core's cache: right for bytes this process
 * does not read again and other cores read later. */
void ts_copy_stream(void *dst, const void *src, size_t n);

/* 1 if ts_copy_stream really streams on this build, 0 if it is memcpy. */
int ts_copy_can_stream(void);

/* Bytes of the last-level cache (sysfs, else sysconf), or 32 MiB where neither says. */
uint64_t ts_copy_cache_bytes(void);

/* The smallest run a ring whose slot data spans data_bytes should stream: streaming pays
 * only when the slots cannot stay cached anyway (UINT64_MAX: never). */
uint64_t ts_copy_stream_threshold(uint64_t data_bytes);

#endif
