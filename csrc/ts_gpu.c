/* ts_gpu.c - one process's GPU state for one ring (see ts_gpu.h). */
#define _GNU_SOURCE
#include "ts_gpu.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ts_proc.h"

/* A release waiting for the consumer's GPU work on the slot to finish. */
typedef struct ts_pending {
    struct ts_pending *next;
    ts_ring *ring; /* owns one ring reference */
    uint32_t slot;
    uint32_t consumer;
    uint32_t n;                      /* events to wait for */
    int all;                         /* wait for the whole device instead */
    CUevent events[TS_LEASE_STREAMS]; /* owns: taken from the pool */
} ts_pending;

struct ts_gpu {
    ts_cuda_api *api; /* owns one reference */
    CUdevice dev;
    int ordinal;
    CUcontext ctx; /* owns: a retain of dev's primary context */
    int is_producer;
    uint32_t slot_count;
    CUdeviceptr *ptr; /* owns: producer's allocations, consumer's opened mappings */
    CUevent *event;   /* owns: producer's events, consumer's opened events */
    CUevent *copied;  /* owns (producer): local blocking-sync events, recorded with event */
    uint8_t *recorded; /* producer: the slot's event was recorded at least once */
    CUstream stream;   /* owns (producer): the copy stream */
    int imported;      /* consumer: ptr and event are open */
    int importer;      /* consumer: our entry in the header's importer table, or -1 */
    ts_header *hdr;    /* the ring's header (valid until the state is torn down) */
    void *pinned;      /* page-locked host range (the ring's data mapping), or NULL */

    /* Consumer: deferred releases, handled by the reaper thread. */
    pthread_mutex_t lock;
    pthread_cond_t cond;
    pthread_t reaper;
    int reaper_started;
    int stop;        /* under lock: the reaper exits once the queue is empty */
    int self_free;   /* under lock: the reaper frees this struct when it exits */
    ts_pending *head; /* owns: the queue, oldest first */
    ts_pending *tail;
    CUevent *pool;    /* owns: idle events for releases */
    uint32_t pool_n;
    uint32_t pool_cap;
};

/* ==========================================================================
 * Context and life cycle
 * ========================================================================== */

/* Make the device's primary context current on this thread. */
static ts_status ts_gpu_enter(const ts_gpu *g, ts_err *err)
{
    CUresult rc = g->api->CtxPushCurrent(g->ctx);
    if (rc != CUDA_SUCCESS) return ts_cuda_fail(g->api, err, rc, "cuCtxPushCurrent");
    return TS_OK;
}

/* Undo ts_gpu_enter. */
static void ts_gpu_leave(const ts_gpu *g)
{
    CUcontext ignored;
    g->api->CtxPopCurrent(&ignored);
}

/* A driver call that failed while setting the GPU ring up means the GPU path cannot work
 * here: GPUUnavailable, with the driver's words kept, so that callers fall back to the
 * host ring. Out of device memory stays a CUDA error: its message names the knobs. */
static ts_status ts_gpu_unusable(ts_err *err, ts_status st)
{
    if (st != TS_E_CUDA || err == NULL || err->sys_errno == ENOMEM) return st;
    err->code = TS_E_GPU_UNAVAILABLE;
    return TS_E_GPU_UNAVAILABLE;
}

/* Name of a compute mode other than the default. */
static const char *ts_gpu_mode_name(int mode)
{
    switch (mode) {
    case CU_COMPUTEMODE_PROHIBITED: return "PROHIBITED (no process may create a context on it)";
    case CU_COMPUTEMODE_EXCLUSIVE_PROCESS:
        return "EXCLUSIVE_PROCESS (one process at a time may use it, and the producer and "
               "every consumer on it each need one)";
    default: return "not DEFAULT";
    }
}

