/* ts_ring.c - the ring protocol over a shared segment (see ts_ring.h). */
#define _GNU_SOURCE
#include "ring/ts_ring.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "base/ts_clock.h"
#include "base/ts_copy.h"
#include "device/ts_device.h"
#include "base/ts_futex.h"
#include "base/ts_proc.h"
#include "base/ts_segment.h"

#define TS_PAGE 4096ULL

/* ==========================================================================
 * Geometry
 * ========================================================================== */

/* Round x up to a multiple of a (a power of two). */
static uint64_t ts_round_up(uint64_t x, uint64_t a)
{
    return (x + a - 1) & ~(a - 1);
}

/* Offset of the slot table inside the segment. */
static uint64_t ts_slot_table_offset(void)
{
    return ts_round_up(sizeof(ts_header), 64);
}

/* Stride of the slot table for max_leaves leaves per slot. */
static uint64_t ts_slot_desc_bytes(uint32_t max_leaves)
{
    return ts_round_up(sizeof(ts_slot) + (uint64_t)max_leaves * sizeof(ts_leaf), 64);
}

/* Offset of the IPC handle table of CUDA rings (after the slot table). */
static uint64_t ts_ipc_table_offset(const ts_geometry *g)
{
    return ts_slot_table_offset() + (uint64_t)g->slot_count * ts_slot_desc_bytes(g->max_leaves);
}

/* Bytes a segment of geometry g needs, and the control-area size. */
uint64_t ts_ring_segment_bytes(const ts_geometry *g, uint64_t *ctrl_bytes)
{
    uint64_t ipc = g->on_device ? (uint64_t)g->slot_count * sizeof(ts_device_ipc) : 0;
    uint64_t ctrl = ts_round_up(ts_ipc_table_offset(g) + ipc, TS_PAGE);
    uint64_t slot = ts_round_up(g->slot_bytes, TS_PAGE);
    if (ctrl_bytes != NULL) *ctrl_bytes = ctrl;
    return ctrl + (uint64_t)g->slot_count * slot;
}

/* Slot descriptor i. */
ts_slot *ts_ring_slot(const ts_ring *ring, uint32_t i)
{
    return (ts_slot *)((uint8_t *)ring->hdr + ts_slot_table_offset() +
                       (uint64_t)i * ring->hdr->slot_desc_bytes);
}

/* 1 for the producer's handle. */
int ts_ring_is_producer(const ts_ring *ring)
{
    return ring->is_producer;
}

/* Slots of the ring. */
uint32_t ts_ring_slot_count(const ts_ring *ring)
{
    return ring->hdr->slot_count;
}

/* DLDeviceType of the ring's slot data. */
int32_t ts_ring_device_type(const ts_ring *ring)
{
    return ring->hdr->device_type;
}

/* This handle's device state, or NULL. */
ts_device_state *ts_ring_device_state(const ts_ring *ring)
{
    return ring->dev;
}

/* Consumer handle: its table index. */
uint32_t ts_ring_consumer_index(const ts_ring *ring)
{
    return ring->consumer;
}

/* Consumer handle: the incarnation its holds are taken as. */
uint64_t ts_ring_incarnation(const ts_ring *ring)
{
    return ring->incarnation;
}

/* The slot that entry seq lives in (or passed through, a hole). */
static uint32_t ts_seq_slot(const ts_header *h, uint64_t seq)
{
    return (uint32_t)(seq % h->slot_count);
}

/* The slot the producer fills next and what holds it back (see ts_ring.h). */
void ts_ring_next_slot(const ts_ring *ring, ts_next_slot *out)
{
    const ts_header *h = ring->hdr;
    uint64_t published = atomic_load_explicit(&h->published, memory_order_acquire);
    out->published = published;
    out->slot = ts_seq_slot(h, published);
    out->seq = published >= h->slot_count ? published - h->slot_count : TS_SEQ_NONE;
    out->readers = out->seq == TS_SEQ_NONE ? 0 : ts_ring_slot_readers(ring, out->slot);
}

/* Host address of slot data. */
uint8_t *ts_ring_slot_data(const ts_ring *ring, uint32_t slot)
{
    if (ring->data == NULL) return NULL;
    return ring->data + (uint64_t)slot * ring->hdr->slot_bytes;
}

/* Device rings: the IPC handles of slot i (NULL for host rings). */
ts_device_ipc *ts_ring_ipc_entry(const ts_ring *ring, uint32_t i)
{
    if (ring->hdr->ipc_offset == 0 || i >= ring->hdr->slot_count) return NULL;
    return (ts_device_ipc *)((uint8_t *)ring->hdr + ring->hdr->ipc_offset) + i;
}

/* Entries published so far. */
uint64_t ts_ring_published(const ts_ring *ring)
{
    return atomic_load_explicit(&ring->hdr->published, memory_order_acquire);
}

/* The reader bitmap of slot i. */
uint64_t ts_ring_slot_readers(const ts_ring *ring, uint32_t i)
{
    return atomic_load_explicit(&ts_ring_slot(ring, i)->readers, memory_order_acquire);
}

/* ==========================================================================
 * Futex helpers: a word bumped by wakers, a waiter count checked by them
 * ========================================================================== */

/* Bump word and wake its sleepers, if any. */
static void ts_signal(_Atomic uint32_t *word, _Atomic uint32_t *waiters)
{
    atomic_fetch_add_explicit(word, 1, memory_order_seq_cst);
    if (atomic_load_explicit(waiters, memory_order_seq_cst) != 0) ts_futex_wake_all(word);
}

/* Clear bit in a slot's readers; wake the producer if the slot became free, or if the bits
 * left may all be holds of consumers that receive no more (none of them is in active_mask):
 * then it may put a hole there (see ts_ring_publish). */
static void ts_slot_drop(ts_header *h, ts_slot *s, uint64_t bit)
{
    uint64_t old = atomic_fetch_and_explicit(&s->readers, ~bit, memory_order_acq_rel);
    uint64_t rest = old & ~bit;
    if ((old & bit) != 0 &&
        (rest == 0 || (atomic_load_explicit(&h->free_waiters, memory_order_seq_cst) != 0 &&
                       (rest & atomic_load_explicit(&h->active_mask, memory_order_seq_cst)) == 0)))
        ts_signal(&h->free_word, &h->free_waiters);
}

/* ==========================================================================
 * Incarnations: a release names the consumer incarnation that took its hold
 * ========================================================================== */

/* Enter a release of consumer entry c's hold as incarnation inc: 1 if inc is still the
 * entry's incarnation (then it cannot change until ts_release_leave), 0 if not (the entry
 * was evicted or handed out again: the bit is no longer this hold's). One CAS on the gate
 * word decides it against the producer's own CAS or add there (ts_gate_bump,
 * ts_ring_reserve): read-modify-writes of one word are totally ordered, so either this
 * release counts itself in under inc first, or it sees the new incarnation. acq_rel: the
 * bit is cleared after the enter (acquire), never before it. */
static int ts_release_enter(ts_consumer *c, uint64_t inc)
{
    uint64_t g = atomic_load_explicit(&c->gate, memory_order_acquire);
    do {
        if ((g >> TS_GATE_SHIFT) != inc) return 0;
    } while (!atomic_compare_exchange_weak_explicit(&c->gate, &g, g + 1, memory_order_acq_rel,
                                                    memory_order_acquire));
    return 1;
}

/* Leave a release entered with ts_release_enter. Release order: the bit cleared before it
 * happens before the producer's reading of a zero count (its acquire CAS in
 * ts_ring_reserve), so a bit the entry's next incarnation gets is never cleared here. */
static void ts_release_leave(ts_consumer *c)
{
    atomic_fetch_sub_explicit(&c->gate, 1, memory_order_release);
}

/* Clear bit of consumer entry index in slot s for a hold of incarnation inc; a release of
 * an older incarnation is counted and clears nothing. */
static void ts_slot_drop_as(ts_header *h, ts_slot *s, uint32_t index, uint64_t inc)
{
    ts_consumer *c = &h->consumers[index];
    if (!ts_release_enter(c, inc)) {
        atomic_fetch_add_explicit(&h->late_releases, 1, memory_order_relaxed);
        return;
    }
    ts_slot_drop(h, s, 1ULL << index);
    ts_release_leave(c);
}

/* A new incarnation of consumer entry c (evicted: lock held). Releases under way finish
 * as the old incarnation (they clear bits the caller clears too); any later release of it
 * is ignored. acq_rel: ordered with the releases' enter and leave on the same word. */
static void ts_gate_bump(ts_consumer *c)
{
    atomic_fetch_add_explicit(&c->gate, 1ULL << TS_GATE_SHIFT, memory_order_acq_rel);
}

/* A condition a waiter sleeps on: 1 once it holds. */
typedef int (*ts_cond_fn)(const ts_ring *ring, const void *arg);

/* What a waiter does after a slice passed without its condition: TS_OK to sleep on, else
 * the status to return, err set (the producer is gone, say). */
typedef ts_status (*ts_slice_fn)(ts_ring *ring, const void *arg, ts_err *err);

/* A sleeper on one of the header's futex words (pub_word, free_word, roster_word). */
typedef struct ts_waiter {
    _Atomic uint32_t *word;    /* borrowed: bumped by wakers (ts_signal) */
    _Atomic uint32_t *waiters; /* borrowed: sleepers on word, which wakers check */
    ts_cond_fn cond;           /* what it waits for */
    ts_slice_fn between;       /* after a slice that timed out; NULL: nothing */
    const void *arg;           /* borrowed: cond's and between's argument */
    const char *what;          /* the timeout's message: "timed out waiting for <what>" */
} ts_waiter;

/* The ring's one wait: sleep on w->word, a slice (TS_SLICE_NS) at a time, until w->cond
 * holds (TS_OK), the deadline passes (TS_E_TIMEOUT), a signal arrives (TS_E_INTR) or
 * w->between, run after each slice that timed out, fails (its status). The condition is
 * checked again after waiters was raised, so a wake between the check and the sleep is
 * never lost. between runs before the deadline is looked at: a caller that waits in
 * slices of its own (the binding) still has it checked once per slice. */
static ts_status ts_wait_for(ts_ring *ring, const ts_waiter *w, uint64_t deadline, ts_err *err)
{
    for (;;) {
        if (w->cond(ring, w->arg)) return TS_OK;
        uint32_t seen = atomic_load_explicit(w->word, memory_order_seq_cst);
        atomic_fetch_add_explicit(w->waiters, 1, memory_order_seq_cst);
        int rc = 0;
        if (!w->cond(ring, w->arg)) rc = ts_futex_wait(w->word, seen, ts_slice_end(deadline));
        atomic_fetch_sub_explicit(w->waiters, 1, memory_order_seq_cst);
        if (rc == EINTR) return ts_err_set(err, TS_E_INTR, EINTR, "interrupted");
        if (w->cond(ring, w->arg)) return TS_OK;
        if (rc == ETIMEDOUT && w->between != NULL) {
            ts_status st = w->between(ring, w->arg, err);
            if (st != TS_OK) return st;
        }
        if (ts_now_ns() >= deadline)
            return ts_err_set(err, TS_E_TIMEOUT, ETIMEDOUT, "timed out waiting for %s", w->what);
    }
}

/* ==========================================================================
 * Life cycle
 * ========================================================================== */

/* Map the first `ctrl` bytes of the segment (header and tables) into ring->hdr. */
static ts_status ts_ring_map_header(ts_ring *ring, uint64_t ctrl, ts_err *err)
{
    void *p = mmap(NULL, ctrl, PROT_READ | PROT_WRITE, MAP_SHARED, ring->fd, 0);
    if (p == MAP_FAILED)
        return ts_err_set(err, TS_E_SYS, errno, "mmap of the ring header: %s", strerror(errno));
    ring->hdr = p;
    ring->ctrl_bytes = ctrl;
    return TS_OK;
}

/* Allocate the process-local handle. */
static ts_ring *ts_ring_alloc(const char *name, int is_producer, ts_err *err)
{
    if (strlen(name) + 1 > sizeof(((ts_ring *)0)->name)) {
        ts_err_set(err, TS_E_INVALID, 0, "segment name too long: %s", name);
        return NULL;
    }
    ts_ring *ring = calloc(1, sizeof *ring);
    if (ring == NULL) {
        ts_err_set(err, TS_E_SYS, ENOMEM, "out of memory");
        return NULL;
    }
    atomic_init(&ring->refs, 1);
    ring->is_producer = is_producer;
    ring->fd = -1;
    ring->producer_pidfd = -1;
    ring->importer = -1;
    ring->consumer = UINT32_MAX;
    ring->stream_min = UINT64_MAX;
    strcpy(ring->name, name);
    ring->pid = getpid();
    pthread_mutex_init(&ring->lock, NULL);
    pthread_mutex_init(&ring->hold_lock, NULL);
    return ring;
}

static void ts_ring_drop_importer(ts_header *h, int entry, uint32_t state);
static void ts_ring_unmap_kept(ts_ring *ring, uint32_t k);

/* Release everything the handle owns. */
static void ts_ring_free(ts_ring *ring)
{
    /* Device state first: it page-locked and mirrors the host slot data. A producer's pool
     * goes only once no process maps it (ts_device.h, close): a handle freed before (the
     * interpreter exits while a consumer still maps it) leaves it to the process's exit. */
    /* A forked child's copy of the handle: the pool, its seal and the importer entry are
     * the parent's, and the child has no driver state (its copy is left, not freed). */
    int child = ts_proc_self() != ring->pid;
    int kept = !child && ring->dev != NULL && ring->is_producer && ts_ring_seal_pool(ring) > 0;
    if (child) {
        /* nothing of the device */
    } else if (kept) {
        if (ring->dev->device->unpin_host != NULL)
            ring->dev->device->unpin_host(ring->dev); /* the data mapping goes below */
    } else if (ring->dev != NULL) {
        ring->dev->device->close(ring->dev);
    }
    ring->dev = NULL;
    /* Our mappings of the pool are closed: the producer may free it. */
    if (ring->importer >= 0 && !child)
        ts_ring_drop_importer(ring->hdr, ring->importer, TS_IMPORTER_MAPPED);
    ring->importer = -1;
    if (ring->data != NULL) {
        if (!ring->is_producer) ts_fault_unwatch(&ring->cow);
        if (!atomic_load_explicit(&ring->aside, memory_order_acquire))
            munmap(ring->data, ring->data_bytes);
        for (uint32_t k = 0; ring->aside && k < ring->hdr->slot_count; k++)
            if (ring->use[k] != NULL) ts_ring_unmap_kept(ring, k); /* holds never released */
        ring->data = NULL;
    }
    for (uint32_t k = 0; ring->use != NULL && k < ring->hdr->slot_count; k++) free(ring->use[k]);
    free(ring->use);
    if (ring->hdr != NULL) munmap(ring->hdr, ring->ctrl_bytes);
    if (ring->fd >= 0) close(ring->fd);
    if (ring->producer_pidfd >= 0) close(ring->producer_pidfd);
    pthread_mutex_destroy(&ring->lock);
    pthread_mutex_destroy(&ring->hold_lock);
    free(ring->held);
    free(ring);
}

