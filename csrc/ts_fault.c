/* ts_fault.c - names a write into a read-only slot mapping (see ts_fault.h). */
#define _GNU_SOURCE
#include "ts_fault.h"

#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

/* Process-wide by necessity: a signal handler cannot reach module state. An entry is a
 * watched mapping [start, end); start is 0 when the entry is free and TS_FAULT_CLAIMED
 * while a watcher fills it in (claimed by compare-and-swap); the handler only reads. */
typedef struct ts_fault_range {
    _Atomic uintptr_t start;
    _Atomic uintptr_t end;
} ts_fault_range;

#define TS_FAULT_CLAIMED ((uintptr_t)1)

static ts_fault_range ts_fault_ranges[TS_FAULT_WATCHED];
static struct sigaction ts_fault_previous; /* the SIGSEGV action before ours (set once) */
static pthread_once_t ts_fault_once = PTHREAD_ONCE_INIT;

static const char ts_fault_message[] =
    "\ntensorsocket: this process wrote into a batch tensor it received from a "
    "TensorConsumer (an in-place op such as x.div_(255), x += 1 or x[...] = v): batches are "
    "read-only views shared with the other jobs, so the write was stopped with SIGSEGV. Use "
    "out-of-place ops (x = x / 255), tensor.clone(), or TensorConsumer(copy=True) for "
    "writable copies.\n";

/* 1 if addr lies in a watched mapping (async-signal-safe). */
static int ts_fault_watched(uintptr_t addr)
{
    for (int i = 0; i < TS_FAULT_WATCHED; i++) {
        uintptr_t start = atomic_load_explicit(&ts_fault_ranges[i].start, memory_order_acquire);
        if (start <= TS_FAULT_CLAIMED || addr < start) continue;
        if (addr < atomic_load_explicit(&ts_fault_ranges[i].end, memory_order_relaxed)) return 1;
    }
    return 0;
}

/* The SIGSEGV handler: name a write into a watched mapping, then hand the fault on. */
static void ts_fault_handler(int sig, siginfo_t *info, void *context)
{
    (void)context;
    if (info->si_code == SEGV_ACCERR && ts_fault_watched((uintptr_t)info->si_addr)) {
        ssize_t written = write(STDERR_FILENO, ts_fault_message, sizeof ts_fault_message - 1);
        (void)written; /* nothing to do if stderr is gone */
    }
    /* With the previous action back, a faulting write runs again and faults under it;
     * a SIGSEGV that was sent (si_code <= 0), not caused, is sent again. */
    sigaction(SIGSEGV, &ts_fault_previous, NULL);
    if (info->si_code <= 0) raise(sig);
}

/* Install the handler, keeping the previous action to hand faults on to. */
static void ts_fault_install(void)
{
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = ts_fault_handler;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK; /* an alternate stack where one is set up */
    sigemptyset(&sa.sa_mask);
    sigaction(SIGSEGV, &sa, &ts_fault_previous);
}

/* Watch the read-only mapping [start, start + len) (see ts_fault.h). */
void ts_fault_watch(const void *start, size_t len)
{
    uintptr_t s = (uintptr_t)start;
    if (s <= TS_FAULT_CLAIMED || len == 0) return;
    pthread_once(&ts_fault_once, ts_fault_install);
    for (int i = 0; i < TS_FAULT_WATCHED; i++) {
        uintptr_t free_start = 0;
        if (!atomic_compare_exchange_strong_explicit(&ts_fault_ranges[i].start, &free_start,
                                                     TS_FAULT_CLAIMED, memory_order_acquire,
                                                     memory_order_relaxed))
            continue;
        atomic_store_explicit(&ts_fault_ranges[i].end, s + len, memory_order_relaxed);
        atomic_store_explicit(&ts_fault_ranges[i].start, s, memory_order_release);
        return;
    }
}

/* Stop watching the mapping at start (see ts_fault.h). */
void ts_fault_unwatch(const void *start)
{
    uintptr_t s = (uintptr_t)start;
    if (s <= TS_FAULT_CLAIMED) return;
    for (int i = 0; i < TS_FAULT_WATCHED; i++) {
        uintptr_t expected = s;
        if (atomic_compare_exchange_strong_explicit(&ts_fault_ranges[i].start, &expected, 0,
                                                    memory_order_release,
                                                    memory_order_relaxed))
            return;
    }
}