/* New state for device ordinal (primary context retained). */
static ts_gpu *ts_gpu_new(ts_cuda_api *api, int ordinal, uint32_t slots, int is_producer,
                          ts_err *err)
{
    ts_gpu *g = calloc(1, sizeof *g);
    if (g == NULL) {
        ts_err_set(err, TS_E_SYS, ENOMEM, "out of memory");
        return NULL;
    }
    g->ptr = calloc(slots, sizeof *g->ptr);
    g->event = calloc(slots, sizeof *g->event);
    g->copied = calloc(slots, sizeof *g->copied);
    g->recorded = calloc(slots, 1);
    if (g->ptr == NULL || g->event == NULL || g->copied == NULL || g->recorded == NULL) {
        free(g->ptr);
        free(g->event);
        free(g->copied);
        free(g->recorded);
        free(g);
        ts_err_set(err, TS_E_SYS, ENOMEM, "out of memory");
        return NULL;
    }
    pthread_mutex_init(&g->lock, NULL);
    pthread_cond_init(&g->cond, NULL);
    g->slot_count = slots;
    g->is_producer = is_producer;
    g->importer = -1;
    g->ordinal = ordinal;
    int count = 0;
    CUresult rc = api->DeviceGetCount(&count);
    if (rc != CUDA_SUCCESS) {
        ts_cuda_fail(api, err, rc, "cuDeviceGetCount");
        goto error;
    }
    if (ordinal < 0 || ordinal >= count) {
        ts_err_set(err, TS_E_GPU_UNAVAILABLE, 0,
                   "there is no CUDA device %d (this process sees %d; check "
                   "CUDA_VISIBLE_DEVICES)",
                   ordinal, count);
        goto error;
    }
    rc = api->DeviceGet(&g->dev, ordinal);
    if (rc != CUDA_SUCCESS) {
        ts_cuda_fail(api, err, rc, "cuDeviceGet");
        goto error;
    }
    /* The pool's GPU is shared by the producer and the consumers on it, each with a
     * context of its own: only the default compute mode allows that. */
    int mode = CU_COMPUTEMODE_DEFAULT;
    if (is_producer &&
        api->DeviceGetAttribute(&mode, CU_DEVICE_ATTRIBUTE_COMPUTE_MODE, g->dev) ==
            CUDA_SUCCESS &&
        mode != CU_COMPUTEMODE_DEFAULT) {
        ts_err_set(err, TS_E_GPU_UNAVAILABLE, 0,
                   "GPU %d is in compute mode %s: the GPU ring needs the DEFAULT mode "
                   "(nvidia-smi -i %d -c DEFAULT)",
                   ordinal, ts_gpu_mode_name(mode), ordinal);
        goto error;
    }
    rc = api->DevicePrimaryCtxRetain(&g->ctx, g->dev);
    if (rc != CUDA_SUCCESS) {
        ts_cuda_fail(api, err, rc, "cuDevicePrimaryCtxRetain");
        goto error;
    }
    ts_cuda_ref(api);
    g->api = api;
    return g;

error:
    if (err != NULL) ts_gpu_unusable(err, err->code);
    pthread_mutex_destroy(&g->lock);
    pthread_cond_destroy(&g->cond);
    free(g->ptr);
    free(g->event);
    free(g->copied);
    free(g->recorded);
    free(g);
    return NULL;
}

/* Release every CUDA resource the state holds, and the driver. */
static void ts_gpu_teardown(ts_gpu *g)
{
    if (g->api == NULL) return;
    const ts_cuda_api *api = g->api;
    int entered = ts_gpu_enter(g, NULL) == TS_OK;
    if (entered) {
        if (g->stream != NULL) api->StreamSynchronize(g->stream);
        for (uint32_t i = 0; i < g->pool_n; i++) api->EventDestroy(g->pool[i]);
        g->pool_n = 0;
        for (uint32_t k = 0; k < g->slot_count; k++) {
            if (g->event[k] != NULL) api->EventDestroy(g->event[k]);
            if (g->copied[k] != NULL) api->EventDestroy(g->copied[k]);
            if (g->ptr[k] == 0) continue;
            if (g->is_producer) api->MemFree(g->ptr[k]);
            else api->IpcCloseMemHandle(g->ptr[k]);
        }
        if (g->pinned != NULL) api->MemHostUnregister(g->pinned);
        if (g->stream != NULL) api->StreamDestroy(g->stream);
        ts_gpu_leave(g);
    }
    /* Our mappings are closed: the producer may free the pool. */
    if (g->importer >= 0) ts_ring_drop_importer(g->hdr, g->importer);
    g->importer = -1;
    memset(g->event, 0, g->slot_count * sizeof *g->event);
    memset(g->copied, 0, g->slot_count * sizeof *g->copied);
    memset(g->ptr, 0, g->slot_count * sizeof *g->ptr);
    g->pinned = NULL;
    g->stream = NULL;
    g->api->DevicePrimaryCtxRelease(g->dev);
    ts_cuda_unref(g->api);
    g->api = NULL;
}