/* Map the slot data: read-write for the producer, which then drops the segment fd (the
 * mappings keep the segment); read-only for a consumer, whose writes into a held slot make
 * it private (ts_fault.h): it keeps the fd until ts_ring_free, to map a slot again, private
 * or shared, when it writes into a batch and when it gives the slot back. */
static ts_status ts_ring_map_data(ts_ring *ring, ts_err *err)
{
    const ts_header *h = ring->hdr;
    size_t bytes = (size_t)(h->segment_bytes - h->data_offset);
    int prot = ring->is_producer ? PROT_READ | PROT_WRITE : PROT_READ;
    void *p = mmap(NULL, bytes, prot, MAP_SHARED, ring->fd, (off_t)h->data_offset);
    if (p == MAP_FAILED)
        return ts_err_set(err, TS_E_SYS, errno, "mmap of %zu bytes of slot data: %s", bytes,
                          strerror(errno));
    ring->data = p;
    ring->data_bytes = bytes;
    if (ring->is_producer) {
        ring->stream_min = ts_copy_stream_threshold(bytes);
        close(ring->fd);
        ring->fd = -1;
        return TS_OK;
    }
    ring->cow.start = p;
    ring->cow.len = bytes;
    ring->cow.fd = ring->fd;
    ring->cow.file_offset = h->data_offset;
    ring->cow.slot_bytes = h->slot_bytes;
    ring->cow.slot_count = h->slot_count;
    ts_fault_watch(&ring->cow); /* an in-place op on a batch gets a private copy */
    return TS_OK;
}

/* What the device backend sees of this ring (ts_device.h). */
static ts_device_ring ts_ring_device_view(const ts_ring *ring)
{
    ts_header *h = ring->hdr;
    return (ts_device_ring){
        .slot_count = h->slot_count,
        .slot_bytes = h->slot_bytes,
        .host = ring->data,
        .host_bytes = ring->data_bytes,
        .ipc = ts_ring_ipc_entry(ring, 0),
        .uuid = h->device_uuid,
    };
}

/* Create a new segment `name` (mode 0600) with geometry g, as producer. */
ts_status ts_ring_create(const char *name, const ts_geometry *g, ts_ring **out, ts_err *err)
{
    ts_geometry host = *g;
    host.on_device = 0;
    return ts_ring_create_on_device(name, &host, NULL, -1, out, err);
}

/* Create a ring whose slot data also lives on device `ordinal` of driver's backend. */
ts_status ts_ring_create_on_device(const char *name, const ts_geometry *g,
                                   ts_device_driver *driver, int ordinal, ts_ring **out,
                                   ts_err *err)
{
    ts_status st = TS_OK;
    int created = 0;
    if (g->on_device && driver == NULL)
        return ts_err_set(err, TS_E_INVALID, 0, "a device ring needs the device's driver");
    if (g->slot_count < TS_MIN_SLOTS || g->slot_count > TS_MAX_SLOTS)
        return ts_err_set(err, TS_E_INVALID, 0, "slot count %u is outside %u..%u",
                          g->slot_count, TS_MIN_SLOTS, TS_MAX_SLOTS);
    if (g->max_leaves < 1 || g->max_leaves > 65536)
        return ts_err_set(err, TS_E_INVALID, 0, "max_leaves %u is outside 1..65536",
                          g->max_leaves);
    if (g->slot_bytes < 1 || g->slot_bytes > (1ULL << 40))
        return ts_err_set(err, TS_E_INVALID, 0, "slot size %llu is outside 1 B..1 TiB",
                          (unsigned long long)g->slot_bytes);

    ts_ring *ring = ts_ring_alloc(name, 1, err);
    if (ring == NULL) return err ? err->code : TS_E_SYS;

    uint64_t ctrl = 0;
    uint64_t total = ts_ring_segment_bytes(g, &ctrl);
    st = ts_segment_create(name, total, &ring->fd, err);
    if (st != TS_OK) goto error;
    created = 1;

    st = ts_ring_map_header(ring, ctrl, err);
    if (st != TS_OK) goto error;

    /* The pages are fresh (zero). Fill in the geometry, then the tables. */
    ts_header *h = ring->hdr;
    h->layout_version = TS_LAYOUT_VERSION;
    h->slot_count = g->slot_count;
    h->max_leaves = g->max_leaves;
    h->slot_desc_bytes = (uint32_t)ts_slot_desc_bytes(g->max_leaves);
    h->slot_bytes = ts_round_up(g->slot_bytes, TS_PAGE);
    h->ctrl_bytes = ctrl;
    h->data_offset = ctrl;
    h->segment_bytes = total;
    h->producer_pid = (int32_t)getpid();
    h->producer_start_time = ts_proc_start_time(getpid());
    h->device_type = g->on_device ? driver->device->device_type : kDLCPU;
    h->pid_ns = ts_proc_pid_ns();
    h->device_ordinal = g->on_device ? ordinal : -1;
    h->ipc_offset = g->on_device ? ts_ipc_table_offset(g) : 0;
    for (uint32_t i = 0; i < TS_MAX_CONSUMERS; i++)
        atomic_store_explicit(&h->consumers[i].state, TS_CONSUMER_FREE, memory_order_relaxed);
    for (uint32_t i = 0; i < g->slot_count; i++) {
        ts_slot *s = ts_ring_slot(ring, i);
        atomic_store_explicit(&s->seq, TS_SEQ_NONE, memory_order_relaxed);
        atomic_store_explicit(&s->readers, 0, memory_order_relaxed);
    }
    atomic_store_explicit(&h->state, TS_RING_OPEN, memory_order_relaxed);
    /* Written last: a reader that sees the magic sees a complete header. */
    atomic_thread_fence(memory_order_release);
    h->magic = TS_MAGIC;

    st = ts_ring_map_data(ring, err);
    if (st != TS_OK) goto error;
    if (g->on_device) {
        /* Device pool, events, handles into the table, page-locked host data. */
        ts_device_ring view = ts_ring_device_view(ring);
        st = driver->device->create_pool(driver, ordinal, &view, &ring->dev, err);
        if (st != TS_OK) goto error;
        h->host_pinned = (uint32_t)ring->dev->host_pinned;
    }
    *out = ring;
    return TS_OK;

error:
    if (created) ts_segment_unlink(name, NULL);
    ts_ring_free(ring);
    return st;
}

/* Open an existing segment as consumer. */
ts_status ts_ring_open(const char *name, ts_ring **out, ts_err *err)
{
    ts_status st = TS_OK;
    uint64_t bytes = 0;
    ts_ring *ring = ts_ring_alloc(name, 0, err);
    if (ring == NULL) return err ? err->code : TS_E_SYS;

    st = ts_segment_open(name, &ring->fd, &bytes, err);
    if (st != TS_OK) goto error;
    /* A producer creates the segment, sizes it, then writes the header with the magic last:
     * until then the ring does not exist yet for a reader (callers retry until a deadline). */
    if (bytes < sizeof(ts_header)) {
        st = ts_err_set(err, TS_E_NOT_FOUND, 0,
                        "segment %s is still being created (no ring header yet)", name);
        goto error;
    }
    /* Read the header alone first, to learn the geometry. */
    ts_header probe;
    if (pread(ring->fd, &probe, sizeof probe, 0) != (ssize_t)sizeof probe) {
        st = ts_err_set(err, TS_E_SYS, errno, "reading the header of %s failed", name);
        goto error;
    }
    if (probe.magic == 0) {
        st = ts_err_set(err, TS_E_NOT_FOUND, 0,
                        "segment %s is still being created (no ring header yet)", name);
        goto error;
    }
    if (probe.magic != TS_MAGIC) {
        st = ts_err_set(err, TS_E_VERSION, 0, "segment %s is not a tensorsocket ring", name);
        goto error;
    }
    if (probe.layout_version != TS_LAYOUT_VERSION) {
        st = ts_err_set(err, TS_E_VERSION, 0,
                        "segment %s has ring layout %u, this build reads layout %u", name,
                        probe.layout_version, TS_LAYOUT_VERSION);
        goto error;
    }
    ts_geometry g = {probe.slot_count, probe.max_leaves, probe.slot_bytes,
                     probe.device_type != kDLCPU};
    if (probe.device_type != kDLCPU && ts_device_for(probe.device_type) == NULL) {
        st = ts_err_set(err, TS_E_VERSION, 0, "segment %s holds slot data on device type %d, "
                        "which this build does not know", name, probe.device_type);
        goto error;
    }
    uint64_t ctrl = 0;
    if (probe.segment_bytes != bytes || ts_ring_segment_bytes(&g, &ctrl) != bytes ||
        ctrl != probe.ctrl_bytes || probe.data_offset != ctrl ||
        probe.ipc_offset != (g.on_device ? ts_ipc_table_offset(&g) : 0)) {
        st = ts_err_set(err, TS_E_VERSION, 0, "segment %s has an inconsistent geometry", name);
        goto error;
    }
    st = ts_ring_map_header(ring, ctrl, err);
    if (st != TS_OK) goto error;
    ring->held = calloc(g.slot_count, sizeof *ring->held);
    ring->use = calloc(g.slot_count, sizeof *ring->use);
    if (ring->held == NULL || ring->use == NULL) {
        st = ts_err_set(err, TS_E_SYS, ENOMEM, "out of memory");
        goto error;
    }
    st = ts_ring_map_data(ring, err);
    if (st != TS_OK) goto error;
    ring->producer_pidfd = ts_proc_pidfd(ring->hdr->producer_pid, ring->hdr->producer_start_time);
    *out = ring;
    return TS_OK;

error:
    ts_ring_free(ring);
    return st;
}

/* Take one more reference on the mapping. */
void ts_ring_ref(ts_ring *ring)
{
    atomic_fetch_add_explicit(&ring->refs, 1, memory_order_relaxed);
}

/* Drop a reference; unmaps and frees at zero. Safe on any thread. */
void ts_ring_unref(ts_ring *ring)
{
    if (atomic_fetch_sub_explicit(&ring->refs, 1, memory_order_acq_rel) == 1) ts_ring_free(ring);
}

/* A consumer handle's owner closed it: its device flushes by itself (see ts_ring.h). */
void ts_ring_orphan(ts_ring *ring)
{
    if (ring == NULL || ring->is_producer || ring->dev == NULL) return;
    if (ring->dev->device->orphan != NULL) ring->dev->device->orphan(ring->dev);
}

/* Remove the segment's name (the mapping stays valid). */
ts_status ts_ring_unlink_name(const char *name, ts_err *err)
{
    return ts_segment_unlink(name, err);
}

/* ==========================================================================
 * Producer: the consumer table
 * ========================================================================== */

/* 1 if any slot still carries bit. */
static int ts_ring_bit_in_use(const ts_ring *ring, uint64_t bit)
{
    for (uint32_t i = 0; i < ring->hdr->slot_count; i++)
        if (atomic_load_explicit(&ts_ring_slot(ring, i)->readers, memory_order_acquire) & bit)
            return 1;
    return 0;
}

/* Reserve a consumer table entry for process pid. */
ts_status ts_ring_reserve(ts_ring *ring, pid_t pid, uint64_t start_time, uint32_t batch_size,
                          uint32_t *index, uint64_t *token, ts_err *err)
{
    ts_header *h = ring->hdr;
    ts_status st = TS_E_FULL;
    pthread_mutex_lock(&ring->lock);
    for (uint32_t i = 0; i < TS_MAX_CONSUMERS; i++) {
        ts_consumer *c = &h->consumers[i];
        uint32_t state = atomic_load_explicit(&c->state, memory_order_acquire);
        if (state == TS_CONSUMER_LEAVING && !ts_ring_bit_in_use(ring, 1ULL << i))
            state = TS_CONSUMER_FREE;
        if (state != TS_CONSUMER_FREE) continue;
        /* Handed out only with no release of the last incarnation under way, which could
         * clear a bit of the new one; a count left by a process that died in a release is
         * void (its eviction cleared its bits). The CAS makes a new incarnation: a release
         * of the old one either entered before it (the CAS fails, the entry is skipped) or
         * finds the new one and clears nothing. Acquire: bits cleared by the releases that
         * left happen before the new incarnation gets any. */
        uint64_t g = atomic_load_explicit(&c->gate, memory_order_acquire);
        if ((g & TS_GATE_COUNT) != 0 && ts_proc_alive(c->pid, c->start_time)) continue;
        if (!atomic_compare_exchange_strong_explicit(
                &c->gate, &g, ((g >> TS_GATE_SHIFT) + 1) << TS_GATE_SHIFT,
                memory_order_acq_rel, memory_order_acquire))
            continue;
        uint64_t now = ts_now_ns();
        c->pid = (int32_t)pid;
        c->start_time = start_time;
        c->batch_size = batch_size;
        c->token = c->token + 1 + (now << 8);
        atomic_store_explicit(&c->reason, TS_REASON_NONE, memory_order_relaxed);
        atomic_store_explicit(&c->cursor, TS_SEQ_NONE, memory_order_relaxed);
        atomic_store_explicit(&c->first_seq, TS_SEQ_NONE, memory_order_relaxed);
        atomic_store_explicit(&c->delivered, 0, memory_order_relaxed);
        atomic_store_explicit(&c->delivered_bytes, 0, memory_order_relaxed);
        atomic_store_explicit(&c->wait_ns, 0, memory_order_relaxed);
        atomic_store_explicit(&c->progress_ns, now, memory_order_relaxed);
        atomic_store_explicit(&c->awaiting, 0, memory_order_relaxed);
        atomic_store_explicit(&c->silent_ms, 0, memory_order_relaxed);
        atomic_store_explicit(&c->silent_limit_ms, 0, memory_order_relaxed);
        atomic_store_explicit(&c->state, TS_CONSUMER_PENDING, memory_order_release);
        *index = i;
        *token = c->token;
        st = TS_OK;
        break;
    }
    pthread_mutex_unlock(&ring->lock);
    if (st != TS_OK)
        ts_err_set(err, st, 0, "all %d consumer places of this ring are taken",
                   TS_MAX_CONSUMERS);
    return st;
}

/* Set the late-joiner window and the lag limit (0: lossless, never detach). */
ts_status ts_ring_set_policy(ts_ring *ring, uint64_t window, uint64_t max_lag, ts_err *err)
{
    ts_header *h = ring->hdr;
    if (window >= h->slot_count)
        return ts_err_set(err, TS_E_INVALID, 0,
                          "a window of %llu entries needs more than %u ring slots",
                          (unsigned long long)window, h->slot_count);
    if (max_lag != 0 &&
        (max_lag <= window || max_lag > (uint64_t)h->slot_count - TS_RESERVE_SLOTS))
        return ts_err_set(err, TS_E_INVALID, 0,
                          "max_lag %llu must exceed the window (%llu) and leave %u of the %u "
                          "slots in reserve",
                          (unsigned long long)max_lag, (unsigned long long)window,
                          TS_RESERVE_SLOTS, h->slot_count);
    pthread_mutex_lock(&ring->lock);
    atomic_store_explicit(&h->window, window, memory_order_relaxed);
    atomic_store_explicit(&h->max_lag, max_lag, memory_order_relaxed);
    pthread_mutex_unlock(&ring->lock);
    return TS_OK;
}

