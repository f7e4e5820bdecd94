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

/* The longest a blocking call sleeps at once: the core re-checks the other side's liveness
 * (ts_ring.c, ts_wait_for), and the binding honours signals such as Ctrl-C (ts_py_ring.c,
 * ts_wait), at least this often. */
#define TS_SLICE_NS 100000000ULL

/* The end of a slice that starts now: TS_SLICE_NS from now, or deadline if that is sooner. */
uint64_t ts_slice_end(uint64_t deadline);

#endif /* TS_CLOCK_H */
