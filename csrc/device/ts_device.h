/* ts_device.h - the device interface: what the ring and DLPack export ask of a GPU backend.
 *
 * Slot data always lives in the segment (host memory, ts_ring.h). A device ring also keeps
 * a copy of each batch in device memory: the producer allocates one pool per ring, exports
 * its handles into the segment, and after writing a slot copies it to the device; a
 * consumer imports the pool once and exports device tensors over it. ts_ring.c and
 * ts_export.c reach the device only through a ts_device (a table of functions, one per
 * backend) and its opaque state, never a driver API; a backend is its driver table (CUDA:
 * ts_cuda_api.c) and one file implementing this table (ts_device_cuda.c). Host rings have no device
 * state at all.
 *
 * Threads: every function may run on any thread; release_after and close also without the
 * GIL, from DLPack deleters (a backend makes its own context current). release_after makes
 * no driver call: it queues, and flush, on the consumer's own thread, orders what it queued
 * after the work queued on the streams the views were used on (docs/gpu.md, "Orderings on
 * the GPU path"). No function calls the driver once the process's exit has begun. */
#ifndef TS_DEVICE_H
#define TS_DEVICE_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "base/ts_dlpack.h"
#include "base/ts_error.h"

/* A backend's stream handle (CUstream) as an integer. */
typedef uintptr_t ts_device_stream;

/* One slot's IPC handle as the segment stores it: opaque bytes to everyone but the backend
 * (CUDA: a CUipcMemHandle). Written once by the producer. No event crosses processes: the
 * producer's copy is complete before the slot is published (ts_device.publish). */
typedef struct ts_device_ipc {
    char mem[64]; /* the handle of the slot's device memory */
} ts_device_ipc;

/* A loaded driver. A backend's own driver table starts with this (ts_cuda_api.base).
 * Reference counted: the module holds one reference, every device state one more, so that
 * DLPack deleters running after the module is gone still find the driver. */
typedef struct ts_device_driver {
    const struct ts_device *device; /* the backend it belongs to */
    _Atomic int refs;
    int version;    /* the driver's version (CUDA: cuDriverGetVersion, e.g. 12040) */
    char path[256]; /* the library that was loaded */
} ts_device_driver;

/* One process's device state for one ring. A backend's state starts with this; the rest is
 * its own. Fields written by the backend, read by anyone. */
typedef struct ts_device_state {
    const struct ts_device *device; /* the backend it belongs to */
    int ordinal;     /* the device it lives on */
    int imported;    /* consumer: the pool is open here (device exports work) */
    int host_pinned; /* this process's mapping of the host slot data is page-locked */
} ts_device_state;

/* What a backend sees of the ring: filled by ts_ring.c, pointers borrowed (valid while the
 * ring lives). */
typedef struct ts_device_ring {
    uint32_t slot_count;
    uint64_t slot_bytes; /* capacity and stride of a slot, host and device alike */
    uint8_t *host;       /* this process's mapping of the host slot data */
    size_t host_bytes;
    ts_device_ipc *ipc;  /* the segment's IPC handle table (slot_count entries) */
    uint8_t *uuid;       /* the segment's device UUID (16 bytes): written by create_pool,
                          * read by import */
} ts_device_ring;

/* One visible device, for status displays (describe). */
typedef struct ts_device_desc {
    char name[128];
    char uuid[33];  /* hex, "" if unknown */
    int ipc_events; /* 1 if it supports interprocess events, 0 if not, -1 if the driver
                     * cannot say (older than the attribute): for status displays only */
} ts_device_desc;

/* A queued release is over. ok: the work queued before it finished, the consumer's hold on
 * slot (taken by incarnation token of entry consumer) ends. !ok: waiting for that work
 * failed; the slot must stay held (only what the release itself owns, such as a ring
 * reference, may go). */
typedef void (*ts_device_done_fn)(void *arg, uint32_t slot, uint32_t consumer, uint64_t token,
                                  int ok);

