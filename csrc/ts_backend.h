/* ts_backend.h - where slot data lives: the device-memory backend interface.
 *
 * The ring protocol (ts_ring.c) never touches slot memory directly; it asks
 * the ring's backend. The host backend keeps slot data in the shared segment
 * itself. A device backend (CUDA) keeps it in device memory and exports it to
 * consumers; it plugs in here without changes to the ring protocol. */
#ifndef TS_BACKEND_H
#define TS_BACKEND_H

#include <stdint.h>

#include "ts_error.h"

struct ts_ring;

typedef struct ts_backend {
    const char *name;
    int32_t device_type; /* DLDeviceType of slot data as consumers see it */
    /* Make slot storage reachable in this process (fd: the ring segment). */
    ts_status (*open)(struct ts_ring *ring, int fd, ts_err *err);
    /* Undo open. Runs on any thread, without the GIL. */
    void (*close)(struct ts_ring *ring);
    /* Producer: the slot may be rewritten once this returns (earlier device
     * copies out of its host data have finished). */
    ts_status (*prepare)(struct ts_ring *ring, uint32_t slot, ts_err *err);
    /* Producer: copy n host bytes to byte offset off of the slot data area. */
    ts_status (*copy_in)(struct ts_ring *ring, uint64_t off, const void *src, uint64_t n,
                         ts_err *err);
    /* Producer: make the slot's writes complete (and, for a device backend,
     * start their copy to the device) before it is published. */
    ts_status (*fence)(struct ts_ring *ring, uint32_t slot, ts_err *err);
} ts_backend;

/* Slot data in the shared segment, after the control area. */
extern const ts_backend ts_backend_host;

/* The host backend's mapping and copy, which the CUDA backend reuses. */
ts_status ts_host_open(struct ts_ring *ring, int fd, ts_err *err);
void ts_host_close(struct ts_ring *ring);
ts_status ts_host_copy_in(struct ts_ring *ring, uint64_t off, const void *src, uint64_t n,
                          ts_err *err);

/* Slot data in the shared segment and mirrored, one copy per batch, into a
 * pool of device memory that consumers open with CUDA IPC (ts_gpu.h). */
extern const ts_backend ts_backend_cuda;

#endif /* TS_BACKEND_H */
