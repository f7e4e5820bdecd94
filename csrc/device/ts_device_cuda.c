/* ts_device_cuda.c - the CUDA backend of the device interface (ts_device.h).
 *
 * Producer (CUDA ring): a pool of device memory, one cuMemAlloc per slot (a base
 * allocation, so its IPC handle is valid), one interprocess event per slot, both exported
 * once into the segment's IPC table; a copy stream; the host slot data page-locked so that
 * each batch's copy to the device is a single asynchronous DMA.
 *
 * Consumer: every slot's memory and event handle opened once (never in the exporting
 * process) on the device the consumer asked for, with lazy peer access when that is another
 * GPU than the pool's. A slot exported to the device (or read through the page-locked host
 * mapping) is released only after all work of the consumer's context queued before its
 * release was flushed has finished: the last view's deleter queues the release, the
 * consumer's next call flushes the queue with one context-wide event, and a reaper thread
 * calls the ring back when the event completes (see "Consumer: releases" below).
 * Optionally the consumer's mapping of the host slot data is page-locked (cuMemHostRegister,
 * read-only) so its own copies to a GPU are asynchronous without pin_memory.
 *
 * Every function pushes the device's primary context (the one torch uses) on the calling
 * thread and pops it again, so any thread may call them, including DLPack deleters without
 * the GIL. Nothing here knows the ring: what it needs of it comes in a ts_device_ring. */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "device/ts_cuda_api.h"
#include "device/ts_device.h"

/* A queued release of a slot, or free of a private device copy. */
typedef struct ts_pending {
    struct ts_pending *next;
    ts_device_done_fn done; /* called once the work queued before the flush finished */
    void *arg;              /* for done (the ring's, holding what it needs) */
    uint32_t slot;
    uint32_t consumer;
    uint64_t token;       /* the incarnation that took the hold, for done */
    CUdeviceptr free_ptr; /* owns: a copy=True allocation to free then, or 0 */
} ts_pending;

/* One flush: the releases it took, and what the reaper waits for before them. */
typedef struct ts_flush {
    struct ts_flush *next;
    CUevent event;      /* owns (from the pool): all work of the context at the flush;
                         * NULL: the flush synchronized the context itself */
    int failed;         /* the flush's context synchronize failed: the slots stay held */
    ts_pending *items;  /* owns: the releases, oldest first */
} ts_flush;

typedef struct ts_gpu {
    ts_device_state base; /* first member: device, ordinal, imported, host_pinned */
    ts_cuda_api *api;     /* owns one reference */
    CUdevice dev;
    CUcontext ctx; /* owns: a retain of dev's primary context */
    int is_producer;
    uint32_t slot_count;
    CUdeviceptr *ptr; /* owns: producer's allocations, consumer's opened mappings */
    CUevent *event;   /* owns: producer's events, consumer's opened events */
    CUevent *copied;  /* owns (producer): local blocking-sync events, recorded with event */
    uint8_t *recorded; /* producer: the slot's event was recorded at least once */
    CUstream stream;   /* owns (producer): the copy stream */
    void *pinned;      /* borrowed: the page-locked host range (the ring's data mapping) */

    /* Consumer: deferred releases. Deleters queue them (unflushed), a flush on the
     * consumer's thread hands them to the reaper thread as one ts_flush. */
    pthread_mutex_t lock;
    pthread_cond_t cond;  /* a flush was queued, stop, or the queue drained */
    pthread_t reaper;
    int reaper_started;
    int stop;        /* under lock: the reaper exits once the queue is empty */
    int self_free;   /* under lock: the reaper frees this struct when it exits */
    int busy;        /* under lock: the reaper is working on a flush it took */
    int orphaned;    /* under lock: the consumer's handle is closed, nobody flushes any
                      * more: the reaper flushes what deleters queue by itself */
    ts_pending *unflushed; /* owns, under lock: queued by deleters, newest first */
    ts_flush *head;  /* owns, under lock: flushes for the reaper, oldest first */
    ts_flush *tail;
    int failed;      /* under lock: a release's wait failed (sticky) */
    char failure[sizeof(((ts_err *)0)->msg)]; /* under lock: what failed, for flush */
    CUevent *pool;    /* owns: idle events for flushes */
    uint32_t pool_n;
    uint32_t pool_cap;
} ts_gpu;

/* The backend's state behind the interface's (base is its first member). */
static ts_gpu *ts_gpu_of(ts_device_state *state)
{
    return (ts_gpu *)state;
}

/* Const version of ts_gpu_of. */
static const ts_gpu *ts_gpu_of_const(const ts_device_state *state)
{
    return (const ts_gpu *)state;
}

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
    g->base.device = &ts_device_cuda;
    g->base.ordinal = ordinal;
    g->slot_count = slots;
    g->is_producer = is_producer;
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

/* Release every CUDA resource the state holds, and the driver. A producer's state comes
 * here only once no other process maps its pool (ts_device.h, close): the driver says
 * "Calling cuMemFree on an exported memory region before calling cuIpcCloseMemHandle in
 * the importing context will result in undefined behavior" (cuIpcOpenMemHandle), and
 * "Memory returned from cuIpcOpenMemHandle must be freed with cuIpcCloseMemHandle", which
 * the consumer's teardown does for each slot it opened. */
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
    memset(g->event, 0, g->slot_count * sizeof *g->event);
    memset(g->copied, 0, g->slot_count * sizeof *g->copied);
    memset(g->ptr, 0, g->slot_count * sizeof *g->ptr);
    g->pinned = NULL;
    g->base.imported = 0;
    g->base.host_pinned = 0;
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

