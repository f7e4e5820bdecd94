/* ts_ring.h - the shared-memory ring: segment layout and the ring protocol.
 *
 * One segment per producer. It starts with a control area (header, consumer
 * table, slot table), mapped read-write by everyone, followed by the slot data
 * of the host backend, mapped read-write by the producer and read-only by the
 * consumers (a batch is shared by every consumer: nobody may write to the shared
 * copy). A consumer's write into a batch it holds maps that slot private to it,
 * copy on write, until it gives the slot back (ts_fault.h).
 *
 * Protocol (single producer, up to 64 consumers):
 *  - Every published entry has a sequence number seq = 0, 1, 2, ...; it lives
 *    in slot seq % slot_count. `published` counts the published entries.
 *  - A slot carries a bitmap `readers` of the consumers that still have to
 *    read it or still hold views of it. The producer fills a slot only when
 *    its bitmap is zero, writes the data, then (under its process-local lock)
 *    sets readers = active_mask, stores seq with release order and bumps
 *    `published`. Consumers clear their bit when the last view is freed.
 *  - Sleepers use futexes on 32-bit words with waiter counts, so publishing
 *    and releasing cost no system call when nobody sleeps.
 *  - A consumer's cursor is the next seq it reads. The consumer advances it
 *    with compare-and-swap; the producer detaches a consumer by setting
 *    TS_CURSOR_DETACHED in it. Whoever wins decides who owns the entry at the
 *    cursor, so an entry is never both handed out and taken back.
 *  - Late joiners: the last `window` published entries of the current epoch
 *    stay readable (window <= slot_count - 1, so the slot being written is
 *    never among them). A consumer activated mid-epoch starts at the oldest of
 *    them: activation ORs its bit into their reader bitmaps.
 *  - Laggards: with max_lag > 0, a consumer more than max_lag entries behind
 *    the fastest consumer is detached when the producer publishes or waits for
 *    a slot (its unread entries are dropped; slots it holds views of stay held
 *    until the views die).
 *  - Holes: a slot whose bits all belong to consumers that receive no more
 *    (detached, left, or taken off as silent: their live views still read it)
 *    is never written; the producer publishes a hole there instead (the seq,
 *    no entry: the descriptor's other fields stay those of the content kept),
 *    which receiving consumers pass without taking, and goes on with the next
 *    slot. Only if every slot is kept so does the producer wait.
 *  - Incarnations: a consumer's holds may end long after it was evicted (a GPU release
 *    deferred until queued work is done, a stopped process that runs again and drops its
 *    views), when its table entry, and so its bit, may belong to a new consumer. Every
 *    release therefore names the incarnation that took the hold: the entry's gate word
 *    carries the incarnation (bumped when the entry is handed out and when it is evicted)
 *    and a count of releases under way. A release enters by compare-and-swap, only while
 *    the incarnation is its own, clears its bit and leaves; a release of an older
 *    incarnation clears nothing and is counted (header.late_releases). The entry is handed
 *    out again only with no release under way (or its process dead), so a bit cleared by
 *    a release is always its own incarnation's.
 */
#ifndef TS_RING_H
#define TS_RING_H

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "device/ts_device.h"
#include "base/ts_dlpack.h"
#include "base/ts_error.h"
#include "base/ts_fault.h"

#define TS_MAGIC 0x315445434f535354ULL /* "TSSOCET1" little-endian */
#define TS_LAYOUT_VERSION 9 /* 9: the cache note; 8: importer claims carry the pid */
#define TS_MAX_CONSUMERS 64
#define TS_MAX_SLOTS 4096 /* most slots a ring holds */
#define TS_MIN_SLOTS 2 /* fewest slots a ring holds */
/* Slots a ring keeps beyond the entries a consumer may fall behind (max_lag): the one the
 * producer fills and the one a consumer holds while it trains on it. The producer's
 * sizing, the default late-joiner window and the transform stage's batches in flight
 * keep to it too (tensorsocket.data.ring.RESERVE_SLOTS). */
#define TS_RESERVE_SLOTS 2
#define TS_MAX_NDIM 16
#define TS_SEQ_NONE UINT64_MAX
#define TS_DATA_ALIGN 64
/* A consumer entry's gate (ts_consumer.gate): its incarnation in the high bits, the
 * releases of that incarnation under way in the low TS_GATE_SHIFT bits (see Incarnations). */
#define TS_GATE_SHIFT 24
#define TS_GATE_COUNT ((1ULL << TS_GATE_SHIFT) - 1)
/* Set in a consumer's cursor by the producer when it takes the consumer off. */
#define TS_CURSOR_DETACHED (1ULL << 63)
/* Room for the text of a producer's failure (header.failure), NUL included. */
#define TS_FAILURE_BYTES 1024
/* Room for the text of why a producer has no decoded-sample cache, NUL included. */
#define TS_CACHE_OFF_BYTES 512