/* First seq a consumer activated now starts at (caller holds the lock). An
 * aligned join looks back over every entry still in the ring, so that it can
 * start at the current epoch's first entry whenever that is still readable. */
static uint64_t ts_join_seq(const ts_ring *ring, int align)
{
    const ts_header *h = ring->hdr;
    uint64_t published = atomic_load_explicit(&h->published, memory_order_relaxed);
    uint64_t window = align ? (uint64_t)h->slot_count - 1
                            : atomic_load_explicit(&h->window, memory_order_relaxed);
    uint64_t first = atomic_load_explicit(&h->epoch_first_seq, memory_order_relaxed);
    uint64_t start = published > window ? published - window : 0;
    return start > first ? start : first;
}

static ts_status ts_activate(ts_ring *ring, const uint32_t *indices, uint32_t n, int align,
                             uint64_t from, uint64_t *start_seq, ts_err *err);

/* Make a reserved consumer receive entries: from the oldest retained entry of
 * the current epoch inside the window (align: inside the whole ring), else from
 * the next one published. */
ts_status ts_ring_activate(ts_ring *ring, uint32_t index, int align, uint64_t *start_seq,
                           ts_err *err)
{
    return ts_activate(ring, &index, 1, align, TS_SEQ_NONE, start_seq, err);
}

/* Make a reserved consumer receive entries from seq `from` on: every entry from it
 * must still be in the ring (another consumer's bits keep them there). */
ts_status ts_ring_activate_from(ts_ring *ring, uint32_t index, uint64_t from,
                                uint64_t *start_seq, ts_err *err)
{
    return ts_activate(ring, &index, 1, 0, from, start_seq, err);
}

/* Make n reserved consumers receive entries from one and the same entry on, picked as
 * ts_ring_activate does (from == TS_SEQ_NONE), or from `from`: the ranks of a group, which
 * must read the same entries. One call under the lock: started one after the other, the
 * first could read and hand back the entry the others were to start at. */
ts_status ts_ring_activate_group(ts_ring *ring, const uint32_t *indices, uint32_t n, int align,
                                 uint64_t from, uint64_t *start_seq, ts_err *err)
{
    return ts_activate(ring, indices, n, align, from, start_seq, err);
}

/* ts_ring_activate, _from and _group: from == TS_SEQ_NONE picks the start. */
static ts_status ts_activate(ts_ring *ring, const uint32_t *indices, uint32_t n, int align,
                             uint64_t from, uint64_t *start_seq, ts_err *err)
{
    ts_header *h = ring->hdr;
    ts_status st = TS_OK;
    uint64_t bits = 0;
    if (n == 0) return ts_err_set(err, TS_E_INVALID, 0, "no consumer to start");
    for (uint32_t i = 0; i < n; i++) {
        if (indices[i] >= TS_MAX_CONSUMERS)
            return ts_err_set(err, TS_E_INVALID, 0, "no consumer %u", indices[i]);
        bits |= 1ULL << indices[i];
    }
    pthread_mutex_lock(&ring->lock);
    for (uint32_t i = 0; i < n; i++) {
        if (atomic_load_explicit(&h->consumers[indices[i]].state, memory_order_acquire) !=
            TS_CONSUMER_PENDING) {
            st = ts_err_set(err, TS_E_INVALID, 0, "consumer %u is not waiting to start",
                            indices[i]);
            goto done;
        }
    }
    /* published only changes under this lock, so nothing slips in between. The
     * slot being filled held seq published - slot_count, which is older than
     * any retained entry (window < slot_count). */
    uint64_t published = atomic_load_explicit(&h->published, memory_order_relaxed);
    uint64_t start = from == TS_SEQ_NONE ? ts_join_seq(ring, align) : from;
    if (from != TS_SEQ_NONE && (from > published || published - from >= h->slot_count)) {
        st = ts_err_set(err, TS_E_INVALID, 0, "entry %llu is no longer in the ring",
                        (unsigned long long)from);
        goto done;
    }
    for (uint64_t seq = start; seq < published; seq++) /* cannot trigger; stay safe */
        if (atomic_load_explicit(&ts_ring_slot(ring, ts_seq_slot(h, seq))->seq,
                                 memory_order_acquire) != seq)
            start = seq + 1;
    if (from != TS_SEQ_NONE && start != from) {
        st = ts_err_set(err, TS_E_INVALID, 0, "entry %llu is no longer in the ring",
                        (unsigned long long)from);
        goto done;
    }
    for (uint64_t seq = start; seq < published; seq++)
        atomic_fetch_or_explicit(&ts_ring_slot(ring, ts_seq_slot(h, seq))->readers,
                                 bits, memory_order_acq_rel);
    for (uint32_t i = 0; i < n; i++) {
        ts_consumer *c = &h->consumers[indices[i]];
        atomic_store_explicit(&c->cursor, start, memory_order_relaxed);
        atomic_store_explicit(&c->first_seq, start, memory_order_relaxed);
        atomic_store_explicit(&c->progress_ns, ts_now_ns(), memory_order_relaxed);
        atomic_store_explicit(&c->state, TS_CONSUMER_ACTIVE, memory_order_release);
    }
    atomic_fetch_or_explicit(&h->active_mask, bits, memory_order_seq_cst);
    *start_seq = start;
done:
    pthread_mutex_unlock(&ring->lock);
    if (st == TS_OK) ts_signal(&h->roster_word, &h->roster_waiters);
    return st;
}

/* Stop sending to consumer index and drop its unread entries (lock held).
 * Setting TS_CURSOR_DETACHED settles the race with a concurrent acquire:
 * entries before the returned cursor were handed out and stay held by their
 * views; entries from it on were not, and are dropped here. */
static void ts_stop_locked(ts_ring *ring, uint32_t index, uint32_t reason)
{
    ts_header *h = ring->hdr;
    ts_consumer *c = &h->consumers[index];
    uint64_t bit = 1ULL << index;
    /* The reason first: an acquire that sees the flag reports it. */
    if (reason != TS_REASON_NONE)
        atomic_store_explicit(&c->reason, reason, memory_order_seq_cst);
    atomic_fetch_and_explicit(&h->active_mask, ~bit, memory_order_seq_cst);
    atomic_store_explicit(&c->awaiting, 0, memory_order_seq_cst);
    uint64_t cursor = atomic_fetch_or_explicit(&c->cursor, TS_CURSOR_DETACHED,
                                               memory_order_seq_cst) & ~TS_CURSOR_DETACHED;
    uint64_t published = atomic_load_explicit(&h->published, memory_order_relaxed);
    for (uint32_t i = 0; i < h->slot_count; i++) {
        ts_slot *s = ts_ring_slot(ring, i);
        uint64_t seq = atomic_load_explicit(&s->seq, memory_order_acquire);
        if (seq != TS_SEQ_NONE && seq >= cursor && seq < published) ts_slot_drop(h, s, bit);
    }
}

/* Stop consumer index (reason: if it was receiving) and let its entry go once no slot
 * carries its bit (lock held). A detached one stopped already: the bits it still has are
 * holds of entries it took, which a hole published since may carry at a later seq, so
 * stopping it again would drop them. */
static void ts_retire_locked(ts_ring *ring, uint32_t index, uint32_t reason)
{
    ts_consumer *c = &ring->hdr->consumers[index];
    uint32_t state = atomic_load_explicit(&c->state, memory_order_acquire);
    if (state == TS_CONSUMER_ACTIVE) ts_stop_locked(ring, index, reason);
    if (state == TS_CONSUMER_ACTIVE || state == TS_CONSUMER_DETACHED)
        atomic_store_explicit(&c->state,
                              ts_ring_bit_in_use(ring, 1ULL << index) ? TS_CONSUMER_LEAVING
                                                                     : TS_CONSUMER_FREE,
                              memory_order_release);
    else if (state == TS_CONSUMER_PENDING)
        atomic_store_explicit(&c->state, TS_CONSUMER_FREE, memory_order_release);
}

/* Wake whoever should notice that a consumer stopped receiving: waiters for the roster,
 * and the producer, which may skip the slots it holds now. */
static void ts_signal_stopped(ts_header *h)
{
    ts_signal(&h->roster_word, &h->roster_waiters);
    ts_signal(&h->free_word, &h->free_waiters);
}

/* A live consumer left: stop sending, drop its unread entries. */
void ts_ring_retire(ts_ring *ring, uint32_t index)
{
    if (index >= TS_MAX_CONSUMERS) return;
    pthread_mutex_lock(&ring->lock);
    ts_retire_locked(ring, index, TS_REASON_LEFT);
    pthread_mutex_unlock(&ring->lock);
    ts_signal_stopped(ring->hdr);
}

/* A consumer silent for too long: retired, its held slots kept (see ts_ring.h). */
void ts_ring_retire_silent(ts_ring *ring, uint32_t index, uint64_t silent_ms,
                           uint64_t limit_ms)
{
    if (index >= TS_MAX_CONSUMERS) return;
    ts_consumer *c = &ring->hdr->consumers[index];
    pthread_mutex_lock(&ring->lock);
    if (atomic_load_explicit(&c->state, memory_order_acquire) == TS_CONSUMER_ACTIVE) {
        /* Before the reason: an acquire that sees the reason sees them. */
        atomic_store_explicit(&c->silent_ms, silent_ms, memory_order_relaxed);
        atomic_store_explicit(&c->silent_limit_ms, limit_ms, memory_order_relaxed);
    }
    ts_retire_locked(ring, index, TS_REASON_SILENT);
    pthread_mutex_unlock(&ring->lock);
    ts_signal_stopped(ring->hdr);
    ts_signal(&ring->hdr->pub_word, &ring->hdr->pub_waiters); /* wake it if it waits */
}

/* Take a live consumer off; the entry stays DETACHED until it retires. */
static void ts_detach_locked(ts_ring *ring, uint32_t index, uint32_t reason)
{
    ts_consumer *c = &ring->hdr->consumers[index];
    if (atomic_load_explicit(&c->state, memory_order_acquire) != TS_CONSUMER_ACTIVE) return;
    ts_stop_locked(ring, index, reason);
    atomic_store_explicit(&c->state, TS_CONSUMER_DETACHED, memory_order_release);
}

/* Take a live consumer off (reason TS_REASON_*). */
void ts_ring_detach(ts_ring *ring, uint32_t index, uint32_t reason)
{
    ts_header *h = ring->hdr;
    if (index >= TS_MAX_CONSUMERS) return;
    pthread_mutex_lock(&ring->lock);
    ts_detach_locked(ring, index, reason);
    pthread_mutex_unlock(&ring->lock);
    ts_signal_stopped(h);
    ts_signal(&h->pub_word, &h->pub_waiters); /* wake it if it waits for an entry */
}

/* Skip the rest of the producer's epoch, keeping the place (see ts_ring.h). */
ts_status ts_ring_await_next_epoch(ts_ring *ring, uint32_t index, ts_err *err)
{
    ts_header *h = ring->hdr;
    ts_status st = TS_OK;
    if (index >= TS_MAX_CONSUMERS)
        return ts_err_set(err, TS_E_INVALID, 0, "no consumer %u", index);
    ts_consumer *c = &h->consumers[index];
    uint64_t bit = 1ULL << index;
    pthread_mutex_lock(&ring->lock);
    uint64_t cursor = atomic_load_explicit(&c->cursor, memory_order_seq_cst);
    if (atomic_load_explicit(&c->state, memory_order_acquire) != TS_CONSUMER_ACTIVE ||
        (cursor & TS_CURSOR_DETACHED)) {
        st = ts_err_set(err, TS_E_INVALID, 0, "consumer %u is not receiving", index);
        goto done;
    }
    /* The epoch's end marker may be published already (the consumer's bit keeps it and
     * what follows in the ring): then the place is right after it. */
    uint64_t published = atomic_load_explicit(&h->published, memory_order_relaxed);
    uint64_t next = published;
    int marker_seen = 0;
    for (uint64_t seq = cursor; seq < published; seq++) {
        const ts_slot *s = ts_ring_slot(ring, ts_seq_slot(h, seq));
        if (atomic_load_explicit(&s->seq, memory_order_acquire) == seq &&
            !atomic_load_explicit(&s->hole, memory_order_relaxed) &&
            s->kind == TS_ENTRY_END_EPOCH) {
            next = seq + 1;
            marker_seen = 1;
            break;
        }
    }
    /* Not "next == published": a marker that is the last entry published also gives that,
     * and waiting for the following one then skipped a whole epoch. */
    if (!marker_seen) {
        /* Awaiting first, then the cursor moves past every published entry: an acquire
         * that loses its claim to this sees the flag when it looks again, and waits. */
        atomic_store_explicit(&c->awaiting, 1, memory_order_seq_cst);
        atomic_fetch_and_explicit(&h->active_mask, ~bit, memory_order_seq_cst);
    }
    cursor = atomic_exchange_explicit(&c->cursor, next, memory_order_seq_cst);
    for (uint32_t i = 0; i < h->slot_count; i++) {
        ts_slot *s = ts_ring_slot(ring, i);
        uint64_t seq = atomic_load_explicit(&s->seq, memory_order_acquire);
        if (seq != TS_SEQ_NONE && seq >= cursor && seq < next) ts_slot_drop(h, s, bit);
    }
done:
    pthread_mutex_unlock(&ring->lock);
    return st;
}

/* A dead consumer: drop every reference it had. */
void ts_ring_evict(ts_ring *ring, uint32_t index)
{
    ts_ring_evict_for(ring, index, TS_REASON_DIED);
}

/* Drop every reference a consumer had, recording why. */
void ts_ring_evict_for(ts_ring *ring, uint32_t index, uint32_t reason)
{
    ts_header *h = ring->hdr;
    if (index >= TS_MAX_CONSUMERS) return;
    uint64_t bit = 1ULL << index;
    ts_consumer *c = &h->consumers[index];
    pthread_mutex_lock(&ring->lock);
    atomic_store_explicit(&c->reason, reason, memory_order_seq_cst);
    atomic_store_explicit(&c->awaiting, 0, memory_order_seq_cst);
    atomic_fetch_and_explicit(&h->active_mask, ~bit, memory_order_seq_cst);
    atomic_fetch_or_explicit(&c->cursor, TS_CURSOR_DETACHED, memory_order_seq_cst);
    ts_gate_bump(c); /* first: from here on, its late releases clear nothing */
    for (uint32_t i = 0; i < h->slot_count; i++) ts_slot_drop(h, ts_ring_slot(ring, i), bit);
    atomic_store_explicit(&c->state, TS_CONSUMER_FREE, memory_order_release);
    pthread_mutex_unlock(&ring->lock);
    ts_signal(&h->roster_word, &h->roster_waiters);
}