/* Free the struct itself (after ts_gpu_teardown). */
static void ts_gpu_free_struct(ts_gpu *g)
{
    pthread_mutex_destroy(&g->lock);
    pthread_cond_destroy(&g->cond);
    free(g->pool);
    free(g->ptr);
    free(g->event);
    free(g->copied);
    free(g->recorded);
    free(g);
}

static void *ts_gpu_reaper_main(void *arg);

/* Free the ring's GPU state (from ts_ring_free; any thread). */
void ts_gpu_close(ts_ring *ring)
{
    ts_gpu *g = ring->gpu;
    if (g == NULL) return;
    ring->gpu = NULL;
    if (g->reaper_started) {
        pthread_mutex_lock(&g->lock);
        g->stop = 1;
        if (pthread_equal(pthread_self(), g->reaper)) {
            /* The reaper dropped the last ring reference: it frees the struct
             * on its way out; the CUDA resources go now. */
            g->self_free = 1;
            pthread_mutex_unlock(&g->lock);
            pthread_detach(g->reaper);
            ts_gpu_teardown(g);
            return;
        }
        pthread_cond_signal(&g->cond);
        pthread_mutex_unlock(&g->lock);
        pthread_join(g->reaper, NULL);
    }
    ts_gpu_teardown(g);
    ts_gpu_free_struct(g);
}

/* ==========================================================================
 * Producer
 * ========================================================================== */

/* Turn a failed export of the first slot into the reason the GPU path cannot work. */
static ts_status ts_gpu_ipc_unsupported(const ts_gpu *g, ts_err *err, CUresult rc,
                                        const char *what)
{
    ts_cuda_fail(g->api, err, rc, what);
    if (rc == CUDA_ERROR_NOT_SUPPORTED || rc == CUDA_ERROR_INVALID_VALUE) {
        char detail[sizeof err->msg] = "";
        if (err != NULL) snprintf(detail, sizeof detail, "%s", err->msg);
        ts_err_set(err, TS_E_GPU_UNAVAILABLE, 0,
                   "CUDA IPC is not supported on GPU %d (MIG instances and some virtual "
                   "GPUs have none): %s",
                   g->ordinal, detail);
    }
    return err != NULL ? err->code : TS_E_CUDA;
}