/* Ring states (header.state). */
enum { TS_RING_OPEN = 1, TS_RING_FINISHED = 2 };

/* Consumer table entry states. */
enum {
    TS_CONSUMER_FREE = 0,    /* unused */
    TS_CONSUMER_PENDING = 1, /* reserved at handshake, not yet receiving */
    TS_CONSUMER_ACTIVE = 2,  /* receives every new publication */
    TS_CONSUMER_LEAVING = 3, /* left; some slots may still carry its bit */
    TS_CONSUMER_DETACHED = 4, /* taken off by the producer; the consumer has not left yet */
};

/* Why a consumer stopped receiving (ts_consumer.reason). */
enum {
    TS_REASON_NONE = 0,
    TS_REASON_LEFT = 1,   /* it said bye */
    TS_REASON_LAGGED = 2, /* it fell more than max_lag entries behind */
    TS_REASON_DIED = 3,   /* its process is gone */
    TS_REASON_SILENT = 4, /* its process lives, but it sent no heartbeat for too long */
    TS_REASON_UNREAD = 5, /* it read nothing at all while the others waited for it too long */
};

/* Kinds of published entries. */
enum { TS_ENTRY_BATCH = 1, TS_ENTRY_END_EPOCH = 2 };

/* One tensor inside a slot (written by the producer before publication). */
typedef struct ts_leaf {
    uint64_t offset; /* bytes from the start of the slot's data */
    uint64_t nbytes;
    DLDataType dtype;
    int32_t ndim;
    int64_t shape[TS_MAX_NDIM];
} ts_leaf;

/* Descriptor of one slot. Its size is rounded to a cache line and followed
 * by header.max_leaves ts_leaf records. */
typedef struct ts_slot {
    _Alignas(64) _Atomic uint64_t seq; /* seq of the content; NONE while written */
    _Atomic uint64_t readers;          /* consumers that still hold this slot */
    uint32_t kind;                     /* TS_ENTRY_* */
    uint32_t n_leaves;
    uint64_t epoch;      /* producer epoch of this entry */
    uint64_t index;      /* batch index inside that epoch */
    uint64_t used_bytes; /* bytes of data used, leaves and meta */
    uint64_t meta_offset; /* structure blob (opaque to C) */
    uint64_t meta_bytes;
    _Atomic uint32_t hole; /* 1: seq is a hole (no entry; the content is someone's kept one) */
    ts_leaf leaves[];
} ts_slot;

/* One consumer. pid/start_time/token are written by the producer before the
 * entry becomes PENDING; cursor and progress fields by the consumer. */
typedef struct ts_consumer {
    _Alignas(64) _Atomic uint32_t state;
    _Atomic uint32_t reason; /* TS_REASON_* once it stopped receiving */
    int32_t pid;
    uint32_t batch_size;    /* samples per batch it asked for (0: the loader's); display only */
    uint64_t start_time;    /* of pid, to survive pid reuse */
    uint64_t token;         /* changes each time the entry is handed out */
    _Atomic uint64_t cursor;       /* next seq this consumer reads (| TS_CURSOR_DETACHED) */
    _Atomic uint64_t first_seq;    /* seq it started at */
    _Atomic uint64_t delivered;    /* entries handed to the consumer */
    _Atomic uint64_t delivered_bytes; /* slot bytes of those entries */
    _Atomic uint64_t wait_ns;      /* time spent asleep waiting for entries */
    _Atomic uint64_t progress_ns;  /* CLOCK_MONOTONIC of the last acquire */
    _Atomic uint32_t awaiting;     /* 1: skips the rest of the producer's epoch; receives
                                    * again from the next one's first entry */
    _Atomic uint64_t silent_ms;    /* TS_REASON_SILENT: how long it had sent no heartbeat */
    _Atomic uint64_t silent_limit_ms; /* ... longer than this limit of the producer's */
    _Atomic uint64_t gate;         /* incarnation << TS_GATE_SHIFT | releases under way
                                    * (see Incarnations); 0 in a new segment */
} ts_consumer;

/* A process that maps a device ring's pool (ts_ring_import_device). The producer
 * frees the pool only once every importer has closed its mapping or died:
 * freeing exported memory still open elsewhere is undefined behaviour. The claim carries
 * the pid from the first store on, so that an entry whose process died at any point is
 * seen as dead (ts_ring_importers). */
typedef struct ts_importer {
    _Atomic uint64_t claim;      /* 0: free; TS_IMPORTER_REAPING; else pid << 2 |
                                  * TS_IMPORTER_CLAIMED or _MAPPED */
    _Atomic uint64_t start_time; /* the claimer's, once written; 0 while free or before */
} ts_importer;

/* CLAIMED: the entry is taken, the claimer checks pool_closing next; MAPPED: it found the
 * pool open and maps it (or is about to); REAPING (the whole claim word, no pid): being
 * freed (its start time cleared before it is free again, so that the next claimer's
 * process is never judged by the last one's start time). A claimer takes an entry only
 * from 0, and changes its own word only by compare-and-swap. */