/* Free the state (the ring's last reference went; any thread, the reaper's too). */
static void ts_gpu_close(ts_device_state *state)
{
    ts_gpu *g = ts_gpu_of(state);
    if (g == NULL) return;
    if (g->reaper_started) {
        pthread_mutex_lock(&g->lock);
        g->stop = 1;
        if (pthread_equal(pthread_self(), g->reaper)) {
            /* The reaper's callback dropped the last ring reference: it frees the
             * struct on its way out; the CUDA resources go now. */
            g->self_free = 1;
            pthread_mutex_unlock(&g->lock);
            pthread_detach(g->reaper);
            ts_gpu_teardown(g);
            return;
        }
        pthread_cond_broadcast(&g->cond); /* drain waiters share the condition */
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
                   g->base.ordinal, detail);
    }
    return err != NULL ? err->code : TS_E_CUDA;
}

/* Whether the pool's GPU can carry a ring (interprocess events), and its UUID into
 * r->uuid for consumers to find it by. */
static ts_status ts_gpu_check_pool_device(ts_gpu *g, const ts_device_ring *r, ts_err *err)
{
    ts_cuda_api *api = g->api;
    int ipc_events = 0;
    CUresult rc =
        api->DeviceGetAttribute(&ipc_events, CU_DEVICE_ATTRIBUTE_IPC_EVENT_SUPPORTED, g->dev);
    if (rc != CUDA_SUCCESS || !ipc_events)
        return ts_err_set(err, TS_E_GPU_UNAVAILABLE, 0,
                          "GPU %d does not support CUDA IPC events (a MIG instance?), which "
                          "the GPU ring needs to order consumers after the producer's copies",
                          g->base.ordinal);
    CUuuid uuid;
    rc = ts_cuda_device_uuid(api, &uuid, g->dev);
    if (rc != CUDA_SUCCESS) return ts_cuda_fail(api, err, rc, ts_cuda_uuid_call(api));
    memcpy(r->uuid, uuid.bytes, sizeof uuid.bytes);
    return TS_OK;
}

/* Allocate slot k's device memory and events and export their IPC handles into r->ipc[k]
 * (context entered). What it made is in g either way, for ts_gpu_teardown. */
static ts_status ts_gpu_export_slot(ts_gpu *g, const ts_device_ring *r, uint32_t k,
                                    ts_err *err)
{
    ts_cuda_api *api = g->api;
    ts_device_ipc *e = &r->ipc[k];
    CUresult rc = api->MemAlloc(&g->ptr[k], (size_t)r->slot_bytes);
    if (rc != CUDA_SUCCESS) {
        g->ptr[k] = 0;
        ts_status st = ts_cuda_fail(api, err, rc, "cuMemAlloc of a ring slot");
        if (rc != CUDA_ERROR_OUT_OF_MEMORY) return st;
        return ts_err_set(err, TS_E_CUDA, ENOMEM,
                          "GPU %d has no room for %u ring slots of %llu bytes (slot %u "
                          "failed): lower ring_slots= or slot_bytes=",
                          g->base.ordinal, r->slot_count, (unsigned long long)r->slot_bytes, k);
    }
    CUipcMemHandle mh;
    rc = api->IpcGetMemHandle(&mh, g->ptr[k]);
    if (rc != CUDA_SUCCESS) return ts_gpu_ipc_unsupported(g, err, rc, "cuIpcGetMemHandle");
    memcpy(e->mem, mh.reserved, sizeof e->mem);
    rc = api->EventCreate(&g->event[k], CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING);
    if (rc != CUDA_SUCCESS) {
        g->event[k] = NULL;
        return ts_gpu_ipc_unsupported(g, err, rc, "cuEventCreate(CU_EVENT_INTERPROCESS)");
    }
    CUipcEventHandle eh;
    rc = api->IpcGetEventHandle(&eh, g->event[k]);
    if (rc != CUDA_SUCCESS) return ts_gpu_ipc_unsupported(g, err, rc, "cuIpcGetEventHandle");
    memcpy(e->event, eh.reserved, sizeof e->event);
    /* The interprocess event cannot be waited on without spinning; this one sleeps. */
    rc = api->EventCreate(&g->copied[k], CU_EVENT_DISABLE_TIMING | CU_EVENT_BLOCKING_SYNC);
    if (rc != CUDA_SUCCESS) {
        g->copied[k] = NULL;
        return ts_cuda_fail(api, err, rc, "cuEventCreate");
    }
    return TS_OK;
}

/* Allocate the device pool of a new CUDA ring (see ts_device.h). */
static ts_status ts_gpu_create_pool(ts_device_driver *driver, int ordinal,
                                    const ts_device_ring *r, ts_device_state **out, ts_err *err)
{
    ts_status st = TS_OK;
    ts_cuda_api *api = ts_cuda_of(driver);
    CUresult rc;
    int entered = 0;
    ts_gpu *g = ts_gpu_new(api, ordinal, r->slot_count, 1, err);
    if (g == NULL) return err != NULL ? err->code : TS_E_GPU_UNAVAILABLE;
    if ((st = ts_gpu_check_pool_device(g, r, err)) != TS_OK) goto error;
    st = ts_gpu_enter(g, err);
    if (st != TS_OK) goto error;
    entered = 1;
    rc = api->StreamCreate(&g->stream, CU_STREAM_NON_BLOCKING);
    if (rc != CUDA_SUCCESS) {
        st = ts_cuda_fail(api, err, rc, "cuStreamCreate");
        goto error;
    }
    for (uint32_t k = 0; k < r->slot_count; k++)
        if ((st = ts_gpu_export_slot(g, r, k, err)) != TS_OK) goto error;
    /* Page-locked host slots make each batch's copy one asynchronous DMA. If
     * the system refuses (locked-memory limits), copies from pageable memory
     * still work, only slower. */
    if (api->MemHostRegister(r->host, r->host_bytes, CU_MEMHOSTREGISTER_PORTABLE) ==
        CUDA_SUCCESS) {
        g->pinned = r->host;
        g->base.host_pinned = 1;
    }
    ts_gpu_leave(g);
    *out = &g->base;
    return TS_OK;

error:
    if (entered) ts_gpu_leave(g);
    ts_gpu_teardown(g);
    ts_gpu_free_struct(g);
    return ts_gpu_unusable(err, st);
}

