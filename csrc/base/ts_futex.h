/* ts_futex.h - futex waits on 32-bit words in MAP_SHARED memory.
 *
 * The words live in the ring's shared segment, so the shared (not private)
 * futex operations are used: processes map the segment at different
 * addresses and the kernel keys the wait on the backing page. */
#ifndef TS_FUTEX_H
#define TS_FUTEX_H

#include <stdatomic.h>
#include <stdint.h>

/* Sleep while *word == expected, until woken or the absolute CLOCK_MONOTONIC
 * deadline (ns) passes. Returns 0 (woken or value changed: re-check),
 * ETIMEDOUT, or EINTR (a signal arrived: the caller checks for Ctrl-C). */
int ts_futex_wait(_Atomic uint32_t *word, uint32_t expected, uint64_t deadline_ns);

/* Wake every waiter sleeping on word. */
void ts_futex_wake_all(_Atomic uint32_t *word);

/* Sleep until the counter *word is 0 or the absolute deadline passes (signals do not cut it
 * short): 1 if it is 0. For counters of work under way whose last one wakes the word. */
int ts_futex_wait_zero(_Atomic uint32_t *word, uint64_t deadline_ns);

#endif /* TS_FUTEX_H */