enum { TS_IMPORTER_CLAIMED = 1, TS_IMPORTER_MAPPED = 2, TS_IMPORTER_REAPING = 3 };

/* The header at offset 0 of the segment. */
typedef struct ts_header {
    uint64_t magic;
    uint32_t layout_version;
    uint32_t slot_count;
    uint32_t max_leaves;
    uint32_t slot_desc_bytes; /* stride of the slot table */
    uint64_t slot_bytes;      /* data capacity of one slot */
    uint64_t ctrl_bytes;      /* header + tables, page aligned */
    uint64_t data_offset;     /* where slot 0's data starts */
    uint64_t segment_bytes;
    int32_t producer_pid;
    int32_t device_type; /* kDLCPU, or a device's (kDLCUDA): slot data also lives there */
    uint64_t producer_start_time;
    uint64_t pid_ns;          /* inode of the producer's PID namespace (0: unknown) */
    uint64_t ipc_offset;      /* CUDA rings: where the ts_device_ipc table starts */
    int32_t device_ordinal;   /* CUDA rings: the producer's device ordinal */
    uint32_t host_pinned;     /* CUDA rings: the producer page-locked the host slot data */
    uint8_t device_uuid[16];  /* CUDA rings: UUID of the GPU holding the slot pool */
    _Atomic uint32_t pool_closing; /* CUDA rings: 1 once the producer's handle is being
                                    * freed: it counts the importers next and frees the pool
                                    * if there are none, so no new import may begin (seq_cst,
                                    * with the importer claims: ts_ring_import_device). In
                                    * the padding before state: no layout change */

    _Alignas(64) _Atomic uint32_t state;
    _Atomic uint32_t pub_word;     /* futex: bumped on publish and state change */
    _Atomic uint32_t pub_waiters;
    _Atomic uint32_t free_word;    /* futex: bumped when a slot becomes free */
    _Atomic uint32_t free_waiters;
    _Atomic uint32_t roster_word;  /* futex: bumped when consumers come or go */
    _Atomic uint32_t roster_waiters;
    _Atomic uint64_t published;    /* entries published so far */
    _Atomic uint64_t active_mask;  /* consumers that receive new entries */
    _Atomic uint64_t epoch_first_seq; /* seq of the current epoch's first entry */
    _Atomic uint64_t window;       /* entries kept readable for late joiners */
    _Atomic uint64_t max_lag;      /* detach consumers further behind (0: never) */
    _Atomic uint64_t lag_detached; /* consumers detached for lagging */
    _Atomic uint64_t publish_wait_ns; /* producer time asleep waiting for free slots */
    _Atomic uint64_t holes;        /* holes published: slots skipped, kept by non-receivers */
    _Atomic uint64_t late_releases; /* releases ignored: an older incarnation's (Incarnations) */
    _Atomic uint64_t publish_cpu_ns; /* producer's thread CPU spent publishing batches (added
                                      * by the producer's own code, ts_ring_note_publish_cpu) */
    _Atomic uint64_t setup_cpu_ns; /* producer process's CPU before its loader's first epoch
                                    * began (imports, set-up; ts_ring_note_setup_cpu) */

    /* Batches (not end markers, not holes) handed to consumers, once per consumer per
     * entry: a line of its own, so that consumers' increments do not take the producer's
     * futex words above away from it. Outlives the consumers (their table entries' counts
     * start again when an entry is handed out anew). */
    _Alignas(64) _Atomic uint64_t batches_delivered;

    ts_consumer consumers[TS_MAX_CONSUMERS];
    ts_importer importers[TS_MAX_CONSUMERS]; /* CUDA rings: who maps the device pool */

    /* Why the producer stopped, if it failed (its loader raised, say): UTF-8, NUL
     * terminated, written before state becomes FINISHED; empty after a normal end. */
    char failure[TS_FAILURE_BYTES];

    /* The producer's decoded-sample cache as it last noted it (ts_ring_note_cache), for
     * status and its consumers: a sequence lock (odd while the producer writes) over
     * words read and written with relaxed atomics, so a reader copies it whole or tries
     * again. cache_off holds the text of ts_cache_note.off, 8 bytes a word. */
    _Atomic uint32_t cache_seq;
    _Atomic uint64_t cache_counts[4]; /* budget, bytes, samples, epochs */
    _Atomic uint64_t cache_off[TS_CACHE_OFF_BYTES / 8];
} ts_header;

/* Ring geometry chosen by the producer. */
typedef struct ts_geometry {
    uint32_t slot_count;
    uint32_t max_leaves;
    uint64_t slot_bytes;
    uint32_t on_device; /* 1: CUDA ring (adds the IPC handle table) */
} ts_geometry;

