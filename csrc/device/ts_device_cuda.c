/* ts_device_cuda.c - the CUDA backend of the device interface (ts_device.h).
 *
 * Producer (CUDA ring): a pool of device memory, one cuMemAlloc per slot (a base
 * allocation, so its IPC handle is valid), exported once into the segment's IPC table; a
 * copy stream; the host slot data page-locked so that each batch's copy to the device is a
 * single asynchronous DMA, which the producer waits for before the slot is published.
 *
 * Consumer: every slot's memory handle opened once (never in the exporting process) on the
 * device the consumer asked for, with lazy peer access when that is another GPU than the
 * pool's. A slot exported to the device (or read through the page-locked host mapping) is
 * released only after the work queued on the streams it was used on has finished: the
 * consumer's release queue (ts_cuda_release.h) orders it, with no call that concerns the
 * whole context. Optionally the consumer's mapping of the host slot data is page-locked
 * (cuMemHostRegister, read-only) so its own copies to a GPU are asynchronous without
 * pin_memory.
 *
 * Every function pushes the device's primary context (the one torch uses) on the calling
 * thread and pops it again, so any thread may call them, including DLPack deleters without
 * the GIL; and none calls the driver once the process's exit has begun (ts_cuda_enter,
 * ts_cuda_calls_begin). Nothing here knows the ring: what it needs of it comes in a
 * ts_device_ring. */
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "device/ts_cuda_api.h"
#include "device/ts_cuda_release.h"
#include "device/ts_device.h"