/* Detach every consumer more than max_lag entries behind the fastest one
 * (lock held). A consumer alone, or all of them equally slow, hold nobody
 * back and are never detached. Returns how many were detached. */
static int ts_detach_laggards_locked(ts_ring *ring)
{
    ts_header *h = ring->hdr;
    uint64_t max_lag = atomic_load_explicit(&h->max_lag, memory_order_relaxed);
    uint64_t cursors[TS_MAX_CONSUMERS], lead = 0;
    int n = 0;
    if (max_lag == 0) return 0;
    uint64_t mask = atomic_load_explicit(&h->active_mask, memory_order_seq_cst);
    for (uint32_t i = 0; i < TS_MAX_CONSUMERS; i++) {
        cursors[i] = TS_CURSOR_DETACHED;
        if (!(mask & (1ULL << i))) continue;
        cursors[i] = atomic_load_explicit(&h->consumers[i].cursor, memory_order_acquire);
        if (!(cursors[i] & TS_CURSOR_DETACHED) && cursors[i] > lead) lead = cursors[i];
    }
    for (uint32_t i = 0; i < TS_MAX_CONSUMERS; i++) {
        if (cursors[i] & TS_CURSOR_DETACHED) continue;
        if (lead - cursors[i] > max_lag) {
            ts_detach_locked(ring, i, TS_REASON_LAGGED);
            atomic_fetch_add_explicit(&h->lag_detached, 1, memory_order_relaxed);
            n++;
        }
    }
    return n;
}

/* Detach laggards now; wake whoever should notice. */
static void ts_detach_laggards(ts_ring *ring)
{
    ts_header *h = ring->hdr;
    if (atomic_load_explicit(&h->max_lag, memory_order_relaxed) == 0) return;
    pthread_mutex_lock(&ring->lock);
    int n = ts_detach_laggards_locked(ring);
    pthread_mutex_unlock(&ring->lock);
    if (n > 0) {
        ts_signal(&h->roster_word, &h->roster_waiters);
        ts_signal(&h->pub_word, &h->pub_waiters);
    }
}

/* ==========================================================================
 * Producer: publishing
 * ========================================================================== */

/* Bytes of one leaf's data (0 for an empty tensor). */
static uint64_t ts_leaf_nbytes(const ts_src_leaf *l)
{
    uint64_t n = l->itemsize;
    for (int32_t d = 0; d < l->ndim; d++) n *= (uint64_t)l->shape[d];
    return n;
}

/* Bytes a batch of these leaves and meta occupies in a slot. */
uint64_t ts_ring_batch_bytes(const ts_src_leaf *leaves, uint32_t n_leaves, uint64_t meta_bytes)
{
    uint64_t off = 0;
    for (uint32_t i = 0; i < n_leaves; i++)
        off = ts_round_up(off, TS_DATA_ALIGN) + ts_leaf_nbytes(&leaves[i]);
    return ts_round_up(off, 8) + meta_bytes;
}

/* Copy n bytes into the slot data at off: streaming stores for long runs into a ring
 * bigger than the cache (ts_copy.h). */
static void ts_copy_in(ts_ring *ring, uint64_t off, const void *src, uint64_t n)
{
    if (n >= ring->stream_min)
        ts_copy_stream(ring->data + off, src, (size_t)n);
    else
        memcpy(ring->data + off, src, (size_t)n);
}

/* Copy a strided array to consecutive bytes at dst_off, run by run. */
static void ts_copy_leaf(ts_ring *ring, uint64_t dst_off, const ts_src_leaf *l)
{
    /* Find the longest contiguous tail: dims [inner, ndim) form one run. */
    int32_t inner = l->ndim;
    uint64_t run = l->itemsize;
    while (inner > 0 && l->strides[inner - 1] == (int64_t)run) {
        inner--;
        run *= (uint64_t)l->shape[inner];
    }
    uint64_t total = ts_leaf_nbytes(l);
    if (total == 0) return;
    if (inner == 0) {
        ts_copy_in(ring, dst_off, l->data, total);
        return;
    }

    /* Odometer over the outer dims [0, inner). */
    int64_t idx[TS_MAX_NDIM] = {0};
    const uint8_t *src = l->data;
    for (uint64_t done = 0; done < total; done += run) {
        ts_copy_in(ring, dst_off + done, src, run);
        for (int32_t d = inner - 1; d >= 0; d--) {
            src += l->strides[d];
            if (++idx[d] < l->shape[d]) break;
            src -= l->strides[d] * l->shape[d];
            idx[d] = 0;
        }
    }
}

/* The slot has no readers. */
static int ts_slot_is_free(const ts_ring *ring, const void *slot)
{
    (void)ring;
    return atomic_load_explicit(&((const ts_slot *)slot)->readers, memory_order_seq_cst) == 0;
}

/* Bits of the consumers that receive entries (state ACTIVE, those awaiting the next
 * epoch included): the only ones whose bits the producer waits for. States change
 * under the lock only: with it held the answer stays true until it is released. */
static uint64_t ts_receiving(const ts_header *h)
{
    uint64_t bits = 0;
    for (uint32_t i = 0; i < TS_MAX_CONSUMERS; i++)
        if (atomic_load_explicit(&h->consumers[i].state, memory_order_acquire) ==
            TS_CONSUMER_ACTIVE)
            bits |= 1ULL << i;
    return bits;
}

/* The slot may get a hole (see ts_ring.h): only consumers that receive no more hold it,
 * and another slot is held by none of them, so that the producer, going on, gets to a
 * slot it can fill (all kept: it waits). Exact with the lock held (consumers only clear
 * bits, and no activation reaches the slot to fill next), a hint without. */
static int ts_slot_skippable(const ts_ring *ring, const void *slot)
{
    const ts_header *h = ring->hdr;
    uint64_t readers = atomic_load_explicit(&((const ts_slot *)slot)->readers,
                                            memory_order_seq_cst);
    if (readers == 0) return 0;
    uint64_t receiving = ts_receiving(h);
    if ((readers & receiving) != 0) return 0;
    for (uint32_t i = 0; i < h->slot_count; i++)
        if ((atomic_load_explicit(&ts_ring_slot(ring, i)->readers, memory_order_seq_cst) &
             ~receiving) == 0)
            return 1;
    return 0;
}

/* The slot is free, or may get a hole. */
static int ts_slot_usable(const ts_ring *ring, const void *slot)
{
    return ts_slot_is_free(ring, slot) || ts_slot_skippable(ring, slot);
}

/* Publish a hole at seq in slot s if it may still get one (the lock decides): the
 * content kept there stays as it is; consumers that receive pass the hole. */
static void ts_publish_hole(ts_ring *ring, ts_slot *s, uint64_t seq)
{
    ts_header *h = ring->hdr;
    pthread_mutex_lock(&ring->lock);
    int skip = ts_slot_skippable(ring, s);
    if (skip) {
        atomic_store_explicit(&s->hole, 1, memory_order_relaxed);
        atomic_fetch_or_explicit(&s->readers,
                                 atomic_load_explicit(&h->active_mask, memory_order_seq_cst),
                                 memory_order_relaxed);
        atomic_store_explicit(&s->seq, seq, memory_order_release);
        atomic_store_explicit(&h->published, seq + 1, memory_order_seq_cst);
        atomic_fetch_add_explicit(&h->holes, 1, memory_order_relaxed);
    }
    pthread_mutex_unlock(&ring->lock);
    if (skip) ts_signal(&h->pub_word, &h->pub_waiters);
}

/* Between the slices of a wait for a slot: a consumer behind by more than max_lag must not
 * hold the others back, and the fastest one moves on meanwhile: look again. */
static ts_status ts_detach_laggards_between(ts_ring *ring, const void *unused, ts_err *err)
{
    (void)unused;
    (void)err;
    ts_detach_laggards(ring);
    return TS_OK;
}

/* Wait until the slot for the next entry has no readers, or may get a hole. */
static ts_status ts_wait_slot_free(ts_ring *ring, ts_slot *s, uint64_t deadline, ts_err *err)
{
    ts_header *h = ring->hdr;
    if (ts_slot_usable(ring, s)) return TS_OK;
    uint64_t t0 = ts_now_ns();
    ts_detach_laggards(ring);
    const ts_waiter w = {&h->free_word, &h->free_waiters, ts_slot_usable,
                         ts_detach_laggards_between, s, "consumers to release a slot"};
    ts_status st = ts_wait_for(ring, &w, deadline, err);
    atomic_fetch_add_explicit(&h->publish_wait_ns, ts_now_ns() - t0, memory_order_relaxed);
    return st;
}

/* Whether leaves and meta fit a slot of this ring: TS_OK, or why not. */
static ts_status ts_publish_check(const ts_header *h, const ts_src_leaf *leaves,
                                  uint32_t n_leaves, uint64_t meta_bytes, ts_err *err)
{
    if (n_leaves > h->max_leaves)
        return ts_err_set(err, TS_E_TOO_BIG, 0,
                          "the batch has %u tensors but a slot holds at most %u (max_leaves)",
                          n_leaves, h->max_leaves);
    for (uint32_t i = 0; i < n_leaves; i++)
        if (leaves[i].ndim < 0 || leaves[i].ndim > TS_MAX_NDIM)
            return ts_err_set(err, TS_E_INVALID, 0, "a tensor has %d dimensions, at most %d "
                              "are supported", leaves[i].ndim, TS_MAX_NDIM);
    uint64_t need = ts_ring_batch_bytes(leaves, n_leaves, meta_bytes);
    if (need > h->slot_bytes)
        return ts_err_set(err, TS_E_TOO_BIG, 0,
                          "the batch needs %llu bytes but a slot holds %llu (slot_bytes)",
                          (unsigned long long)need, (unsigned long long)h->slot_bytes);
    return TS_OK;
}

/* Wait for the slot of the next entry, putting holes in slots kept by consumers that
 * receive no more; *seq and *k: the entry's seq and its slot, free to be written. */
static ts_status ts_publish_slot(ts_ring *ring, uint64_t deadline, uint64_t *seq, uint32_t *k,
                                 ts_err *err)
{
    ts_header *h = ring->hdr;
    for (;;) {
        *seq = atomic_load_explicit(&h->published, memory_order_relaxed);
        *k = ts_seq_slot(h, *seq);
        ts_slot *s = ts_ring_slot(ring, *k);
        ts_status st = ts_wait_slot_free(ring, s, deadline, err);
        if (st != TS_OK) return st;
        if (ts_slot_is_free(ring, s)) return TS_OK;
        ts_publish_hole(ring, s, *seq);
    }
}

/* Write the entry into free slot k: its leaves, meta and descriptor (not yet published).
 * Returns the bytes of its tensors (the meta follows them, 8-byte aligned). */
static uint64_t ts_write_slot(ts_ring *ring, uint32_t k, uint32_t kind, uint64_t epoch,
                              uint64_t index, const ts_src_leaf *leaves, uint32_t n_leaves,
                              const void *meta, uint64_t meta_bytes)
{
    ts_slot *s = ts_ring_slot(ring, k);
    atomic_store_explicit(&s->seq, TS_SEQ_NONE, memory_order_relaxed);
    atomic_store_explicit(&s->hole, 0, memory_order_relaxed);
    uint64_t base = (uint64_t)k * ring->hdr->slot_bytes, off = 0;
    for (uint32_t i = 0; i < n_leaves; i++) {
        const ts_src_leaf *l = &leaves[i];
        ts_leaf *d = &s->leaves[i];
        off = ts_round_up(off, TS_DATA_ALIGN);
        d->offset = off;
        d->nbytes = ts_leaf_nbytes(l);
        d->dtype = l->dtype;
        d->ndim = l->ndim;
        for (int32_t j = 0; j < l->ndim; j++) d->shape[j] = l->shape[j];
        ts_copy_leaf(ring, base + off, l);
        off += d->nbytes;
    }
    off = ts_round_up(off, 8);
    if (meta_bytes > 0) ts_copy_in(ring, base + off, meta, meta_bytes);
    s->kind = kind;
    s->n_leaves = n_leaves;
    s->epoch = epoch;
    s->index = index;
    s->meta_offset = off;
    s->meta_bytes = meta_bytes;
    s->used_bytes = off + meta_bytes;
    return off;
}

/* Publish entry seq, written into slot k, to the active consumers (lock held). An epoch's
 * end marker also starts the consumers that skipped the rest of the epoch on the next
 * one. Returns 1 if laggards were detached (the roster changed). */
static int ts_publish_locked(ts_ring *ring, uint32_t k, uint64_t seq)
{
    ts_header *h = ring->hdr;
    ts_slot *s = ts_ring_slot(ring, k);
    uint64_t mask = atomic_load_explicit(&h->active_mask, memory_order_seq_cst);
    atomic_store_explicit(&s->readers, mask, memory_order_relaxed);
    atomic_store_explicit(&s->seq, seq, memory_order_release);
    atomic_store_explicit(&h->published, seq + 1, memory_order_seq_cst);
    if (s->kind == TS_ENTRY_END_EPOCH) {
        atomic_store_explicit(&h->epoch_first_seq, seq + 1, memory_order_relaxed);
        for (uint32_t i = 0; i < TS_MAX_CONSUMERS; i++) {
            ts_consumer *c = &h->consumers[i];
            if (!atomic_load_explicit(&c->awaiting, memory_order_seq_cst) ||
                atomic_load_explicit(&c->state, memory_order_acquire) != TS_CONSUMER_ACTIVE)
                continue;
            atomic_store_explicit(&c->cursor, seq + 1, memory_order_seq_cst);
            atomic_fetch_or_explicit(&h->active_mask, 1ULL << i, memory_order_seq_cst);
            atomic_store_explicit(&c->awaiting, 0, memory_order_seq_cst);
        }
    }
    return ts_detach_laggards_locked(ring);
}

/* Copy leaves and meta into the next slot and publish it. */
ts_status ts_ring_publish(ts_ring *ring, uint32_t kind, uint64_t epoch, uint64_t index,
                          const ts_src_leaf *leaves, uint32_t n_leaves, const void *meta,
                          uint64_t meta_bytes, uint64_t deadline, ts_err *err)
{
    ts_header *h = ring->hdr;
    uint64_t seq;
    uint32_t k;
    ts_status st = ts_publish_check(h, leaves, n_leaves, meta_bytes, err);
    if (st != TS_OK || (st = ts_publish_slot(ring, deadline, &seq, &k, err)) != TS_OK)
        return st;
    /* A device ring: earlier copies out of the slot's host data have finished. */
    if (ring->dev != NULL && (st = ring->dev->device->prepare(ring->dev, k, err)) != TS_OK)
        return st;
    uint64_t off = ts_write_slot(ring, k, kind, epoch, index, leaves, n_leaves, meta,
                                 meta_bytes);
    /* A device ring copies the tensors to the device (they come first in a slot; the
     * structure blob is host-only) and marks the slot's content for consumers to wait on.
     * Host writes are made visible by the release store that publishes the slot. */
    if (ring->dev != NULL &&
        (st = ring->dev->device->publish(ring->dev, k, ts_ring_slot_data(ring, k),
                                         n_leaves > 0 ? off : 0, err)) != TS_OK)
        return st;
    pthread_mutex_lock(&ring->lock);
    int detached = ts_publish_locked(ring, k, seq);
    pthread_mutex_unlock(&ring->lock);
    ring->bytes_copied += off + meta_bytes;
    if (detached) ts_signal(&h->roster_word, &h->roster_waiters);
    ts_signal(&h->pub_word, &h->pub_waiters);
    return TS_OK;
}

