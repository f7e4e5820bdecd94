/* ts_export.c - leases and DLPack export. No Python here (deleters run without the GIL). */
#include "ring/ts_export.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

/* ==========================================================================
 * Leases
 * ========================================================================== */

/* A new lease (one reference, using every leaf) on slot for the ring's consumer. */
ts_lease *ts_lease_new(ts_ring *ring, uint32_t slot, uint64_t seq)
{
    ts_lease *lease = calloc(1, sizeof *lease); /* no streams yet */
    if (lease == NULL) return NULL;
    lease->streams = lease->inline_streams;
    lease->cap_streams = sizeof lease->inline_streams / sizeof lease->inline_streams[0];
    if (ts_ring_use_begin(ring, slot) != 0) {
        free(lease);
        return NULL;
    }
    atomic_init(&lease->refs, 1);
    ts_ring_ref(ring);
    lease->ring = ring;
    lease->slot = slot;
    lease->consumer = ts_ring_consumer_index(ring);
    lease->token = ts_ring_incarnation(ring);
    lease->seq = seq;
    return lease;
}

/* Take a reference that uses leaf (TS_USE_WHOLE: every leaf). */
void ts_lease_ref(ts_lease *lease, uint32_t leaf)
{
    ts_ring_use_leaf(lease->ring, lease->slot, leaf);
    atomic_fetch_add_explicit(&lease->refs, 1, memory_order_relaxed);
}

/* A deferred release is over: the hold ends if the wait for the GPU work succeeded (else
 * the slot stays held: a slot must never go back under queued work), and the ring
 * reference taken for it goes. The hold's incarnation is the lease's token, not the
 * handle's: the handle may have been bound again since (a consumer that rejoined). */
static void ts_lease_released(void *ring, uint32_t slot, uint32_t consumer, uint64_t token,
                              int ok)
{
    if (ok) ts_ring_release(ring, slot, consumer, token);
    ts_ring_unref(ring);
}

/* Drop a reference that used leaf; at zero the slot is released and the lease freed. A
 * slot that GPU work may read (a device view or export was handed out, or a page-locked
 * host mapping read by asynchronous copies) is released through the device: queued until
 * the consumer's next flush, then after the work queued before it on the streams the
 * views were used on (ts_device.h, release_after). */
void ts_lease_unref(ts_lease *lease, uint32_t leaf)
{
    ts_ring *ring = lease->ring;
    ts_ring_unuse_leaf(ring, lease->slot, leaf);
    if (atomic_fetch_sub_explicit(&lease->refs, 1, memory_order_acq_rel) != 1) return;
    ts_ring_use_end(ring, lease->slot);
    ts_device_state *dev = ts_ring_device_state(ring);
    if (dev != NULL && !ts_ring_is_producer(ring) && (lease->device_used || dev->host_pinned)) {
        ts_ring_ref(ring); /* until done: the device calls it later, on its thread */
        dev->device->release_after(dev, lease->slot, lease->consumer, lease->token,
                                   lease->streams, lease->n_streams, lease->unnamed,
                                   ts_lease_released, ring);
    } else {
        ts_ring_release(ring, lease->slot, lease->consumer, lease->token);
    }
    ts_ring_unref(ring);
    if (lease->streams != lease->inline_streams) free(lease->streams);
    free(lease);
}

/* Remember that the slot's device copy is used on stream; 0, or -1 out of memory (then the
 * lease counts as read on streams nobody named). */
static int ts_lease_add_stream(ts_lease *lease, ts_device_stream stream)
{
    for (uint32_t i = 0; i < lease->n_streams; i++)
        if (lease->streams[i] == stream) return 0;
    if (lease->n_streams == lease->cap_streams) {
        uint32_t cap = lease->cap_streams * 2;
        ts_device_stream *p = malloc(cap * sizeof *p);
        if (p == NULL) return -1;
        memcpy(p, lease->streams, lease->n_streams * sizeof *p);
        if (lease->streams != lease->inline_streams) free(lease->streams);
        lease->streams = p;
        lease->cap_streams = cap;
    }
    lease->streams[lease->n_streams++] = stream;
    return 0;
}

/* A device view of the lease was handed out (see ts_export.h). */
void ts_lease_use_device(ts_lease *lease)
{
    lease->device_used = 1;
}