/* One leaf of a slot as a consumer handle uses it (ts_slot_use). */
typedef struct ts_use_leaf {
    _Atomic uint32_t refs; /* views and exported tensors of the leaf alive */
    uint32_t kept;         /* set aside: 1 while its pages of the private copy are mapped */
    uint64_t first, end;   /* set aside: those pages, as offsets into the slot */
} ts_use_leaf;

/* What of one slot a consumer handle's leases still use: the leaves whose tensors are
 * alive. Set aside, only their pages stay mapped (a private copy), each unmapped once its
 * last tensor goes, the rest at the slot's last release. Counts change on any thread;
 * the rest under the handle's hold_lock. */
typedef struct ts_slot_use {
    uint32_t leases;        /* leases of the slot alive */
    uint32_t capacity;      /* entries of leaf[] */
    uint32_t n_leaves;      /* leaves of the entry leased (1 for a whole slot set aside) */
    _Atomic uint32_t whole; /* references that use every leaf (the lease's own) */
    uint32_t holds;         /* set aside: holds of the slot not yet released */
    ts_use_leaf leaf[];
} ts_slot_use;

/* Leaf number of a lease reference that uses every leaf (ts_ring_use_leaf). */
#define TS_USE_WHOLE UINT32_MAX

/* A process's handle on a ring segment. Reference counted: the owner (the
 * Python object) holds one reference and every consumer lease one more, so
 * the mapping outlives the object for as long as any view of it lives. */
typedef struct ts_ring {
    _Atomic int refs;
    int is_producer;
    int fd;                  /* owns: segment fd; the producer closes it after mapping, a
                              * consumer keeps it to remap slots (ts_fault.h) */
    ts_header *hdr;          /* owns: control mapping, read-write */
    size_t ctrl_bytes;
    uint8_t *data;           /* owns (host backend): slot data mapping */
    size_t data_bytes;
    ts_fault_map cow;        /* consumer: copy-on-write state of the data mapping (watched
                              * while mapped; borrows fd, owns its state array) */
    uint64_t stream_min;     /* copies of runs this long or longer stream (ts_copy.h) */
    ts_device_state *dev;    /* owns: this process's device state (ts_device.h), or NULL */
    int producer_pidfd;      /* owns (consumer): a pidfd of the producer, or -1 (see
                              * ts_proc_pidfd; the start-time check is used then) */
    int importer;            /* consumer: our importer table entry while the pool is
                              * imported, or -1 */
    pthread_mutex_t lock;    /* producer: publish vs roster changes */
    uint32_t consumer;       /* consumer side: our table index */
    uint64_t token;          /* consumer side: token of our entry */
    uint64_t incarnation;    /* consumer side: our entry's incarnation at bind (its releases
                              * name it, ts_ring_release) */
    uint64_t bound_as[TS_MAX_CONSUMERS]; /* consumer side: per entry, the incarnation this
                              * handle was last bound to it with: the holds under that
                              * entry's bit in held are its (ts_ring_set_aside) */
    pid_t pid;               /* the process that opened the handle (a fork's child is not it) */
    _Atomic uint64_t *held;  /* owns (consumer side): per slot, the consumer bits under which
                              * this handle holds the slot (set by acquire, cleared by release) */
    _Atomic int aside;       /* 1 once set aside (ts_ring_set_aside): it reads no more */
    ts_slot_use **use;       /* owns (consumer side): per slot, what its leases use, or NULL
                              * before the first lease of the slot */
    pthread_mutex_t hold_lock; /* releases, uses and ts_ring_set_aside */
    uint64_t bytes_copied;   /* producer: bytes copied into slots */
    char name[256];          /* shm name, with the leading '/' */
} ts_ring;

/* A tensor the producer copies into a slot: any strided host array. */
typedef struct ts_src_leaf {
    const void *data;
    int32_t ndim;
    const int64_t *shape;
    const int64_t *strides; /* in bytes */
    uint64_t itemsize;
    DLDataType dtype;
} ts_src_leaf;

/* What a consumer acquired. */
typedef struct ts_acquired {
    uint32_t slot;
    uint32_t kind;
    uint64_t seq;
    uint64_t epoch;
    uint64_t index;
    uint32_t n_leaves;
    uint64_t used_bytes;  /* bytes of the entry in its slot (tensors and meta) */
    const uint8_t *meta;  /* borrowed: the structure blob, valid while the slot is held */
    uint64_t meta_bytes;
} ts_acquired;

/* A reading of a ring's header and of this handle (ts_ring_snapshot). Counters are read
 * one by one without a lock: each is current, together they need not be consistent. */
