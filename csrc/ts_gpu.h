/* ts_gpu.h - one process's GPU state for one ring.
 *
 * Producer (CUDA ring): a pool of device memory, one cuMemAlloc per slot (a
 * base allocation, so its IPC handle is valid), one interprocess event per
 * slot, both exported once into the segment's IPC table; a copy stream; the
 * host slot data page-locked so that each batch's copy to the device is a
 * single asynchronous DMA.
 *
 * Consumer: every slot's memory and event handle opened once (never in the
 * exporting process) on the device the consumer asked for, with lazy peer
 * access when that is another GPU than the pool's. A slot exported to the
 * device is released only after the work queued on the consumer's streams
 * up to the moment its last view died has finished: the release records an
 * event on each stream and a reaper thread clears the slot's reader bit when
 * the events complete. Optionally the consumer's mapping of the host slot
 * data is page-locked (cuMemHostRegister, read-only) so its own copies to a
 * GPU are asynchronous without pin_memory.
 *
 * Every function pushes the device's primary context (the one torch uses)
 * on the calling thread and pops it again, so any thread may call them,
 * including DLPack deleters without the GIL. */
#ifndef TS_GPU_H
#define TS_GPU_H

#include <stdint.h>

#include "ts_cuda.h"
#include "ts_error.h"
#include "ts_ring.h"

/* Longest list of streams a lease records; beyond it a release waits for the
 * whole device. */
#define TS_LEASE_STREAMS 4

typedef struct ts_gpu ts_gpu;

/* ---- producer -------------------------------------------------------------- */

/* Allocate the device pool of a new CUDA ring on device ordinal, export its
 * handles into the segment and page-lock the host slot data. */
ts_status ts_gpu_create_pool(ts_ring *ring, ts_cuda_api *api, int ordinal, ts_err *err);

/* Wait until the last copy out of the slot's host data has finished. */
ts_status ts_gpu_prepare_slot(ts_ring *ring, uint32_t slot, ts_err *err);

/* Copy the first `bytes` of the slot's host data to its device memory on the
 * producer's stream, then record the slot's event. */
ts_status ts_gpu_publish_slot(ts_ring *ring, uint32_t slot, uint64_t bytes, ts_err *err);

/* ---- consumer -------------------------------------------------------------- */

/* Open every slot's memory and event handle on device ordinal (once; calling
 * again with the same ordinal does nothing). */
ts_status ts_gpu_import(ts_ring *ring, ts_cuda_api *api, int ordinal, ts_err *err);

/* Page-lock this process's mapping of the host slot data. */
ts_status ts_gpu_pin_host(ts_ring *ring, ts_cuda_api *api, int ordinal, ts_err *err);

/* The ordinal the pool was imported on, or -1. */
int ts_gpu_imported_device(const ts_ring *ring);

/* 1 if this process's mapping of the host slot data is page-locked. */
int ts_gpu_host_pinned(const ts_ring *ring);

/* Device address of slot data in this process (0 if not imported). */
CUdeviceptr ts_gpu_slot_ptr(const ts_ring *ring, uint32_t slot);

/* Make stream wait for the slot's content (its event). */
ts_status ts_gpu_stream_wait(ts_ring *ring, uint32_t slot, CUstream stream, ts_err *err);

/* Release the consumer's hold on slot once the work queued so far on the n
 * streams has finished (all: on the whole device). Takes its own ring
 * reference until then. Any thread, no GIL. */
void ts_gpu_release_after(ts_ring *ring, uint32_t slot, uint32_t consumer,
                          const CUstream *streams, uint32_t n, int all);

/* A private device copy of n bytes at src, made on stream. */
ts_status ts_gpu_copy(ts_ring *ring, CUdeviceptr src, uint64_t n, CUstream stream,
                      CUdeviceptr *out, ts_err *err);

/* Free a copy made by ts_gpu_copy (any thread). */
void ts_gpu_free_copy(ts_ring *ring, CUdeviceptr p);

/* ---- both ------------------------------------------------------------------ */

/* Free the ring's GPU state (from ts_ring_free; any thread). */
void ts_gpu_close(ts_ring *ring);

#endif /* TS_GPU_H */