/* Wait until the last copy out of the slot's host data has finished. */
static ts_status ts_gpu_prepare(ts_device_state *state, uint32_t slot, ts_err *err)
{
    ts_gpu *g = ts_gpu_of(state);
    if (!g->recorded[slot]) return TS_OK;
    ts_status st = ts_gpu_enter(g, err);
    if (st != TS_OK) return st;
    CUresult rc = g->api->EventSynchronize(g->copied[slot]);
    ts_gpu_leave(g);
    if (rc != CUDA_SUCCESS) return ts_cuda_fail(g->api, err, rc, "cuEventSynchronize");
    return TS_OK;
}

/* Copy the slot's tensors to the device and record its event. */
static ts_status ts_gpu_publish(ts_device_state *state, uint32_t slot, const void *host,
                                uint64_t bytes, ts_err *err)
{
    ts_gpu *g = ts_gpu_of(state);
    ts_status st = ts_gpu_enter(g, err);
    if (st != TS_OK) return st;
    CUresult rc = CUDA_SUCCESS;
    if (bytes > 0)
        rc = g->api->MemcpyHtoDAsync(g->ptr[slot], host, (size_t)bytes, g->stream);
    if (rc != CUDA_SUCCESS) {
        st = ts_cuda_fail(g->api, err, rc, "cuMemcpyHtoDAsync of a batch");
    } else {
        rc = g->api->EventRecord(g->event[slot], g->stream);
        if (rc == CUDA_SUCCESS) rc = g->api->EventRecord(g->copied[slot], g->stream);
        if (rc != CUDA_SUCCESS) st = ts_cuda_fail(g->api, err, rc, "cuEventRecord");
        else g->recorded[slot] = 1;
    }
    /* The ring publishes the slot once this returns: wait for the copy (the blocking-sync
     * event sleeps), so that the batch is on the device before any consumer sees it, and
     * a read on any stream of theirs, ordered by nothing of ours, finds it whole. The
     * caller released the GIL. */
    if (st == TS_OK) {
        rc = g->api->EventSynchronize(g->copied[slot]);
        if (rc != CUDA_SUCCESS)
            st = ts_cuda_fail(g->api, err, rc, "cuEventSynchronize of a batch's copy");
    }
    ts_gpu_leave(g);
    return st;
}

/* ==========================================================================
 * Consumer: importing the pool
 * ========================================================================== */

/* A consumer's state on device ordinal (see ts_device.h). */
static ts_status ts_gpu_open(ts_device_driver *driver, int ordinal, uint32_t slot_count,
                             ts_device_state **out, ts_err *err)
{
    ts_gpu *g = ts_gpu_new(ts_cuda_of(driver), ordinal, slot_count, 0, err);
    if (g == NULL) return err != NULL ? err->code : TS_E_GPU_UNAVAILABLE;
    *out = &g->base;
    return TS_OK;
}

static void *ts_gpu_reaper_main(void *arg);

/* "GPU <ordinal> (<name>)" of a visible device, into buf. */
static const char *ts_gpu_label(const ts_cuda_api *api, CUdevice dev, int ordinal, char *buf,
                                size_t n)
{
    char name[128] = "";
    if (api->DeviceGetName(name, (int)sizeof name - 1, dev) != CUDA_SUCCESS) name[0] = '\0';
    snprintf(buf, n, "GPU %d (%s)", ordinal, name[0] ? name : "unnamed");
    return buf;
}

/* Whether this consumer's GPU can map the memory of the pool's GPU, another one: TS_OK if
 * it can, or if the pool's GPU is not visible here (the driver decides then: it "can open
 * handles to devices that may not be visible in the process calling the API",
 * cudaIpcOpenMemHandle's documentation); GPUUnavailable naming both GPUs if
 * cuDeviceCanAccessPeer says it cannot. The driver documents that "cuDeviceCanAccessPeer
 * can determine if a mapping is possible" (cuIpcOpenMemHandle), and that it gives "1 if
 * contexts on dev are capable of directly accessing memory from contexts on peerDev and 0
 * otherwise". */
