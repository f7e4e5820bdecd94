/* ts_export.h - consumer leases on slots and DLPack tensors over them.
 *
 * A lease is one consumer's hold on one slot. It is reference counted: the
 * Python SlotView objects hold one reference each and every exported DLPack
 * tensor one more. When the last reference goes, the consumer's bit in the
 * slot is cleared and the producer may reuse the slot. Nothing here touches
 * a Python object, so a DLPack deleter may run on any thread without the GIL. */
#ifndef TS_EXPORT_H
#define TS_EXPORT_H

#include <stdatomic.h>
#include <stdint.h>

#include "device/ts_device.h"
#include "base/ts_dlpack.h"
#include "base/ts_error.h"
#include "ring/ts_ring.h"

typedef struct ts_lease {
    _Atomic int64_t refs;
    ts_ring *ring;     /* owns one ring reference: the mapping outlives views */
    uint32_t slot;
    uint32_t consumer;
    uint64_t token;    /* the consumer's incarnation that took the hold (ts_ring_release) */
    uint64_t seq;
    /* What GPU work may read the slot, for the release (ts_device.h release_after).
     * Written under the GIL by exports and views, read by the final unref. */
    int device_used;  /* a device view or export was handed out: the release is deferred */
    int unnamed;      /* read on streams nobody named: a raw pointer (data_ptr), or DLPack
                       * stream -1 or 2 (the release also waits for the legacy stream) */
    uint32_t n_streams;           /* streams the device copy was exported to */
    uint32_t cap_streams;
    ts_device_stream *streams;    /* owns when it is not inline_streams */
    ts_device_stream inline_streams[4];
} ts_lease;

/* How to export one tensor of a slot. */
typedef struct ts_export_opts {
    int versioned;  /* DLManagedTensorVersioned rather than the legacy DLManagedTensor */
    uint32_t minor; /* versioned: the minor version to report */
    int copy;       /* a private copy instead of a view (host memory only: a device copy is
                     * the consumer framework's to make, with its allocator) */
    int device;     /* the slot's device copy (a pool imported with ts_ring_import_device) */
    int64_t stream; /* device: DLPack stream (1 legacy, 2 per-thread, >2 handle, -1 none) */
} ts_export_opts;

/* A new lease (one reference, using every leaf) on slot for the ring's consumer; NULL
 * when out of memory. */
ts_lease *ts_lease_new(ts_ring *ring, uint32_t slot, uint64_t seq);

/* Take a reference that uses the data of leaf (TS_USE_WHOLE: of every leaf; what a
 * set-aside keeps, ts_ring_set_aside). */
void ts_lease_ref(ts_lease *lease, uint32_t leaf);

/* Drop a reference taken for leaf (the lease's own: TS_USE_WHOLE); at zero the slot is
 * released and the lease freed. */
void ts_lease_unref(ts_lease *lease, uint32_t leaf);

/* The leaf descriptor i of the leased slot (NULL when out of range). */
const ts_leaf *ts_lease_leaf(const ts_lease *lease, uint32_t i);

/* A device view of the lease was handed out: its release waits for GPU work. */
void ts_lease_use_device(ts_lease *lease);

/* The address of leaf i's device copy was read (SlotView.data_ptr): the work that reads it
 * is on a stream nobody names. */
void ts_lease_use_raw(ts_lease *lease);

/* Export leaf i as DLPack (see ts_export_opts). A device export records its stream in the
 * lease (no driver call: the slot was whole before it was published). Returns the managed
 * tensor (to be put in a capsule) or NULL with err set. */
void *ts_export_leaf(ts_lease *lease, uint32_t i, const ts_export_opts *opts, ts_err *err);

/* Call the deleter of a managed tensor made by ts_export_leaf. */
void ts_export_delete(void *managed, int versioned);

#endif /* TS_EXPORT_H */
