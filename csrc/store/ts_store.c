/* ts_store.c - the decoded-sample store: segment, index, buddy arena, entries, pins.
 * See ts_store.h and docs/decoded-store.md. */
#define _GNU_SOURCE
#include "store/ts_store.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "base/ts_clock.h"
#include "base/ts_proc.h"
#include "base/ts_segment.h"

/* ==========================================================================
 * Layout
 * ========================================================================== */

/* Block map values (one byte per 4 KiB block, at a block's first): its head's state. */
#define TS_MAP_FREE 0x40u /* | order - TS_STORE_MIN_ORDER: a free block's head */
#define TS_MAP_USED 0x80u /* | order - TS_STORE_MIN_ORDER: an entry's block's head */
#define TS_INDEX_EMPTY 0u
#define TS_INDEX_GONE UINT32_MAX /* a tombstone */

/* x rounded up to a multiple of a (a power of two). */
static uint64_t ts_align(uint64_t x, uint64_t a) { return (x + a - 1) & ~(a - 1); }

/* The smallest order whose block holds bytes (at least TS_STORE_MIN_ORDER). */
static uint32_t ts_order_for(uint64_t bytes)
{
    uint32_t k = TS_STORE_MIN_ORDER;
    while (k < 63 && (1ULL << k) < bytes) k++;
    return k;
}

/* The table pointers of a mapped header. */
static ts_store_entry *ts_entries_of(ts_store_header *h)
{
    return (ts_store_entry *)((char *)h + h->layout.entry_offset);
}
static uint32_t *ts_index_of(ts_store_header *h) { return (uint32_t *)((char *)h + h->layout.index_offset); }
static uint16_t *ts_uses_of(ts_store_header *h) { return (uint16_t *)((char *)h + h->layout.uses_offset); }
/* Job slot j's bitmap of the samples it still needs. */
static uint64_t *ts_needs_of(ts_store_header *h, uint32_t j)
{
    return (uint64_t *)((char *)h + h->layout.needs_offset) + (uint64_t)j * h->layout.needs_words;
}
static uint8_t *ts_map_of(ts_store_header *h) { return (uint8_t *)h + h->layout.map_offset; }
/* links[2 * b] / [2 * b + 1]: next / prev free block of free block b's list. */
static uint32_t *ts_links_of(ts_store_header *h) { return (uint32_t *)((char *)h + h->layout.links_offset); }

ts_store_entry *ts_store_entries(const ts_store *st) { return ts_entries_of(st->hdr); }

/* ==========================================================================
 * The buddy arena (lock held)
 * ========================================================================== */

/* Push free block b of order k on its list and mark its head. */
static void ts_free_push(ts_store_header *h, uint32_t b, uint32_t k)
{
    uint32_t *links = ts_links_of(h), i = k - TS_STORE_MIN_ORDER, head = h->free_head[i];
    links[2 * b] = head;
    links[2 * b + 1] = TS_STORE_NONE;
    if (head != TS_STORE_NONE) links[2 * head + 1] = b;
    h->free_head[i] = b;
    ts_map_of(h)[b] = (uint8_t)(TS_MAP_FREE | i);
}

/* Take free block b of order k off its list (its head mark is the caller's to change). */
static void ts_free_unlink(ts_store_header *h, uint32_t b, uint32_t k)
{
    uint32_t *links = ts_links_of(h), i = k - TS_STORE_MIN_ORDER;
    uint32_t next = links[2 * b], prev = links[2 * b + 1];
    if (prev != TS_STORE_NONE) links[2 * prev] = next;
    else h->free_head[i] = next;
    if (next != TS_STORE_NONE) links[2 * next + 1] = prev;
    ts_map_of(h)[b] = 0;
}

/* A block of order k taken from the free lists (split from a larger one if need be), its
 * head marked used; TS_STORE_NONE if none is free. */
static uint32_t ts_block_take(ts_store_header *h, uint32_t k)
{
    uint32_t j = k;
    while (j <= h->layout.max_order && h->free_head[j - TS_STORE_MIN_ORDER] == TS_STORE_NONE) j++;
    if (j > h->layout.max_order) return TS_STORE_NONE;
    uint32_t b = h->free_head[j - TS_STORE_MIN_ORDER];
    ts_free_unlink(h, b, j);
    while (j > k) { /* split: the upper half goes back free */
        j--;
        ts_free_push(h, b + (1u << (j - TS_STORE_MIN_ORDER)), j);
    }
    ts_map_of(h)[b] = (uint8_t)(TS_MAP_USED | (k - TS_STORE_MIN_ORDER));
    return b;
}