/* Add the producer's CPU time spent publishing to the header (see ts_ring.h). */
void ts_ring_note_publish_cpu(ts_ring *ring, uint64_t ns)
{
    /* Relaxed: only the producer adds, status reads the sum alone. */
    atomic_fetch_add_explicit(&ring->hdr->publish_cpu_ns, ns, memory_order_relaxed);
}

/* Set the producer's CPU time before its loader began (see ts_ring.h). */
void ts_ring_note_setup_cpu(ts_ring *ring, uint64_t ns)
{
    /* Relaxed: written once by the producer, read alone by status. */
    atomic_store_explicit(&ring->hdr->setup_cpu_ns, ns, memory_order_relaxed);
}

/* Where address lies in the segment's file (see ts_ring.h). */
int ts_ring_locate(const ts_ring *ring, uint64_t address, char *path, size_t path_len,
                   uint64_t *offset)
{
    uintptr_t start = (uintptr_t)ring->data, at = (uintptr_t)address;
    if (ring->is_producer || ring->fd < 0 || ring->data == NULL || at < start ||
        at - start >= ring->data_bytes)
        return 0;
    uint64_t rel = (uint64_t)(at - start);
    if (!ts_fault_slot_shared(&ring->cow, (uint32_t)(rel / ring->hdr->slot_bytes))) return 0;
    int n = snprintf(path, path_len, "/dev/shm%s", ring->name);
    if (n < 0 || (size_t)n >= path_len) return 0;
    struct stat mine, named;
    if (fstat(ring->fd, &mine) != 0 || stat(path, &named) != 0 ||
        mine.st_dev != named.st_dev || mine.st_ino != named.st_ino)
        return 0; /* unlinked, or the name is another segment's now */
    *offset = ring->hdr->data_offset + rel;
    return 1;
}

/* Note the producer's cache (see ts_ring.h): the sequence lock's writer side. */
void ts_ring_note_cache(ts_ring *ring, const ts_cache_note *note)
{
    ts_header *h = ring->hdr;
    uint32_t seq = atomic_load_explicit(&h->cache_seq, memory_order_relaxed);
    atomic_store_explicit(&h->cache_seq, seq + 1, memory_order_relaxed);
    atomic_thread_fence(memory_order_release); /* odd before any word changes */
    const uint64_t counts[4] = {note->budget, note->bytes, note->samples, note->epochs};
    for (int i = 0; i < 4; i++)
        atomic_store_explicit(&h->cache_counts[i], counts[i], memory_order_relaxed);
    char text[TS_CACHE_OFF_BYTES] = {0};
    memcpy(text, note->off, strnlen(note->off, TS_CACHE_OFF_BYTES - 1));
    for (size_t i = 0; i < TS_CACHE_OFF_BYTES / 8; i++) {
        uint64_t word;
        memcpy(&word, text + 8 * i, 8);
        atomic_store_explicit(&h->cache_off[i], word, memory_order_relaxed);
    }
    atomic_store_explicit(&h->cache_seq, seq + 2, memory_order_release);
}

/* Copy the cache note (see ts_ring.h): the sequence lock's reader side. */
int ts_ring_cache(const ts_ring *ring, ts_cache_note *out)
{
    const ts_header *h = ring->hdr;
    for (int attempt = 0; attempt < 10000; attempt++) {
        uint32_t before = atomic_load_explicit(&h->cache_seq, memory_order_acquire);
        if (before & 1) continue;
        uint64_t counts[4];
        for (int i = 0; i < 4; i++)
            counts[i] = atomic_load_explicit(&h->cache_counts[i], memory_order_relaxed);
        for (size_t i = 0; i < TS_CACHE_OFF_BYTES / 8; i++) {
            uint64_t word = atomic_load_explicit(&h->cache_off[i], memory_order_relaxed);
            memcpy(out->off + 8 * i, &word, 8);
        }
        atomic_thread_fence(memory_order_acquire); /* the words before the second read */
        if (atomic_load_explicit(&h->cache_seq, memory_order_relaxed) != before) continue;
        out->budget = counts[0];
        out->bytes = counts[1];
        out->samples = counts[2];
        out->epochs = counts[3];
        out->off[TS_CACHE_OFF_BYTES - 1] = '\0'; /* from shared memory: terminated here */
        return 1;
    }
    return 0;
}

/* Number of active consumers. */
static uint32_t ts_active_count(const ts_header *h)
{
    /* One awaiting the next epoch counts: it receives once the producer goes on to it. */
    uint64_t mask = atomic_load_explicit(&h->active_mask, memory_order_seq_cst);
    for (uint32_t i = 0; i < TS_MAX_CONSUMERS; i++)
        if (atomic_load_explicit(&h->consumers[i].awaiting, memory_order_seq_cst))
            mask |= 1ULL << i;
    return (uint32_t)__builtin_popcountll(mask);
}

/* At least *(uint32_t *)n consumers are active. */
static int ts_enough_consumers(const ts_ring *ring, const void *n)
{
    return ts_active_count(ring->hdr) >= *(const uint32_t *)n;
}

/* Wait until at least n consumers are active. */
ts_status ts_ring_wait_consumers(ts_ring *ring, uint32_t n, uint64_t deadline, ts_err *err)
{
    ts_header *h = ring->hdr;
    const ts_waiter w = {&h->roster_word, &h->roster_waiters, ts_enough_consumers, NULL, &n,
                         "consumers"};
    ts_status st = ts_wait_for(ring, &w, deadline, err);
    if (st == TS_E_TIMEOUT)
        return ts_err_set(err, st, ETIMEDOUT, "timed out waiting for %u consumers (%u attached)",
                          n, ts_active_count(h));
    return st;
}

/* Every active consumer has read every published entry. */
static int ts_ring_is_drained(const ts_ring *ring, const void *unused)
{
    (void)unused;
    const ts_header *h = ring->hdr;
    uint64_t published = atomic_load_explicit(&h->published, memory_order_seq_cst);
    uint64_t mask = atomic_load_explicit(&h->active_mask, memory_order_seq_cst);
    for (uint32_t i = 0; i < TS_MAX_CONSUMERS; i++) {
        if (!(mask & (1ULL << i))) continue;
        uint64_t cursor = atomic_load_explicit(&h->consumers[i].cursor, memory_order_acquire);
        if ((cursor & ~TS_CURSOR_DETACHED) < published) return 0;
    }
    return 1;
}

/* Wait until every active consumer has read every published entry. */
ts_status ts_ring_wait_drained(ts_ring *ring, uint64_t deadline, ts_err *err)
{
    ts_header *h = ring->hdr;
    const ts_waiter w = {&h->free_word, &h->free_waiters, ts_ring_is_drained, NULL, NULL,
                         "consumers to read the last batches"};
    return ts_wait_for(ring, &w, deadline, err);
}

/* The claim word of an importer entry of this process in state (TS_IMPORTER_*). */
static uint64_t ts_importer_claim(uint32_t state)
{
    return (uint64_t)ts_proc_self() << 2 | state;
}

/* Claim an importer entry for this process (CLAIMED, pid and start time written); its
 * index, or -1 (table full). */
static int ts_ring_claim_importer(ts_ring *ring)
{
    ts_header *h = ring->hdr;
    for (int i = 0; i < TS_MAX_CONSUMERS; i++) {
        uint64_t want = 0;
        /* seq_cst: against the producer's pool_closing (ts_ring_seal_pool); and a free
         * entry's start time was cleared before it became 0 (ts_importer_free). */
        if (!atomic_compare_exchange_strong_explicit(&h->importers[i].claim, &want,
                                                     ts_importer_claim(TS_IMPORTER_CLAIMED),
                                                     memory_order_seq_cst,
                                                     memory_order_relaxed))
            continue;
        atomic_store_explicit(&h->importers[i].start_time, ts_proc_start_time(ts_proc_self()),
                              memory_order_seq_cst);
        return i;
    }
    return -1;
}

/* Free entry e whose claim word is claim (any process: its owner, or a reader that found
 * it dead); nothing if the word changed meanwhile. Through REAPING: the start time is
 * cleared before the entry is free, so a next claimer is never judged by it. */
static int ts_importer_free(ts_importer *e, uint64_t claim)
{
    if (!atomic_compare_exchange_strong_explicit(&e->claim, &claim, TS_IMPORTER_REAPING,
                                                 memory_order_acq_rel, memory_order_relaxed))
        return 0;
    atomic_store_explicit(&e->start_time, 0, memory_order_relaxed);
    atomic_store_explicit(&e->claim, 0, memory_order_release);
    return 1;
}

/* This process closed its mapping of the device pool, or backed out (entry from claim, in
 * state: CLAIMED or MAPPED). */
static void ts_ring_drop_importer(ts_header *h, int entry, uint32_t state)
{
    if (entry < 0 || entry >= TS_MAX_CONSUMERS) return;
    if (ts_importer_free(&h->importers[entry], ts_importer_claim(state)))
        ts_signal(&h->free_word, &h->free_waiters);
}

/* Whether the process of importer entry e (claim word claim) lives; a dead one's entry is
 * freed (the driver unmapped a dead process's imports), whether it died mapped or still
 * claiming. */
static int ts_importer_alive(ts_importer *e, uint64_t claim)
{
    pid_t pid = (pid_t)(claim >> 2);
    uint64_t start = atomic_load_explicit(&e->start_time, memory_order_seq_cst);
    if (start != 0 ? ts_proc_alive(pid, start) : ts_proc_pid_alive(pid)) return 1;
    ts_importer_free(e, claim);
    return 0;
}

/* Whether claim names a process (an entry taken, not free nor being freed). */
static int ts_importer_taken(uint64_t claim)
{
    return claim != 0 && claim != TS_IMPORTER_REAPING;
}

/* Live processes that still map the device pool, or claimed an entry (dead ones' entries
 * are freed). */
uint32_t ts_ring_importers(const ts_ring *ring)
{
    ts_header *h = ring->hdr;
    uint32_t n = 0;
    for (int i = 0; i < TS_MAX_CONSUMERS; i++) {
        ts_importer *e = &h->importers[i];
        uint64_t claim = atomic_load_explicit(&e->claim, memory_order_seq_cst);
        if (ts_importer_taken(claim) && ts_importer_alive(e, claim)) n++;
    }
    return n;
}

/* How long ts_ring_seal_pool waits for the imports under way to settle: a claimer checks
 * pool_closing right after its claim, so this bounds only a claimer that stopped there
 * (SIGSTOP): it then counts as an importer. */
#define TS_SEAL_SETTLE_NS TS_SLICE_NS

/* Seal the pool and count the importers once settled (see ts_ring.h). */
uint32_t ts_ring_seal_pool(ts_ring *ring)
{
    ts_header *h = ring->hdr;
    if (!ring->is_producer || h->device_type == kDLCPU) return 0;
    /* No import begins from here on; one that claimed its entry before is counted: seq_cst
     * on both sides, so one of the two sees the other (a consumer that sees the flag backs
     * out, ts_ring_import_device). */
    atomic_store_explicit(&h->pool_closing, 1, memory_order_seq_cst);
    atomic_thread_fence(memory_order_seq_cst);
    uint64_t deadline = ts_now_ns() + TS_SEAL_SETTLE_NS;
    for (;;) {
        uint32_t mapped = 0, claiming = 0;
        for (int i = 0; i < TS_MAX_CONSUMERS; i++) {
            ts_importer *e = &h->importers[i];
            uint64_t claim = atomic_load_explicit(&e->claim, memory_order_seq_cst);
            if (!ts_importer_taken(claim) || !ts_importer_alive(e, claim)) continue;
            if ((claim & 3) == TS_IMPORTER_MAPPED) mapped++;
            else claiming++;
        }
        if (claiming == 0 || ts_now_ns() >= deadline) return mapped + claiming;
        /* It sees the seal and backs out, or it had passed the check and maps: soon. */
        struct timespec nap = {0, 1000000};
        nanosleep(&nap, NULL);
    }
}

/* The producer's process still runs (see ts_ring.h). */
int ts_ring_producer_alive(const ts_ring *ring)
{
    if (ring->producer_pidfd >= 0) return ts_proc_pidfd_alive(ring->producer_pidfd);
    return ts_proc_alive(ring->hdr->producer_pid, ring->hdr->producer_start_time);
}

/* This handle maps the producer's device pool and the producer's process is gone. The
 * driver frees a process's device memory when it exits, and documents no import that
 * outlives its exporter ("Calling cuMemFree on an exported memory region before calling
 * cuIpcCloseMemHandle in the importing context will result in undefined behavior",
 * cuIpcOpenMemHandle): a batch in that memory must not be handed out. */
static int ts_ring_pool_gone(const ts_ring *ring)
{
    return ring->dev != NULL && ring->dev->imported && !ts_ring_producer_alive(ring);
}

/* ==========================================================================
 * Devices (ts_device.h)
 * ========================================================================== */

/* This consumer handle's device state on driver's device ordinal, made on first use. */
static ts_status ts_ring_open_device(ts_ring *ring, ts_device_driver *driver, int ordinal,
                                     ts_err *err)
{
    if (ring->dev == NULL)
        return driver->device->open(driver, ordinal, ring->hdr->slot_count, &ring->dev, err);
    if (ring->dev->device == driver->device && ring->dev->ordinal == ordinal) return TS_OK;
    return ts_err_set(err, TS_E_INVALID, 0,
                      "this consumer already uses the ring on GPU %d, not GPU %d",
                      ring->dev->ordinal, ordinal);
}

