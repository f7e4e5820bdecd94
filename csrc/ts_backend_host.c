/* ts_backend_host.c - slot data in the shared segment, after the control area. */
#define _GNU_SOURCE
#include <errno.h>
#include <string.h>
#include <sys/mman.h>

#include "ts_backend.h"
#include "ts_copy.h"
#include "ts_fault.h"
#include "ts_ring.h"

/* Map the data area: read-write for the producer; read-only for consumers, whose writes
 * into a held slot make it private (ts_fault.h: fd stays open for that, see ts_ring_map_data). */
ts_status ts_host_open(ts_ring *ring, int fd, ts_err *err)
{
    const ts_header *h = ring->hdr;
    size_t bytes = (size_t)(h->segment_bytes - h->data_offset);
    int prot = ring->is_producer ? PROT_READ | PROT_WRITE : PROT_READ;
    void *p = mmap(NULL, bytes, prot, MAP_SHARED, fd, (off_t)h->data_offset);
    if (p == MAP_FAILED)
        return ts_err_set(err, TS_E_SYS, errno, "mmap of %zu bytes of slot data: %s", bytes,
                          strerror(errno));
    ring->data = p;
    ring->data_bytes = bytes;
    if (ring->is_producer) {
        ring->stream_min = ts_copy_stream_threshold(bytes);
        return TS_OK;
    }
    ring->cow.start = p;
    ring->cow.len = bytes;
    ring->cow.fd = fd;
    ring->cow.file_offset = h->data_offset;
    ring->cow.slot_bytes = h->slot_bytes;
    ring->cow.slot_count = h->slot_count;
    ts_fault_watch(&ring->cow); /* an in-place op on a batch gets a private copy */
    return TS_OK;
}

/* Unmap the data area. */
void ts_host_close(ts_ring *ring)
{
    if (ring->data != NULL) {
        if (!ring->is_producer) ts_fault_unwatch(&ring->cow);
        munmap(ring->data, ring->data_bytes);
    }
    ring->data = NULL;
}

/* Copy into the mapping: streaming stores for long runs into a ring bigger than the cache. */
ts_status ts_host_copy_in(ts_ring *ring, uint64_t off, const void *src, uint64_t n,
                                 ts_err *err)
{
    (void)err;
    if (n >= ring->stream_min)
        ts_copy_stream(ring->data + off, src, (size_t)n);
    else
        memcpy(ring->data + off, src, (size_t)n);
    return TS_OK;
}

/* Host slots have nothing in flight once their readers are gone. */
static ts_status ts_host_prepare(ts_ring *ring, uint32_t slot, ts_err *err)
{
    (void)ring;
    (void)slot;
    (void)err;
    return TS_OK;
}

/* Host writes are made visible by the release store that publishes the slot. */
static ts_status ts_host_fence(ts_ring *ring, uint32_t slot, ts_err *err)
{
    (void)ring;
    (void)slot;
    (void)err;
    return TS_OK;
}

const ts_backend ts_backend_host = {
    .name = "host",
    .device_type = kDLCPU,
    .open = ts_host_open,
    .close = ts_host_close,
    .prepare = ts_host_prepare,
    .copy_in = ts_host_copy_in,
    .fence = ts_host_fence,
};
