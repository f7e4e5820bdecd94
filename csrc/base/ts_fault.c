/* ts_fault.c - copy-on-write of consumer slot mappings on a write fault (see ts_fault.h). */
#define _GNU_SOURCE
#include "base/ts_fault.h"

#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

/* A slot's state word (ts_fault_map.state): the low 2 bits say how the slot is mapped,
 * the rest count this process's holds of it (in units of TS_FAULT_HOLD). BUSY is a lock:
 * its owner is remapping the slot, or handing it back to the producer; everyone else waits
 * (briefly: one mmap, or one atomic and a futex wake) until it is gone. */
enum {
    TS_FAULT_SHARED = 0,  /* the shared read-only view */
    TS_FAULT_PRIVATE = 1, /* a private copy-on-write view: written pages are this process's */
    TS_FAULT_BUSY = 2,    /* locked (see above) */
    TS_FAULT_MASK = 3,
    TS_FAULT_HOLD = 4, /* one hold */
};

/* What the handler made of a write fault in a watched mapping. */
enum {
    TS_FAULT_FIXED = 0,    /* the slot is private now: the write runs again and succeeds */
    TS_FAULT_PINNED = 1,   /* the mapping is page-locked for CUDA: slots stay shared */
    TS_FAULT_NOT_HELD = 2, /* the process does not hold the slot */
    TS_FAULT_NO_COPY = 3,  /* no private copy here: unaligned geometry, or mmap failed */
};

/* Process-wide by necessity: a signal handler cannot reach module state. An entry is a
 * watched mapping [start, end) and its map; start is 0 when the entry is free and
 * TS_FAULT_CLAIMED while a watcher fills it in (claimed by compare-and-swap); the handler
 * only reads. It uses an entry only for a fault inside the entry's mapping, and the map
 * lives as long as the mapping (ts_fault_unwatch runs before the munmap): a fault there
 * after that would be a write into memory the process had already freed. */
typedef struct ts_fault_entry {
    _Atomic uintptr_t start;
    _Atomic uintptr_t end;
    ts_fault_map *_Atomic map; /* borrowed: the watcher's map */
} ts_fault_entry;

#define TS_FAULT_CLAIMED ((uintptr_t)1)

static ts_fault_entry ts_fault_entries[TS_FAULT_WATCHED];
/* Serialises watchers with a fork's copies (never taken by the handler). */
static pthread_mutex_t ts_fault_table_lock = PTHREAD_MUTEX_INITIALIZER;
static struct sigaction ts_fault_previous; /* the SIGSEGV action before ours (set once) */
static pthread_once_t ts_fault_once = PTHREAD_ONCE_INIT;

static const char ts_fault_head[] =
    "\ntensorsocket: this process wrote into a batch tensor it received from a "
    "TensorConsumer (an in-place op such as x.div_(255), x += 1 or x[...] = v), ";
static const char ts_fault_pinned[] =
    "and this consumer's mapping of the ring is page-locked for CUDA (pin_memory=True), so "
    "the batch cannot be made private to this process: the write was stopped with SIGSEGV "
    "instead of changing the batch under the other jobs. Use out-of-place ops "
    "(x = x / 255), tensor.clone(), TensorConsumer(copy=True) for writable copies, or "
    "pin_memory=False.\n";
static const char ts_fault_not_held[] =
    "but into memory of a batch this process no longer holds (a pointer kept after all of "
    "the batch's tensors were freed?): the write was stopped with SIGSEGV. Keep a tensor of "
    "the batch alive while writing into it, or take writable copies: tensor.clone() or "
    "TensorConsumer(copy=True).\n";
static const char ts_fault_no_copy[] =
    "and no private copy of the batch could be mapped for it (mmap failed, or the ring's "
    "geometry is not page aligned here), so the write was stopped with SIGSEGV. Use "
    "out-of-place ops (x = x / 255), tensor.clone(), or TensorConsumer(copy=True) for "
    "writable copies.\n";

