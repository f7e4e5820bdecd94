/* ts_futex.c - futex waits with absolute deadlines, and the clock they use. */
#define _GNU_SOURCE
#include "base/ts_futex.h"

#include <errno.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "base/ts_clock.h"

/* Current CLOCK_MONOTONIC time in nanoseconds. */
uint64_t ts_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

/* Absolute deadline `seconds` from now; negative means no deadline. */
uint64_t ts_deadline_after(double seconds)
{
    if (seconds < 0 || seconds > 1e9) return TS_NO_DEADLINE;
    return ts_now_ns() + (uint64_t)(seconds * 1e9);
}

/* The end of a slice that starts now (see ts_clock.h). */
uint64_t ts_slice_end(uint64_t deadline)
{
    uint64_t until = ts_now_ns() + TS_SLICE_NS;
    return until < deadline ? until : deadline;
}

/* Sleep while *word == expected, until woken or the deadline passes. */
int ts_futex_wait(_Atomic uint32_t *word, uint32_t expected, uint64_t deadline_ns)
{
    struct timespec ts, *tsp = NULL;
    if (deadline_ns != TS_NO_DEADLINE) {
        uint64_t now = ts_now_ns();
        if (now >= deadline_ns) return ETIMEDOUT;
        /* FUTEX_WAIT takes a relative timeout measured on CLOCK_MONOTONIC. */
        uint64_t left = deadline_ns - now;
        ts.tv_sec = (time_t)(left / 1000000000ULL);
        ts.tv_nsec = (long)(left % 1000000000ULL);
        tsp = &ts;
    }
    long rc = syscall(SYS_futex, (uint32_t *)word, FUTEX_WAIT, expected, tsp, NULL, 0);
    if (rc == 0) return 0;
    switch (errno) {
    case EAGAIN: return 0; /* value already changed */
    case ETIMEDOUT: return ETIMEDOUT;
    case EINTR: return EINTR;
    default: return 0; /* unexpected: let the caller re-check its condition */
    }
}

/* Wake every waiter sleeping on word. */
void ts_futex_wake_all(_Atomic uint32_t *word)
{
    syscall(SYS_futex, (uint32_t *)word, FUTEX_WAKE, 0x7fffffff, NULL, NULL, 0);
}

/* Sleep until *word is 0 or the deadline passes (see ts_futex.h). */
int ts_futex_wait_zero(_Atomic uint32_t *word, uint64_t deadline_ns)
{
    for (;;) {
        uint32_t n = atomic_load_explicit(word, memory_order_acquire);
        if (n == 0) return 1;
        if (ts_now_ns() >= deadline_ns) return 0;
        ts_futex_wait(word, n, deadline_ns);
    }
}