/* Give back block b of order k, merged with its free buddies. */
static void ts_block_give(ts_store_header *h, uint32_t b, uint32_t k)
{
    uint8_t *map = ts_map_of(h);
    map[b] = 0;
    while (k < h->layout.max_order) {
        uint32_t buddy = b ^ (1u << (k - TS_STORE_MIN_ORDER));
        if (buddy >= h->layout.min_blocks || map[buddy] != (TS_MAP_FREE | (k - TS_STORE_MIN_ORDER)))
            break;
        ts_free_unlink(h, buddy, k);
        if (buddy < b) b = buddy;
        k++;
    }
    ts_free_push(h, b, k);
}

/* Call fn on each top block of the arena (its first min-block and its order): whole
 * blocks of max_order, then the rest's powers of two, largest first. Each lies aligned to
 * its size, so the buddy of any block inside one is inside it too, and a top block's
 * buddy is never a free block of its order: merges stay within top blocks. */
static void ts_tops_each(ts_store_header *h, void (*fn)(ts_store_header *, uint32_t, uint32_t))
{
    uint64_t off = 0, top = 1ULL << h->layout.max_order, arena = h->layout.arena_bytes;
    for (; off + top <= arena; off += top) fn(h, (uint32_t)(off >> TS_STORE_MIN_ORDER), h->layout.max_order);
    for (uint32_t k = h->layout.max_order; k-- > TS_STORE_MIN_ORDER;)
        if ((arena - off) & (1ULL << k)) {
            fn(h, (uint32_t)(off >> TS_STORE_MIN_ORDER), k);
            off += 1ULL << k;
        }
}

/* Free blocks for [b, b + 2^k) around the used heads marked in the map (repair). */
static void ts_blocks_rebuild(ts_store_header *h, uint32_t b, uint32_t k)
{
    uint32_t n = 1u << (k - TS_STORE_MIN_ORDER);
    uint8_t *map = ts_map_of(h);
    if (map[b] == (TS_MAP_USED | (k - TS_STORE_MIN_ORDER))) return; /* one entry's block */
    int any = 0;
    for (uint32_t i = 0; i < n && !any; i++) any = (map[b + i] & TS_MAP_USED) != 0;
    if (!any) {
        ts_free_push(h, b, k);
        return;
    }
    ts_blocks_rebuild(h, b, k - 1);
    ts_blocks_rebuild(h, b + n / 2, k - 1);
}

/* ==========================================================================
 * The index (lock held): sample -> entry, open addressing, linear probing
 * ========================================================================== */

/* The first slot to probe for sample s. */
static uint32_t ts_index_home(const ts_store_header *h, uint64_t s)
{
    uint64_t x = s * 0x9E3779B97F4A7C15ULL;
    return (uint32_t)(x >> 32) & (h->layout.index_slots - 1);
}

/* The entry of sample s, or TS_STORE_NONE (*slot: where it is, if found). */
static uint32_t ts_index_find(ts_store_header *h, uint64_t s, uint32_t *slot)
{
    uint32_t *index = ts_index_of(h), mask = h->layout.index_slots - 1;
    ts_store_entry *entries = ts_entries_of(h);
    for (uint32_t i = ts_index_home(h, s), n = 0; n < h->layout.index_slots; i = (i + 1) & mask, n++) {
        uint32_t v = index[i];
        if (v == TS_INDEX_EMPTY) return TS_STORE_NONE;
        if (v != TS_INDEX_GONE && entries[v - 1].sample == s) {
            if (slot != NULL) *slot = i;
            return v - 1;
        }
    }
    return TS_STORE_NONE;
}

/* Index entry e under its sample (it is not indexed yet). */
static void ts_index_add(ts_store_header *h, uint32_t e)
{
    uint32_t *index = ts_index_of(h), mask = h->layout.index_slots - 1;
    uint32_t i = ts_index_home(h, ts_entries_of(h)[e].sample);
    while (index[i] != TS_INDEX_EMPTY && index[i] != TS_INDEX_GONE) i = (i + 1) & mask;
    index[i] = e + 1;
}

/* ==========================================================================
 * Entries (lock held)
 * ========================================================================== */

/* Free entry e: off the index, its block given back. */
static void ts_entry_free(ts_store_header *h, uint32_t e)
{
    ts_store_entry *en = &ts_entries_of(h)[e];
    uint32_t slot;
    if (ts_index_find(h, en->sample, &slot) == e) ts_index_of(h)[slot] = TS_INDEX_GONE;
    atomic_store_explicit(&en->state, TS_STORE_FREE, memory_order_release);
    ts_block_give(h, (uint32_t)(en->offset >> TS_STORE_MIN_ORDER), en->order);
    h->used_bytes -= 1ULL << en->order;
    h->used_entries--;
}

/* Whether the writer of FILLING entry en still runs. */
static int ts_writer_alive(const ts_store_entry *en)
{
    return ts_proc_alive(en->writer_pid, en->writer_start);
}