/* Open the ring's device pool in this consumer process (see ts_ring.h). */
ts_status ts_ring_import_device(ts_ring *ring, ts_device_driver *driver, int ordinal,
                                ts_err *err)
{
    const ts_header *h = ring->hdr;
    if (h->ipc_offset == 0)
        return ts_err_set(err, TS_E_INVALID, 0, "the producer's ring holds no GPU memory");
    if (ring->is_producer)
        return ts_err_set(err, TS_E_INVALID, 0,
                          "the producer's own handle cannot import its GPU ring (CUDA IPC "
                          "handles open only in other processes)");
    if (driver->device->device_type != h->device_type)
        return ts_err_set(err, TS_E_INVALID, 0,
                          "the ring's pool is on device type %d, the %s driver's are %d",
                          h->device_type, driver->device->name, driver->device->device_type);
    uint64_t ns = ts_proc_pid_ns();
    if (h->pid_ns != 0 && ns != 0 && h->pid_ns != ns)
        return ts_err_set(err, TS_E_GPU_UNAVAILABLE, 0,
                          "the producer runs in another PID namespace (a container without a "
                          "shared --pid): CUDA IPC handles do not work across PID namespaces");
    if (ordinal < 0 && (ordinal = driver->device->find(driver, h->device_uuid)) < 0)
        return ts_err_set(err, TS_E_GPU_UNAVAILABLE, 0,
                          "the producer's GPU is not visible to this process (check "
                          "CUDA_VISIBLE_DEVICES), pass device='cuda:N' to read the ring from "
                          "another GPU");
    if (!ts_ring_producer_alive(ring))
        return ts_err_set(err, TS_E_PRODUCER_GONE, 0,
                          "the producer process (pid %d) is gone, and its GPU memory with it",
                          h->producer_pid);
    /* "CUipcMemHandles from each CUdevice in a given process may only be opened by one
     * CUcontext per CUdevice per other process" (cuIpcOpenMemHandle): never in the
     * exporting one, where the driver says "invalid device context". */
    if (h->producer_pid == ts_proc_self())
        return ts_err_set(err, TS_E_GPU_UNAVAILABLE, 0,
                          "this consumer runs in the producer's own process (pid %d), where "
                          "the CUDA driver does not open the producer's IPC handles: run it "
                          "in another process to read the GPU ring in place",
                          h->producer_pid);
    ts_status st = ts_ring_open_device(ring, driver, ordinal, err);
    if (st != TS_OK || ring->dev->imported) return st;
    /* Announce the mapping before it exists: the producer never frees under it. */
    int entry = ts_ring_claim_importer(ring);
    if (entry < 0) return ts_err_set(err, TS_E_FULL, 0, "too many processes map this GPU ring");
    /* The producer may have sealed the pool before our claim, and be freeing it: it said so
     * first (ts_ring_seal_pool); if not, it counts us from here on. */
    if (atomic_load_explicit(&ring->hdr->pool_closing, memory_order_seq_cst)) {
        ts_ring_drop_importer(ring->hdr, entry, TS_IMPORTER_CLAIMED);
        return ts_err_set(err, TS_E_PRODUCER_GONE, 0,
                          "the producer (pid %d) closed its GPU ring and is freeing its GPU "
                          "memory",
                          h->producer_pid);
    }
    uint64_t claimed = ts_importer_claim(TS_IMPORTER_CLAIMED);
    if (!atomic_compare_exchange_strong_explicit(&ring->hdr->importers[entry].claim, &claimed,
                                                 ts_importer_claim(TS_IMPORTER_MAPPED),
                                                 memory_order_seq_cst, memory_order_relaxed))
        return ts_err_set(err, TS_E_SYS, EAGAIN,
                          "this process's entry in the GPU ring's importer table was taken "
                          "back (was it judged dead?): not mapping the producer's memory");
    ts_device_ring view = ts_ring_device_view(ring);
    st = ring->dev->device->import(ring->dev, &view, err);
    if (st != TS_OK) {
        ts_ring_drop_importer(ring->hdr, entry, TS_IMPORTER_MAPPED);
        return st;
    }
    ring->importer = entry;
    return TS_OK;
}

/* Page-lock this consumer's mapping of the host slot data (see ts_ring.h). */
ts_status ts_ring_pin_host(ts_ring *ring, ts_device_driver *driver, int ordinal, ts_err *err)
{
    if (ring->is_producer)
        return ts_err_set(err, TS_E_INVALID, 0, "the producer's slots are page-locked already");
    ts_status st = ts_ring_open_device(ring, driver, ordinal, err);
    if (st != TS_OK || ring->dev->host_pinned) return st;
    /* Remapping a slot private on a write (ts_fault.h) would replace pages the driver has
     * locked: a registered mapping stays shared, and a write into it is stopped as before. */
    if (ts_fault_forbid(&ring->cow) != 0)
        return ts_err_set(err, TS_E_INVALID, EBUSY,
                          "cannot page-lock the ring: this process has written into a batch "
                          "it still holds (pin the ring before taking batches)");
    ts_device_ring view = ts_ring_device_view(ring);
    st = ring->dev->device->pin_host(ring->dev, &view, err);
    if (st != TS_OK) ts_fault_allow(&ring->cow); /* not page-locked: writes may be private */
    return st;
}

/* The ordinal the pool was imported on, or -1. */
int ts_ring_imported_device(const ts_ring *ring)
{
    return ring->dev != NULL && ring->dev->imported ? ring->dev->ordinal : -1;
}

/* Device address of slot data in this process (0 if not imported). */
uint64_t ts_ring_device_ptr(const ts_ring *ring, uint32_t slot)
{
    if (ring->dev == NULL) return 0;
    return ring->dev->device->slot_ptr(ring->dev, slot);
}

/* Hand a consumer's queued device releases to the device (see ts_ring.h). */
ts_status ts_ring_flush_releases(ts_ring *ring, int64_t current, uint32_t wait_ms, ts_err *err)
{
    if (ring->dev == NULL || ring->is_producer) return TS_OK;
    ts_device_stream stream = 0;
    int followable = 0;
    if (current != 0 &&
        ring->dev->device->dlpack_stream(current, &stream, &followable, err) != TS_OK)
        return err != NULL ? err->code : TS_E_INVALID;
    return ring->dev->device->flush(ring->dev, stream, wait_ms, err);
}

/* The DLDevice of this handle's views (see ts_ring.h). */
DLDevice ts_ring_dl_device(const ts_ring *ring, int device)
{
    if (!device) return (DLDevice){kDLCPU, 0};
    if (ring->dev == NULL) return (DLDevice){ring->hdr->device_type, -1};
    return (DLDevice){ring->dev->device->device_type, ts_ring_imported_device(ring)};
}

/* No slot carries a reader bit and nobody maps the device pool. */
static int ts_ring_is_released(const ts_ring *ring, const void *unused)
{
    (void)unused;
    for (uint32_t i = 0; i < ring->hdr->slot_count; i++)
        if (atomic_load_explicit(&ts_ring_slot(ring, i)->readers, memory_order_seq_cst) != 0)
            return 0;
    return ring->hdr->device_type == kDLCPU || ts_ring_importers(ring) == 0;
}

/* Wait until no slot is held by any consumer (views included). */
ts_status ts_ring_wait_released(ts_ring *ring, uint64_t deadline, ts_err *err)
{
    ts_header *h = ring->hdr;
    const ts_waiter w = {&h->free_word, &h->free_waiters, ts_ring_is_released, NULL, NULL,
                         "consumers to free the batches they hold"};
    return ts_wait_for(ring, &w, deadline, err);
}

/* Mark the ring finished and wake every consumer. */
void ts_ring_finish(ts_ring *ring)
{
    ts_header *h = ring->hdr;
    atomic_store_explicit(&h->state, TS_RING_FINISHED, memory_order_seq_cst);
    atomic_fetch_add_explicit(&h->pub_word, 1, memory_order_seq_cst);
    ts_futex_wake_all(&h->pub_word);
}

/* Finish because the producer failed; the text first, so that whoever sees FINISHED
 * (the store in ts_ring_finish is sequentially consistent) sees the text too. */
void ts_ring_fail(ts_ring *ring, const char *why)
{
    ts_header *h = ring->hdr;
    size_t n = strnlen(why, TS_FAILURE_BYTES - 1);
    memcpy(h->failure, why, n);
    h->failure[n] = '\0';
    ts_ring_finish(ring);
}

/* The producer's failure text, once the ring is finished (see ts_ring.h). The text
 * comes from shared memory: it is copied and terminated here whatever it holds. */
int ts_ring_failure(const ts_ring *ring, char *buf)
{
    const ts_header *h = ring->hdr;
    if (atomic_load_explicit(&h->state, memory_order_acquire) != TS_RING_FINISHED) return 0;
    memcpy(buf, h->failure, TS_FAILURE_BYTES);
    buf[TS_FAILURE_BYTES - 1] = '\0';
    return buf[0] != '\0';
}

/* ==========================================================================
 * Consumer
 * ========================================================================== */

/* Bind this handle to consumer entry index (token from the handshake). */
ts_status ts_ring_bind_consumer(ts_ring *ring, uint32_t index, uint64_t token, ts_err *err)
{
    if (index >= TS_MAX_CONSUMERS)
        return ts_err_set(err, TS_E_INVALID, 0, "consumer index %u out of range", index);
    ts_consumer *c = &ring->hdr->consumers[index];
    /* The incarnation read around the token check: the same both times, it is the one
     * the entry was handed to us with (reserve makes the new one before the token). */
    uint64_t inc = atomic_load_explicit(&c->gate, memory_order_acquire) >> TS_GATE_SHIFT;
    if (c->token != token || c->pid != (int32_t)getpid() ||
        atomic_load_explicit(&c->gate, memory_order_acquire) >> TS_GATE_SHIFT != inc)
        return ts_err_set(err, TS_E_INVALID, 0, "consumer entry %u is not ours", index);
    ring->consumer = index;
    ring->token = token;
    ring->incarnation = inc;
    ring->bound_as[index] = inc;
    return TS_OK;
}

/* Why our consumer no longer receives: the error for acquire to return. */
static ts_status ts_detached_error(const ts_ring *ring, const ts_consumer *c, ts_err *err)
{
    if (c->token != ring->token)
        return ts_err_set(err, TS_E_DETACHED, 0,
                          "this consumer's place in the ring was taken back and given to "
                          "another consumer: the producer had evicted it (its reason is "
                          "lost with the place; the producer's log names it)");
    switch (atomic_load_explicit(&c->reason, memory_order_relaxed)) {
    case TS_REASON_LAGGED:
        return ts_err_set(err, TS_E_DETACHED, 0,
                          "this consumer fell more than max_lag=%llu batches behind the "
                          "fastest consumer and was detached by the producer",
                          (unsigned long long)atomic_load_explicit(&ring->hdr->max_lag,
                                                                   memory_order_relaxed));
    case TS_REASON_LEFT:
        return ts_err_set(err, TS_E_DETACHED, 0, "this consumer has left the ring");
    case TS_REASON_SILENT: {
        uint64_t silent = atomic_load_explicit(&c->silent_ms, memory_order_relaxed);
        uint64_t limit = atomic_load_explicit(&c->silent_limit_ms, memory_order_relaxed);
        char said[96] = "for longer than the producer's heartbeat_timeout";
        if (limit > 0)
            snprintf(said, sizeof said, "for %.3g s, longer than the producer's "
                     "heartbeat_timeout=%g s", (double)silent / 1e3, (double)limit / 1e3);
        return ts_err_set(err, TS_E_DETACHED, 0,
                          "the producer detached this consumer when it had sent no heartbeat "
                          "%s (its process was stopped, or a step held the GIL so that its "
                          "heartbeat thread could not run), and the others went on without "
                          "it; the batches it holds were kept intact, but it receives no "
                          "more. A consumer busy for that long needs a longer "
                          "TensorProducer(heartbeat_timeout=) or "
                          "TENSORSOCKET_HEARTBEAT_TIMEOUT", said);
    }
    case TS_REASON_UNREAD:
        return ts_err_set(err, TS_E_DETACHED, 0,
                          "this consumer read no batch at all while the other consumers "
                          "waited for it for longer than the producer allows (it was "
                          "created long before its loop started, or never iterated), so "
                          "the producer detached it; create the TensorConsumer where its "
                          "loop starts");
    case TS_REASON_DIED:
        return ts_err_set(err, TS_E_DETACHED, 0,
                          "the producer found this consumer's process (pid %d) gone and "
                          "released its slots", (int)c->pid);
    default:
        return ts_err_set(err, TS_E_DETACHED, 0,
                          "this consumer was detached from the ring by the producer "
                          "(reason %u)", (unsigned)atomic_load_explicit(&c->reason,
                                                                        memory_order_relaxed));
    }
}

/* Why this handle cannot take entries (not a consumer's, a forked child's, set aside, or
 * its mapping damaged): TS_OK if it can. */
static ts_status ts_acquire_usable(const ts_ring *ring, ts_err *err)
{
    if (ring->consumer >= TS_MAX_CONSUMERS)
        return ts_err_set(err, TS_E_INVALID, 0, "this ring handle is not a consumer");
    if (ts_proc_self() != ring->pid)
        return ts_err_set(err, TS_E_INVALID, 0,
                          "this ring handle was opened by process %d, not by this one (a "
                          "forked child): it cannot read from the ring", (int)ring->pid);
    if (atomic_load_explicit(&ring->aside, memory_order_acquire))
        return ts_err_set(err, TS_E_INVALID, 0, "this ring handle was set aside");
    int broken = atomic_load_explicit(&ring->cow.broken, memory_order_acquire);
    if (broken != 0)
        return ts_err_set(err, TS_E_SYS, broken,
                          "this consumer's mapping of the ring is damaged: a slot it had "
                          "written into could not be mapped back (%s); open the ring again",
                          strerror(broken));
    return TS_OK;
}

/* Hand out the entry at cursor in slot k, claimed (our bit keeps its content stable). */
static void ts_acquire_hand_out(ts_ring *ring, ts_consumer *c, uint32_t k, uint64_t cursor,
                                ts_acquired *out)
{
    ts_header *h = ring->hdr;
    const ts_slot *s = ts_ring_slot(ring, k);
    ts_fault_take(&ring->cow, k); /* before any pointer into the slot is handed out */
    atomic_fetch_or_explicit(&ring->held[k], 1ULL << ring->consumer, memory_order_relaxed);
    out->slot = k;
    out->seq = cursor;
    out->kind = s->kind;
    out->epoch = s->epoch;
    out->index = s->index;
    out->n_leaves = s->n_leaves;
    out->used_bytes = s->used_bytes;
    out->meta = ts_ring_slot_data(ring, k) + s->meta_offset;
    out->meta_bytes = s->meta_bytes;
    atomic_fetch_add_explicit(&c->delivered, 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&c->delivered_bytes, s->used_bytes, memory_order_relaxed);
    /* Relaxed: a statistic, read alone by status; nothing else is ordered by it (the entry
     * was claimed by the cursor's compare-and-swap above, which orders the hand-out). */
    if (out->kind == TS_ENTRY_BATCH)
        atomic_fetch_add_explicit(&h->batches_delivered, 1, memory_order_relaxed);
    atomic_store_explicit(&c->progress_ns, ts_now_ns(), memory_order_relaxed);
    /* The producer may be waiting for this consumer to drain. */
    if (atomic_load_explicit(&h->free_waiters, memory_order_seq_cst) != 0 &&
        out->kind == TS_ENTRY_END_EPOCH)
        ts_signal(&h->free_word, &h->free_waiters);
}