typedef struct ts_gpu {
    ts_device_state base; /* first member: device, ordinal, imported, host_pinned */
    ts_cuda_api *api;     /* owns one reference */
    CUdevice dev;
    CUcontext ctx; /* owns: a retain of dev's primary context */
    int is_producer;
    uint32_t slot_count;
    CUdeviceptr *ptr;  /* owns: producer's allocations, consumer's opened mappings */
    CUevent *copied;   /* owns (producer): blocking-sync events marking each slot's copy */
    uint8_t *recorded; /* producer: the slot's event was recorded at least once */
    CUstream stream;   /* owns (producer): the copy stream */
    void *pinned;      /* borrowed: the page-locked host range (the ring's data mapping) */
    ts_cuda_releases *releases; /* owns (consumer, once it imported or pinned): the release
                                 * queue and its thread */
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

/* Make the device's primary context current on this thread (a section of driver calls). */
static ts_status ts_gpu_enter(const ts_gpu *g, ts_err *err)
{
    return ts_cuda_enter(g->api, g->ctx, err);
}

/* Undo ts_gpu_enter. */
static void ts_gpu_leave(const ts_gpu *g)
{
    ts_cuda_leave(g->api);
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

/* The device of ordinal in g->dev, checked for the pool (compute mode), and its primary
 * context retained (inside a section of driver calls). */
static ts_status ts_gpu_bind_device(ts_gpu *g, ts_cuda_api *api, int ordinal, ts_err *err)
{
    int count = 0;
    CUresult rc = api->DeviceGetCount(&count);
    if (rc != CUDA_SUCCESS) return ts_cuda_fail(api, err, rc, "cuDeviceGetCount");
    if (ordinal < 0 || ordinal >= count)
        return ts_err_set(err, TS_E_GPU_UNAVAILABLE, 0,
                          "there is no CUDA device %d (this process sees %d; check "
                          "CUDA_VISIBLE_DEVICES)",
                          ordinal, count);
    rc = api->DeviceGet(&g->dev, ordinal);
    if (rc != CUDA_SUCCESS) return ts_cuda_fail(api, err, rc, "cuDeviceGet");
    /* The pool's GPU is shared by the producer and the consumers on it, each with a
     * context of its own: only the default compute mode allows that. */
    int mode = CU_COMPUTEMODE_DEFAULT;
    if (g->is_producer &&
        api->DeviceGetAttribute(&mode, CU_DEVICE_ATTRIBUTE_COMPUTE_MODE, g->dev) ==
            CUDA_SUCCESS &&
        mode != CU_COMPUTEMODE_DEFAULT)
        return ts_err_set(err, TS_E_GPU_UNAVAILABLE, 0,
                          "GPU %d is in compute mode %s: the GPU ring needs the DEFAULT mode "
                          "(nvidia-smi -i %d -c DEFAULT)",
                          ordinal, ts_gpu_mode_name(mode), ordinal);
    rc = api->DevicePrimaryCtxRetain(&g->ctx, g->dev);
    if (rc != CUDA_SUCCESS) return ts_cuda_fail(api, err, rc, "cuDevicePrimaryCtxRetain");
    return TS_OK;
}

/* New state for device ordinal (primary context retained). */
static ts_gpu *ts_gpu_new(ts_cuda_api *api, int ordinal, uint32_t slots, int is_producer,
                          ts_err *err)
{
    ts_gpu *g = calloc(1, sizeof *g);
    if (g != NULL) {
        g->ptr = calloc(slots, sizeof *g->ptr);
        g->copied = calloc(slots, sizeof *g->copied);
        g->recorded = calloc(slots, 1);
    }
    ts_status st = TS_OK;
    if (g == NULL || g->ptr == NULL || g->copied == NULL || g->recorded == NULL) {
        st = ts_err_set(err, TS_E_SYS, ENOMEM, "out of memory");
    } else if (ts_cuda_calls_begin() != 0) {
        st = ts_err_set(err, TS_E_GPU_UNAVAILABLE, 0,
                        "this process is exiting: the CUDA driver is shutting down");
    } else {
        g->is_producer = is_producer;
        st = ts_gpu_bind_device(g, api, ordinal, err);
        ts_cuda_calls_end();
    }
    if (st != TS_OK) {
        ts_gpu_unusable(err, st);
        if (g != NULL) {
            free(g->ptr);
            free(g->copied);
            free(g->recorded);
            free(g);
        }
        return NULL;
    }
    g->base.device = &ts_device_cuda;
    g->base.ordinal = ordinal;
    g->slot_count = slots;
    ts_cuda_ref(api);
    g->api = api;
    return g;
}

/* Release every CUDA resource the state holds, and the driver; only the memory once the
 * process's exit has begun (the driver takes the rest). A producer's state comes here only
 * once no other process maps its pool (ts_device.h, close): the driver says "Calling
 * cuMemFree on an exported memory region before calling cuIpcCloseMemHandle in the
 * importing context will result in undefined behavior" (cuIpcOpenMemHandle), and "Memory
 * returned from cuIpcOpenMemHandle must be freed with cuIpcCloseMemHandle", which the
 * consumer's teardown does for each slot it opened. */
static void ts_gpu_teardown(ts_gpu *g)
{
    if (g->api == NULL) return;
    const ts_cuda_api *api = g->api;
    if (ts_gpu_enter(g, NULL) == TS_OK) {
        if (g->stream != NULL) api->StreamSynchronize(g->stream);
        for (uint32_t k = 0; k < g->slot_count; k++) {
            if (g->copied[k] != NULL) api->EventDestroy(g->copied[k]);
            if (g->ptr[k] == 0) continue;
            if (g->is_producer) api->MemFree(g->ptr[k]);
            else api->IpcCloseMemHandle(g->ptr[k]);
        }
        if (g->pinned != NULL) api->MemHostUnregister(g->pinned);
        if (g->stream != NULL) api->StreamDestroy(g->stream);
        ts_gpu_leave(g);
        if (ts_cuda_calls_begin() == 0) {
            api->DevicePrimaryCtxRelease(g->dev);
            ts_cuda_calls_end();
        }
    }
    memset(g->copied, 0, g->slot_count * sizeof *g->copied);
    memset(g->ptr, 0, g->slot_count * sizeof *g->ptr);
    g->pinned = NULL;
    g->base.imported = 0;
    g->base.host_pinned = 0;
    g->stream = NULL;
    ts_cuda_unref(g->api);
    g->api = NULL;
}

/* Free the struct itself (after ts_gpu_teardown). */
static void ts_gpu_free_struct(ts_gpu *g)
{
    free(g->ptr);
    free(g->copied);
    free(g->recorded);
    free(g);
}

/* Free the state (the ring's last reference went; any thread, the release thread's too:
 * ts_cuda_releases_free then leaves the queue to that thread's end). */
static void ts_gpu_close(ts_device_state *state)
{
    ts_gpu *g = ts_gpu_of(state);
    if (g == NULL) return;
    ts_cuda_releases_free(g->releases); /* its events go inside the context, first */
    g->releases = NULL;
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

/* Allocate slot k's device memory and its copy event and export the memory's IPC handle
 * into r->ipc[k] (context entered). What it made is in g either way, for ts_gpu_teardown. */
static ts_status ts_gpu_export_slot(ts_gpu *g, const ts_device_ring *r, uint32_t k,
                                    ts_err *err)
{
    ts_cuda_api *api = g->api;
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
    memcpy(r->ipc[k].mem, mh.reserved, sizeof r->ipc[k].mem);
    /* Blocking sync: the producer sleeps while it waits for a copy. */
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
    st = ts_gpu_enter(g, err);
    if (st != TS_OK) goto error;
    entered = 1;
    /* Consumers find the pool's GPU by its UUID (_v2: a MIG instance's own). No interprocess
     * event is needed, so CU_DEVICE_ATTRIBUTE_IPC_EVENT_SUPPORTED (CUDA 12.0) is not asked:
     * an 11.x driver would refuse it. */
    CUuuid uuid;
    rc = ts_cuda_device_uuid(api, &uuid, g->dev);
    if (rc != CUDA_SUCCESS) {
        st = ts_cuda_fail(api, err, rc, ts_cuda_uuid_call(api));
        goto error;
    }
    memcpy(r->uuid, uuid.bytes, sizeof uuid.bytes);
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

/* Copy the slot's tensors to the device and wait for the copy. */
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
        rc = g->api->EventRecord(g->copied[slot], g->stream);
        if (rc != CUDA_SUCCESS) st = ts_cuda_fail(g->api, err, rc, "cuEventRecord");
        else g->recorded[slot] = 1;
    }
    /* The ring publishes the slot once this returns: wait for the copy (the blocking-sync
     * event sleeps), so that the batch is on the device before any consumer sees it, and
     * a read on any stream of theirs, ordered by nothing of ours, finds it whole. This is
     * also why no consumer waits on an event of ours: a capturing stream could not (it
     * would need CU_EVENT_WAIT_EXTERNAL). The caller released the GIL. */
    if (st == TS_OK) {
        rc = g->api->EventSynchronize(g->copied[slot]);
        if (rc != CUDA_SUCCESS)
            st = ts_cuda_fail(g->api, err, rc, "cuEventSynchronize of a batch's copy");
    }
    ts_gpu_leave(g);
    return st;
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

/* Start the release queue once (import or pin_host: releases are deferred from then). */
static ts_status ts_gpu_start_releases(ts_gpu *g, ts_err *err)
{
    if (g->releases != NULL) return TS_OK;
    g->releases = ts_cuda_releases_new(g->api, g->ctx, err);
    return g->releases != NULL ? TS_OK : (err != NULL ? err->code : TS_E_SYS);
}

/* The reason an IPC open failed with rc, in words a user can act on, into err. */
static ts_status ts_gpu_open_failed(const ts_gpu *g, CUresult rc, int peer, ts_err *err)
{
    ts_status st = ts_cuda_fail(g->api, err, rc, "cuIpcOpenMemHandle of a ring slot");
    if (rc != CUDA_ERROR_INVALID_CONTEXT && rc != CUDA_ERROR_MAP_FAILED &&
        rc != CUDA_ERROR_INVALID_VALUE && rc != CUDA_ERROR_INVALID_DEVICE &&
        rc != CUDA_ERROR_PEER_ACCESS_UNSUPPORTED)
        return st;
    char detail[sizeof err->msg] = "";
    if (err != NULL) snprintf(detail, sizeof detail, "%s", err->msg);
    /* "CUipcMemHandles from each CUdevice in a given process may only be opened by one
     * CUcontext per CUdevice per other process" (cuIpcOpenMemHandle). */
    const char *why = peer ? "; is peer access between the two GPUs possible?"
                      : rc == CUDA_ERROR_INVALID_CONTEXT
                          ? "; the driver lets a process open it in one GPU's context only: "
                            "another consumer of this process may have opened it on another GPU"
                          : "";
    return ts_err_set(err, TS_E_GPU_UNAVAILABLE, 0,
                      "cannot open the producer's GPU memory on GPU %d (%s%s)", g->base.ordinal,
                      detail, why);
}

/* Open every slot's memory handle (see ts_device.h). */
static ts_status ts_gpu_import(ts_device_state *state, const ts_device_ring *r, ts_err *err)
{
    ts_status st = TS_OK;
    ts_gpu *g = ts_gpu_of(state);
    const ts_cuda_api *api = g->api;
    CUresult rc;
    if (g->base.imported) return TS_OK;
    st = ts_gpu_enter(g, err);
    if (st != TS_OK) return ts_gpu_unusable(err, st);

    /* Devices are told apart by ts_cuda_device_uuid (the _v2 UUID): two MIG instances of
     * one GPU share its v1 UUID. */
    CUuuid mine;
    rc = ts_cuda_device_uuid(api, &mine, g->dev);
    if (rc != CUDA_SUCCESS) {
        ts_gpu_leave(g);
        return ts_gpu_unusable(err, ts_cuda_fail(api, err, rc, ts_cuda_uuid_call(api)));
    }
    /* Another GPU than the pool's reads it through peer access, if there is any. The flag is
     * passed for the pool's own GPU too: the driver documents it as required, and a real
     * one (H100, driver 580) refuses 0 with CUDA_ERROR_INVALID_VALUE. */
    int peer = memcmp(mine.bytes, r->uuid, sizeof mine.bytes) != 0;
    if (peer && (st = ts_gpu_check_peer(g, r->uuid, err)) != TS_OK) {
        ts_gpu_leave(g);
        return st;
    }
    const unsigned int flags = CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS;
    uint32_t k = 0;
    for (; k < r->slot_count && st == TS_OK; k++) {
        CUipcMemHandle mh;
        memcpy(mh.reserved, r->ipc[k].mem, sizeof mh.reserved);
        rc = api->IpcOpenMemHandle(&g->ptr[k], mh, flags);
        if (rc != CUDA_SUCCESS) {
            g->ptr[k] = 0;
            st = ts_gpu_open_failed(g, rc, peer, err);
        }
    }
    if (st == TS_OK) st = ts_gpu_start_releases(g, err);
    if (st != TS_OK) {
        /* Close what was opened; the state stays for pin_host or another try. */
        for (uint32_t i = 0; i < r->slot_count; i++) {
            if (g->ptr[i] != 0) api->IpcCloseMemHandle(g->ptr[i]);
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
    if (rc != CUDA_SUCCESS) {
        int read_only = 1;
        api->DeviceGetAttribute(&read_only, CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED,
                                g->dev);
        ts_gpu_leave(g);
        if (!read_only)
            return ts_err_set(err, TS_E_GPU_UNAVAILABLE, 0,
                              "GPU %d cannot page-lock read-only memory "
                              "(CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED is 0), "
                              "and a consumer maps the ring read-only",
                              g->base.ordinal);
        return ts_gpu_unusable(err, ts_cuda_fail(api, err, rc, "cuMemHostRegister of the ring"));
    }
    /* Views of page-locked memory may be read by asynchronous copies: their releases
     * are deferred like device views' (ts_export.c), through the release queue. */
    st = ts_gpu_start_releases(g, err);
    if (st != TS_OK) api->MemHostUnregister(r->host);
    ts_gpu_leave(g);
    if (st != TS_OK) return st;
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
 * leaves the ordering to the caller, whose work may be on any stream, and 2 is the calling
 * thread's per-thread stream, which the flushing thread cannot name: neither is followed
 * (a release of such a view waits for the legacy stream, which the per-thread streams
 * synchronize with, and the stream current at the flush). */
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

/* ==========================================================================
 * Consumer: releases after the GPU is done with a slot (ts_cuda_release.h)
 * ========================================================================== */

/* Queue the release of slot until the next flush (see ts_device.h). */
static void ts_gpu_release_after(ts_device_state *state, uint32_t slot, uint32_t consumer,
                                 uint64_t token, const ts_device_stream *streams, uint32_t n,
                                 int unnamed, ts_device_done_fn done, void *arg)
{
    ts_cuda_releases_queue(ts_gpu_of(state)->releases, slot, consumer, token, streams, n,
                           unnamed, done, arg);
}

/* Hand the queued releases to the release thread (see ts_device.h). */
static ts_status ts_gpu_flush(ts_device_state *state, ts_device_stream current,
                              uint32_t wait_ms, ts_err *err)
{
    ts_gpu *g = ts_gpu_of(state);
    if (g->releases == NULL) return TS_OK;
    return ts_cuda_releases_flush(g->releases, current, wait_ms, err);
}

/* The consumer's handle is closed (see ts_device.h): the release thread flushes from now. */
static void ts_gpu_orphan(ts_device_state *state)
{
    ts_gpu *g = ts_gpu_of(state);
    if (g != NULL && !g->is_producer && g->releases != NULL)
        ts_cuda_releases_orphan(g->releases);
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
    if (ts_cuda_calls_begin() != 0) return -1;
    CUresult rc = ts_cuda_of(driver)->DeviceGetCount(&count);
    ts_cuda_calls_end();
    return rc == CUDA_SUCCESS ? count : -1;
}

/* Name, UUID and IPC event support of visible device ordinal; -1 if it cannot be had. */
static int ts_gpu_describe(ts_device_driver *driver, int ordinal, ts_device_desc *out)
{
    const ts_cuda_api *api = ts_cuda_of(driver);
    CUdevice dev;
    CUuuid uuid;
    memset(out, 0, sizeof *out);
    if (ts_cuda_calls_begin() != 0) return -1;
    if (api->DeviceGet(&dev, ordinal) != CUDA_SUCCESS) {
        ts_cuda_calls_end();
        return -1;
    }
    api->DeviceGetName(out->name, (int)sizeof out->name - 1, dev);
    int ipc = 0;
    /* A driver older than CUDA 12.0 does not know the attribute: -1, "cannot say". */
    if (api->DeviceGetAttribute(&ipc, CU_DEVICE_ATTRIBUTE_IPC_EVENT_SUPPORTED, dev) !=
        CUDA_SUCCESS)
        ipc = -1;
    out->ipc_events = ipc < 0 ? -1 : ipc != 0;
    if (ts_cuda_device_uuid(api, &uuid, dev) == CUDA_SUCCESS)
        for (int b = 0; b < 16; b++)
            snprintf(out->uuid + 2 * b, 3, "%02x", (unsigned char)uuid.bytes[b]);
    ts_cuda_calls_end();
    return 0;
}

/* The ordinal of the visible device with this UUID, or -1. */
static int ts_gpu_find(ts_device_driver *driver, const uint8_t *uuid)
{
    CUuuid u;
    memcpy(u.bytes, uuid, sizeof u.bytes);
    if (ts_cuda_calls_begin() != 0) return -1;
    int ordinal = ts_cuda_find_device(ts_cuda_of(driver), &u);
    ts_cuda_calls_end();
    return ordinal;
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
    .release_after = ts_gpu_release_after,
    .flush = ts_gpu_flush,
    .close = ts_gpu_close,
    .orphan = ts_gpu_orphan,
    .unpin_host = ts_gpu_unpin_host,
};