/* Free FILLING entries whose writer died (a SIGKILL mid-insert); how many. */
static uint32_t ts_reap_writers(ts_store_header *h)
{
    uint32_t n = 0;
    ts_store_entry *entries = ts_entries_of(h);
    for (uint32_t e = 0; e < h->layout.entries; e++)
        if (atomic_load_explicit(&entries[e].state, memory_order_relaxed) == TS_STORE_FILLING &&
            !ts_writer_alive(&entries[e])) {
            ts_entry_free(h, e);
            n++;
        }
    return n;
}

/* Job slot j's needs go: each sample it still needed has one use fewer. */
static void ts_job_needs_drop(ts_store_header *h, uint32_t j)
{
    uint64_t *needs = ts_needs_of(h, j);
    uint16_t *uses = ts_uses_of(h);
    for (uint64_t w = 0; w < h->layout.needs_words; w++) {
        for (uint64_t bits = needs[w]; bits != 0; bits &= bits - 1) {
            uint16_t *u = &uses[w * 64 + (uint64_t)__builtin_ctzll(bits)];
            if (*u > 0) (*u)--;
        }
        needs[w] = 0;
    }
}

/* The jobs of `mask` leave (closed, or dead): their pins and needs go, their slots are
 * free. */
static void ts_jobs_drop(ts_store_header *h, uint64_t mask)
{
    ts_store_entry *entries = ts_entries_of(h);
    for (uint32_t e = 0; e < h->layout.entries; e++)
        atomic_fetch_and_explicit(&entries[e].pins, ~mask, memory_order_acq_rel);
    for (uint32_t j = 0; j < TS_STORE_MAX_JOBS; j++)
        if (mask & (1ULL << j)) {
            ts_job_needs_drop(h, j);
            h->jobs[j].pid = 0;
        }
}

/* Drop the jobs whose process died (ts_jobs_drop); how many. */
static uint32_t ts_reap_jobs(ts_store_header *h)
{
    uint64_t dead = 0;
    for (uint32_t j = 0; j < TS_STORE_MAX_JOBS; j++)
        if (h->jobs[j].pid != 0 && !ts_proc_alive(h->jobs[j].pid, h->jobs[j].start_time))
            dead |= 1ULL << j;
    if (dead != 0) ts_jobs_drop(h, dead);
    return (uint32_t)__builtin_popcountll(dead);
}

/* The READY, unpinned entry to evict first: fewest remaining uses, then least recently
 * used; TS_STORE_NONE if every READY entry is pinned. */
static uint32_t ts_victim(ts_store_header *h)
{
    ts_store_entry *entries = ts_entries_of(h);
    const uint16_t *uses = ts_uses_of(h);
    uint32_t best = TS_STORE_NONE;
    for (uint32_t e = 0; e < h->layout.entries; e++) {
        ts_store_entry *en = &entries[e];
        if (atomic_load_explicit(&en->state, memory_order_relaxed) != TS_STORE_READY ||
            atomic_load_explicit(&en->pins, memory_order_acquire) != 0)
            continue;
        if (best == TS_STORE_NONE) { best = e; continue; }
        const ts_store_entry *b = &entries[best];
        uint16_t ue = uses[en->sample], ub = uses[b->sample];
        if (ue < ub || (ue == ub && en->last_use < b->last_use)) best = e;
    }
    return best;
}

/* A block of order k, evicting by ts_victim (and reaping the dead) as needed;
 * TS_STORE_NONE if it cannot be had without a pinned sample going. */
static uint32_t ts_block_room(ts_store *st, uint32_t k)
{
    ts_store_header *h = st->hdr;
    int reaped = 0;
    for (;;) {
        uint32_t b = ts_block_take(h, k);
        if (b != TS_STORE_NONE) return b;
        uint32_t v = ts_victim(h);
        if (v != TS_STORE_NONE) {
            ts_entry_free(h, v);
            atomic_fetch_add_explicit(&h->evictions, 1, memory_order_relaxed);
            continue;
        }
        if (reaped) return TS_STORE_NONE;
        reaped = 1;
        if (ts_reap_writers(h) + ts_reap_jobs(h) == 0) return TS_STORE_NONE;
    }
}

/* A FREE entry's number; TS_STORE_NONE if the table is full. */
static uint32_t ts_entry_take(ts_store_header *h)
{
    ts_store_entry *entries = ts_entries_of(h);
    for (uint32_t e = 0; e < h->layout.entries; e++)
        if (atomic_load_explicit(&entries[e].state, memory_order_relaxed) == TS_STORE_FREE)
            return e;
    return TS_STORE_NONE;
}

/* ==========================================================================
 * The lock, and the repair after a holder died
 * ========================================================================== */

/* Rebuild the index, the arena's lists and the counts from the entry table, freeing the
 * entries of dead writers: every step of a change leaves the table valid. */