typedef struct ts_ring_info {
    const char *name;           /* borrowed: the segment name */
    uint32_t slot_count;
    uint32_t max_leaves;
    uint64_t slot_bytes;
    uint64_t segment_bytes;
    int32_t producer_pid;
    uint64_t producer_start_time;
    uint32_t state;             /* TS_RING_* */
    uint64_t published;
    uint64_t active_mask;
    uint64_t bytes_copied;      /* producer handle: bytes it copied into slots */
    uint64_t data_address;      /* this handle's mapping of the slot data */
    uint64_t data_bytes;
    uint32_t consumer;          /* consumer handle: its table index (UINT32_MAX: none) */
    int is_producer;
    uint32_t occupied;          /* slots some consumer holds */
    uint64_t window;
    uint64_t max_lag;
    uint64_t epoch_first_seq;
    uint64_t lag_detached;
    uint64_t publish_wait_ns;
    uint64_t holes;             /* holes published (slots skipped, see Holes) */
    uint64_t late_releases;     /* releases ignored as an older incarnation's (Incarnations) */
    uint64_t publish_cpu_ns;    /* producer's thread CPU spent publishing batches */
    uint64_t setup_cpu_ns;      /* producer process's CPU before its loader began */
    uint64_t batches_delivered; /* batches handed to consumers, once per consumer each */
    uint64_t incarnation;       /* consumer handle: the incarnation its releases name */
    int host_writable;          /* ts_ring_host_writable */
    uint32_t private_slots;     /* slots this handle made private by writing (ts_fault.h) */
    int newest_valid;           /* the newest entry was read whole (not overwritten meanwhile) */
    uint64_t newest_epoch;
    uint64_t newest_index;
    uint64_t newest_bytes;      /* its bytes; 0 for an epoch's end marker */
    int32_t device_type;        /* DLDeviceType of the ring's slot data (kDLCPU: host only) */
    int32_t device_ordinal;     /* the producer's device, -1 on a host ring */
    char device_uuid[33];       /* hex UUID of the pool's device; "" on a host ring */
    int producer_host_pinned;   /* the producer page-locked its host slot data */
    int imported_device;        /* ts_ring_imported_device */
    int host_pinned;            /* this handle page-locked its mapping of the slot data */
    int same_pid_namespace;     /* the producer runs in this process's PID namespace */
    uint32_t gpu_importers;     /* live processes mapping the device pool */
} ts_ring_info;

/* A reading of one consumer table entry (ts_ring_consumer_snapshot). */
typedef struct ts_consumer_info {
    uint32_t index;
    uint32_t state;             /* TS_CONSUMER_* */
    uint32_t reason;            /* TS_REASON_* */
    int32_t pid;
    uint64_t cursor;            /* next seq it reads; TS_SEQ_NONE: none yet */
    uint64_t first_seq;
    int64_t lag;                /* published entries it has not taken */
    uint64_t delivered;
    uint64_t delivered_bytes;
    uint64_t wait_ns;
    uint64_t progress_ns;
    uint64_t start_time;
    uint32_t batch_size;
    uint64_t token;
    uint64_t incarnation;       /* the entry's incarnation now (see Incarnations) */
    uint32_t releasing;         /* releases of it under way */
} ts_consumer_info;

/* ---- life cycle ---------------------------------------------------------- */

/* Create a new segment `name` (mode 0600) with geometry g, as producer. */
ts_status ts_ring_create(const char *name, const ts_geometry *g, ts_ring **out, ts_err *err);

/* Create a device ring: slot data on device `ordinal` of driver's backend as well (its
 * device state takes its own driver reference). */
ts_status ts_ring_create_on_device(const char *name, const ts_geometry *g,
                                   ts_device_driver *driver, int ordinal, ts_ring **out,
                                   ts_err *err);

/* Open an existing segment as consumer. */
ts_status ts_ring_open(const char *name, ts_ring **out, ts_err *err);

/* Take one more reference on the mapping. */
void ts_ring_ref(ts_ring *ring);

/* Drop a reference; unmaps and frees at zero. Safe on any thread. */
void ts_ring_unref(ts_ring *ring);

/* The owner of a consumer handle closed it (the references left are its views'): from
 * now on the device releases those views queue are flushed by the device's own thread,
 * since no call of the consumer will flush them (ts_device.h, orphan). */
void ts_ring_orphan(ts_ring *ring);

/* Remove the segment's name (the mapping stays valid). */
ts_status ts_ring_unlink_name(const char *name, ts_err *err);

/* Bytes a segment of geometry g needs, and the control-area size. */
uint64_t ts_ring_segment_bytes(const ts_geometry *g, uint64_t *ctrl_bytes);

/* Slot descriptor i. */
ts_slot *ts_ring_slot(const ts_ring *ring, uint32_t i);

/* ---- accessors: what the binding and the export read of a handle (never its fields) */

/* 1 for the producer's handle, 0 for a consumer's. */
int ts_ring_is_producer(const ts_ring *ring);

/* Slots of the ring. */
uint32_t ts_ring_slot_count(const ts_ring *ring);

/* DLDeviceType of the ring's slot data: kDLCPU for a host ring, kDLCUDA for a CUDA ring. */
int32_t ts_ring_device_type(const ts_ring *ring);

/* This handle's device state (ts_device.h; borrowed, lives as long as the ring), or NULL. */
ts_device_state *ts_ring_device_state(const ts_ring *ring);

