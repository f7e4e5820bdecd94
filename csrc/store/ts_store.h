/* ts_store.h - a store of decoded samples in one shared-memory segment (issue 38; see
 * docs/decoded-store.md). Reached from Python through the binding's Store type.
 *
 * One segment per dataset prefix, mode 0600. Samples are keyed by their index in the
 * dataset. A writer reserves an entry (FILLING, its pid and start time recorded), copies
 * the sample into the entry's block, and commits it (READY, release order); readers see
 * READY entries only, and pin them while their views live (one bit per attached job). All
 * changes to the index, the entries' states and the arena's allocator go under one robust
 * process-shared mutex; a process that died holding it leaves a state that the next
 * locker rebuilds from the entry table (ts_store_repair). */
#ifndef TS_STORE_H
#define TS_STORE_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/types.h>

#include "base/ts_error.h"

#define TS_STORE_MAGIC 0x3145524f545354ULL /* "TSTORE1" little-endian */
#define TS_STORE_LAYOUT_VERSION 2
#define TS_STORE_MIN_ORDER 12u /* the smallest block: 4 KiB */
#define TS_STORE_MAX_ORDER 30u /* the largest block: 1 GiB */
#define TS_STORE_ORDERS (TS_STORE_MAX_ORDER - TS_STORE_MIN_ORDER + 1)
#define TS_STORE_MAX_JOBS 64
#define TS_STORE_NONE UINT32_MAX
#define TS_STORE_REASON_BYTES 256
/* The longest wait for the store's lock: its holders hold it for a few table steps, so a
 * longer wait is a holder stopped (SIGSTOP, Ctrl-Z, a debugger). The call then fails
 * TS_E_TIMEOUT (the caller decodes privately), and the handle does not try the lock again
 * for TS_STORE_BUSY_BACKOFF_NS: a stopped job costs the others one wait a second. */
#define TS_STORE_LOCK_WAIT_NS 200000000ULL
#define TS_STORE_BUSY_BACKOFF_NS 1000000000ULL
/* The wait of a call that ends what a handle began (commit, abort, close, drop): no
 * backoff, a longer wait (an entry left FILLING, or a job left attached, costs more). */
#define TS_STORE_FINISH_WAIT_NS 2000000000ULL

/* An entry's state. FREE: unused; FILLING: a writer copies a sample in (invisible);
 * READY: complete, readable. */
enum { TS_STORE_FREE = 0, TS_STORE_FILLING = 1, TS_STORE_READY = 2 };

/* What a reserve found (ts_store_reserve). */
typedef enum {
    TS_STORE_RESERVED = 0, /* an entry is this writer's to fill */
    TS_STORE_PRESENT,      /* the sample is READY already (read it) */
    TS_STORE_RACED,        /* another live writer fills it now (decode privately) */
    TS_STORE_NO_ROOM,      /* no room without evicting a pinned sample (keep it private) */
} ts_store_outcome;
/* (The binding's put adds its own outcome, STORE_BUSY: the lock was not to be had.) */

/* One sample's entry. */
typedef struct ts_store_entry {
    _Atomic uint32_t state; /* TS_STORE_FREE / FILLING / READY */
    uint32_t order;         /* its block: 2^order bytes */
    uint64_t sample;        /* its index in the dataset */
    uint64_t offset;        /* its block's offset in the arena */
    uint64_t bytes;         /* the sample's bytes (<= 2^order) */
    int32_t writer_pid;     /* FILLING: the writer, and its start time */
    uint32_t pad;
    uint64_t writer_start;
    _Atomic uint64_t pins;  /* one bit per attached job with views of it */
    uint64_t last_use;      /* the store's clock at its last get or commit */
} ts_store_entry;

/* An attached job: a process reading and writing samples. */
typedef struct ts_store_job {
    int32_t pid; /* 0: free */
    uint32_t pad;
    uint64_t start_time;
    /* Where the job is (ts_store_progress; written by the job, read by status). */
    _Atomic uint64_t epoch, position, length;
} ts_store_job;

/* Where everything is in a store's segment, planned once at its creation
 * (ts_store_plan). */
typedef struct ts_store_layout {
    uint32_t max_order;      /* of the arena's top blocks */
    uint32_t entries;        /* entry table capacity */
    uint64_t segment_bytes;
    uint64_t arena_offset;   /* where the arena starts (page aligned) */
    uint64_t arena_bytes;    /* a whole number of top blocks */
    uint64_t samples;        /* the dataset's length: the keys are 0..samples-1 */
    uint32_t index_slots;    /* open-addressing slots, a power of two (>= 2 x entries) */
    uint32_t min_blocks;     /* arena_bytes >> TS_STORE_MIN_ORDER */
    uint64_t entry_offset, index_offset, uses_offset, map_offset, links_offset;
    uint64_t needs_offset;   /* per job slot, a bitmap of the samples it still needs */
    uint64_t needs_words;    /* 64-bit words of one job's bitmap */
} ts_store_layout;