static void ts_store_repair(ts_store_header *h)
{
    memset(ts_map_of(h), 0, h->layout.min_blocks);
    memset(ts_index_of(h), 0, (size_t)h->layout.index_slots * sizeof(uint32_t));
    for (uint32_t i = 0; i < TS_STORE_ORDERS; i++) h->free_head[i] = TS_STORE_NONE;
    h->used_bytes = 0;
    h->used_entries = 0;
    ts_store_entry *entries = ts_entries_of(h);
    for (uint32_t e = 0; e < h->layout.entries; e++) {
        ts_store_entry *en = &entries[e];
        uint32_t s = atomic_load_explicit(&en->state, memory_order_relaxed);
        if (s == TS_STORE_FREE) continue;
        if ((s == TS_STORE_FILLING && !ts_writer_alive(en)) ||
            ts_index_find(h, en->sample, NULL) != TS_STORE_NONE) { /* dead, or a twin */
            atomic_store_explicit(&en->state, TS_STORE_FREE, memory_order_relaxed);
            continue;
        }
        ts_map_of(h)[en->offset >> TS_STORE_MIN_ORDER] =
            (uint8_t)(TS_MAP_USED | (en->order - TS_STORE_MIN_ORDER));
        ts_index_add(h, e);
        h->used_bytes += 1ULL << en->order;
        h->used_entries++;
    }
    ts_tops_each(h, ts_blocks_rebuild);
    atomic_fetch_add_explicit(&h->repairs, 1, memory_order_relaxed);
}

/* Take the store's lock, waiting at most wait_ns; a holder that died is repaired after. A
 * wait that times out (a holder stopped) fails TS_E_TIMEOUT. The data path's calls
 * (backoff set) wait TS_STORE_LOCK_WAIT_NS, and after a timeout fail at once for
 * TS_STORE_BUSY_BACKOFF_NS; the calls that end what the handle began (commit, abort,
 * close, drop) ignore the backoff and wait TS_STORE_FINISH_WAIT_NS. */
static ts_status ts_store_lock_wait(ts_store *st, uint64_t wait_ns, int backoff, ts_err *err)
{
    if (backoff && ts_now_ns() < st->busy_until) {
        atomic_fetch_add_explicit(&st->hdr->busy, 1, memory_order_relaxed);
        return ts_err_set(err, TS_E_TIMEOUT, 0, "the sample store's lock is held by a "
                          "stopped process (backing off)");
    }
    struct timespec deadline;
    clock_gettime(CLOCK_REALTIME, &deadline);
    deadline.tv_sec += (time_t)(wait_ns / 1000000000ULL);
    deadline.tv_nsec += (long)(wait_ns % 1000000000ULL);
    deadline.tv_sec += deadline.tv_nsec / 1000000000L;
    deadline.tv_nsec %= 1000000000L;
    int rc = pthread_mutex_timedlock(&st->hdr->lock, &deadline);
    if (rc == ETIMEDOUT) {
        if (backoff) st->busy_until = ts_now_ns() + TS_STORE_BUSY_BACKOFF_NS;
        atomic_fetch_add_explicit(&st->hdr->busy, 1, memory_order_relaxed);
        return ts_err_set(err, TS_E_TIMEOUT, rc, "the sample store's lock was held for more "
                          "than %llu ms (a process of a job that shares it is stopped?)",
                          (unsigned long long)(wait_ns / 1000000));
    }
    if (rc == EOWNERDEAD) {
        ts_store_repair(st->hdr);
        rc = pthread_mutex_consistent(&st->hdr->lock);
    }
    if (rc != 0)
        return ts_err_set(err, TS_E_SYS, rc, "locking the sample store: %s", strerror(rc));
    return TS_OK;
}

/* The lock for the data path (ts_store_lock_wait). */
static ts_status ts_store_lock(ts_store *st, ts_err *err)
{
    return ts_store_lock_wait(st, TS_STORE_LOCK_WAIT_NS, 1, err);
}

/* The lock for a call that ends what the handle began (ts_store_lock_wait). */
static ts_status ts_store_lock_finish(ts_store *st, ts_err *err)
{
    return ts_store_lock_wait(st, TS_STORE_FINISH_WAIT_NS, 0, err);
}

/* Release the store's lock. */
static void ts_store_unlock(ts_store *st) { pthread_mutex_unlock(&st->hdr->lock); }

/* ==========================================================================
 * Life cycle
 * ========================================================================== */

/* Map the whole segment of fd into a new handle. */
static ts_status ts_store_map(const char *name, int fd, uint64_t bytes, ts_store **out,
                              ts_err *err)
{
    if (strlen(name) + 1 > sizeof((*out)->name)) {
        close(fd);
        return ts_err_set(err, TS_E_INVALID, 0, "store name too long: %s", name);
    }
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
        int e = errno;
        close(fd);
        return ts_err_set(err, TS_E_SYS, e, "mmap of the sample store: %s", strerror(e));
    }
    ts_store *st = calloc(1, sizeof *st);
    if (st == NULL || pthread_mutex_init(&st->pin_lock, NULL) != 0) {
        free(st);
        munmap(p, bytes);
        close(fd);
        return ts_err_set(err, TS_E_SYS, ENOMEM, "out of memory");
    }
    st->hdr = p;
    st->map_bytes = bytes;
    st->fd = fd;
    st->job = TS_STORE_NONE;
    strcpy(st->name, name);
    *out = st;
    return TS_OK;
}