/* What an acquire that found nothing saw: it sleeps until one of these changes. */
typedef struct ts_acquire_seen {
    const ts_consumer *c; /* borrowed: our table entry */
    uint64_t cursor;      /* our cursor */
    int awaiting;         /* we skip the rest of the producer's epoch */
} ts_acquire_seen;

/* One look at our cursor: TS_OK with the entry there taken into out (holes passed), or
 * TS_E_TIMEOUT (err untouched) if nothing is published for us yet, with what was seen in
 * *seen; else the error (detached, the producer's GPU memory gone). */
static ts_status ts_acquire_try(ts_ring *ring, ts_consumer *c, ts_acquired *out,
                                ts_acquire_seen *seen, ts_err *err)
{
    ts_header *h = ring->hdr;
    uint64_t bit = 1ULL << ring->consumer;
    for (;;) {
        uint64_t cursor = atomic_load_explicit(&c->cursor, memory_order_seq_cst);
        if ((cursor & TS_CURSOR_DETACHED) || c->token != ring->token ||
            atomic_load_explicit(&c->state, memory_order_acquire) != TS_CONSUMER_ACTIVE)
            return ts_detached_error(ring, c, err);
        int awaiting = atomic_load_explicit(&c->awaiting, memory_order_seq_cst);
        if (awaiting || atomic_load_explicit(&h->published, memory_order_acquire) <= cursor) {
            *seen = (ts_acquire_seen){c, cursor, awaiting};
            return TS_E_TIMEOUT;
        }
        uint32_t k = ts_seq_slot(h, cursor);
        ts_slot *s = ts_ring_slot(ring, k);
        uint64_t readers = atomic_load_explicit(&s->readers, memory_order_acquire);
        uint64_t seq = atomic_load_explicit(&s->seq, memory_order_acquire);
        if (!(readers & bit) || seq != cursor) {
            /* Only a detach (which sets the cursor flag) takes entries back. */
            if (atomic_load_explicit(&c->cursor, memory_order_seq_cst) != cursor) continue;
            return ts_err_set(err, TS_E_DETACHED, 0,
                              "entry %llu was withdrawn from this consumer: "
                              "the producer took it off the ring meanwhile",
                              (unsigned long long)cursor);
        }
        if (atomic_load_explicit(&s->hole, memory_order_relaxed)) {
            /* No entry here (ts_ring_publish): pass it, unless detached meanwhile. */
            if (atomic_compare_exchange_strong_explicit(&c->cursor, &cursor, cursor + 1,
                                                        memory_order_seq_cst,
                                                        memory_order_seq_cst))
                ts_slot_drop_as(h, s, ring->consumer, ring->incarnation);
            continue;
        }
        /* A batch of a GPU ring lives in the producer's device memory (see
         * ts_ring_pool_gone): hand none out once that memory is gone. */
        if (s->kind == TS_ENTRY_BATCH && ts_ring_pool_gone(ring))
            return ts_err_set(err, TS_E_PRODUCER_GONE, 0,
                              "the producer process (pid %d) exited while this consumer "
                              "mapped its GPU memory: the batches it published and this "
                              "consumer had not read were in that memory and are lost, "
                              "and the GPU tensors of its batches still held here are "
                              "no longer valid (see docs/gpu.md, \"When the producer's "
                              "GPU memory is freed\")",
                              h->producer_pid);
        /* Claim the entry; fails only if the producer detached us meanwhile. */
        if (!atomic_compare_exchange_strong_explicit(&c->cursor, &cursor, cursor + 1,
                                                     memory_order_seq_cst,
                                                     memory_order_seq_cst))
            continue;
        ts_acquire_hand_out(ring, c, k, cursor, out);
        return TS_OK;
    }
}

/* What an acquire that found nothing waits for: something published for it (or, while it
 * skips the producer's epoch, the next epoch begun), the ring finished, or its cursor
 * changed (a detach). */
static int ts_acquire_news(const ts_ring *ring, const void *arg)
{
    const ts_acquire_seen *seen = arg;
    const ts_header *h = ring->hdr;
    int news = seen->awaiting
                   ? atomic_load_explicit(&seen->c->awaiting, memory_order_seq_cst) == 0
                   : atomic_load_explicit(&h->published, memory_order_seq_cst) > seen->cursor;
    return news ||
           atomic_load_explicit(&h->state, memory_order_seq_cst) == TS_RING_FINISHED ||
           atomic_load_explicit(&seen->c->cursor, memory_order_seq_cst) != seen->cursor;
}

/* Between the slices of an acquire's wait: TS_E_PRODUCER_GONE once the producer died. */
static ts_status ts_acquire_between(ts_ring *ring, const void *unused, ts_err *err)
{
    (void)unused;
    if (ts_ring_producer_alive(ring)) return TS_OK;
    return ts_err_set(err, TS_E_PRODUCER_GONE, 0, "the producer process (pid %d) is gone",
                      ring->hdr->producer_pid);
}

/* Take the next entry for our consumer, waiting until deadline. */
ts_status ts_ring_acquire(ts_ring *ring, uint64_t deadline, ts_acquired *out, ts_err *err)
{
    ts_status st = ts_acquire_usable(ring, err);
    if (st != TS_OK) return st;
    ts_header *h = ring->hdr;
    ts_consumer *c = &h->consumers[ring->consumer];
    for (;;) {
        ts_acquire_seen seen;
        if ((st = ts_acquire_try(ring, c, out, &seen, err)) != TS_E_TIMEOUT) return st;
        if (atomic_load_explicit(&h->state, memory_order_acquire) == TS_RING_FINISHED)
            return ts_err_set(err, TS_E_FINISHED, 0, "the producer has finished");
        if (deadline == TS_DEADLINE_NOW) /* a try: the caller waits, or times out with this */
            return ts_err_set(err, TS_E_TIMEOUT, ETIMEDOUT, "timed out waiting for the next "
                              "batch");
        const ts_waiter w = {&h->pub_word, &h->pub_waiters, ts_acquire_news,
                             ts_acquire_between, &seen, "the next batch"};
        uint64_t t0 = ts_now_ns();
        st = ts_wait_for(ring, &w, deadline, err);
        atomic_fetch_add_explicit(&c->wait_ns, ts_now_ns() - t0, memory_order_relaxed);
        if (st != TS_OK) return st;
    }
}

/* Unmap slot pages [first, end) of a handle set aside (hold_lock held). 0, or -1 where
 * munmap failed (splitting a mapping past vm.max_map_count) and left them mapped. */
static int ts_ring_unmap_pages(ts_ring *ring, uint32_t slot, uint64_t first, uint64_t end)
{
    if (first >= end) return 0;
    return munmap(ts_ring_slot_data(ring, slot) + first, (size_t)(end - first));
}

/* Unmap what is left of set-aside slot k, its kept leaves' pages, each page once (hold_lock
 * held; leaves are in slot order). */
static void ts_ring_unmap_kept(ts_ring *ring, uint32_t k)
{
    ts_slot_use *u = ring->use[k];
    uint64_t first = 0, end = 0; /* the run of kept pages being gathered, if end > first */
    for (uint32_t i = 0; i < u->n_leaves; i++) {
        ts_use_leaf *l = &u->leaf[i];
        if (!l->kept) continue;
        l->kept = 0;
        if (l->first > end) { /* a gap ends the run */
            ts_ring_unmap_pages(ring, k, first, end);
            first = l->first;
        }
        if (l->end > end) end = l->end;
    }
    ts_ring_unmap_pages(ring, k, first, end);
}

/* 1 if a kept leaf of u other than leaf i has data on the page at offset p. */
static int ts_use_page_kept(const ts_slot_use *u, uint32_t i, uint64_t p, uint64_t page)
{
    for (uint32_t j = i; j-- > 0 && u->leaf[j].end > p;)
        if (u->leaf[j].kept && u->leaf[j].first <= p) return 1;
    for (uint32_t j = i + 1; j < u->n_leaves && u->leaf[j].first < p + page; j++)
        if (u->leaf[j].kept && u->leaf[j].end > p) return 1;
    return 0;
}

/* Set aside: unmap the pages of slot k's leaves no longer used, but those they share with
 * a leaf still used (hold_lock held; see ts_slot_use). */
static void ts_ring_drop_unused(ts_ring *ring, uint32_t k)
{
    ts_slot_use *u = ring->use[k];
    long page = sysconf(_SC_PAGESIZE);
    if (u == NULL || u->holds == 0 || atomic_load_explicit(&u->whole, memory_order_acquire) != 0)
        return;
    for (uint32_t i = 0; i < u->n_leaves; i++) {
        ts_use_leaf *l = &u->leaf[i];
        if (!l->kept || atomic_load_explicit(&l->refs, memory_order_acquire) != 0) continue;
        l->kept = 0;
        uint64_t first = l->first, end = l->end;
        if (ts_use_page_kept(u, i, first, (uint64_t)page)) first += (uint64_t)page;
        if (end > first && ts_use_page_kept(u, i, end - (uint64_t)page, (uint64_t)page))
            end -= (uint64_t)page;
        if (ts_ring_unmap_pages(ring, k, first, end) != 0) l->kept = 1; /* then at the end */
    }
}

/* Drop our consumer's reference on slot (safe on any thread, no GIL). */
void ts_ring_release(ts_ring *ring, uint32_t slot, uint32_t consumer, uint64_t incarnation)
{
    if (slot >= ring->hdr->slot_count || consumer >= TS_MAX_CONSUMERS) return;
    /* A forked child inherited the parent's views (as private copies, ts_fault.h): the
     * holds are the parent's to give back. */
    if (ts_proc_self() != ring->pid) return;
    uint64_t bit = 1ULL << consumer;
    pthread_mutex_lock(&ring->hold_lock);
    if (atomic_load_explicit(&ring->aside, memory_order_acquire)) {
        /* Handed back when the handle was set aside: the last hold unmaps the copy. */
        ts_slot_use *u = ring->use[slot];
        if (u != NULL && u->holds > 0 && --u->holds == 0) ts_ring_unmap_kept(ring, slot);
        pthread_mutex_unlock(&ring->hold_lock);
        return;
    }
    if (ring->held != NULL)
        atomic_fetch_and_explicit(&ring->held[slot], ~bit, memory_order_relaxed);
    /* Every consumer hold ends here (the last lease, the GPU release thread, an acquire given back
     * at once), so this is where a private slot gets its shared view back: before the bit
     * is cleared, since from then on the producer may refill the slot, and the next batch
     * in it must not be read through stale private pages. The slot stays locked against
     * being made private until the bit is cleared (a write racing with the release of the
     * last tensor of its batch is stopped, not made private after the restore). A handle
     * can hold one slot twice (ts_fault_give_begin says when): only the last hold restores. */
    int locked = ts_fault_give_begin(&ring->cow, slot);
    ts_slot_drop_as(ring->hdr, ts_ring_slot(ring, slot), consumer, incarnation);
    ts_fault_give_end(&ring->cow, slot, locked);
    pthread_mutex_unlock(&ring->hold_lock);
}

/* A use record for n leaves (n >= 1), counts zero. */
static ts_slot_use *ts_slot_use_new(uint32_t n)
{
    if (n == 0) n = 1;
    ts_slot_use *u = calloc(1, sizeof *u + (size_t)n * sizeof(ts_use_leaf));
    if (u != NULL) u->capacity = n;
    return u;
}

/* A lease of slot begins: it uses every leaf (see ts_ring.h). */
int ts_ring_use_begin(ts_ring *ring, uint32_t slot)
{
    if (ring->use == NULL || slot >= ring->hdr->slot_count) return 0;
    uint32_t n = ts_ring_slot(ring, slot)->n_leaves; /* held by the caller: stable */
    int e = 0;
    pthread_mutex_lock(&ring->hold_lock);
    ts_slot_use *u = ring->use[slot];
    if (u == NULL || (u->leases == 0 && u->capacity < n)) {
        ts_slot_use *bigger = ts_slot_use_new(n); /* no lease of the slot: no one counts */
        if (bigger == NULL) {
            e = ENOMEM;
            goto done;
        }
        free(u);
        ring->use[slot] = u = bigger;
    }
    if (u->leases == 0) { /* a new entry: no reference of the last one is left */
        u->n_leaves = n < u->capacity ? n : u->capacity;
        atomic_store_explicit(&u->whole, 0, memory_order_relaxed);
        for (uint32_t i = 0; i < u->n_leaves; i++)
            atomic_store_explicit(&u->leaf[i].refs, 0, memory_order_relaxed);
    }
    u->leases++;
    atomic_fetch_add_explicit(&u->whole, 1, memory_order_relaxed);
done:
    pthread_mutex_unlock(&ring->hold_lock);
    return e;
}

/* The counter of references to leaf of slot, or NULL (a lease of the slot is alive). */
static _Atomic uint32_t *ts_ring_use_count(ts_ring *ring, uint32_t slot, uint32_t leaf)
{
    ts_slot_use *u = ring->use != NULL && slot < ring->hdr->slot_count ? ring->use[slot] : NULL;
    if (u == NULL) return NULL;
    if (leaf == TS_USE_WHOLE) return &u->whole;
    return leaf < u->n_leaves ? &u->leaf[leaf].refs : NULL;
}

/* One more reference that uses leaf of slot (see ts_ring.h). */
void ts_ring_use_leaf(ts_ring *ring, uint32_t slot, uint32_t leaf)
{
    _Atomic uint32_t *count = ts_ring_use_count(ring, slot, leaf);
    if (count != NULL) atomic_fetch_add_explicit(count, 1, memory_order_relaxed);
}

/* One reference to leaf of slot fewer; set aside, unused pages go (see ts_ring.h). The
 * last reference of a leaf takes the lock even on a handle not set aside: a set-aside that
 * counted the leaf in use is then over, and the pages it kept are unmapped here. */
void ts_ring_unuse_leaf(ts_ring *ring, uint32_t slot, uint32_t leaf)
{
    _Atomic uint32_t *count = ts_ring_use_count(ring, slot, leaf);
    if (count == NULL || atomic_fetch_sub_explicit(count, 1, memory_order_acq_rel) != 1) return;
    if (ts_proc_self() != ring->pid) return; /* a fork's child: its copies stay */
    pthread_mutex_lock(&ring->hold_lock);
    if (atomic_load_explicit(&ring->aside, memory_order_acquire)) ts_ring_drop_unused(ring, slot);
    pthread_mutex_unlock(&ring->hold_lock);
}

/* A lease of slot ends (see ts_ring.h). */
void ts_ring_use_end(ts_ring *ring, uint32_t slot)
{
    if (ring->use == NULL || slot >= ring->hdr->slot_count) return;
    if (ts_proc_self() != ring->pid) return; /* a fork's child: the parent's to count */
    pthread_mutex_lock(&ring->hold_lock);
    if (ring->use[slot] != NULL && ring->use[slot]->leases > 0) ring->use[slot]->leases--;
    pthread_mutex_unlock(&ring->hold_lock);
}