/* Consumer handle: the table index it is bound to (UINT32_MAX before ts_ring_bind_consumer). */
uint32_t ts_ring_consumer_index(const ts_ring *ring);

/* Consumer handle: the incarnation its holds are taken as now (ts_ring_release names it). */
uint64_t ts_ring_incarnation(const ts_ring *ring);

/* Entries published so far. */
uint64_t ts_ring_published(const ts_ring *ring);

/* The reader bitmap of slot i. */
uint64_t ts_ring_slot_readers(const ts_ring *ring, uint32_t i);

/* The slot the producer must fill for its next entry, as any process reads it. */
typedef struct ts_next_slot {
    uint64_t published; /* entries published so far: the next one is seq `published` */
    uint32_t slot;      /* where it goes: published % slot_count */
    uint64_t seq;       /* the entry (or hole) last in that slot; TS_SEQ_NONE: never used */
    uint64_t readers;   /* that slot's reader bitmap (0 for a slot never used): the producer
                         * waits while it is not 0, unless every bit left is a hold of a
                         * consumer that receives no more (then a hole goes there, Holes) */
} ts_next_slot;

/* Read the slot the producer fills next and its readers into out: the one answer to
 * "which slot is reused next" for status and diagnosis (tensorsocket/data/diagnosis.py). */
void ts_ring_next_slot(const ts_ring *ring, ts_next_slot *out);

/* Read the header and this handle's state into out. */
void ts_ring_snapshot(const ts_ring *ring, ts_ring_info *out);

/* Read consumer table entry index (< TS_MAX_CONSUMERS) into out. */
void ts_ring_consumer_snapshot(const ts_ring *ring, uint32_t index, ts_consumer_info *out);

/* ---- producer -------------------------------------------------------------- */

/* Reserve a consumer table entry for process pid, which asked for batches
 * of batch_size samples (0: the loader's; recorded for status displays). The entry gets a
 * new incarnation; one with a release of its last incarnation under way is passed over
 * while the releasing process lives (see Incarnations). */
ts_status ts_ring_reserve(ts_ring *ring, pid_t pid, uint64_t start_time, uint32_t batch_size,
                          uint32_t *index, uint64_t *token, ts_err *err);

/* Set the late-joiner window and the lag limit (0: lossless, never detach). */
ts_status ts_ring_set_policy(ts_ring *ring, uint64_t window, uint64_t max_lag, ts_err *err);

/* Make a reserved consumer receive entries: from the oldest entry of the
 * current epoch still inside the window, else from the next one published.
 * align != 0 widens the window to every entry still in the ring, so that a
 * consumer that wants whole epochs starts at the current epoch's first entry
 * whenever it is still readable. */
ts_status ts_ring_activate(ts_ring *ring, uint32_t index, int align, uint64_t *start_seq,
                           ts_err *err);

/* Make a reserved consumer receive entries from seq `from` on (the ranks of a consumer
 * group start together); TS_E_INVALID if an entry from `from` on left the ring. */
ts_status ts_ring_activate_from(ts_ring *ring, uint32_t index, uint64_t from,
                                uint64_t *start_seq, ts_err *err);

/* Start n reserved consumers (the ranks of a group) at one and the same entry: picked as
 * ts_ring_activate picks it, or `from` (TS_SEQ_NONE: pick), in one step. */
ts_status ts_ring_activate_group(ts_ring *ring, const uint32_t *indices, uint32_t n, int align,
                                 uint64_t from, uint64_t *start_seq, ts_err *err);

/* A live consumer left: stop sending, drop its unread entries. Slots it still
 * holds views of stay held until those views are freed. */
void ts_ring_retire(ts_ring *ring, uint32_t index);

/* A consumer whose process lives but that sent no heartbeat for silent_ms, longer than
 * limit_ms (stopped, or its heartbeat thread could not run): retired as for leaving, so
 * that nobody waits for it, with reason TS_REASON_SILENT (its next acquire says so). The
 * slots it holds views of stay held (the producer skips them, see Holes) until it frees
 * those views or is evicted as dead. One detached before just retires (its reason stays). */
void ts_ring_retire_silent(ts_ring *ring, uint32_t index, uint64_t silent_ms,
                           uint64_t limit_ms);

/* Take a live consumer off (reason TS_REASON_*): like retire, but the entry
 * stays DETACHED (not reusable) until the consumer retires or is evicted. */
void ts_ring_detach(ts_ring *ring, uint32_t index, uint32_t reason);

/* Consumer index (active) skips the rest of the producer's current epoch, keeping its
 * place: its unread entries are dropped, it receives nothing more until the epoch's end
 * marker is published, then everything from the next epoch's first entry on (a job that
 * left its epoch with break; nobody waits for it meanwhile). TS_E_INVALID if not active. */
ts_status ts_ring_await_next_epoch(ts_ring *ring, uint32_t index, ts_err *err);