/* Allocate the handle's per-entry pin counts (the layout is known). */
static ts_status ts_store_counts_alloc(ts_store *st, ts_err *err)
{
    st->pin_counts = calloc(st->hdr->layout.entries, sizeof *st->pin_counts);
    if (st->pin_counts == NULL)
        return ts_err_set(err, TS_E_SYS, ENOMEM, "out of memory for %u pin counts",
                          st->hdr->layout.entries);
    return TS_OK;
}

/* Plan the segment of a store of `samples` samples whose arena takes at most budget bytes
 * (whole top blocks): where each table and the arena go. */
static ts_status ts_store_plan(uint64_t samples, uint64_t budget, ts_store_layout *l,
                               ts_err *err)
{
    if (budget < (1ULL << TS_STORE_MIN_ORDER) || samples == 0)
        return ts_err_set(err, TS_E_INVALID, 0, "a sample store needs a budget of at least "
                          "4096 bytes and at least one sample (budget %llu, samples %llu)",
                          (unsigned long long)budget, (unsigned long long)samples);
    memset(l, 0, sizeof *l);
    /* The arena is the budget in whole 4 KiB blocks, cut into top blocks (ts_tops_each):
     * as many of the largest order as fit, then the rest's powers of two. */
    l->max_order = TS_STORE_MAX_ORDER;
    while ((1ULL << l->max_order) > budget) l->max_order--;
    l->arena_bytes = budget & ~((1ULL << TS_STORE_MIN_ORDER) - 1);
    uint64_t min_blocks = l->arena_bytes >> TS_STORE_MIN_ORDER;
    if (min_blocks >= TS_STORE_NONE)
        return ts_err_set(err, TS_E_INVALID, 0, "a sample store budget of %llu bytes is too "
                          "large", (unsigned long long)budget);
    l->min_blocks = (uint32_t)min_blocks;
    l->samples = samples;
    /* An entry per block, but never more than there are samples. */
    l->entries = (uint32_t)(min_blocks < samples ? min_blocks : samples);
    l->index_slots = 1;
    while (l->index_slots < 2 * (uint64_t)l->entries) l->index_slots <<= 1;
    uint64_t off = ts_align(sizeof(ts_store_header), 64);
    l->entry_offset = off;
    off = ts_align(off + (uint64_t)l->entries * sizeof(ts_store_entry), 64);
    l->index_offset = off;
    off = ts_align(off + (uint64_t)l->index_slots * sizeof(uint32_t), 64);
    l->uses_offset = off;
    off = ts_align(off + samples * sizeof(uint16_t), 64);
    l->needs_offset = off;
    l->needs_words = (samples + 63) / 64;
    off = ts_align(off + TS_STORE_MAX_JOBS * l->needs_words * sizeof(uint64_t), 64);
    l->map_offset = off;
    off = ts_align(off + min_blocks, 64);
    l->links_offset = off;
    l->arena_offset = ts_align(off + min_blocks * 2 * sizeof(uint32_t), 4096);
    l->segment_bytes = l->arena_offset + l->arena_bytes;
    return TS_OK;
}

ts_status ts_store_create(const char *name, uint64_t samples, uint64_t budget,
                          ts_store **out, ts_err *err)
{
    ts_store_layout layout;
    ts_status s = ts_store_plan(samples, budget, &layout, err);
    if (s != TS_OK) return s;
    int fd = -1;
    if ((s = ts_segment_create(name, layout.segment_bytes, &fd, err)) != TS_OK) return s;
    if ((s = ts_store_map(name, fd, layout.segment_bytes, out, err)) != TS_OK) {
        ts_segment_unlink(name, NULL);
        return s;
    }
    ts_store_header *h = (*out)->hdr;
    h->layout_version = TS_STORE_LAYOUT_VERSION;
    h->layout = layout;
    if ((s = ts_store_counts_alloc(*out, err)) != TS_OK) {
        ts_store_close(*out);
        *out = NULL;
        ts_segment_unlink(name, NULL);
        return s;
    }
    for (uint32_t i = 0; i < TS_STORE_ORDERS; i++) h->free_head[i] = TS_STORE_NONE;
    ts_tops_each(h, ts_free_push);
    pthread_mutexattr_t a;
    pthread_mutexattr_init(&a);
    pthread_mutexattr_setpshared(&a, PTHREAD_PROCESS_SHARED);
    pthread_mutexattr_setrobust(&a, PTHREAD_MUTEX_ROBUST);
    int rc = pthread_mutex_init(&h->lock, &a);
    pthread_mutexattr_destroy(&a);
    if (rc != 0) {
        ts_store_close(*out);
        *out = NULL;
        ts_segment_unlink(name, NULL);
        return ts_err_set(err, TS_E_SYS, rc, "a robust shared mutex: %s", strerror(rc));
    }
    /* Last: a store is valid once it has its magic (an opener sees it being made before). */
    atomic_store_explicit(&h->magic, TS_STORE_MAGIC, memory_order_release);
    return TS_OK;
}