/* Write n bytes of s to stderr (async-signal-safe; nothing to do if stderr is gone). */
static void ts_fault_print(const char *s, size_t n)
{
    ssize_t written = write(STDERR_FILENO, s, n);
    (void)written;
}

/* The map of the watched mapping that contains addr, or NULL (async-signal-safe). */
static ts_fault_map *ts_fault_find(uintptr_t addr)
{
    for (int i = 0; i < TS_FAULT_WATCHED; i++) {
        uintptr_t start = atomic_load_explicit(&ts_fault_entries[i].start, memory_order_acquire);
        if (start <= TS_FAULT_CLAIMED || addr < start) continue;
        if (addr < atomic_load_explicit(&ts_fault_entries[i].end, memory_order_relaxed))
            return atomic_load_explicit(&ts_fault_entries[i].map, memory_order_relaxed);
    }
    return NULL;
}

/* The state word of slot k, once no one holds its BUSY lock; loaded with seq_cst. */
static uint32_t ts_fault_settled(_Atomic uint32_t *state)
{
    uint32_t w = atomic_load_explicit(state, memory_order_seq_cst);
    while ((w & TS_FAULT_MASK) == TS_FAULT_BUSY) {
        sched_yield(); /* the owner is between two system calls at most */
        w = atomic_load_explicit(state, memory_order_seq_cst);
    }
    return w;
}

/* Make the slot at addr of m private to this process, if it holds the slot; what happened
 * (TS_FAULT_*). Runs in the SIGSEGV handler: atomics and system calls only. mmap is not on
 * POSIX's list of async-signal-safe functions, but on Linux it is a plain system call (no
 * lock, no allocation in libc), and the fault interrupted an access to this very slot, not
 * a call into the allocator over it. */
static int ts_fault_privatize(ts_fault_map *m, uintptr_t addr)
{
    if (atomic_load_explicit(&m->forbidden, memory_order_seq_cst)) return TS_FAULT_PINNED;
    if (m->state == NULL) return TS_FAULT_NO_COPY;
    uint64_t k = (addr - (uintptr_t)m->start) / m->slot_bytes;
    if (k >= m->slot_count) return TS_FAULT_NO_COPY;
    _Atomic uint32_t *state = &m->state[k];
    uint32_t w = ts_fault_settled(state);
    for (;;) {
        /* Another thread of this process made it private meanwhile: write again. */
        if ((w & TS_FAULT_MASK) == TS_FAULT_PRIVATE) return TS_FAULT_FIXED;
        if (w < TS_FAULT_HOLD) return TS_FAULT_NOT_HELD;
        if ((w & TS_FAULT_MASK) == TS_FAULT_SHARED &&
            atomic_compare_exchange_weak_explicit(state, &w, w | TS_FAULT_BUSY,
                                                  memory_order_seq_cst, memory_order_seq_cst))
            break;
        if ((w & TS_FAULT_MASK) == TS_FAULT_BUSY) w = ts_fault_settled(state);
    }
    /* Under the lock, and after it was taken (seq_cst on both sides): either ts_fault_forbid
     * sees this slot busy or private and refuses, or this sees the mapping forbidden. */
    int out = TS_FAULT_NO_COPY;
    if (atomic_load_explicit(&m->forbidden, memory_order_seq_cst)) {
        out = TS_FAULT_PINNED;
    } else {
        void *slot = m->start + k * m->slot_bytes;
        void *p = mmap(slot, (size_t)m->slot_bytes, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_FIXED, m->fd, (off_t)(m->file_offset + k * m->slot_bytes));
        if (p != MAP_FAILED) out = TS_FAULT_FIXED;
    }
    /* BUSY -> PRIVATE, or back to SHARED; holds taken meanwhile stay counted. */
    if (out == TS_FAULT_FIXED)
        atomic_fetch_xor_explicit(state, TS_FAULT_BUSY ^ TS_FAULT_PRIVATE, memory_order_release);
    else
        atomic_fetch_and_explicit(state, ~(uint32_t)TS_FAULT_MASK, memory_order_release);
    return out;
}

