/* ts_clock.h - monotonic time and absolute deadlines in nanoseconds. */
#ifndef TS_CLOCK_H
#define TS_CLOCK_H

#include <stdint.h>

/* A deadline that never passes. */
#define TS_NO_DEADLINE UINT64_MAX

/* Current CLOCK_MONOTONIC time in nanoseconds. */
uint64_t ts_now_ns(void);

/* Absolute deadline `seconds` from now; negative means no deadline. */
uint64_t ts_deadline_after(double seconds);

#endif /* TS_CLOCK_H */