/* Plan which pages of held slot k a set-aside keeps (hold_lock held): the pages of the
 * leaves its leases use, each leaf's [first, end); the whole slot, as one leaf, where no
 * lease says (a hold without one) or the leaves are not laid out as the producer lays
 * them (in slot order, inside the slot). 0, or ENOMEM. */
static int ts_ring_plan_keep(ts_ring *ring, uint32_t k)
{
    const ts_slot *s = ts_ring_slot(ring, k);
    uint64_t page = (uint64_t)sysconf(_SC_PAGESIZE), slot_bytes = ring->hdr->slot_bytes;
    ts_slot_use *u = ring->use[k];
    int by_leaf = u != NULL && u->leases > 0 && u->n_leaves == s->n_leaves;
    int whole = by_leaf && atomic_load_explicit(&u->whole, memory_order_seq_cst) != 0;
    uint64_t prev_end = 0;
    for (uint32_t i = 0; by_leaf && i < u->n_leaves; i++) {
        const ts_leaf *leaf = &s->leaves[i];
        if (leaf->offset < prev_end || leaf->offset > slot_bytes ||
            leaf->nbytes > slot_bytes - leaf->offset) {
            by_leaf = 0;
            break;
        }
        prev_end = leaf->offset + leaf->nbytes;
        ts_use_leaf *l = &u->leaf[i];
        l->first = leaf->offset / page * page;
        l->end = (prev_end + page - 1) / page * page;
        l->kept = leaf->nbytes > 0 &&
                  (whole || atomic_load_explicit(&l->refs, memory_order_seq_cst) > 0);
    }
    if (by_leaf) return 0;
    if (u == NULL || u->leases == 0) { /* no lease: nobody counts; a whole-slot record */
        ts_slot_use *record = u != NULL ? u : ts_slot_use_new(1);
        if (record == NULL) return ENOMEM;
        ring->use[k] = u = record;
    }
    u->n_leaves = 1;
    u->leaf[0].first = 0;
    u->leaf[0].end = slot_bytes;
    u->leaf[0].kept = 1;
    atomic_fetch_add_explicit(&u->whole, 1, memory_order_relaxed); /* never dropped early */
    return 0;
}

/* Copy the pages of held slot k its plan keeps (hold_lock held). 0, or an errno. */
static int ts_ring_copy_kept(ts_ring *ring, uint32_t k)
{
    ts_slot_use *u = ring->use[k];
    int e = 0;
    for (uint32_t i = 0; e == 0 && i < u->n_leaves; i++)
        if (u->leaf[i].kept)
            e = ts_fault_copy_slot(&ring->cow, k, u->leaf[i].first,
                                   u->leaf[i].end - u->leaf[i].first);
    return e;
}

/* Once set aside: unmap all of the data mapping but the kept pages of held slots, and stop
 * watching it (hold_lock held). Pages munmap cannot unmap here (no memory to split the
 * mapping) stay mapped until the process exits: address space, and memory only where the
 * process wrote into them. */
static void ts_ring_trim_aside(ts_ring *ring, const uint8_t *was_held)
{
    uint32_t n = ring->hdr->slot_count;
    uint64_t slot_bytes = ring->hdr->slot_bytes;
    /* Retired before anything is unmapped: a range unmapped here and mapped again by
     * another watcher must never be matched to this mapping's entry. The kept pages are
     * private, read-write: no access to them faults, and nothing else of the mapping is
     * left to fault on. */
    ts_fault_retire(&ring->cow);
    for (uint32_t k = 0; k < n; k++) {
        ts_slot_use *u = ring->use[k];
        if (!was_held[k]) {
            ts_ring_unmap_pages(ring, k, 0, slot_bytes);
            /* A plan of an earlier set-aside that failed keeps nothing of it: the last
             * release (ts_ring_free) must not unmap that range again. */
            for (uint32_t i = 0; u != NULL && i < u->n_leaves; i++) u->leaf[i].kept = 0;
            continue;
        }
        uint64_t gap = 0; /* start of the pages not kept since the last kept leaf */
        for (uint32_t i = 0; i < u->n_leaves; i++) {
            if (!u->leaf[i].kept) continue;
            ts_ring_unmap_pages(ring, k, gap, u->leaf[i].first > gap ? u->leaf[i].first : gap);
            if (u->leaf[i].end > gap) gap = u->leaf[i].end;
        }
        ts_ring_unmap_pages(ring, k, gap, slot_bytes);
    }
    uint64_t slots_end = (uint64_t)n * slot_bytes;
    if (ring->data_bytes > slots_end)
        munmap(ring->data + slots_end, ring->data_bytes - (size_t)slots_end);
    if (ring->fd >= 0) close(ring->fd);
    ring->fd = ring->cow.fd = -1;
    /* It reads no more: the liveness of the producer is the new handle's to check. */
    if (ring->producer_pidfd >= 0) close(ring->producer_pidfd);
    ring->producer_pidfd = -1;
}

/* Copy what the held slots' leases use and hand the slots back (see ts_ring.h). */
ts_status ts_ring_set_aside(ts_ring *ring, ts_err *err)
{
    ts_status st = TS_OK;
    if (ring->is_producer || ring->held == NULL || ring->data == NULL || ring->dev != NULL ||
        ring->hdr->device_type != kDLCPU || !ts_fault_writable(&ring->cow))
        return ts_err_set(err, TS_E_INVALID, 0, "the slots of this ring cannot be copied "
                          "privately here (a ring on or page-locked for a GPU)");
    if (ts_proc_self() != ring->pid)
        return ts_err_set(err, TS_E_INVALID, 0, "this ring handle belongs to process %d",
                          (int)ring->pid);
    if (atomic_load_explicit(&ring->aside, memory_order_acquire))
        return ts_err_set(err, TS_E_INVALID, 0, "this ring handle was set aside already");
    uint32_t n = ring->hdr->slot_count;
    uint8_t *was_held = calloc(n, 1);
    if (was_held == NULL) return ts_err_set(err, TS_E_SYS, ENOMEM, "out of memory");
    pthread_mutex_lock(&ring->hold_lock);
    /* Copy all first: if one copy fails, nothing was handed back and all stays as it was
     * (copies already made are dropped by their slots' last releases, as after a write). */
    for (uint32_t k = 0; k < n; k++) {
        if (atomic_load_explicit(&ring->held[k], memory_order_relaxed) == 0) continue;
        was_held[k] = 1;
        int e = ts_ring_plan_keep(ring, k);
        if (e == 0) e = ts_ring_copy_kept(ring, k);
        if (e != 0) {
            st = ts_err_set(err, TS_E_SYS, e, "copying a held slot privately failed: %s",
                            strerror(e));
            goto done;
        }
    }
    atomic_store_explicit(&ring->aside, 1, memory_order_release);
    for (uint32_t k = 0; k < n; k++) {
        if (was_held[k]) ring->use[k]->holds = ts_fault_holds(&ring->cow, k);
        uint64_t bits = atomic_exchange_explicit(&ring->held[k], 0, memory_order_relaxed);
        for (uint32_t i = 0; bits != 0; i++, bits >>= 1)
            if (bits & 1) /* an entry of an earlier bind keeps that bind's incarnation */
                ts_slot_drop_as(ring->hdr, ts_ring_slot(ring, k), i, ring->bound_as[i]);
    }
    ts_ring_trim_aside(ring, was_held);
done:
    pthread_mutex_unlock(&ring->hold_lock);
    free(was_held);
    return st;
}

/* Slots this consumer handle holds now. */
uint32_t ts_ring_held_slots(const ts_ring *ring)
{
    uint32_t n = 0;
    for (uint32_t k = 0; ring->held != NULL && k < ring->hdr->slot_count; k++)
        if (atomic_load_explicit(&ring->held[k], memory_order_relaxed) != 0) n++;
    return n;
}

/* Held slots, if the next one to reuse is among them (see ts_ring.h). */
uint32_t ts_ring_held_blocking(const ts_ring *ring)
{
    ts_next_slot next;
    if (ring->held == NULL) return 0;
    ts_ring_next_slot(ring, &next);
    if (next.seq == TS_SEQ_NONE ||
        atomic_load_explicit(&ring->held[next.slot], memory_order_relaxed) == 0)
        return 0;
    return ts_ring_held_slots(ring);
}

/* 1 if host views of this handle may be written into. */
int ts_ring_host_writable(const ts_ring *ring)
{
    return ring->is_producer || ts_fault_writable(&ring->cow);
}

/* ==========================================================================
 * Snapshots for status displays
 * ========================================================================== */

/* The newest published entry's epoch, batch index and bytes, read without a lock
 * (seqlock-style): newest_valid is 0 if the entry is not there or was overwritten
 * while read. */
static void ts_ring_newest(const ts_ring *ring, uint64_t published, ts_ring_info *out)
{
    out->newest_valid = 0;
    out->newest_epoch = out->newest_index = out->newest_bytes = 0;
    if (published == 0) return;
    uint64_t seq = published - 1;
    const ts_slot *s = ts_ring_slot(ring, ts_seq_slot(ring->hdr, seq));
    if (atomic_load_explicit(&s->seq, memory_order_acquire) != seq ||
        atomic_load_explicit(&s->hole, memory_order_relaxed))
        return;
    /* Acquire loads (the fields are plain: GCC's builtins), so that the second read of seq
     * cannot move before them (an acquire fence would do, but ThreadSanitizer lacks it). */
    uint64_t epoch = __atomic_load_n(&s->epoch, __ATOMIC_ACQUIRE);
    uint64_t index = __atomic_load_n(&s->index, __ATOMIC_ACQUIRE);
    uint32_t kind = __atomic_load_n(&s->kind, __ATOMIC_ACQUIRE);
    uint64_t bytes = __atomic_load_n(&s->used_bytes, __ATOMIC_ACQUIRE);
    if (atomic_load_explicit(&s->seq, memory_order_relaxed) != seq) return;
    out->newest_valid = 1;
    out->newest_epoch = epoch;
    out->newest_index = index;
    out->newest_bytes = kind == TS_ENTRY_BATCH ? bytes : 0;
}

/* Read the header and this handle's state into out (see ts_ring.h). */
void ts_ring_snapshot(const ts_ring *ring, ts_ring_info *out)
{
    static const char hex[] = "0123456789abcdef";
    const ts_header *h = ring->hdr;
    memset(out, 0, sizeof *out);
    out->name = ring->name;
    out->slot_count = h->slot_count;
    out->max_leaves = h->max_leaves;
    out->slot_bytes = h->slot_bytes;
    out->segment_bytes = h->segment_bytes;
    out->producer_pid = h->producer_pid;
    out->producer_start_time = h->producer_start_time;
    out->state = atomic_load_explicit(&h->state, memory_order_acquire);
    out->published = atomic_load_explicit(&h->published, memory_order_acquire);
    out->active_mask = atomic_load_explicit(&h->active_mask, memory_order_acquire);
    out->bytes_copied = ring->bytes_copied;
    out->data_address = (uint64_t)(uintptr_t)ring->data;
    out->data_bytes = ring->data_bytes;
    out->consumer = ring->consumer;
    out->is_producer = ring->is_producer;
    for (uint32_t i = 0; i < h->slot_count; i++)
        if (atomic_load_explicit(&ts_ring_slot(ring, i)->readers, memory_order_relaxed) != 0)
            out->occupied++;
    out->window = atomic_load_explicit(&h->window, memory_order_relaxed);
    out->max_lag = atomic_load_explicit(&h->max_lag, memory_order_relaxed);
    out->epoch_first_seq = atomic_load_explicit(&h->epoch_first_seq, memory_order_relaxed);
    out->lag_detached = atomic_load_explicit(&h->lag_detached, memory_order_relaxed);
    out->publish_wait_ns = atomic_load_explicit(&h->publish_wait_ns, memory_order_relaxed);
    out->holes = atomic_load_explicit(&h->holes, memory_order_relaxed);
    out->late_releases = atomic_load_explicit(&h->late_releases, memory_order_relaxed);
    out->publish_cpu_ns = atomic_load_explicit(&h->publish_cpu_ns, memory_order_relaxed);
    out->setup_cpu_ns = atomic_load_explicit(&h->setup_cpu_ns, memory_order_relaxed);
    out->batches_delivered = atomic_load_explicit(&h->batches_delivered, memory_order_relaxed);
    out->incarnation = ring->incarnation;
    out->host_writable = ts_ring_host_writable(ring);
    out->private_slots = ts_fault_private_slots(&ring->cow);
    ts_ring_newest(ring, atomic_load_explicit(&h->published, memory_order_acquire), out);
    out->device_type = h->device_type;
    out->device_ordinal = h->device_ordinal;
    for (int i = 0; h->device_type != kDLCPU && i < 16; i++) {
        out->device_uuid[2 * i] = hex[h->device_uuid[i] >> 4];
        out->device_uuid[2 * i + 1] = hex[h->device_uuid[i] & 15];
    }
    out->producer_host_pinned = (int)h->host_pinned;
    out->imported_device = ts_ring_imported_device(ring);
    out->host_pinned = ring->dev != NULL && ring->dev->host_pinned;
    out->same_pid_namespace = h->pid_ns == ts_proc_pid_ns();
    out->gpu_importers = h->device_type != kDLCPU ? ts_ring_importers(ring) : 0;
}

/* Read consumer table entry index into out (see ts_ring.h). The state is read first: an
 * entry seen active has its cursor (stored before the state) in place. */
void ts_ring_consumer_snapshot(const ts_ring *ring, uint32_t index, ts_consumer_info *out)
{
    const ts_header *h = ring->hdr;
    const ts_consumer *c = &h->consumers[index];
    out->index = index;
    out->state = atomic_load_explicit(&c->state, memory_order_acquire);
    out->reason = atomic_load_explicit(&c->reason, memory_order_relaxed);
    out->pid = c->pid;
    uint64_t cursor = atomic_load_explicit(&c->cursor, memory_order_acquire);
    uint64_t published = atomic_load_explicit(&h->published, memory_order_acquire);
    uint64_t at = cursor & ~TS_CURSOR_DETACHED;
    out->cursor = cursor == TS_SEQ_NONE ? TS_SEQ_NONE : at;
    out->lag = (cursor == TS_SEQ_NONE || at > published) ? 0 : (int64_t)(published - at);
    out->first_seq = atomic_load_explicit(&c->first_seq, memory_order_relaxed);
    out->delivered = atomic_load_explicit(&c->delivered, memory_order_relaxed);
    out->delivered_bytes = atomic_load_explicit(&c->delivered_bytes, memory_order_relaxed);
    out->wait_ns = atomic_load_explicit(&c->wait_ns, memory_order_relaxed);
    out->progress_ns = atomic_load_explicit(&c->progress_ns, memory_order_relaxed);
    out->start_time = c->start_time;
    out->batch_size = c->batch_size;
    out->token = c->token;
    uint64_t gate = atomic_load_explicit(&c->gate, memory_order_acquire);
    out->incarnation = gate >> TS_GATE_SHIFT;
    out->releasing = (uint32_t)(gate & TS_GATE_COUNT);
}