/* A dead consumer: drop every reference it had. */
void ts_ring_evict(ts_ring *ring, uint32_t index);

/* Drop every reference a consumer had, recording why (TS_REASON_DIED, or
 * TS_REASON_SILENT for one that stopped sending heartbeats: if it runs again,
 * its next acquire says so). */
void ts_ring_evict_for(ts_ring *ring, uint32_t index, uint32_t reason);

/* Copy leaves and meta into the next slot and publish it. Waits for the slot
 * until deadline (TS_E_TIMEOUT, TS_E_INTR: nothing was written, call again). */
ts_status ts_ring_publish(ts_ring *ring, uint32_t kind, uint64_t epoch, uint64_t index,
                          const ts_src_leaf *leaves, uint32_t n_leaves, const void *meta,
                          uint64_t meta_bytes, uint64_t deadline, ts_err *err);

/* Add ns of the producer thread's CPU time spent publishing (encoding and copying a batch:
 * measured by the caller, whose own work on the batch the ring cannot see) to
 * header.publish_cpu_ns. */
void ts_ring_note_publish_cpu(ts_ring *ring, uint64_t ns);

/* Set header.setup_cpu_ns: the producer process's CPU time before its loader's first
 * epoch began (what status leaves out of the loader's CPU). */
void ts_ring_note_setup_cpu(ts_ring *ring, uint64_t ns);

/* The producer's decoded-sample cache (cache_bytes=), as noted in the ring's header. */
typedef struct ts_cache_note {
    uint64_t budget;  /* bytes the cache may take (0: none asked for) */
    uint64_t bytes;   /* bytes it holds now */
    uint64_t samples; /* samples filled */
    uint64_t epochs;  /* epochs served from it */
    char off[TS_CACHE_OFF_BYTES]; /* why there is none, NUL terminated ("": there is one,
                                   * or the producer has not decided yet) */
} ts_cache_note;

/* Where address lies in the segment's file, for another process to map the same bytes: 1
 * with the file's path (path_len bytes at most, NUL terminated) and the offset in it, if
 * address is in a slot this consumer handle sees through the shared mapping (not a
 * private copy) and the segment's name still names the file this handle maps; else 0. */
int ts_ring_locate(const ts_ring *ring, uint64_t address, char *path, size_t path_len,
                   uint64_t *offset);

/* Note the producer's cache in the header (the producer's thread only). */
void ts_ring_note_cache(ts_ring *ring, const ts_cache_note *note);

/* Copy the header's cache note into out: 1, or 0 if a write under way never let a
 * whole copy be taken (a producer killed while writing it). */
int ts_ring_cache(const ts_ring *ring, ts_cache_note *out);

/* Bytes a batch of these leaves and meta occupies in a slot. */
uint64_t ts_ring_batch_bytes(const ts_src_leaf *leaves, uint32_t n_leaves, uint64_t meta_bytes);

/* Wait until at least n consumers are active. */
ts_status ts_ring_wait_consumers(ts_ring *ring, uint32_t n, uint64_t deadline, ts_err *err);

/* Wait until every active consumer has read every published entry. */
ts_status ts_ring_wait_drained(ts_ring *ring, uint64_t deadline, ts_err *err);

/* Wait until no slot is held by any consumer (views included) and, for a
 * CUDA ring, no live process maps the device pool any more. */
ts_status ts_ring_wait_released(ts_ring *ring, uint64_t deadline, ts_err *err);

/* Mark the ring finished and wake every consumer. */
void ts_ring_finish(ts_ring *ring);

/* Finish the ring because the producer failed: `why` (cut to TS_FAILURE_BYTES - 1
 * bytes) is stored for the consumers first (ts_ring_failure). */
void ts_ring_fail(ts_ring *ring, const char *why);

/* If the ring is finished and its producer failed, copy the failure's text into buf
 * (TS_FAILURE_BYTES bytes, NUL terminated) and return 1; else return 0. */
int ts_ring_failure(const ts_ring *ring, char *buf);

/* ---- consumer -------------------------------------------------------------- */

/* Bind this handle to consumer entry index (token from the handshake). */
ts_status ts_ring_bind_consumer(ts_ring *ring, uint32_t index, uint64_t token, ts_err *err);

/* Take the next entry for our consumer, waiting until deadline (absolute, ts_now_ns
 * clock). TS_DEADLINE_NOW: take it only if it is published already, never wait (no
 * waiter registered, no system call): TS_E_TIMEOUT otherwise. */
#define TS_DEADLINE_NOW 0
ts_status ts_ring_acquire(ts_ring *ring, uint64_t deadline, ts_acquired *out, ts_err *err);

/* Drop consumer's reference on slot, taken by its incarnation (ring->incarnation when the
 * hold was taken; safe on any thread, no GIL). A slot this process wrote into is mapped
 * shared and read-only again before it is handed back. If the entry was evicted or handed
 * out again since, the slot's bit is left alone (it is no longer this hold's) and the
 * release is counted in header.late_releases (see Incarnations). */