ts_status ts_store_open(const char *name, ts_store **out, ts_err *err)
{
    int fd = -1;
    uint64_t bytes = 0;
    ts_status s = ts_segment_open(name, &fd, &bytes, err);
    if (s != TS_OK) return s;
    /* A segment another process is making (its size not set yet, or its magic not
     * stored) is not there yet: TS_E_NOT_FOUND, as before it was created. */
    if (bytes < sizeof(ts_store_header)) {
        close(fd);
        return ts_err_set(err, TS_E_NOT_FOUND, 0, "%s is being made (%llu bytes so far)",
                          name, (unsigned long long)bytes);
    }
    if ((s = ts_store_map(name, fd, bytes, out, err)) != TS_OK) return s;
    ts_store_header *h = (*out)->hdr;
    uint64_t magic = atomic_load_explicit(&h->magic, memory_order_acquire);
    if (magic == 0) {
        ts_store_close(*out);
        *out = NULL;
        return ts_err_set(err, TS_E_NOT_FOUND, 0, "%s is being made", name);
    }
    if (magic != TS_STORE_MAGIC || h->layout_version != TS_STORE_LAYOUT_VERSION ||
        h->layout.segment_bytes != bytes) {
        ts_store_close(*out);
        *out = NULL;
        return ts_err_set(err, TS_E_VERSION, 0, "%s is no sample store of layout %d", name,
                          TS_STORE_LAYOUT_VERSION);
    }
    if ((s = ts_store_counts_alloc(*out, err)) != TS_OK) {
        ts_store_close(*out);
        *out = NULL;
    }
    return s;
}

void ts_store_close(ts_store *st)
{
    if (st == NULL) return;
    /* (A forked child's copy of a handle leaves its parent's job alone.) */
    if (st->job != TS_STORE_NONE && st->owner == getpid() &&
        ts_store_lock_finish(st, NULL) == TS_OK) {
        ts_jobs_drop(st->hdr, 1ULL << st->job);
        ts_store_unlock(st);
    }
    munmap(st->hdr, st->map_bytes);
    close(st->fd);
    pthread_mutex_destroy(&st->pin_lock);
    free(st->pin_counts);
    free(st);
}

ts_status ts_store_attach(ts_store *st, ts_err *err)
{
    pid_t pid = getpid();
    uint64_t start = ts_proc_start_time(pid); /* (read before the lock: /proc is slow) */
    ts_status s = ts_store_lock(st, err);
    if (s != TS_OK) return s;
    ts_store_header *h = st->hdr;
    ts_reap_jobs(h);
    for (uint32_t j = 0; j < TS_STORE_MAX_JOBS; j++)
        if (h->jobs[j].pid == 0) {
            h->jobs[j].start_time = start;
            h->jobs[j].pid = pid;
            st->start_time = start;
            atomic_store_explicit(&h->jobs[j].epoch, 0, memory_order_relaxed);
            atomic_store_explicit(&h->jobs[j].position, 0, memory_order_relaxed);
            atomic_store_explicit(&h->jobs[j].length, 0, memory_order_relaxed);
            st->job = j;
            st->owner = pid;
            ts_store_unlock(st);
            return TS_OK;
        }
    ts_store_unlock(st);
    return ts_err_set(err, TS_E_FULL, 0, "the sample store has %d jobs attached already",
                      TS_STORE_MAX_JOBS);
}

/* ==========================================================================
 * Samples in and out
 * ========================================================================== */