/* Allocate the device pool of a new CUDA ring (see ts_gpu.h). */
ts_status ts_gpu_create_pool(ts_ring *ring, ts_cuda_api *api, int ordinal, ts_err *err)
{
    ts_status st = TS_OK;
    ts_header *h = ring->hdr;
    CUresult rc;
    int entered = 0;
    if (ring->gpu != NULL) return ts_err_set(err, TS_E_INVALID, 0, "the pool exists already");
    ts_gpu *g = ts_gpu_new(api, ordinal, h->slot_count, 1, err);
    if (g == NULL) return err != NULL ? err->code : TS_E_GPU_UNAVAILABLE;

    int ipc_events = 0;
    rc = api->DeviceGetAttribute(&ipc_events, CU_DEVICE_ATTRIBUTE_IPC_EVENT_SUPPORTED, g->dev);
    if (rc != CUDA_SUCCESS || !ipc_events) {
        st = ts_err_set(err, TS_E_GPU_UNAVAILABLE, 0,
                        "GPU %d does not support CUDA IPC events (a MIG instance?), which the "
                        "GPU ring needs to order consumers after the producer's copies",
                        ordinal);
        goto error;
    }
    CUuuid uuid;
    rc = api->DeviceGetUuid(&uuid, g->dev);
    if (rc != CUDA_SUCCESS) {
        st = ts_cuda_fail(api, err, rc, "cuDeviceGetUuid");
        goto error;
    }
    memcpy(h->device_uuid, uuid.bytes, sizeof h->device_uuid);

    st = ts_gpu_enter(g, err);
    if (st != TS_OK) goto error;
    entered = 1;
    rc = api->StreamCreate(&g->stream, CU_STREAM_NON_BLOCKING);
    if (rc != CUDA_SUCCESS) {
        st = ts_cuda_fail(api, err, rc, "cuStreamCreate");
        goto error;
    }
    for (uint32_t k = 0; k < h->slot_count; k++) {
        ts_ipc_entry *e = ts_ring_ipc_entry(ring, k);
        rc = api->MemAlloc(&g->ptr[k], (size_t)h->slot_bytes);
        if (rc != CUDA_SUCCESS) {
            g->ptr[k] = 0;
            st = ts_cuda_fail(api, err, rc, "cuMemAlloc of a ring slot");
            if (rc == CUDA_ERROR_OUT_OF_MEMORY)
                st = ts_err_set(err, TS_E_CUDA, ENOMEM,
                                "GPU %d has no room for %u ring slots of %llu bytes (slot %u "
                                "failed): lower ring_slots= or slot_bytes=",
                                ordinal, h->slot_count, (unsigned long long)h->slot_bytes, k);
            goto error;
        }
        CUipcMemHandle mh;
        rc = api->IpcGetMemHandle(&mh, g->ptr[k]);
        if (rc != CUDA_SUCCESS) {
            st = ts_gpu_ipc_unsupported(g, err, rc, "cuIpcGetMemHandle");
            goto error;
        }
        memcpy(e->mem, mh.reserved, sizeof e->mem);
        rc = api->EventCreate(&g->event[k], CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING);
        if (rc != CUDA_SUCCESS) {
            g->event[k] = NULL;
            st = ts_gpu_ipc_unsupported(g, err, rc, "cuEventCreate(CU_EVENT_INTERPROCESS)");
            goto error;
        }
        CUipcEventHandle eh;
        rc = api->IpcGetEventHandle(&eh, g->event[k]);
        if (rc != CUDA_SUCCESS) {
            st = ts_gpu_ipc_unsupported(g, err, rc, "cuIpcGetEventHandle");
            goto error;
        }
        memcpy(e->event, eh.reserved, sizeof e->event);
        /* The interprocess event cannot be waited on without spinning; this one sleeps. */
        rc = api->EventCreate(&g->copied[k], CU_EVENT_DISABLE_TIMING | CU_EVENT_BLOCKING_SYNC);
        if (rc != CUDA_SUCCESS) {
            g->copied[k] = NULL;
            st = ts_cuda_fail(api, err, rc, "cuEventCreate");
            goto error;
        }
    }
    /* Page-locked host slots make each batch's copy one asynchronous DMA. If
     * the system refuses (locked-memory limits), copies from pageable memory
     * still work, only slower. */
    if (api->MemHostRegister(ring->data, ring->data_bytes, CU_MEMHOSTREGISTER_PORTABLE) ==
        CUDA_SUCCESS) {
        g->pinned = ring->data;
        h->host_pinned = 1;
    }
    ts_gpu_leave(g);
    ring->gpu = g;
    return TS_OK;

error:
    if (entered) ts_gpu_leave(g);
    ts_gpu_teardown(g);
    ts_gpu_free_struct(g);
    return ts_gpu_unusable(err, st);
}

/* Wait until the last copy out of the slot's host data has finished. */
ts_status ts_gpu_prepare_slot(ts_ring *ring, uint32_t slot, ts_err *err)
{
    ts_gpu *g = ring->gpu;
    if (g == NULL || !g->recorded[slot]) return TS_OK;
    ts_status st = ts_gpu_enter(g, err);
    if (st != TS_OK) return st;
    CUresult rc = g->api->EventSynchronize(g->copied[slot]);
    ts_gpu_leave(g);
    if (rc != CUDA_SUCCESS) return ts_cuda_fail(g->api, err, rc, "cuEventSynchronize");
    return TS_OK;
}