/* Hand the fault on to the action installed before ours. A handler is called in place (ours
 * stays installed, so a handler that recovers, as some runtimes' do, keeps copy-on-write
 * working); for the default action it is put back, so that a faulting access runs again and
 * faults under it, and a SIGSEGV that was sent (si_code <= 0), not caused, is sent again. */
static void ts_fault_hand_on(int sig, siginfo_t *info, void *context)
{
    const struct sigaction *prev = &ts_fault_previous;
    if ((prev->sa_flags & SA_SIGINFO) && prev->sa_sigaction != NULL) {
        prev->sa_sigaction(sig, info, context);
        return;
    }
    if (!(prev->sa_flags & SA_SIGINFO) && prev->sa_handler != SIG_DFL &&
        prev->sa_handler != SIG_IGN) {
        prev->sa_handler(sig);
        return;
    }
    sigaction(SIGSEGV, prev, NULL);
    if (info->si_code <= 0) raise(sig);
}

/* The SIGSEGV handler: make a held slot private, else name the write and hand it on. */
static void ts_fault_handler(int sig, siginfo_t *info, void *context)
{
    int saved = errno;
    if (info->si_code == SEGV_ACCERR) {
        ts_fault_map *m = ts_fault_find((uintptr_t)info->si_addr);
        if (m != NULL) {
            int why = ts_fault_privatize(m, (uintptr_t)info->si_addr);
            if (why == TS_FAULT_FIXED) {
                errno = saved;
                return; /* the write runs again, on the private copy */
            }
            ts_fault_print(ts_fault_head, sizeof ts_fault_head - 1);
            if (why == TS_FAULT_PINNED) ts_fault_print(ts_fault_pinned, sizeof ts_fault_pinned - 1);
            else if (why == TS_FAULT_NOT_HELD)
                ts_fault_print(ts_fault_not_held, sizeof ts_fault_not_held - 1);
            else ts_fault_print(ts_fault_no_copy, sizeof ts_fault_no_copy - 1);
        }
    }
    ts_fault_hand_on(sig, info, context);
    errno = saved;
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

/* Watch m (see ts_fault.h). */
void ts_fault_watch(ts_fault_map *m)
{
    uintptr_t s = (uintptr_t)m->start;
    long page = sysconf(_SC_PAGESIZE);
    m->state = NULL;
    if (s <= TS_FAULT_CLAIMED || m->len == 0) return;
    /* A slot is remapped on its own: its address, size and file offset must be pages. */
    if (m->fd >= 0 && page > 0 && m->slot_count > 0 && m->slot_bytes > 0 &&
        s % (uint64_t)page == 0 && m->slot_bytes % (uint64_t)page == 0 &&
        m->file_offset % (uint64_t)page == 0 &&
        m->slot_bytes * m->slot_count <= (uint64_t)m->len) {
        m->state = calloc(m->slot_count, sizeof *m->state);
        for (uint32_t k = 0; m->state != NULL && k < m->slot_count; k++)
            atomic_init(&m->state[k], TS_FAULT_SHARED);
    }
    pthread_mutex_lock(&ts_fault_table_lock);
    for (int i = 0; i < TS_FAULT_WATCHED; i++) {
        uintptr_t free_start = 0;
        if (!atomic_compare_exchange_strong_explicit(&ts_fault_entries[i].start, &free_start,
                                                     TS_FAULT_CLAIMED, memory_order_acquire,
                                                     memory_order_relaxed))
            continue;
        atomic_store_explicit(&ts_fault_entries[i].map, m, memory_order_relaxed);
        atomic_store_explicit(&ts_fault_entries[i].end, s + m->len, memory_order_relaxed);
        atomic_store_explicit(&ts_fault_entries[i].start, s, memory_order_release);
        m->entry = i + 1;
        pthread_mutex_unlock(&ts_fault_table_lock);
        return;
    }
    pthread_mutex_unlock(&ts_fault_table_lock);
    /* Not watched: a write cannot be made private, so none may be allowed. */
    free(m->state);
    m->state = NULL;
}

/* Free m's place in the table, if it has one (see ts_fault.h). */
void ts_fault_retire(ts_fault_map *m)
{
    pthread_mutex_lock(&ts_fault_table_lock);
    if (m->entry > 0)
        atomic_store_explicit(&ts_fault_entries[m->entry - 1].start, 0, memory_order_release);
    m->entry = 0;
    pthread_mutex_unlock(&ts_fault_table_lock);
}

/* Stop watching m and free its state (see ts_fault.h). */
void ts_fault_unwatch(ts_fault_map *m)
{
    ts_fault_retire(m);
    free(m->state);
    m->state = NULL;
}

/* One more hold of slot (see ts_fault.h); the first in this process installs the handler. */
void ts_fault_take(ts_fault_map *m, uint32_t slot)
{
    pthread_once(&ts_fault_once, ts_fault_install);
    if (m->state == NULL || slot >= m->slot_count) return;
    atomic_fetch_add_explicit(&m->state[slot], TS_FAULT_HOLD, memory_order_acq_rel);
}

/* Map the shared read-only view back over private slot k (its private pages are dropped).
 * If that fails twice, the slot's range must still never show stale private data nor
 * become a hole that a later mmap could fill (and ring close would then unmap): it is
 * replaced by an inaccessible anonymous mapping, and the map is marked broken, so that its
 * ring hands out no further batch (ts_ring_acquire fails, naming the cause). The slot can
 * then be given back to the producer safely: this process's last pointer into it is gone,
 * and it will never read the slot again. The other slots stay valid. If even the
 * inaccessible mapping cannot be made, nothing safe is left: abort. */
static void ts_fault_restore(ts_fault_map *m, uint32_t k)
{
    void *slot = m->start + (uint64_t)k * m->slot_bytes;
    off_t off = (off_t)(m->file_offset + (uint64_t)k * m->slot_bytes);
    int e = 0;
    for (int attempt = 0; attempt < 2; attempt++) {
        if (mmap(slot, (size_t)m->slot_bytes, PROT_READ, MAP_SHARED | MAP_FIXED, m->fd, off) !=
            MAP_FAILED)
            return;
        e = errno;
    }
    atomic_store_explicit(&m->broken, e != 0 ? e : EIO, memory_order_seq_cst);
    fprintf(stderr,
            "tensorsocket: could not map a ring slot back after this process wrote into it "
            "(mmap: %s); this consumer receives no further batches from the ring\n",
            strerror(e));
    if (mmap(slot, (size_t)m->slot_bytes, PROT_NONE,
             MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0) == MAP_FAILED) {
        fprintf(stderr, "tensorsocket: could not replace the slot's private mapping either "
                        "(mmap: %s); aborting\n", strerror(errno));
        abort();
    }
}

/* One hold of slot ends; the last one restores the shared view and locks (see ts_fault.h).
 * A ring handle holds a slot more than once only after it was bound to a new consumer
 * entry while batches of the old one were still alive, and a late joiner's window then
 * handed it the same entry again: the holds count makes the last of them restore. */
int ts_fault_give_begin(ts_fault_map *m, uint32_t slot)
{
    if (m->state == NULL || slot >= m->slot_count) return 0;
    _Atomic uint32_t *state = &m->state[slot];
    uint32_t w = ts_fault_settled(state);
    int was_private = 0;
    for (;;) {
        if ((w & TS_FAULT_MASK) == TS_FAULT_BUSY) {
            w = ts_fault_settled(state);
            continue;
        }
        if (w < TS_FAULT_HOLD) return 0; /* never taken through this map */
        if (w >= 2 * TS_FAULT_HOLD) {    /* not the last hold: nothing to restore */
            if (atomic_compare_exchange_weak_explicit(state, &w, w - TS_FAULT_HOLD,
                                                      memory_order_acq_rel,
                                                      memory_order_acquire))
                return 0;
            continue;
        }
        was_private = (w & TS_FAULT_MASK) == TS_FAULT_PRIVATE;
        if (atomic_compare_exchange_weak_explicit(state, &w,
                                                  (w & ~(uint32_t)TS_FAULT_MASK) | TS_FAULT_BUSY,
                                                  memory_order_acq_rel, memory_order_acquire))
            break;
    }
    if (was_private) ts_fault_restore(m, slot);
    return 1;
}

/* Unlock after ts_fault_give_begin: one hold fewer, BUSY -> SHARED (see ts_fault.h). */
void ts_fault_give_end(ts_fault_map *m, uint32_t slot, int locked)
{
    if (!locked) return;
    atomic_fetch_sub_explicit(&m->state[slot], TS_FAULT_HOLD + TS_FAULT_BUSY,
                              memory_order_release);
}

/* Never make a slot private again; EBUSY if one is private now (see ts_fault.h). */
int ts_fault_forbid(ts_fault_map *m)
{
    atomic_store_explicit(&m->forbidden, 1, memory_order_seq_cst);
    for (uint32_t k = 0; m->state != NULL && k < m->slot_count; k++) {
        if ((ts_fault_settled(&m->state[k]) & TS_FAULT_MASK) == TS_FAULT_PRIVATE) {
            atomic_store_explicit(&m->forbidden, 0, memory_order_seq_cst);
            return EBUSY;
        }
    }
    return 0;
}

/* Undo ts_fault_forbid. */
void ts_fault_allow(ts_fault_map *m)
{
    atomic_store_explicit(&m->forbidden, 0, memory_order_seq_cst);
}

/* 1 if a write into a held slot of m is made private. */
int ts_fault_writable(const ts_fault_map *m)
{
    return m->state != NULL && !atomic_load_explicit(&m->forbidden, memory_order_acquire);
}

/* Slots of m private to this process now. */
uint32_t ts_fault_private_slots(const ts_fault_map *m)
{
    uint32_t n = 0;
    for (uint32_t k = 0; m->state != NULL && k < m->slot_count; k++)
        if ((atomic_load_explicit(&m->state[k], memory_order_acquire) & TS_FAULT_MASK) ==
            TS_FAULT_PRIVATE)
            n++;
    return n;
}

/* Whether slot of m is seen through the shared view (see ts_fault.h). */
int ts_fault_slot_shared(const ts_fault_map *m, uint32_t slot)
{
    if (slot >= m->slot_count) return 0;
    if (m->state == NULL) return 1; /* slots are never made private here */
    return (atomic_load_explicit(&m->state[slot], memory_order_acquire) & TS_FAULT_MASK) ==
           TS_FAULT_SHARED;
}

/* Copy every page of [p, p + n) of a private file mapping, so that none of them shows the
 * file any more: MADV_POPULATE_WRITE breaks copy-on-write without writing; where the
 * kernel lacks it (EINVAL), an atomic OR of 0 into each page does (a write that changes
 * nothing, even under a concurrent writer). 0, or the errno of the failed madvise. */
static int ts_fault_copy_pages(uint8_t *p, size_t n)
{
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23 /* Linux 5.14 */
#endif
    if (n == 0 || madvise(p, n, MADV_POPULATE_WRITE) == 0) return 0;
    if (errno != EINVAL) return errno; /* ENOMEM: no memory for the copies */
    long page = sysconf(_SC_PAGESIZE);
    for (size_t off = 0; off < n; off += (size_t)page)
        atomic_fetch_or_explicit((_Atomic uint8_t *)(void *)(p + off), 0, memory_order_relaxed);
    return 0;
}

/* Make held slot k private and copy the pages spanning [offset, offset + bytes) of it (see
 * ts_fault.h): the write-fault path makes it private (the same lock and checks). */
int ts_fault_copy_slot(ts_fault_map *m, uint32_t k, uint64_t offset, uint64_t bytes)
{
    if (m->state == NULL || k >= m->slot_count || offset > m->slot_bytes ||
        bytes > m->slot_bytes - offset)
        return EINVAL;
    uint8_t *slot = m->start + (uint64_t)k * m->slot_bytes;
    errno = 0;
    switch (ts_fault_privatize(m, (uintptr_t)slot)) {
    case TS_FAULT_FIXED: break;
    case TS_FAULT_PINNED: return EPERM;
    case TS_FAULT_NOT_HELD: return EINVAL; /* not held: nothing to keep */
    default: return errno != 0 ? errno : EIO;
    }
    if (bytes == 0) return 0;
    uint64_t page = (uint64_t)sysconf(_SC_PAGESIZE);
    uint64_t first = offset / page * page;
    uint64_t end = (offset + bytes + page - 1) / page * page;
    return ts_fault_copy_pages(slot + first, (size_t)(end - first));
}

/* This process's holds of slot k of m. */
uint32_t ts_fault_holds(const ts_fault_map *m, uint32_t k)
{
    if (m->state == NULL || k >= m->slot_count) return 0;
    return atomic_load_explicit(&m->state[k], memory_order_acquire) / TS_FAULT_HOLD;
}

/* The watched map in entry i, or NULL (table lock held). */
static ts_fault_map *ts_fault_entry_map(int i)
{
    if (atomic_load_explicit(&ts_fault_entries[i].start, memory_order_acquire) <= TS_FAULT_CLAIMED)
        return NULL;
    return atomic_load_explicit(&ts_fault_entries[i].map, memory_order_relaxed);
}

/* Before a fork: copy the held slots of every watched mapping (see ts_fault.h). A slot that
 * cannot be copied (no memory) stays shared in the child, as before this existed. */
void ts_fault_fork_prepare(void)
{
    pthread_mutex_lock(&ts_fault_table_lock);
    for (int i = 0; i < TS_FAULT_WATCHED; i++) {
        ts_fault_map *m = ts_fault_entry_map(i);
        if (m == NULL || m->state == NULL) continue;
        for (uint32_t k = 0; k < m->slot_count; k++) {
            if (atomic_load_explicit(&m->state[k], memory_order_acquire) < TS_FAULT_HOLD)
                continue;
            if (m->fork_copies == NULL) m->fork_copies = calloc(m->slot_count, sizeof(void *));
            if (m->fork_copies == NULL) break;
            void *copy = mmap(NULL, (size_t)m->slot_bytes, PROT_READ | PROT_WRITE,
                              MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
            if (copy == MAP_FAILED) continue;
            memcpy(copy, m->start + (uint64_t)k * m->slot_bytes, (size_t)m->slot_bytes);
            m->fork_copies[k] = copy;
        }
    }
}

/* Free what ts_fault_fork_prepare made (parent; or a child's leftovers). */
static void ts_fault_fork_free(int in_child)
{
    for (int i = 0; i < TS_FAULT_WATCHED; i++) {
        ts_fault_map *m = ts_fault_entry_map(i);
        if (m == NULL || m->fork_copies == NULL) continue;
        for (uint32_t k = 0; k < m->slot_count; k++) {
            void *copy = m->fork_copies[k];
            if (copy == NULL) continue;
            void *slot = m->start + (uint64_t)k * m->slot_bytes;
            size_t n = (size_t)m->slot_bytes;
            /* The child: the copy moves over the slot, atomically for its readers. */
            if (!in_child || mremap(copy, n, n, MREMAP_MAYMOVE | MREMAP_FIXED, slot) == MAP_FAILED)
                munmap(copy, n);
        }
        free(m->fork_copies);
        m->fork_copies = NULL;
    }
    pthread_mutex_unlock(&ts_fault_table_lock);
}

/* After a fork, in the parent: drop the copies (see ts_fault.h). */
void ts_fault_fork_parent(void)
{
    ts_fault_fork_free(0);
}

/* After a fork, in the child: the copies replace the held slots (see ts_fault.h). */
void ts_fault_fork_child(void)
{
    ts_fault_fork_free(1);
}