void ts_ring_release(ts_ring *ring, uint32_t slot, uint32_t consumer, uint64_t incarnation);

/* 1 if host views of this handle may be written into (the producer's, or a consumer's
 * whose slots are made private on a write, ts_fault.h). */
int ts_ring_host_writable(const ts_ring *ring);

/* Set this consumer handle aside, once its consumer entry no longer reads (it left, was
 * parked or detached) while batches of it are still alive: every slot it holds becomes a
 * private copy in this process and is handed back to the producer at once, so that the
 * process, reading on through a new handle, never waits for a slot it holds itself. Only
 * the pages of leaves still in use are copied (ts_ring_use_leaf; a slot held without a
 * lease is copied whole); the rest of the mapping is unmapped, each leaf's pages go when
 * its last tensor does, and the handle no longer takes a place among the mappings that
 * fault handling watches (ts_fault.h) nor an fd: a process may keep any number of them.
 * The handle reads no more; its views stay valid. Host rings whose slots can be made
 * private (not page-locked for CUDA) only. TS_E_SYS with ENOMEM: no memory for the
 * copies (nothing was handed back). */
ts_status ts_ring_set_aside(ts_ring *ring, ts_err *err);

/* A lease of slot begins (before its first ts_ring_use_leaf): it uses every leaf until
 * its own reference goes. 0, or ENOMEM. */
int ts_ring_use_begin(ts_ring *ring, uint32_t slot);

/* One more reference that uses leaf of slot (TS_USE_WHOLE: every leaf). */
void ts_ring_use_leaf(ts_ring *ring, uint32_t slot, uint32_t leaf);

/* One reference to leaf of slot fewer (TS_USE_WHOLE: every leaf); on a handle set aside,
 * the pages of leaves no longer used are unmapped. Any thread. */
void ts_ring_unuse_leaf(ts_ring *ring, uint32_t slot, uint32_t leaf);

/* A lease of slot ends (before its release). */
void ts_ring_use_end(ts_ring *ring, uint32_t slot);

/* Slots this consumer handle holds now. */
uint32_t ts_ring_held_slots(const ts_ring *ring);

/* Whether the producer's process still runs (its pid with the start time it had: not a
 * reuse). A consumer handle asks the pidfd it took at attach when it has one: one poll, no
 * /proc read (ts_proc.h). */
int ts_ring_producer_alive(const ts_ring *ring);

/* Slots this consumer handle holds, if one of them is the slot the producer must reuse
 * for its next entry (its kept batches block every reader); else 0. */
uint32_t ts_ring_held_blocking(const ts_ring *ring);

/* Host address of slot data. */
uint8_t *ts_ring_slot_data(const ts_ring *ring, uint32_t slot);

/* ---- devices (ts_device.h) ----------------------------------------------------- */

/* Device rings: the IPC handles of slot i (NULL for host rings). */
ts_device_ipc *ts_ring_ipc_entry(const ts_ring *ring, uint32_t i);

/* Consumer: open the ring's device pool on device ordinal of driver's backend (once;
 * calling again with the same ordinal does nothing). ordinal < 0: the visible device that
 * holds the pool (found by UUID). */
ts_status ts_ring_import_device(ts_ring *ring, ts_device_driver *driver, int ordinal,
                                ts_err *err);

/* Consumer: page-lock this process's mapping of the host slot data for device ordinal. */
ts_status ts_ring_pin_host(ts_ring *ring, ts_device_driver *driver, int ordinal,
                           ts_err *err);

/* The ordinal the pool was imported on, or -1. */
int ts_ring_imported_device(const ts_ring *ring);

/* Device address of slot data in this process (0 if not imported). */
uint64_t ts_ring_device_ptr(const ts_ring *ring, uint32_t slot);

/* The DLDevice of this handle's views: of the imported device copy (device != 0), or of
 * the host slot data. */
DLDevice ts_ring_dl_device(const ts_ring *ring, int device);

/* Live processes that still map the device pool. */
uint32_t ts_ring_importers(const ts_ring *ring);

/* Producer of a device ring: from now on no import begins (pool_closing), and the live
 * processes that map the pool are counted once the imports under way have settled (mapped,
 * or backed out on seeing the seal). The count can only go down after this, so the pool
 * may be freed once it is 0 (ts_ring_free frees it then). 0 for a host ring. */
uint32_t ts_ring_seal_pool(ts_ring *ring);

/* Consumer of a device ring: hand the releases its dropped views queued to the device
 * (ts_device.h, flush), current being the DLPack number of the calling thread's current
 * stream on the ring's device (0: unknown). A producer's handle, or a host ring's, has
 * nothing to flush: TS_OK. */
ts_status ts_ring_flush_releases(ts_ring *ring, int64_t current, uint32_t wait_ms, ts_err *err);

#endif /* TS_RING_H */