static ts_status ts_gpu_check_peer(const ts_gpu *g, const uint8_t *pool_uuid, ts_err *err)
{
    const ts_cuda_api *api = g->api;
    CUuuid u;
    memcpy(u.bytes, pool_uuid, sizeof u.bytes);
    int pool_ordinal = ts_cuda_find_device(api, &u);
    CUdevice pool_dev;
    if (pool_ordinal < 0 || api->DeviceGet(&pool_dev, pool_ordinal) != CUDA_SUCCESS)
        return TS_OK;
    int can = 0;
    CUresult rc = api->DeviceCanAccessPeer(&can, g->dev, pool_dev);
    if (rc != CUDA_SUCCESS)
        return ts_gpu_unusable(err, ts_cuda_fail(api, err, rc, "cuDeviceCanAccessPeer"));
    if (can) return TS_OK;
    char mine[160], pool[160];
    return ts_err_set(err, TS_E_GPU_UNAVAILABLE, 0,
                      "%s cannot read the memory of %s, which holds the producer's ring: "
                      "cuDeviceCanAccessPeer says peer access between them is impossible "
                      "(MIG instances and GPUs without a peer link have none)",
                      ts_gpu_label(api, g->dev, g->base.ordinal, mine, sizeof mine),
                      ts_gpu_label(api, pool_dev, pool_ordinal, pool, sizeof pool));
}

/* Start the release thread once (import or pin_host: releases are deferred from then). */
static ts_status ts_gpu_start_reaper(ts_gpu *g, ts_err *err)
{
    if (g->reaper_started) return TS_OK;
    if (pthread_create(&g->reaper, NULL, ts_gpu_reaper_main, g) != 0)
        return ts_err_set(err, TS_E_SYS, EAGAIN, "cannot start the GPU release thread");
    g->reaper_started = 1;
    return TS_OK;
}

