/* ts_fault.h - copy-on-write of a consumer's read-only slot mapping, on demand.
 *
 * Consumers map slot data read-only and shared: a batch is one copy in the segment, read
 * by every job. A DataLoader's batches are writable, though, and training code writes into
 * them (timm's Mixup: x.mul_(lam), x[..., a:b, c:d] = ...). So a write is allowed and made
 * private to the writing process, at no cost to consumers that never write:
 *
 *  - This module's SIGSEGV handler recognises an access fault inside a watched mapping. If
 *    the process holds the slot there (ts_fault_take, not yet given back), it maps that
 *    slot's range again, MAP_PRIVATE | MAP_FIXED, read-write, over the same file pages,
 *    and returns: the faulting write runs again and lands on a private copy-on-write page
 *    (the kernel copies only the pages actually written; the first write into a batch costs
 *    one signal and one mmap, every written 4 KiB page one page copy). The producer and the
 *    other consumers never see it.
 *  - When the process's last hold of the slot ends (ts_fault_give_begin, from
 *    ts_ring_release), the shared read-only view is mapped back before the slot is handed
 *    back to the producer, so the next batch in that slot reads as published.
 *  - Where a slot cannot be made private, the handler writes one line to stderr saying what
 *    happened and what to do instead, and hands the fault on to the handler installed before
 *    it (the default one ends the process; Python's faulthandler or a sanitizer report as
 *    usual): a mapping page-locked for CUDA (ts_fault_forbid: remapping would break the
 *    registration), a slot the process does not hold (a pointer kept past its batch), a
 *    geometry that is not page aligned, or a failed mmap.
 *
 * The handler is process-wide by necessity (a signal handler cannot reach module state); it
 * only reads the table of watched mappings, which watchers update lock-free. It is installed
 * once, when the process first takes a hold of a slot (ts_fault_take: a consumer's first
 * batch), before any pointer into a slot exists: a process that only maps rings to read
 * their headers (tensorsocket status) or only produces never installs it. A SIGSEGV handler
 * installed after it runs first (Python's faulthandler, enabled later, reports a write into
 * a batch as a fatal error). */
#ifndef TS_FAULT_H
#define TS_FAULT_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

/* A watched mapping of consecutive, equal slots of a file, and their copy-on-write state. */
typedef struct ts_fault_map {
    uint8_t *start;       /* borrowed: the mapping (PROT_READ, MAP_SHARED), page aligned */
    size_t len;
    int fd;               /* borrowed: the file mapped; open for as long as it is watched */
    uint64_t file_offset; /* file offset of start */
    uint64_t slot_bytes;  /* size and stride of a slot in the mapping */
    uint32_t slot_count;
    /* Per slot: low 2 bits TS_FAULT_SHARED/PRIVATE/BUSY, the rest 4 * this process's holds
     * of the slot. owns: set by ts_fault_watch; NULL where slots cannot be made private. */
    _Atomic uint32_t *state;
    _Atomic int forbidden; /* 1: never make a slot private (the mapping is CUDA-registered) */
    _Atomic int broken;    /* errno of a failed restore: this mapping must not be read again */
    void **fork_copies;    /* owns, between ts_fault_fork_prepare and _parent/_child: per
                            * slot, an anonymous copy of a held slot, or NULL */
    int entry;             /* 1 + its index in the table of watched mappings, 0 if none */
} ts_fault_map;

/* Watch m (start, len, fd, file_offset, slot_bytes and slot_count filled in by the caller,
 * the rest zero). Slots can be made private only where
 * the geometry is page aligned and fd is open; the mapping is still watched (for the
 * message) otherwise. Silently does nothing more once TS_FAULT_WATCHED mappings are
 * watched. m must stay in place until ts_fault_unwatch. */
void ts_fault_watch(ts_fault_map *m);

/* Stop watching m and free what watch allocated (call before unmapping it, once no slot
 * of it is held). */
void ts_fault_unwatch(ts_fault_map *m);

/* Stop watching m, keeping its state until ts_fault_unwatch: for a mapping whose held
 * slots are private copies now (ts_fault_copy_slot) and whose other slots are unmapped,
 * so that no access to it faults any more. Its place in the table is free for another
 * mapping; a handler that found m just before still reads valid state. */
void ts_fault_retire(ts_fault_map *m);

/* This process took one more hold of slot (before it can hand out a pointer into it); the
 * first hold in the process installs the handler. */
void ts_fault_take(ts_fault_map *m, uint32_t slot);

/* One hold of slot ends. When it is the last, the shared read-only view of the slot is
 * back once this returns (mapped again if the slot was private), and the slot stays locked
 * against being made private until ts_fault_give_end: give the slot back to its owner in
 * between. Returns the value to pass to ts_fault_give_end. Any thread. */
int ts_fault_give_begin(ts_fault_map *m, uint32_t slot);

/* End what ts_fault_give_begin started (locked: its return value). */
void ts_fault_give_end(ts_fault_map *m, uint32_t slot, int locked);

/* Never make a slot of m private again (before the mapping is page-locked for CUDA).
 * Returns 0, or EBUSY (and changes nothing) if a slot is private now. */
int ts_fault_forbid(ts_fault_map *m);

/* Undo ts_fault_forbid (the page-locking failed). */
void ts_fault_allow(ts_fault_map *m);

/* 1 if a write into a held slot of m is made private (rather than stopped). */
int ts_fault_writable(const ts_fault_map *m);

/* Slots of m that are private to this process now. */
uint32_t ts_fault_private_slots(const ts_fault_map *m);

/* 1 if this process sees slot of m through the shared view of the file (not a private
 * copy, and not being made one), else 0. */
int ts_fault_slot_shared(const ts_fault_map *m, uint32_t slot);

/* Make held slot of m private, and bytes [offset, offset + bytes) of it a copy of what
 * they show now, every page spanning them copied, so that the file under them may change
 * (ts_ring_set_aside, before the slot is handed back; pages of the slot not copied must
 * not be read again). The caller keeps holds of the slot from being given back meanwhile.
 * 0, or an errno (ENOMEM: no memory for the copy). */
int ts_fault_copy_slot(ts_fault_map *m, uint32_t slot, uint64_t offset, uint64_t bytes);

/* This process's holds of slot of m (ts_fault_take less the holds given back). */
uint32_t ts_fault_holds(const ts_fault_map *m, uint32_t slot);

/* Around a fork (os.register_at_fork, from the binding): prepare copies every slot this
 * process holds, in every watched mapping, and keeps the table of mappings locked; in the
 * child, those copies replace the slots' shared pages (a forked child reads its batches as
 * they were, whatever the parent and the producer do next); in the parent they are freed. */
void ts_fault_fork_prepare(void);
void ts_fault_fork_parent(void);
void ts_fault_fork_child(void);

/* Most mappings watched at once (rings a process reads at the same time). */
#define TS_FAULT_WATCHED 64

#endif /* TS_FAULT_H */