ts_status ts_store_reserve(ts_store *st, uint64_t sample, uint64_t bytes,
                           ts_store_outcome *outcome, uint32_t *entry, void **data, ts_err *err)
{
    ts_store_header *h = st->hdr;
    if (sample >= h->layout.samples)
        return ts_err_set(err, TS_E_INVALID, 0, "sample %llu of a store of %llu samples",
                          (unsigned long long)sample, (unsigned long long)h->layout.samples);
    pid_t pid = getpid();
    uint64_t start = pid == st->owner ? st->start_time : ts_proc_start_time(pid);
    ts_status s = ts_store_lock(st, err);
    if (s != TS_OK) return s;
    if (atomic_load_explicit(&h->dropped, memory_order_relaxed)) {
        *outcome = TS_STORE_NO_ROOM;
        ts_store_unlock(st);
        return TS_OK;
    }
    uint32_t e = ts_index_find(h, sample, NULL);
    if (e != TS_STORE_NONE) {
        ts_store_entry *en = &ts_entries_of(h)[e];
        if (atomic_load_explicit(&en->state, memory_order_relaxed) == TS_STORE_READY) {
            atomic_fetch_add_explicit(&h->races, 1, memory_order_relaxed);
            *outcome = TS_STORE_PRESENT;
            *entry = e;
            ts_store_unlock(st);
            return TS_OK;
        }
        if (ts_writer_alive(en)) {
            atomic_fetch_add_explicit(&h->races, 1, memory_order_relaxed);
            *outcome = TS_STORE_RACED;
            ts_store_unlock(st);
            return TS_OK;
        }
        ts_entry_free(h, e); /* its writer died mid-insert */
    }
    uint32_t k = ts_order_for(bytes), b = TS_STORE_NONE;
    e = ts_entry_take(h);
    if (e == TS_STORE_NONE && (e = ts_victim(h)) != TS_STORE_NONE) { /* a full table */
        ts_entry_free(h, e);
        atomic_fetch_add_explicit(&h->evictions, 1, memory_order_relaxed);
    }
    if (k <= h->layout.max_order && e != TS_STORE_NONE) b = ts_block_room(st, k);
    if (b == TS_STORE_NONE) {
        atomic_fetch_add_explicit(&h->no_room, 1, memory_order_relaxed);
        *outcome = TS_STORE_NO_ROOM;
        ts_store_unlock(st);
        return TS_OK;
    }
    ts_store_entry *en = &ts_entries_of(h)[e];
    en->order = k;
    en->sample = sample;
    en->offset = (uint64_t)b << TS_STORE_MIN_ORDER;
    en->bytes = bytes;
    en->writer_pid = pid;
    en->writer_start = start;
    atomic_store_explicit(&en->pins, 0, memory_order_relaxed);
    atomic_store_explicit(&en->state, TS_STORE_FILLING, memory_order_release);
    ts_index_add(h, e);
    h->used_bytes += 1ULL << k;
    h->used_entries++;
    *outcome = TS_STORE_RESERVED;
    *entry = e;
    *data = (char *)h + h->layout.arena_offset + en->offset;
    ts_store_unlock(st);
    return TS_OK;
}

/* Entry e if it is a FILLING entry of this process, else NULL (err set). */
static ts_store_entry *ts_own_filling(ts_store *st, uint32_t e, ts_err *err)
{
    ts_store_entry *en = e < st->hdr->layout.entries ? &ts_entries_of(st->hdr)[e] : NULL;
    if (en == NULL || atomic_load_explicit(&en->state, memory_order_relaxed) != TS_STORE_FILLING ||
        en->writer_pid != getpid()) {
        ts_err_set(err, TS_E_INVALID, 0, "entry %u is no entry this process fills", e);
        return NULL;
    }
    return en;
}

ts_status ts_store_commit(ts_store *st, uint32_t e, ts_err *err)
{
    ts_status s = ts_store_lock_finish(st, err);
    if (s != TS_OK) return s;
    ts_store_entry *en = ts_own_filling(st, e, err);
    if (en != NULL) {
        en->last_use = ++st->hdr->clock;
        atomic_store_explicit(&en->state, TS_STORE_READY, memory_order_release);
        atomic_fetch_add_explicit(&st->hdr->commits, 1, memory_order_relaxed);
    }
    ts_store_unlock(st);
    return en != NULL ? TS_OK : TS_E_INVALID;
}

ts_status ts_store_abort(ts_store *st, uint32_t e, ts_err *err)
{
    ts_status s = ts_store_lock_finish(st, err);
    if (s != TS_OK) return s;
    ts_store_entry *en = ts_own_filling(st, e, err);
    if (en != NULL) ts_entry_free(st->hdr, e);
    ts_store_unlock(st);
    return en != NULL ? TS_OK : TS_E_INVALID;
}

ts_status ts_store_get(ts_store *st, uint64_t sample, int counted, uint32_t *entry,
                       const void **data, uint64_t *bytes, ts_err *err)
{
    ts_store_header *h = st->hdr;
    if (st->job == TS_STORE_NONE)
        return ts_err_set(err, TS_E_INVALID, 0, "attach to the sample store before a get");
    ts_status s = ts_store_lock(st, err);
    if (s != TS_OK) return s;
    uint32_t e = ts_index_find(h, sample, NULL);
    ts_store_entry *en = e == TS_STORE_NONE ? NULL : &ts_entries_of(h)[e];
    if (en == NULL || atomic_load_explicit(&en->state, memory_order_acquire) != TS_STORE_READY ||
        atomic_load_explicit(&h->dropped, memory_order_relaxed)) {
        if (counted) atomic_fetch_add_explicit(&h->misses, 1, memory_order_relaxed);
        ts_store_unlock(st);
        return TS_E_NOT_FOUND;
    }
    pthread_mutex_lock(&st->pin_lock);
    if (st->pin_counts[e]++ == 0)
        atomic_fetch_or_explicit(&en->pins, 1ULL << st->job, memory_order_acq_rel);
    pthread_mutex_unlock(&st->pin_lock);
    en->last_use = ++h->clock;
    if (counted) atomic_fetch_add_explicit(&h->hits, 1, memory_order_relaxed);
    *entry = e;
    *data = (const char *)h + h->layout.arena_offset + en->offset;
    *bytes = en->bytes;
    ts_store_unlock(st);
    return TS_OK;
}