/* Open every slot's memory and event handle (see ts_device.h). */
static ts_status ts_gpu_import(ts_device_state *state, const ts_device_ring *r, ts_err *err)
{
    ts_status st = TS_OK;
    ts_gpu *g = ts_gpu_of(state);
    const ts_cuda_api *api = g->api;
    CUresult rc;
    if (g->base.imported) return TS_OK;

    /* Devices are told apart by ts_cuda_device_uuid (the _v2 UUID): two MIG instances of
     * one GPU share its v1 UUID. */
    CUuuid mine;
    rc = ts_cuda_device_uuid(api, &mine, g->dev);
    if (rc != CUDA_SUCCESS)
        return ts_gpu_unusable(err, ts_cuda_fail(api, err, rc, ts_cuda_uuid_call(api)));
    /* Another GPU than the pool's reads it through peer access, if there is any. The flag is
     * passed for the pool's own GPU too: the driver documents it as required, and a real
     * one (H100, driver 580) refuses 0 with CUDA_ERROR_INVALID_VALUE. */
    int peer = memcmp(mine.bytes, r->uuid, sizeof mine.bytes) != 0;
    if (peer && (st = ts_gpu_check_peer(g, r->uuid, err)) != TS_OK) return st;
    const unsigned int flags = CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS;
    st = ts_gpu_enter(g, err);
    if (st != TS_OK) return ts_gpu_unusable(err, st);
    uint32_t k = 0;
    for (; k < r->slot_count; k++) {
        const ts_device_ipc *e = &r->ipc[k];
        CUipcMemHandle mh;
        CUipcEventHandle eh;
        memcpy(mh.reserved, e->mem, sizeof mh.reserved);
        memcpy(eh.reserved, e->event, sizeof eh.reserved);
        rc = api->IpcOpenMemHandle(&g->ptr[k], mh, flags);
        if (rc != CUDA_SUCCESS) {
            g->ptr[k] = 0;
            st = ts_cuda_fail(api, err, rc, "cuIpcOpenMemHandle of a ring slot");
            if (rc == CUDA_ERROR_INVALID_CONTEXT || rc == CUDA_ERROR_MAP_FAILED ||
                rc == CUDA_ERROR_INVALID_VALUE || rc == CUDA_ERROR_INVALID_DEVICE ||
                rc == CUDA_ERROR_PEER_ACCESS_UNSUPPORTED) {
                char detail[sizeof err->msg] = "";
                if (err != NULL) snprintf(detail, sizeof detail, "%s", err->msg);
                st = ts_err_set(err, TS_E_GPU_UNAVAILABLE, 0,
                                "cannot open the producer's GPU memory on GPU %d (%s%s)",
                                g->base.ordinal, detail,
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
    if (st == TS_OK) st = ts_gpu_start_reaper(g, err);
    if (st != TS_OK) {
        /* Close what was opened; the state stays for pin_host or another try. */
        for (uint32_t i = 0; i <= k && i < r->slot_count; i++) {
            if (g->event[i] != NULL) api->EventDestroy(g->event[i]);
            if (g->ptr[i] != 0) api->IpcCloseMemHandle(g->ptr[i]);
            g->event[i] = NULL;
            g->ptr[i] = 0;
        }
        ts_gpu_leave(g);
        return ts_gpu_unusable(err, st);
    }
    ts_gpu_leave(g);
    g->base.imported = 1;
    return TS_OK;
}

/* Page-lock this process's mapping of the host slot data (see ts_device.h). */
static ts_status ts_gpu_pin_host(ts_device_state *state, const ts_device_ring *r, ts_err *err)
{
    ts_gpu *g = ts_gpu_of(state);
    const ts_cuda_api *api = g->api;
    if (g->pinned != NULL) return TS_OK;
    ts_status st = ts_gpu_enter(g, err);
    if (st != TS_OK) return ts_gpu_unusable(err, st);
    /* A consumer maps the slots read-only, and such memory registers only read-only. */
    CUresult rc = api->MemHostRegister(r->host, r->host_bytes,
                                       CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_READ_ONLY);
    ts_gpu_leave(g);
    if (rc != CUDA_SUCCESS) {
        int read_only = 1;
        api->DeviceGetAttribute(&read_only, CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED,
                                g->dev);
        if (!read_only)
            return ts_err_set(err, TS_E_GPU_UNAVAILABLE, 0,
                              "GPU %d cannot page-lock read-only memory "
                              "(CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED is 0), "
                              "and a consumer maps the ring read-only",
                              g->base.ordinal);
        return ts_gpu_unusable(err, ts_cuda_fail(api, err, rc, "cuMemHostRegister of the ring"));
    }
    /* Views of page-locked memory may be read by asynchronous copies: their releases
     * are deferred like device views' (ts_export.c), through the release thread. */
    ts_status started = ts_gpu_start_reaper(g, err);
    if (started != TS_OK) {
        if (ts_gpu_enter(g, NULL) == TS_OK) {
            api->MemHostUnregister(r->host);
            ts_gpu_leave(g);
        }
        return started;
    }
    g->pinned = r->host;
    g->base.host_pinned = 1;
    return TS_OK;
}

/* Device address of slot data in this process (0 if not imported). */
static uint64_t ts_gpu_slot_ptr(const ts_device_state *state, uint32_t slot)
{
    const ts_gpu *g = ts_gpu_of_const(state);
    if (slot >= g->slot_count) return 0;
    return g->ptr[slot];
}

/* The CUstream a DLPack stream number names: 1 legacy, 2 per-thread, >2 a handle; -1
 * leaves the ordering to the caller, whose work may be on any stream (the legacy stream
 * does not order non-blocking ones), and 2 is the calling thread's per-thread stream, not
 * the deleter's: a release cannot follow either, it waits for the whole context. */
static ts_status ts_gpu_dlpack_stream(int64_t number, ts_device_stream *out, int *followable,
                                      ts_err *err)
{
    if (number == 0)
        return ts_err_set(err, TS_E_INVALID, 0, "stream 0 is not a valid DLPack stream");
    CUstream s = number == -1 ? TS_CU_STREAM_LEGACY : (CUstream)(uintptr_t)number;
    *out = (ts_device_stream)s;
    *followable = number != -1 && number != 2;
    return TS_OK;
}

/* Make stream wait for the slot's content (its event). */
static ts_status ts_gpu_stream_wait(ts_device_state *state, uint32_t slot,
                                    ts_device_stream stream, ts_err *err)
{
    ts_gpu *g = ts_gpu_of(state);
    ts_status st = ts_gpu_enter(g, err);
    if (st != TS_OK) return st;
    CUresult rc = g->api->StreamWaitEvent((CUstream)stream, g->event[slot], 0);
    ts_gpu_leave(g);
    if (rc != CUDA_SUCCESS) return ts_cuda_fail(g->api, err, rc, "cuStreamWaitEvent");
    return TS_OK;
}

/* A private device copy of n bytes at src, made on stream. */
static ts_status ts_gpu_copy(ts_device_state *state, uint64_t src, uint64_t n,
                             ts_device_stream stream, uint64_t *out, ts_err *err)
{
    ts_gpu *g = ts_gpu_of(state);
    CUdeviceptr p = 0;
    ts_status st = ts_gpu_enter(g, err);
    if (st != TS_OK) return st;
    CUresult rc = g->api->MemAlloc(&p, (size_t)(n > 0 ? n : 1));
    if (rc != CUDA_SUCCESS) {
        st = ts_cuda_fail(g->api, err, rc, "cuMemAlloc for copy=True");
    } else if (n > 0) {
        rc = g->api->MemcpyDtoDAsync(p, (CUdeviceptr)src, (size_t)n, (CUstream)stream);
        if (rc != CUDA_SUCCESS) {
            st = ts_cuda_fail(g->api, err, rc, "cuMemcpyDtoDAsync for copy=True");
            g->api->MemFree(p);
        }
    }
    ts_gpu_leave(g);
    if (st == TS_OK) *out = p;
    return st;
}

/* ==========================================================================
 * Consumer: releases after the GPU is done with a slot
 *
 * A DLPack deleter may run anywhere: inside a CUDA-graph capture, on a thread of
 * torch's allocator, at interpreter exit. So it makes no driver call: it queues the
 * release (release_after, free_copy). The consumer's own thread flushes the queue at
 * its next call (ts_gpu_flush), outside any capture: one event recorded on the whole
 * context (cuCtxRecordEvent) covers every stream the views were used on, known or not,
 * and the reaper thread releases the slots once that event has completed. A failed wait
 * never hands a slot back: the slot stays held, and the next flush reports the failure.
 * ========================================================================== */

/* Queue a pending release or free (no driver call; any thread). */
static void ts_gpu_queue(ts_gpu *g, uint32_t slot, uint32_t consumer, uint64_t token,
                         CUdeviceptr free_ptr, ts_device_done_fn done, void *arg)
{
    ts_pending *p = calloc(1, sizeof *p);
    if (p == NULL) {
        /* Nothing orders this release after the GPU work: keep the slot held (!ok) and
         * say so at the next flush; the allocation (if any) leaks. */
        pthread_mutex_lock(&g->lock);
        if (!g->failed)
            snprintf(g->failure, sizeof g->failure,
                     "out of memory queueing a GPU release: the slot stays held");
        g->failed = 1;
        pthread_mutex_unlock(&g->lock);
        done(arg, slot, consumer, token, 0);
        return;
    }
    p->done = done;
    p->arg = arg;
    p->slot = slot;
    p->consumer = consumer;
    p->token = token;
    p->free_ptr = free_ptr;
    pthread_mutex_lock(&g->lock);
    p->next = g->unflushed;
    g->unflushed = p;
    if (g->orphaned) pthread_cond_broadcast(&g->cond); /* the reaper flushes it */
    pthread_mutex_unlock(&g->lock);
}

/* Queue the release of slot until the next flush (see ts_device.h). */
static void ts_gpu_release_after(ts_device_state *state, uint32_t slot, uint32_t consumer,
                                 uint64_t token, ts_device_done_fn done, void *arg)
{
    ts_gpu_queue(ts_gpu_of(state), slot, consumer, token, 0, done, arg);
}

/* Queue the free of a copy made by ts_gpu_copy until the next flush: the copy was made,
 * and may be read, on any stream of the context. */
static void ts_gpu_free_copy(ts_device_state *state, uint64_t p, ts_device_done_fn done,
                             void *arg)
{
    ts_gpu_queue(ts_gpu_of(state), 0, 0, 0, (CUdeviceptr)p, done, arg);
}

/* An idle flush event (caller holds the lock and is inside the context). */
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

/* Return an event to the pool (caller holds the lock and is inside the context). */
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

/* Record that a release's wait failed (sticky: every later flush reports it). */
static void ts_gpu_record_failure(ts_gpu *g, CUresult rc, const char *what)
{
    ts_err e = {0};
    ts_cuda_fail(g->api, &e, rc, what);
    pthread_mutex_lock(&g->lock);
    if (!g->failed)
        snprintf(g->failure, sizeof g->failure,
                 "a GPU release of this consumer failed (%.300s): its slot stays held until the "
                 "producer evicts this consumer",
                 e.msg);
    g->failed = 1;
    pthread_mutex_unlock(&g->lock);
}

/* 1 if rc says only that a stream of the context is being captured (CUDA graphs), so a
 * context-wide call was refused: "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED: This error
 * indicates that the operation is not permitted when the stream is capturing" and
 * "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED: ... the current capture sequence on the stream
 * has been invalidated due to a previous error" (CUresult, CUDA driver API). Nothing was
 * waited for and nothing failed: the releases wait for a later flush. */
static int ts_gpu_capture_refused(CUresult rc)
{
    return rc == CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED ||
           rc == CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
}

/* The list in the other order (a queue's newest first <-> oldest first). */
static ts_pending *ts_pending_reversed(ts_pending *items)
{
    ts_pending *out = NULL;
    while (items != NULL) {
        ts_pending *next = items->next;
        items->next = out;
        out = items;
        items = next;
    }
    return out;
}

/* The CLOCK_REALTIME time ms milliseconds from now (pthread_cond_timedwait's clock). */
static struct timespec ts_gpu_realtime_in(uint32_t ms)
{
    struct timespec t;
    clock_gettime(CLOCK_REALTIME, &t);
    t.tv_sec += (time_t)(ms / 1000);
    t.tv_nsec += (long)(ms % 1000) * 1000000L;
    if (t.tv_nsec >= 1000000000L) {
        t.tv_sec++;
        t.tv_nsec -= 1000000000L;
    }
    return t;
}

/* Wait until the reaper has finished every flush queued so far; 0, or -1 at the deadline
 * (CLOCK_REALTIME, as pthread_cond_timedwait measures). */
static int ts_gpu_drain(ts_gpu *g, const struct timespec *deadline)
{
    int rc = 0;
    pthread_mutex_lock(&g->lock);
    while ((g->head != NULL || g->busy) && rc == 0) {
        int w = pthread_cond_timedwait(&g->cond, &g->lock, deadline);
        if (w == ETIMEDOUT) rc = -1;
    }
    pthread_mutex_unlock(&g->lock);
    return rc;
}

static ts_status ts_gpu_flush_now(ts_gpu *g, int *synced, ts_err *err);

/* Flush, then wait up to wait_ms for the reaper to finish (see ts_device.h). */
static ts_status ts_gpu_flush(ts_device_state *state, uint32_t wait_ms, int *synced,
                              ts_err *err)
{
    ts_gpu *g = ts_gpu_of(state);
    ts_status st = ts_gpu_flush_now(g, synced, err);
    if (st != TS_OK || wait_ms == 0 || !g->reaper_started) return st;
    struct timespec dl = ts_gpu_realtime_in(wait_ms);
    if (ts_gpu_drain(g, &dl) != 0)
        return ts_err_set(err, TS_E_TIMEOUT, 0,
                          "the GPU releases of this consumer did not finish within %u ms "
                          "(its GPU work is still running)",
                          wait_ms);
    return TS_OK;
}

/* Hand the queued releases to the reaper after the context's work. */
static ts_status ts_gpu_flush_now(ts_gpu *g, int *synced, ts_err *err)
{
    *synced = 0;
    pthread_mutex_lock(&g->lock);
    if (g->failed) {
        ts_status st = ts_err_set(err, TS_E_CUDA, 0, "%s", g->failure);
        pthread_mutex_unlock(&g->lock);
        return st;
    }
    ts_pending *items = g->unflushed;
    g->unflushed = NULL;
    pthread_mutex_unlock(&g->lock);
    if (items == NULL) return TS_OK;
    ts_pending *oldest = ts_pending_reversed(items); /* the queue was newest first */
    ts_flush *f = calloc(1, sizeof *f);
    ts_status st = f != NULL ? ts_gpu_enter(g, err)
                             : ts_err_set(err, TS_E_SYS, ENOMEM, "out of memory");
    if (st != TS_OK) goto requeue;
    CUresult rc;
    if (g->api->CtxRecordEvent != NULL) {
        /* cuCtxRecordEvent: "Captures in hEvent all the activities of the context hCtx at
         * the time of this call" (CUDA driver API, 12.5+). It fails with
         * CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, invalidating the capture, if a stream of
         * the context is being captured: the caller does not flush during its own
         * captures, and one on another thread only defers the releases (below). */
        pthread_mutex_lock(&g->lock);
        f->event = ts_gpu_take_event(g);
        pthread_mutex_unlock(&g->lock);
        rc = f->event != NULL ? g->api->CtxRecordEvent(g->ctx, f->event) : CUDA_ERROR_OUT_OF_MEMORY;
        if (rc != CUDA_SUCCESS) {
            /* Nothing was handed over: the releases stay queued for the next flush. A
             * capture on another thread refused it (and was invalidated by it, per the
             * note on cuCtxRecordEvent): not a failed wait, so no error here. */
            if (!ts_gpu_capture_refused(rc))
                st = ts_cuda_fail(g->api, err, rc, "cuCtxRecordEvent for the GPU releases");
            if (f->event != NULL) {
                pthread_mutex_lock(&g->lock);
                ts_gpu_give_event(g, f->event);
                pthread_mutex_unlock(&g->lock);
            }
            ts_gpu_leave(g);
            goto requeue;
        }
    } else {
        /* No context-wide event in this driver: wait for the whole context here. */
        *synced = 1;
        rc = g->api->CtxSynchronize();
        if (ts_gpu_capture_refused(rc)) {
            /* A capture on another thread: the sync did not happen, nothing failed. */
            *synced = 0;
            ts_gpu_leave(g);
            goto requeue;
        }
        if (rc != CUDA_SUCCESS) {
            ts_gpu_record_failure(g, rc, "cuCtxSynchronize before GPU releases");
            f->failed = 1; /* the reaper drops the releases' references, not the slots */
        }
    }
    ts_gpu_leave(g);
    f->items = oldest;
    pthread_mutex_lock(&g->lock);
    if (g->tail != NULL) g->tail->next = f;
    else g->head = f;
    g->tail = f;
    pthread_cond_broadcast(&g->cond);
    if (f->failed) st = ts_err_set(err, TS_E_CUDA, 0, "%s", g->failure);
    pthread_mutex_unlock(&g->lock);
    return st;

requeue:
    free(f);
    /* Back at the old end of the queue (newest first), in their order: reversed again,
     * behind the items queued meanwhile (newer). */
    ts_pending *back = ts_pending_reversed(oldest);
    pthread_mutex_lock(&g->lock);
    ts_pending **tail = &g->unflushed;
    while (*tail != NULL) tail = &(*tail)->next;
    *tail = back;
    pthread_mutex_unlock(&g->lock);
    return st;
}

/* The reaper's own flush once the handle is closed (lock held; dropped meanwhile). A
 * flush refused by a capture on another thread (ts_gpu_capture_refused) leaves the
 * releases queued: retried after ORPHAN_RETRY_MS, or at the next release queued. The
 * price: cuCtxRecordEvent "will return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED if the
 * specified context hCtx has a stream in the capture mode. In such a case, the call will
 * invalidate all the conflicting captures" (CUDA driver API), so a capture the process
 * runs at that moment fails and must be redone; nothing else orders a release after work
 * on streams nobody named, and without it the slot stays held until the process exits. */
#define ORPHAN_RETRY_MS 100
static void ts_gpu_orphan_flush(ts_gpu *g)
{
    int synced = 0;
    ts_err e = {0};
    pthread_mutex_unlock(&g->lock);
    ts_status st = ts_gpu_flush_now(g, &synced, &e);
    pthread_mutex_lock(&g->lock);
    if (st != TS_OK && !g->failed) {
        /* Not a failed wait (that one is sticky already): say it as one, the slots
         * stay held; nobody is left to report it to. */
        snprintf(g->failure, sizeof g->failure, "%s", e.msg);
        g->failed = 1;
    }
    if (st == TS_OK && g->head == NULL && g->unflushed != NULL && !g->failed) {
        struct timespec dl = ts_gpu_realtime_in(ORPHAN_RETRY_MS);
        pthread_cond_timedwait(&g->cond, &g->lock, &dl);
    }
}

/* The producer's handle goes before its pool may (see ts_device.h): the host slot data
 * stops being page-locked once the copies out of it finished. */
static void ts_gpu_unpin_host(ts_device_state *state)
{
    ts_gpu *g = ts_gpu_of(state);
    if (g == NULL || g->api == NULL || g->pinned == NULL || ts_gpu_enter(g, NULL) != TS_OK)
        return;
    if (g->stream != NULL) g->api->StreamSynchronize(g->stream);
    g->api->MemHostUnregister(g->pinned);
    g->pinned = NULL;
    g->base.host_pinned = 0;
    ts_gpu_leave(g);
}

/* The consumer's handle is closed (see ts_device.h): the reaper flushes from now on. */
static void ts_gpu_orphan(ts_device_state *state)
{
    ts_gpu *g = ts_gpu_of(state);
    if (g == NULL || g->is_producer) return;
    pthread_mutex_lock(&g->lock);
    g->orphaned = 1;
    pthread_cond_broadcast(&g->cond);
    pthread_mutex_unlock(&g->lock);
}

/* The reaper: waits for each flush's event, then releases its slots. */
static void *ts_gpu_reaper_main(void *arg)
{
    ts_gpu *g = arg;
    /* RELAXED: nothing this thread does (cuMemFree of copies, event waits) may invalidate
     * a CUDA-graph capture the training code runs on another thread. The mode is the
     * calling thread's own (cuThreadExchangeStreamCaptureMode, CUDA driver API). */
    if (g->api->ThreadExchangeStreamCaptureMode != NULL) {
        int mode = CU_STREAM_CAPTURE_MODE_RELAXED;
        g->api->ThreadExchangeStreamCaptureMode(&mode);
    }
    pthread_mutex_lock(&g->lock);
    for (;;) {
        while (g->head == NULL && !g->stop) {
            if (g->orphaned && g->unflushed != NULL && !g->failed) {
                ts_gpu_orphan_flush(g);
                continue;
            }
            pthread_cond_wait(&g->cond, &g->lock);
        }
        ts_flush *f = g->head;
        if (f == NULL) break; /* stopped and nothing left */
        g->head = f->next;
        if (g->head == NULL) g->tail = NULL;
        g->busy = 1;
        pthread_mutex_unlock(&g->lock);

        int ok = !f->failed;
        int entered = ts_gpu_enter(g, NULL) == TS_OK;
        if (!entered && ok) {
            ts_gpu_record_failure(g, CUDA_ERROR_INVALID_CONTEXT, "cuCtxPushCurrent");
            ok = 0;
        }
        if (entered && f->event != NULL) {
            CUresult rc = g->api->EventSynchronize(f->event);
            if (rc != CUDA_SUCCESS && ok) {
                ts_gpu_record_failure(g, rc, "cuEventSynchronize of the context's work");
                ok = 0;
            }
        }
        for (ts_pending *p = f->items; p != NULL; p = p->next)
            if (ok && entered && p->free_ptr != 0) g->api->MemFree(p->free_ptr);
        if (f->event != NULL && entered) {
            pthread_mutex_lock(&g->lock);
            ts_gpu_give_event(g, f->event);
            pthread_mutex_unlock(&g->lock);
        }
        if (entered) ts_gpu_leave(g);

        /* A done may drop the ring's last reference: ts_gpu_close then runs on this
         * thread (only with the last item: every item holds a reference). */
        ts_pending *p = f->items;
        free(f);
        while (p != NULL) {
            ts_pending *next = p->next;
            ts_pending fin = *p;
            free(p);
            fin.done(fin.arg, fin.slot, fin.consumer, fin.token, ok);
            p = next;
        }
        pthread_mutex_lock(&g->lock);
        g->busy = 0;
        if (g->head == NULL) pthread_cond_broadcast(&g->cond); /* ts_gpu_drain */
    }
    int self_free = g->self_free;
    pthread_mutex_unlock(&g->lock);
    if (self_free) ts_gpu_free_struct(g);
    return NULL;
}

/* ==========================================================================
 * The driver table and the backend
 * ========================================================================== */

/* Load the CUDA driver (ts_cuda_api.h) as the backend's driver. */
static ts_status ts_gpu_load(ts_device_driver **out, ts_err *err)
{
    ts_cuda_api *api = NULL;
    ts_status st = ts_cuda_load(&api, err);
    if (st == TS_OK) *out = &api->base;
    return st;
}

/* Visible devices, or -1. */
static int ts_gpu_device_count(ts_device_driver *driver)
{
    int count = 0;
    if (ts_cuda_of(driver)->DeviceGetCount(&count) != CUDA_SUCCESS) return -1;
    return count;
}

/* Name, UUID and IPC event support of visible device ordinal; -1 if it cannot be had. */
static int ts_gpu_describe(ts_device_driver *driver, int ordinal, ts_device_desc *out)
{
    const ts_cuda_api *api = ts_cuda_of(driver);
    CUdevice dev;
    CUuuid uuid;
    memset(out, 0, sizeof *out);
    if (api->DeviceGet(&dev, ordinal) != CUDA_SUCCESS) return -1;
    api->DeviceGetName(out->name, (int)sizeof out->name - 1, dev);
    api->DeviceGetAttribute(&out->ipc_events, CU_DEVICE_ATTRIBUTE_IPC_EVENT_SUPPORTED, dev);
    if (ts_cuda_device_uuid(api, &uuid, dev) == CUDA_SUCCESS)
        for (int b = 0; b < 16; b++)
            snprintf(out->uuid + 2 * b, 3, "%02x", (unsigned char)uuid.bytes[b]);
    out->ipc_events = out->ipc_events != 0;
    return 0;
}

/* The ordinal of the visible device with this UUID, or -1. */
static int ts_gpu_find(ts_device_driver *driver, const uint8_t *uuid)
{
    CUuuid u;
    memcpy(u.bytes, uuid, sizeof u.bytes);
    return ts_cuda_find_device(ts_cuda_of(driver), &u);
}

const ts_device ts_device_cuda = {
    .name = "cuda",
    .device_type = kDLCUDA,
    .load = ts_gpu_load,
    .unload = ts_cuda_unload,
    .device_count = ts_gpu_device_count,
    .describe = ts_gpu_describe,
    .find = ts_gpu_find,
    .create_pool = ts_gpu_create_pool,
    .prepare = ts_gpu_prepare,
    .publish = ts_gpu_publish,
    .open = ts_gpu_open,
    .import = ts_gpu_import,
    .pin_host = ts_gpu_pin_host,
    .slot_ptr = ts_gpu_slot_ptr,
    .dlpack_stream = ts_gpu_dlpack_stream,
    .stream_wait = ts_gpu_stream_wait,
    .release_after = ts_gpu_release_after,
    .copy = ts_gpu_copy,
    .free_copy = ts_gpu_free_copy,
    .flush = ts_gpu_flush,
    .close = ts_gpu_close,
    .orphan = ts_gpu_orphan,
    .unpin_host = ts_gpu_unpin_host,
};
