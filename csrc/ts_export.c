/* ts_export.c - leases and DLPack export. No Python here (deleters run without the GIL). */
#include "ts_export.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

/* ==========================================================================
 * Leases
 * ========================================================================== */

/* A new lease (one reference) on slot for the ring's consumer. */
ts_lease *ts_lease_new(ts_ring *ring, uint32_t slot, uint64_t seq)
{
    ts_lease *lease = malloc(sizeof *lease);
    if (lease == NULL) return NULL;
    atomic_init(&lease->refs, 1);
    ts_ring_ref(ring);
    lease->ring = ring;
    lease->slot = slot;
    lease->consumer = ring->consumer;
    lease->seq = seq;
    return lease;
}

/* Take a reference. */
void ts_lease_ref(ts_lease *lease)
{
    atomic_fetch_add_explicit(&lease->refs, 1, memory_order_relaxed);
}

/* Drop a reference; at zero the slot is released and the lease freed. */
void ts_lease_unref(ts_lease *lease)
{
    if (atomic_fetch_sub_explicit(&lease->refs, 1, memory_order_acq_rel) != 1) return;
    ts_ring_release(lease->ring, lease->slot, lease->consumer);
    ts_ring_unref(lease->ring);
    free(lease);
}

/* The leaf descriptor i of the leased slot (NULL when out of range). */
const ts_leaf *ts_lease_leaf(const ts_lease *lease, uint32_t i)
{
    const ts_slot *s = ts_ring_slot(lease->ring, lease->slot);
    if (i >= s->n_leaves) return NULL;
    return &s->leaves[i];
}

/* ==========================================================================
 * DLPack export
 * ========================================================================== */

/* Everything one exported tensor owns, in one allocation. */
typedef struct ts_export_ctx {
    union {
        DLManagedTensor legacy;
        DLManagedTensorVersioned versioned;
    } managed;
    ts_lease *lease; /* owns one lease reference; NULL for a copy */
    void *copy;      /* owns: private copy of the data, or NULL */
    int64_t shape[TS_MAX_NDIM];
    int64_t strides[TS_MAX_NDIM];
} ts_export_ctx;

/* Free the context and drop what it owns. */
static void ts_export_ctx_free(ts_export_ctx *ctx)
{
    if (ctx->lease != NULL) ts_lease_unref(ctx->lease);
    free(ctx->copy);
    free(ctx);
}

/* DLPack deleter of legacy tensors. */
static void ts_deleter_legacy(DLManagedTensor *self)
{
    ts_export_ctx_free(self->manager_ctx);
}

/* DLPack deleter of versioned tensors. */
static void ts_deleter_versioned(DLManagedTensorVersioned *self)
{
    ts_export_ctx_free(self->manager_ctx);
}

/* Export leaf i as DLPack (see ts_export.h). */
void *ts_export_leaf(ts_lease *lease, uint32_t i, int versioned, uint32_t minor, int copy,
                     ts_err *err)
{
    const ts_leaf *leaf = ts_lease_leaf(lease, i);
    if (leaf == NULL) {
        ts_err_set(err, TS_E_INVALID, 0, "tensor %u is not in this slot", i);
        return NULL;
    }
    uint8_t *base = ts_ring_slot_data(lease->ring, lease->slot);
    if (base == NULL) {
        ts_err_set(err, TS_E_INVALID, 0, "slot data is not host memory");
        return NULL;
    }
    ts_export_ctx *ctx = calloc(1, sizeof *ctx);
    if (ctx == NULL) {
        ts_err_set(err, TS_E_SYS, ENOMEM, "out of memory");
        return NULL;
    }
    void *data = base + leaf->offset;
    if (copy) {
        ctx->copy = malloc(leaf->nbytes > 0 ? leaf->nbytes : 1);
        if (ctx->copy == NULL) {
            free(ctx);
            ts_err_set(err, TS_E_SYS, ENOMEM, "out of memory copying %llu bytes",
                       (unsigned long long)leaf->nbytes);
            return NULL;
        }
        memcpy(ctx->copy, data, leaf->nbytes);
        data = ctx->copy;
    } else {
        ts_lease_ref(lease);
        ctx->lease = lease;
    }
    /* C-contiguous strides in elements, always filled in. */
    int64_t stride = 1;
    for (int32_t d = leaf->ndim - 1; d >= 0; d--) {
        ctx->shape[d] = leaf->shape[d];
        ctx->strides[d] = stride;
        stride *= leaf->shape[d] > 0 ? leaf->shape[d] : 1;
    }
    DLTensor t = {
        .data = data,
        .device = {kDLCPU, 0},
        .ndim = leaf->ndim,
        .dtype = leaf->dtype,
        .shape = ctx->shape,
        .strides = ctx->strides,
        .byte_offset = 0, /* torch ignores byte_offset: data points at the first element */
    };
    if (versioned) {
        DLManagedTensorVersioned *m = &ctx->managed.versioned;
        m->version.major = TS_DLPACK_MAJOR;
        m->version.minor = minor;
        m->manager_ctx = ctx;
        m->deleter = ts_deleter_versioned;
        m->flags = copy ? TS_DLPACK_FLAG_IS_COPIED
                        : (lease->ring->is_producer ? 0 : TS_DLPACK_FLAG_READ_ONLY);
        m->dl_tensor = t;
        return m;
    }
    DLManagedTensor *m = &ctx->managed.legacy;
    m->manager_ctx = ctx;
    m->deleter = ts_deleter_legacy;
    m->dl_tensor = t;
    return m;
}

/* Call the deleter of a managed tensor made by ts_export_leaf. */
void ts_export_delete(void *managed, int versioned)
{
    if (versioned) {
        DLManagedTensorVersioned *m = managed;
        m->deleter(m);
    } else {
        DLManagedTensor *m = managed;
        m->deleter(m);
    }
}
