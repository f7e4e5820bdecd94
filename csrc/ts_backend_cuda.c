/* ts_backend_cuda.c - the CUDA backend: host slots mirrored into device memory.
 *
 * The producer writes a batch into the slot's host data exactly as for the
 * host backend (the segment is page-locked, so this is the staging buffer),
 * then fence() starts one host-to-device copy of the slot's tensors on the
 * producer's stream and records the slot's interprocess event after it.
 * Consumers that imported the pool (ts_gpu_import) read the device copy;
 * any other consumer still reads the host copy. */
#include "ts_backend.h"
#include "ts_gpu.h"
#include "ts_ring.h"

/* Wait until the previous device copy out of this slot's host data is done. */
static ts_status ts_cuda_prepare(ts_ring *ring, uint32_t slot, ts_err *err)
{
    return ts_gpu_prepare_slot(ring, slot, err);
}

/* Copy the slot's tensors to its device memory and record its event. */
static ts_status ts_cuda_fence(ts_ring *ring, uint32_t slot, ts_err *err)
{
    const ts_slot *s = ts_ring_slot(ring, slot);
    /* Tensors come first in a slot; the structure blob (meta) is host-only. */
    uint64_t bytes = s->n_leaves > 0 ? s->meta_offset : 0;
    return ts_gpu_publish_slot(ring, slot, bytes, err);
}

const ts_backend ts_backend_cuda = {
    .name = "cuda",
    .device_type = kDLCUDA,
    .open = ts_host_open,
    .close = ts_host_close,
    .prepare = ts_cuda_prepare,
    .copy_in = ts_host_copy_in,
    .fence = ts_cuda_fence,
};