/* Copy the slot's tensors to the device and record its event. */
ts_status ts_gpu_publish_slot(ts_ring *ring, uint32_t slot, uint64_t bytes, ts_err *err)
{
    ts_gpu *g = ring->gpu;
    if (g == NULL) return ts_err_set(err, TS_E_INVALID, 0, "this ring has no device pool");
    ts_status st = ts_gpu_enter(g, err);
    if (st != TS_OK) return st;
    CUresult rc = CUDA_SUCCESS;
    if (bytes > 0)
        rc = g->api->MemcpyHtoDAsync(g->ptr[slot], ts_ring_slot_data(ring, slot), (size_t)bytes,
                                     g->stream);
    if (rc != CUDA_SUCCESS) {
        st = ts_cuda_fail(g->api, err, rc, "cuMemcpyHtoDAsync of a batch");
    } else {
        rc = g->api->EventRecord(g->event[slot], g->stream);
        if (rc == CUDA_SUCCESS) rc = g->api->EventRecord(g->copied[slot], g->stream);
        if (rc != CUDA_SUCCESS) st = ts_cuda_fail(g->api, err, rc, "cuEventRecord");
        else g->recorded[slot] = 1;
    }
    ts_gpu_leave(g);
    return st;
}

/* ==========================================================================
 * Consumer: importing the pool
 * ========================================================================== */

/* State of a consumer handle, made on first use with device ordinal. */
static ts_gpu *ts_gpu_consumer_state(ts_ring *ring, ts_cuda_api *api, int ordinal, ts_err *err)
{
    if (ring->gpu != NULL) {
        if (ring->gpu->ordinal == ordinal) return ring->gpu;
        ts_err_set(err, TS_E_INVALID, 0,
                   "this consumer already uses the ring on GPU %d, not GPU %d",
                   ring->gpu->ordinal, ordinal);
        return NULL;
    }
    ring->gpu = ts_gpu_new(api, ordinal, ring->hdr->slot_count, 0, err);
    if (ring->gpu != NULL) ring->gpu->hdr = ring->hdr;
    return ring->gpu;
}

static void *ts_gpu_reaper_main(void *arg);