/* The header at offset 0 of the segment; the tables follow it (layout). */
typedef struct ts_store_header {
    _Atomic uint64_t magic; /* TS_STORE_MAGIC once made (stored last, release) */
    uint32_t layout_version;
    uint32_t pad;
    ts_store_layout layout;
    pthread_mutex_t lock;    /* robust, process-shared: every change below */
    uint64_t clock;          /* bumped by each get and commit (under lock) */
    uint32_t free_head[TS_STORE_ORDERS]; /* per order: first free block (min-block no.) */
    uint64_t used_bytes;     /* bytes in blocks of FILLING and READY entries */
    uint32_t used_entries;
    ts_store_job jobs[TS_STORE_MAX_JOBS];
    /* races: reserves of a sample READY or FILLING by a live writer, a decode that came
     * second (its copy not kept). (The order is the layout's: TS_STORE_LAYOUT_VERSION.) */
    _Atomic uint64_t hits, misses, commits, evictions, races, no_room, repairs;
    _Atomic uint64_t busy;    /* calls refused for a busy lock: waits that timed out (a
                               * holder stopped), and the calls in the backoff after */
    _Atomic uint32_t dropped; /* set once (ts_store_drop): readers decode privately */
    char drop_reason[TS_STORE_REASON_BYTES]; /* written before dropped is set */
} ts_store_header;

/* A process's handle on a store. */
typedef struct ts_store {
    ts_store_header *hdr;   /* the mapping (owned) */
    uint64_t map_bytes;
    int fd;                 /* owned */
    uint32_t job;           /* this process's job slot (TS_STORE_NONE before attach) */
    pid_t owner;            /* the process that attached (a forked child is not it) */
    uint64_t start_time;    /* the owner's start time (read at attach, not under the lock) */
    uint64_t busy_until;    /* monotonic ns: the lock is not tried again before (backoff) */
    pthread_mutex_t pin_lock; /* this process's: pin_counts and its pin bits change together */
    uint32_t *pin_counts;   /* owned: per entry, this process's pins (its bit set while > 0) */
    char name[128];
} ts_store;

/* Create store `name` for a dataset of `samples` samples, its arena at most budget bytes
 * (rounded down to whole top blocks; at least one 4 KiB block). */
ts_status ts_store_create(const char *name, uint64_t samples, uint64_t budget,
                          ts_store **out, ts_err *err);
/* Open existing store `name`. */
ts_status ts_store_open(const char *name, ts_store **out, ts_err *err);
/* Close the handle (the segment stays until unlinked). */
void ts_store_close(ts_store *st);
/* Take a job slot for this process; TS_E_FULL if none is free. */
ts_status ts_store_attach(ts_store *st, ts_err *err);

/* Reserve room for `bytes` of sample `sample`: on TS_STORE_RESERVED, *entry is this
 * writer's (FILLING) and *data where to copy the sample; on PRESENT, *entry is READY. */
ts_status ts_store_reserve(ts_store *st, uint64_t sample, uint64_t bytes,
                           ts_store_outcome *outcome, uint32_t *entry, void **data, ts_err *err);
/* Make a reserved entry READY: visible to every reader from now on. */
ts_status ts_store_commit(ts_store *st, uint32_t entry, ts_err *err);
/* Give a reserved entry back unfilled. */
ts_status ts_store_abort(ts_store *st, uint32_t entry, ts_err *err);
/* The READY entry of `sample`, pinned for this job (once more: pins are counted per
 * process): *entry, *data, *bytes; TS_E_NOT_FOUND on a miss. counted: the lookup counts
 * as a hit or a miss (0: a check's look, which saves no decode). */
ts_status ts_store_get(ts_store *st, uint64_t sample, int counted, uint32_t *entry,
                       const void **data, uint64_t *bytes, ts_err *err);
/* Drop one of this process's pins of entry; the last clears its job's bit. Takes only the
 * process's own pin lock (never the store's): a deleter may call it on any thread. */
void ts_store_unpin(ts_store *st, uint32_t entry);
/* Job slot `job` (this process's or the job whose worker this process is) needs each of n
 * samples in its epoch: its epoch order, at the epoch's start; its needs of the epoch
 * before (what it did not visit: an epoch left early) go. A sample's
 * remaining uses are the jobs that still need it (eviction takes the fewest); a job's
 * needs go when it closes or dies. */
ts_status ts_store_need(ts_store *st, uint32_t job, const uint64_t *samples, uint64_t n,
                        ts_err *err);
/* Job slot `job` visited sample s: it needs it no more this epoch. */
ts_status ts_store_visited(ts_store *st, uint32_t job, uint64_t s, ts_err *err);
/* Record where this job is: epoch, batches taken of it, its length (for status). */
void ts_store_progress(ts_store *st, uint64_t epoch, uint64_t position, uint64_t length);
/* Drop the store for every job (a prefix found not deterministic: reason says how); the
 * first reason stays. Gets miss from now on and reserves find no room. */
ts_status ts_store_drop(ts_store *st, const char *reason, ts_err *err);
/* Whether the store was dropped; its reason copied into reason (cap bytes, NUL ended). */
int ts_store_dropped(const ts_store *st, char *reason, size_t cap);

/* Free the entries of writers that died mid-insert and the pins of jobs that died; how
 * many of each went, in *writers and *jobs (either may be NULL). */
ts_status ts_store_reap(ts_store *st, uint32_t *writers, uint32_t *jobs, ts_err *err);

/* The entry table (for tests and status). */
ts_store_entry *ts_store_entries(const ts_store *st);

#endif /* TS_STORE_H */
