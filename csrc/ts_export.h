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

#include "ts_dlpack.h"
#include "ts_error.h"
#include "ts_ring.h"

typedef struct ts_lease {
    _Atomic int64_t refs;
    ts_ring *ring;     /* owns one ring reference: the mapping outlives views */
    uint32_t slot;
    uint32_t consumer;
    uint64_t seq;
} ts_lease;

/* A new lease (one reference) on slot for the ring's consumer. */
ts_lease *ts_lease_new(ts_ring *ring, uint32_t slot, uint64_t seq);

/* Take a reference. */
void ts_lease_ref(ts_lease *lease);

/* Drop a reference; at zero the slot is released and the lease freed. */
void ts_lease_unref(ts_lease *lease);

/* The leaf descriptor i of the leased slot (NULL when out of range). */
const ts_leaf *ts_lease_leaf(const ts_lease *lease, uint32_t i);

/* Export leaf i as DLPack. versioned selects DLManagedTensorVersioned
 * (minor: the minor version to report) over the legacy DLManagedTensor;
 * copy makes a private malloc'd copy instead of a view. Returns the managed
 * tensor (to be put in a capsule) or NULL with err set. */
void *ts_export_leaf(ts_lease *lease, uint32_t i, int versioned, uint32_t minor, int copy,
                     ts_err *err);

/* Call the deleter of a managed tensor made by ts_export_leaf. */
void ts_export_delete(void *managed, int versioned);

#endif /* TS_EXPORT_H */