/* Open every slot's memory and event handle on device ordinal. */
ts_status ts_gpu_import(ts_ring *ring, ts_cuda_api *api, int ordinal, ts_err *err)
{
    ts_status st = TS_OK;
    const ts_header *h = ring->hdr;
    CUresult rc;
    if (h->ipc_offset == 0)
        return ts_err_set(err, TS_E_INVALID, 0, "the producer's ring holds no GPU memory");
    if (ring->is_producer)
        return ts_err_set(err, TS_E_INVALID, 0,
                          "the producer's own handle cannot import its GPU ring (CUDA IPC "
                          "handles open only in other processes)");
    uint64_t ns = ts_proc_pid_ns();
    if (h->pid_ns != 0 && ns != 0 && h->pid_ns != ns)
        return ts_err_set(err, TS_E_GPU_UNAVAILABLE, 0,
                          "the producer runs in another PID namespace (a container without a "
                          "shared --pid): CUDA IPC handles do not work across PID namespaces");
    ts_gpu *g = ts_gpu_consumer_state(ring, api, ordinal, err);
    if (g == NULL) return err != NULL ? err->code : TS_E_GPU_UNAVAILABLE;
    if (g->imported) return TS_OK;

    CUuuid mine;
    rc = api->DeviceGetUuid(&mine, g->dev);
    if (rc != CUDA_SUCCESS)
        return ts_gpu_unusable(err, ts_cuda_fail(api, err, rc, "cuDeviceGetUuid"));
    /* Another GPU than the pool's reads it through peer access. The flag is passed for
     * the pool's own GPU too: the driver documents it as required, and a real one (H100,
     * driver 580) refuses 0 with CUDA_ERROR_INVALID_VALUE. */
    int peer = memcmp(mine.bytes, h->device_uuid, sizeof mine.bytes) != 0;
    const unsigned int flags = CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS;
    /* Announce the mapping before it exists: the producer never frees under it. */
    g->importer = ts_ring_add_importer(ring);
    if (g->importer < 0)
        return ts_err_set(err, TS_E_FULL, 0, "too many processes map this GPU ring");
    st = ts_gpu_enter(g, err);
    if (st != TS_OK) {
        ts_ring_drop_importer(ring->hdr, g->importer);
        g->importer = -1;
        return ts_gpu_unusable(err, st);
    }
    uint32_t k = 0;
    for (; k < h->slot_count; k++) {
        const ts_ipc_entry *e = ts_ring_ipc_entry(ring, k);
        CUipcMemHandle mh;
        CUipcEventHandle eh;
        memcpy(mh.reserved, e->mem, sizeof mh.reserved);
        memcpy(eh.reserved, e->event, sizeof eh.reserved);
        rc = api->IpcOpenMemHandle(&g->ptr[k], mh, flags);
        if (rc != CUDA_SUCCESS) {
            g->ptr[k] = 0;
            st = ts_cuda_fail(api, err, rc, "cuIpcOpenMemHandle of a ring slot");
            if (rc == CUDA_ERROR_INVALID_CONTEXT || rc == CUDA_ERROR_MAP_FAILED ||
                rc == CUDA_ERROR_INVALID_VALUE || rc == CUDA_ERROR_INVALID_DEVICE) {
                char detail[sizeof err->msg] = "";
                if (err != NULL) snprintf(detail, sizeof detail, "%s", err->msg);
                st = ts_err_set(err, TS_E_GPU_UNAVAILABLE, 0,
                                "cannot open the producer's GPU memory on GPU %d (%s%s)",
                                ordinal, detail,
                                peer ? "; is peer access between the two GPUs possible?"
                                      : "");
            }
            break;
        }
        rc = api->IpcOpenEventHandle(&g->event[k], eh);
        if (rc != CUDA_SUCCESS) {
            g->event[k] = NULL;
            st = ts_cuda_fail(api, err, rc, "cuIpcOpenEventHandle of a ring slot");
            break;
        }
    }
    if (st == TS_OK && pthread_create(&g->reaper, NULL, ts_gpu_reaper_main, g) != 0)
        st = ts_err_set(err, TS_E_SYS, EAGAIN, "cannot start the GPU release thread");
    if (st != TS_OK) {
        /* Close what was opened; the state stays for pin_host or another try. */
        for (uint32_t i = 0; i <= k && i < h->slot_count; i++) {
            if (g->event[i] != NULL) api->EventDestroy(g->event[i]);
            if (g->ptr[i] != 0) api->IpcCloseMemHandle(g->ptr[i]);
            g->event[i] = NULL;
            g->ptr[i] = 0;
        }
        ts_gpu_leave(g);
        ts_ring_drop_importer(ring->hdr, g->importer);
        g->importer = -1;
        return ts_gpu_unusable(err, st);
    }
    ts_gpu_leave(g);
    g->reaper_started = 1;
    g->imported = 1;
    return TS_OK;
}

/* Page-lock this process's mapping of the host slot data. */
ts_status ts_gpu_pin_host(ts_ring *ring, ts_cuda_api *api, int ordinal, ts_err *err)
{
    if (ring->is_producer)
        return ts_err_set(err, TS_E_INVALID, 0, "the producer's slots are page-locked already");
    ts_gpu *g = ts_gpu_consumer_state(ring, api, ordinal, err);
    if (g == NULL) return err != NULL ? err->code : TS_E_GPU_UNAVAILABLE;
    if (g->pinned != NULL) return TS_OK;
    /* Remapping a slot private on a write (ts_fault.h) would replace pages the driver has
     * locked: a registered mapping stays shared, and a write into it is stopped as before. */
    if (ts_fault_forbid(&ring->cow) != 0)
        return ts_err_set(err, TS_E_INVALID, EBUSY,
                          "cannot page-lock the ring: this process has written into a batch "
                          "it still holds (pin the ring before taking batches)");
    ts_status st = ts_gpu_enter(g, err);
    if (st != TS_OK) {
        st = ts_gpu_unusable(err, st);
        goto error;
    }
    /* A consumer maps the slots read-only, and such memory registers only read-only. */
    CUresult rc = api->MemHostRegister(ring->data, ring->data_bytes,
                                       CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_READ_ONLY);
    ts_gpu_leave(g);
    if (rc != CUDA_SUCCESS) {
        int read_only = 1;
        api->DeviceGetAttribute(&read_only, CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED,
                                g->dev);
        if (!read_only)
            st = ts_err_set(err, TS_E_GPU_UNAVAILABLE, 0,
                            "GPU %d cannot page-lock read-only memory "
                            "(CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED is 0), "
                            "and a consumer maps the ring read-only",
                            ordinal);
        else
            st = ts_gpu_unusable(err, ts_cuda_fail(api, err, rc, "cuMemHostRegister of the ring"));
        goto error;
    }
    g->pinned = ring->data;
    return TS_OK;

error:
    ts_fault_allow(&ring->cow); /* not page-locked: writes may be made private again */
    return st;
}