void ts_store_unpin(ts_store *st, uint32_t e)
{
    if (e >= st->hdr->layout.entries || st->job == TS_STORE_NONE) return;
    pthread_mutex_lock(&st->pin_lock);
    if (st->pin_counts[e] > 0 && --st->pin_counts[e] == 0)
        atomic_fetch_and_explicit(&ts_entries_of(st->hdr)[e].pins, ~(1ULL << st->job),
                                  memory_order_acq_rel);
    pthread_mutex_unlock(&st->pin_lock);
}

/* TS_OK if job names an attached job slot, else TS_E_INVALID (err set). */
static ts_status ts_job_check(ts_store_header *h, uint32_t job, ts_err *err)
{
    if (job < TS_STORE_MAX_JOBS && h->jobs[job].pid != 0) return TS_OK;
    return ts_err_set(err, TS_E_INVALID, 0, "job slot %u of the sample store is not attached",
                      job);
}

ts_status ts_store_need(ts_store *st, uint32_t job, const uint64_t *samples, uint64_t n,
                        ts_err *err)
{
    ts_store_header *h = st->hdr;
    ts_status s = ts_store_lock(st, err);
    if (s != TS_OK) return s;
    if ((s = ts_job_check(h, job, err)) != TS_OK) {
        ts_store_unlock(st);
        return s;
    }
    ts_job_needs_drop(h, job); /* (what it did not visit of its last epoch goes) */
    uint64_t *needs = ts_needs_of(h, job);
    uint16_t *uses = ts_uses_of(h);
    for (uint64_t i = 0; i < n; i++) {
        uint64_t x = samples[i], bit = 1ULL << (x % 64);
        if (x >= h->layout.samples || (needs[x / 64] & bit)) continue;
        needs[x / 64] |= bit;
        if (uses[x] < UINT16_MAX) uses[x]++;
    }
    ts_store_unlock(st);
    return TS_OK;
}

ts_status ts_store_visited(ts_store *st, uint32_t job, uint64_t x, ts_err *err)
{
    ts_store_header *h = st->hdr;
    if (job >= TS_STORE_MAX_JOBS || x >= h->layout.samples) return TS_OK;
    ts_status s = ts_store_lock(st, err); /* (a job's workers visit for it: the lock) */
    if (s != TS_OK) return s;
    uint64_t *word = &ts_needs_of(h, job)[x / 64], bit = 1ULL << (x % 64);
    if (*word & bit) {
        *word &= ~bit;
        uint16_t *u = &ts_uses_of(h)[x];
        if (*u > 0) (*u)--;
    }
    ts_store_unlock(st);
    return TS_OK;
}

void ts_store_progress(ts_store *st, uint64_t epoch, uint64_t position, uint64_t length)
{
    if (st->job == TS_STORE_NONE) return;
    ts_store_job *j = &st->hdr->jobs[st->job];
    atomic_store_explicit(&j->epoch, epoch, memory_order_relaxed);
    atomic_store_explicit(&j->position, position, memory_order_relaxed);
    atomic_store_explicit(&j->length, length, memory_order_relaxed);
}

ts_status ts_store_drop(ts_store *st, const char *reason, ts_err *err)
{
    ts_store_header *h = st->hdr;
    ts_status s = ts_store_lock_finish(st, err);
    if (s != TS_OK) return s;
    if (!atomic_load_explicit(&h->dropped, memory_order_relaxed)) {
        snprintf(h->drop_reason, sizeof h->drop_reason, "%s", reason);
        atomic_store_explicit(&h->dropped, 1, memory_order_release);
    }
    ts_store_unlock(st);
    return TS_OK;
}

int ts_store_dropped(const ts_store *st, char *reason, size_t cap)
{
    const ts_store_header *h = st->hdr;
    if (!atomic_load_explicit(&h->dropped, memory_order_acquire)) return 0;
    if (cap > 0) snprintf(reason, cap, "%s", h->drop_reason);
    return 1;
}

ts_status ts_store_reap(ts_store *st, uint32_t *writers, uint32_t *jobs, ts_err *err)
{
    ts_status s = ts_store_lock(st, err);
    if (s != TS_OK) return s;
    uint32_t w = ts_reap_writers(st->hdr), j = ts_reap_jobs(st->hdr);
    ts_store_unlock(st);
    if (writers != NULL) *writers = w;
    if (jobs != NULL) *jobs = j;
    return TS_OK;
}