/* A backend. Functions taking a state get the one its create_pool, open or import made. */
typedef struct ts_device {
    const char *name;    /* "cuda" */
    int32_t device_type; /* DLDeviceType of its device memory (kDLCUDA) */

    /* ---- the driver table */
    /* Load the driver (one reference); on failure err says why (TS_E_GPU_UNAVAILABLE). */
    ts_status (*load)(ts_device_driver **out, ts_err *err);
    /* Close a driver whose last reference went (ts_device_driver_unref calls it). */
    void (*unload)(ts_device_driver *driver);
    /* Visible devices, or -1. */
    int (*device_count)(ts_device_driver *driver);
    /* Describe visible device ordinal: 0, or -1 if the driver cannot see it. */
    int (*describe)(ts_device_driver *driver, int ordinal, ts_device_desc *out);
    /* The ordinal of the visible device with this 16-byte UUID, or -1. */
    int (*find)(ts_device_driver *driver, const uint8_t *uuid);

    /* ---- producer: the pool */
    /* Allocate the ring's device pool on ordinal, export its handles into r->ipc and the
     * device's UUID into r->uuid, and page-lock r->host if the system allows. */
    ts_status (*create_pool)(ts_device_driver *driver, int ordinal, const ts_device_ring *r,
                             ts_device_state **out, ts_err *err);
    /* The slot's host data may be rewritten once this returns (earlier copies out of it
     * have finished). */
    ts_status (*prepare)(ts_device_state *state, uint32_t slot, ts_err *err);
    /* Copy the slot's first `bytes` (at host) to the device and wait until the copy is
     * done: the ring publishes the slot once this returns, and a consumer may then read
     * it on any stream without waiting for anything. */
    ts_status (*publish)(ts_device_state *state, uint32_t slot, const void *host,
                         uint64_t bytes, ts_err *err);

    /* ---- consumer */
    /* A consumer's state on device ordinal, opening nothing yet. */
    ts_status (*open)(ts_device_driver *driver, int ordinal, uint32_t slot_count,
                      ts_device_state **out, ts_err *err);
    /* Open every slot's memory handle (not in the exporting process). */
    ts_status (*import)(ts_device_state *state, const ts_device_ring *r, ts_err *err);
    /* Page-lock this process's (read-only) mapping of the host slot data. */
    ts_status (*pin_host)(ts_device_state *state, const ts_device_ring *r, ts_err *err);
    /* Device address of the slot's data in this process (0 if not imported). */
    uint64_t (*slot_ptr)(const ts_device_state *state, uint32_t slot);
    /* The stream a DLPack stream number names, and whether it names one stream the caller
     * queues its work on (not -1, "the consumer orders its own work", nor 2, the calling
     * thread's per-thread stream, which no other thread can name). TS_E_INVALID if none. */
    ts_status (*dlpack_stream)(int64_t number, ts_device_stream *out, int *followable,
                               ts_err *err);
    /* Queue the release of slot (no driver call): done(arg, slot, consumer, token, ok) is
     * called on a thread of the backend once a later flush recorded the work queued on
     * each of the n streams (the lease's), on the stream current at that flush, and, if
     * unnamed (a view read through its raw pointer, or exported with a stream number
     * that names none) or if no stream is known at all, on the legacy default stream, and
     * that work finished (ok), or waiting for it failed (!ok). token is the lease's
     * incarnation, carried as is (the handle may be bound again before done runs). */
    void (*release_after)(ts_device_state *state, uint32_t slot, uint32_t consumer,
                          uint64_t token, const ts_device_stream *streams, uint32_t n,
                          int unnamed, ts_device_done_fn done, void *arg);
    /* Hand what release_after queued to the backend's thread, ordered after the work
     * queued so far on the streams each release names (see release_after; current: the
     * stream current on the calling thread, 0 if unknown). No call of it concerns the
     * whole context (cuCtxRecordEvent or cuCtxSynchronize would invalidate a CUDA-graph
     * capture on any thread of the process): a release whose stream is being captured
     * waits for a later flush. A release whose wait failed earlier is reported here
     * (TS_E_CUDA), on every call. wait_ms > 0: then wait up to that long until the
     * backend's thread has finished every release flushed so far (TS_E_TIMEOUT if it has
     * not; close). */
    ts_status (*flush)(ts_device_state *state, ts_device_stream current, uint32_t wait_ms,
                       ts_err *err);

    /* ---- both */
    /* Free the state: close what it opened (a consumer's cuIpcCloseMemHandle of each
     * slot), free what it allocated (driver calls only while the process is not exiting). A producer's state goes only once no importer maps
     * the pool any more: the ring leaves it open while one does (ts_ring_free), and the
     * producer keeps the ring until then (tensorsocket/producer.py, _PoolKeeper), or its
     * process's exit takes the memory. */
    void (*close)(ts_device_state *state);

    /* ---- consumer, appended */
    /* The consumer's handle is closed: no flush will come any more. What release_after
     * queues from now on is flushed by the backend's thread itself, as flush does (with no
     * current stream; a release whose stream is being captured is retried later). */
    void (*orphan)(ts_device_state *state);

    /* ---- producer, appended */
    /* The producer's handle goes while other processes still map the pool (close must
     * wait): undo the page-locking of the host slot data, whose mapping goes now; the
     * pool, its events and the driver stay, for the process's exit to take. */
    void (*unpin_host)(ts_device_state *state);
} ts_device;

/* The CUDA backend (ts_device_cuda.c over the driver table of ts_cuda_api.c). */
extern const ts_device ts_device_cuda;

/* The backend whose device memory has this DLDeviceType, or NULL. */
const ts_device *ts_device_for(int32_t device_type);

/* Take a reference on a driver. */
void ts_device_driver_ref(ts_device_driver *driver);

/* Drop a reference (NULL is fine); the driver is unloaded at zero. */
void ts_device_driver_unref(ts_device_driver *driver);

#endif /* TS_DEVICE_H */