/* The ordinal the pool was imported on, or -1. */
int ts_gpu_imported_device(const ts_ring *ring)
{
    return ring->gpu != NULL && ring->gpu->imported ? ring->gpu->ordinal : -1;
}

/* 1 if this process's mapping of the host slot data is page-locked. */
int ts_gpu_host_pinned(const ts_ring *ring)
{
    return ring->gpu != NULL && ring->gpu->pinned != NULL;
}

/* Device address of slot data in this process (0 if not imported). */
CUdeviceptr ts_gpu_slot_ptr(const ts_ring *ring, uint32_t slot)
{
    if (ring->gpu == NULL || slot >= ring->gpu->slot_count) return 0;
    return ring->gpu->ptr[slot];
}

/* Make stream wait for the slot's content (its event). */
ts_status ts_gpu_stream_wait(ts_ring *ring, uint32_t slot, CUstream stream, ts_err *err)
{
    ts_gpu *g = ring->gpu;
    ts_status st = ts_gpu_enter(g, err);
    if (st != TS_OK) return st;
    CUresult rc = g->api->StreamWaitEvent(stream, g->event[slot], 0);
    ts_gpu_leave(g);
    if (rc != CUDA_SUCCESS) return ts_cuda_fail(g->api, err, rc, "cuStreamWaitEvent");
    return TS_OK;
}

/* A private device copy of n bytes at src, made on stream. */
ts_status ts_gpu_copy(ts_ring *ring, CUdeviceptr src, uint64_t n, CUstream stream,
                      CUdeviceptr *out, ts_err *err)
{
    ts_gpu *g = ring->gpu;
    ts_status st = ts_gpu_enter(g, err);
    if (st != TS_OK) return st;
    CUresult rc = g->api->MemAlloc(out, (size_t)(n > 0 ? n : 1));
    if (rc != CUDA_SUCCESS) {
        st = ts_cuda_fail(g->api, err, rc, "cuMemAlloc for copy=True");
    } else if (n > 0) {
        rc = g->api->MemcpyDtoDAsync(*out, src, (size_t)n, stream);
        if (rc != CUDA_SUCCESS) {
            st = ts_cuda_fail(g->api, err, rc, "cuMemcpyDtoDAsync for copy=True");
            g->api->MemFree(*out);
        }
    }
    ts_gpu_leave(g);
    return st;
}

/* Free a copy made by ts_gpu_copy (cuMemFree waits for work using it). */
void ts_gpu_free_copy(ts_ring *ring, CUdeviceptr p)
{
    ts_gpu *g = ring->gpu;
    if (g == NULL || ts_gpu_enter(g, NULL) != TS_OK) return;
    g->api->MemFree(p);
    ts_gpu_leave(g);
}

/* ==========================================================================
 * Consumer: releases after the GPU is done with a slot
 * ========================================================================== */

/* An idle release event (caller holds the lock and is inside the context). */
static CUevent ts_gpu_take_event(ts_gpu *g)
{
    if (g->pool_n > 0) return g->pool[--g->pool_n];
    CUevent ev = NULL;
    /* Blocking sync: the reaper sleeps instead of spinning while it waits. */
    if (g->api->EventCreate(&ev, CU_EVENT_DISABLE_TIMING | CU_EVENT_BLOCKING_SYNC) !=
        CUDA_SUCCESS)
        return NULL;
    return ev;
}