/* A device view's raw address was read (see ts_export.h). */
void ts_lease_use_raw(ts_lease *lease)
{
    lease->device_used = 1;
    lease->unnamed = 1;
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
    ts_lease *lease; /* owns one lease reference, using leaf; NULL for a copy */
    uint32_t leaf;
    void *copy;      /* owns: private host copy of the data, or NULL */
    int64_t shape[TS_MAX_NDIM];
    int64_t strides[TS_MAX_NDIM];
} ts_export_ctx;

/* Free the context and drop what it owns. */
static void ts_export_ctx_free(ts_export_ctx *ctx)
{
    if (ctx->lease != NULL) ts_lease_unref(ctx->lease, ctx->leaf);
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

/* Where leaf i's data is: a host address, or a device address whose stream is recorded in
 * the lease (the release waits for the work queued there; no driver call now: the
 * producer's copy finished before the slot was published, so a stream being captured
 * needs no wait on an event from outside the capture). */
static ts_status ts_export_locate(ts_lease *lease, const ts_leaf *leaf,
                                  const ts_export_opts *o, void **data, ts_err *err)
{
    ts_ring *ring = lease->ring;
    if (!o->device) {
        uint8_t *base = ts_ring_slot_data(ring, lease->slot);
        if (base == NULL) return ts_err_set(err, TS_E_INVALID, 0, "slot data is not mapped");
        *data = base + leaf->offset;
        return TS_OK;
    }
    uint64_t base = ts_ring_device_ptr(ring, lease->slot);
    if (base == 0)
        return ts_err_set(err, TS_E_INVALID, 0,
                          "this consumer has not opened the ring's GPU memory");
    ts_device_state *dev = ts_ring_device_state(ring);
    int followable = 0;
    ts_device_stream stream = 0;
    ts_status st = dev->device->dlpack_stream(o->stream, &stream, &followable, err);
    if (st != TS_OK) return st;
    lease->device_used = 1;
    if (!followable || ts_lease_add_stream(lease, stream) != 0) lease->unnamed = 1;
    *data = (void *)(uintptr_t)(base + leaf->offset);
    return TS_OK;
}

/* Export leaf i as DLPack (see ts_export.h). */
void *ts_export_leaf(ts_lease *lease, uint32_t i, const ts_export_opts *o, ts_err *err)
{
    const ts_leaf *leaf = ts_lease_leaf(lease, i);
    if (leaf == NULL) {
        ts_err_set(err, TS_E_INVALID, 0, "tensor %u is not in this slot", i);
        return NULL;
    }
    if (o->copy && o->device) {
        /* Device memory of our own (cuMemAlloc) would compete with the framework's caching
         * allocator, which cannot lend it what it keeps reserved, and its cuMemFree stalls
         * the device: the copy is the framework's to make. */
        ts_err_set(err, TS_E_INVALID, 0,
                   "tensorsocket does not allocate GPU memory for copies: export the view "
                   "and copy it with your framework's allocator (torch: "
                   "torch.from_dlpack(view).clone()), or use TensorConsumer(copy=True)");
        return NULL;
    }
    void *data = NULL;
    if (ts_export_locate(lease, leaf, o, &data, err) != TS_OK) return NULL;
    ts_export_ctx *ctx = calloc(1, sizeof *ctx);
    if (ctx == NULL) {
        ts_err_set(err, TS_E_SYS, ENOMEM, "out of memory");
        return NULL;
    }
    if (o->copy) {
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
        ts_lease_ref(lease, i);
        ctx->lease = lease;
        ctx->leaf = i;
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
        .device = ts_ring_dl_device(lease->ring, o->device),
        .ndim = leaf->ndim,
        .dtype = leaf->dtype,
        .shape = ctx->shape,
        .strides = ctx->strides,
        .byte_offset = 0, /* torch ignores byte_offset: data points at the first element */
    };
    if (o->versioned) {
        DLManagedTensorVersioned *m = &ctx->managed.versioned;
        m->version.major = TS_DLPACK_MAJOR;
        m->version.minor = o->minor;
        m->manager_ctx = ctx;
        m->deleter = ts_deleter_versioned;
        /* A consumer's host view is writable where a write makes the slot private to this
         * process (ts_fault.h); device memory is shared by every importer (no copy on write
         * there), and a page-locked host mapping stays shared: read-only for those. */
        int writable = ts_ring_is_producer(lease->ring) ||
                       (!o->device && ts_ring_host_writable(lease->ring));
        m->flags = o->copy ? TS_DLPACK_FLAG_IS_COPIED : writable ? 0 : TS_DLPACK_FLAG_READ_ONLY;
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