/* Return an event to the pool (caller holds the lock). */
static void ts_gpu_give_event(ts_gpu *g, CUevent ev)
{
    if (g->pool_n == g->pool_cap) {
        uint32_t cap = g->pool_cap ? g->pool_cap * 2 : 16;
        CUevent *p = realloc(g->pool, cap * sizeof *p);
        if (p == NULL) {
            g->api->EventDestroy(ev);
            return;
        }
        g->pool = p;
        g->pool_cap = cap;
    }
    g->pool[g->pool_n++] = ev;
}

/* Release once the work queued so far on the streams has finished. */
void ts_gpu_release_after(ts_ring *ring, uint32_t slot, uint32_t consumer,
                          const CUstream *streams, uint32_t n, int all)
{
    ts_gpu *g = ring->gpu;
    ts_pending *p = NULL;
    if (g != NULL && g->reaper_started) p = calloc(1, sizeof *p);
    if (p == NULL || ts_gpu_enter(g, NULL) != TS_OK) {
        /* No reaper or no memory: wait here, then release. */
        free(p);
        if (g != NULL && ts_gpu_enter(g, NULL) == TS_OK) {
            if (all) g->api->CtxSynchronize();
            for (uint32_t i = 0; i < n; i++) g->api->StreamSynchronize(streams[i]);
            ts_gpu_leave(g);
        }
        ts_ring_release(ring, slot, consumer);
        return;
    }
    p->slot = slot;
    p->consumer = consumer;
    p->all = all;
    pthread_mutex_lock(&g->lock);
    for (uint32_t i = 0; i < n && !p->all; i++) {
        CUevent ev = ts_gpu_take_event(g);
        if (ev != NULL && g->api->EventRecord(ev, streams[i]) == CUDA_SUCCESS) {
            p->events[p->n++] = ev;
        } else {
            if (ev != NULL) ts_gpu_give_event(g, ev);
            p->all = 1; /* cannot follow this stream: wait for the whole device */
        }
    }
    ts_ring_ref(ring);
    p->ring = ring;
    if (g->tail != NULL) g->tail->next = p;
    else g->head = p;
    g->tail = p;
    pthread_cond_signal(&g->cond);
    pthread_mutex_unlock(&g->lock);
    ts_gpu_leave(g);
}

/* The reaper: waits for each pending release's events, then releases. */
static void *ts_gpu_reaper_main(void *arg)
{
    ts_gpu *g = arg;
    pthread_mutex_lock(&g->lock);
    for (;;) {
        while (g->head == NULL && !g->stop) pthread_cond_wait(&g->cond, &g->lock);
        ts_pending *p = g->head;
        if (p == NULL) break; /* stopped and nothing left */
        g->head = p->next;
        if (g->head == NULL) g->tail = NULL;
        pthread_mutex_unlock(&g->lock);

        int entered = ts_gpu_enter(g, NULL) == TS_OK;
        if (entered) {
            for (uint32_t i = 0; i < p->n; i++) g->api->EventSynchronize(p->events[i]);
            if (p->all) g->api->CtxSynchronize();
        }
        /* Inside the context: an event that does not fit back in the pool is destroyed. */
        pthread_mutex_lock(&g->lock);
        for (uint32_t i = 0; i < p->n; i++) ts_gpu_give_event(g, p->events[i]);
        pthread_mutex_unlock(&g->lock);
        if (entered) ts_gpu_leave(g);

        ts_ring *ring = p->ring;
        ts_ring_release(ring, p->slot, p->consumer);
        free(p);
        /* May be the last reference: ts_gpu_close then runs on this thread. */
        ts_ring_unref(ring);
        pthread_mutex_lock(&g->lock);
    }
    int self_free = g->self_free;
    pthread_mutex_unlock(&g->lock);
    if (self_free) ts_gpu_free_struct(g);
    return NULL;
}
