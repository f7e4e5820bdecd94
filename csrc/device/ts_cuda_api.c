/* ts_cuda_api.c - loading the CUDA driver API at run time (see ts_cuda_api.h). */
#define _GNU_SOURCE
#include "device/ts_cuda_api.h"

#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/ts_clock.h"
#include "base/ts_futex.h"

#define TS_LIBCUDA_DEFAULT "libcuda.so.1"
#define TS_LIBCUDA_ENV "TENSORSOCKET_LIBCUDA"

/* One symbol to look up: its exported (versioned) name and where it goes. */
typedef struct ts_cuda_sym {
    const char *name;
    size_t offset; /* of the function pointer in ts_cuda_api */
} ts_cuda_sym;

#define TS_SYM(field, symbol) {symbol, offsetof(ts_cuda_api, field)}

/* The exported names are the ones cuda.h #defines the API names to. The newest of them,
 * cuIpcOpenMemHandle_v2 and cuDevicePrimaryCtxRelease_v2, came with CUDA 11.0
 * (cudaTypedefs.h: PFN_..._v11000): the oldest driver the GPU path can load. */
static const ts_cuda_sym ts_cuda_syms[] = {
    TS_SYM(Init, "cuInit"),
    TS_SYM(DriverGetVersion, "cuDriverGetVersion"),
    TS_SYM(GetErrorName, "cuGetErrorName"),
    TS_SYM(GetErrorString, "cuGetErrorString"),
    TS_SYM(DeviceGetCount, "cuDeviceGetCount"),
    TS_SYM(DeviceGet, "cuDeviceGet"),
    TS_SYM(DeviceGetAttribute, "cuDeviceGetAttribute"),
    TS_SYM(DeviceGetUuid, "cuDeviceGetUuid"),
    TS_SYM(DeviceGetName, "cuDeviceGetName"),
    TS_SYM(DevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain"),
    TS_SYM(DevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2"),
    TS_SYM(CtxPushCurrent, "cuCtxPushCurrent_v2"),
    TS_SYM(CtxPopCurrent, "cuCtxPopCurrent_v2"),
    TS_SYM(MemAlloc, "cuMemAlloc_v2"),
    TS_SYM(MemFree, "cuMemFree_v2"),
    TS_SYM(MemcpyHtoDAsync, "cuMemcpyHtoDAsync_v2"),
    TS_SYM(MemHostRegister, "cuMemHostRegister_v2"),
    TS_SYM(MemHostUnregister, "cuMemHostUnregister"),
    TS_SYM(StreamCreate, "cuStreamCreate"),
    TS_SYM(StreamDestroy, "cuStreamDestroy_v2"),
    TS_SYM(StreamSynchronize, "cuStreamSynchronize"),
    TS_SYM(StreamIsCapturing, "cuStreamIsCapturing"),
    TS_SYM(EventCreate, "cuEventCreate"),
    TS_SYM(EventDestroy, "cuEventDestroy_v2"),
    TS_SYM(EventRecord, "cuEventRecord"),
    TS_SYM(EventSynchronize, "cuEventSynchronize"),
    TS_SYM(IpcGetMemHandle, "cuIpcGetMemHandle"),
    TS_SYM(IpcOpenMemHandle, "cuIpcOpenMemHandle_v2"),
    TS_SYM(IpcCloseMemHandle, "cuIpcCloseMemHandle"),
    TS_SYM(DeviceCanAccessPeer, "cuDeviceCanAccessPeer"),
};

/* Symbols a driver may lack; their pointers stay NULL then. cuDeviceGetUuid_v2 came with
 * CUDA 11.4: "If the device is in MIG mode, returns its MIG UUID which uniquely identifies
 * the subscribed MIG compute instance" (CUDA driver API, Device Management), where
 * cuDeviceGetUuid (v1) gives a MIG instance its parent GPU's UUID;
 * cuThreadExchangeStreamCaptureMode came with CUDA 10.1. */
static const ts_cuda_sym ts_cuda_optional_syms[] = {
    TS_SYM(DeviceGetUuid_v2, "cuDeviceGetUuid_v2"),
    TS_SYM(ThreadExchangeStreamCaptureMode, "cuThreadExchangeStreamCaptureMode"),
};

/* ==========================================================================
 * Process exit (see ts_cuda_api.h)
 * ========================================================================== */

/* How long the exit handler waits for the driver calls under way (a release thread's wait
 * for GPU work) before it lets the exit go on. */
#define TS_CUDA_EXIT_WAIT_NS (10ULL * 1000000000ULL)

/* Process-wide by nature, as exit() is: sections of driver calls under way, and whether
 * exit has begun. */
static _Atomic uint32_t ts_cuda_in_flight;
static _Atomic int ts_cuda_exit_begun;
static pthread_once_t ts_cuda_exit_once = PTHREAD_ONCE_INIT;

/* Begin a section of driver calls, unless exit has begun (see ts_cuda_api.h). seq_cst with
 * ts_cuda_at_exit: either the handler sees this section, or this sees the exit. */
int ts_cuda_calls_begin(void)
{
    atomic_fetch_add_explicit(&ts_cuda_in_flight, 1, memory_order_seq_cst);
    if (!atomic_load_explicit(&ts_cuda_exit_begun, memory_order_seq_cst)) return 0;
    ts_cuda_calls_end();
    return -1;
}

/* End a section of driver calls; the last one out wakes the exit handler. */
void ts_cuda_calls_end(void)
{
    if (atomic_fetch_sub_explicit(&ts_cuda_in_flight, 1, memory_order_seq_cst) == 1 &&
        atomic_load_explicit(&ts_cuda_exit_begun, memory_order_seq_cst))
        ts_futex_wake_all(&ts_cuda_in_flight);
}

/* 1 once the process's exit has begun. */
int ts_cuda_exiting(void)
{
    return atomic_load_explicit(&ts_cuda_exit_begun, memory_order_seq_cst);
}

/* This thread's sections (ts_cuda_enter) under way, and its capture mode before the
 * first of them (-1: unchanged, the driver lacks cuThreadExchangeStreamCaptureMode). */
static _Thread_local int ts_cuda_sections;
static _Thread_local int ts_cuda_outer_mode = -1;

/* Begin a section, make ctx current, capture mode RELAXED (see ts_cuda_api.h). */
ts_status ts_cuda_enter(const ts_cuda_api *api, CUcontext ctx, ts_err *err)
{
    if (ts_cuda_calls_begin() != 0)
        return ts_err_set(err, TS_E_GPU_UNAVAILABLE, 0,
                          "this process is exiting: the CUDA driver is shutting down");
    CUresult rc = api->CtxPushCurrent(ctx);
    if (rc != CUDA_SUCCESS) {
        ts_cuda_calls_end();
        return ts_cuda_fail(api, err, rc, "cuCtxPushCurrent");
    }
    if (ts_cuda_sections++ == 0 && api->ThreadExchangeStreamCaptureMode != NULL) {
        int mode = CU_STREAM_CAPTURE_MODE_RELAXED;
        ts_cuda_outer_mode =
            api->ThreadExchangeStreamCaptureMode(&mode) == CUDA_SUCCESS ? mode : -1;
    }
    return TS_OK;
}

/* Undo ts_cuda_enter. */
void ts_cuda_leave(const ts_cuda_api *api)
{
    if (--ts_cuda_sections == 0 && ts_cuda_outer_mode >= 0) {
        int mode = ts_cuda_outer_mode;
        api->ThreadExchangeStreamCaptureMode(&mode);
        ts_cuda_outer_mode = -1;
    }
    CUcontext ignored;
    api->CtxPopCurrent(&ignored);
    ts_cuda_calls_end();
}

/* The exit hook (ts_cuda_on_exit), or NULL. */
static void (*_Atomic ts_cuda_exit_hook)(uint64_t deadline_ns);

/* Set the exit hook (see ts_cuda_api.h). */
void ts_cuda_on_exit(void (*fn)(uint64_t deadline_ns))
{
    atomic_store_explicit(&ts_cuda_exit_hook, fn, memory_order_release);
}

/* The exit handler: no driver call starts from now on, and the ones under way (a release
 * thread waiting for GPU work) end before the driver's own teardown, which runs after this
 * (registered before it) - up to TS_CUDA_EXIT_WAIT_NS. */
static void ts_cuda_at_exit(void)
{
    atomic_store_explicit(&ts_cuda_exit_begun, 1, memory_order_seq_cst);
    uint64_t deadline = ts_now_ns() + TS_CUDA_EXIT_WAIT_NS;
    void (*hook)(uint64_t) = atomic_load_explicit(&ts_cuda_exit_hook, memory_order_acquire);
    if (hook != NULL) hook(deadline); /* the release threads stop, and are waited for */
    ts_futex_wait_zero(&ts_cuda_in_flight, deadline);
}

/* A forked child starts with no section under way (the parent's threads are not in it). */
static void ts_cuda_forked_child(void)
{
    atomic_store_explicit(&ts_cuda_in_flight, 0, memory_order_relaxed);
}

/* Once per process, after the first cuInit: exit() runs ts_cuda_at_exit before the
 * driver's own exit handlers, which were registered earlier (atexit's last-in first-out
 * order; a driver's library destructors run later still, in _dl_fini). */
static void ts_cuda_register_exit(void)
{
    atexit(ts_cuda_at_exit);
    pthread_atfork(NULL, NULL, ts_cuda_forked_child);
}

/* Load the driver (dlopen, symbols, cuInit). */
ts_status ts_cuda_load(ts_cuda_api **out, ts_err *err)
{
    ts_status st = TS_OK;
    const char *path = getenv(TS_LIBCUDA_ENV);
    int from_env = path != NULL && path[0] != '\0';
    if (!from_env) path = TS_LIBCUDA_DEFAULT;
    ts_cuda_api *api = calloc(1, sizeof *api);
    if (api == NULL) return ts_err_set(err, TS_E_SYS, ENOMEM, "out of memory");
    api->base.device = &ts_device_cuda;
    atomic_init(&api->base.refs, 1);
    snprintf(api->base.path, sizeof api->base.path, "%s", path);

    /* RTLD_NODELETE: never unloaded, not even by someone else's dlclose (see the header). */
    api->lib = dlopen(path, RTLD_NOW | RTLD_LOCAL | RTLD_NODELETE);
    if (api->lib == NULL) {
        const char *why = dlerror();
        st = ts_err_set(err, TS_E_GPU_UNAVAILABLE, 0,
                        "the CUDA driver library %s could not be loaded (%s): no NVIDIA "
                        "driver on this machine%s",
                        path, why ? why : "unknown error",
                        from_env ? " (set by " TS_LIBCUDA_ENV ")" : "");
        goto error;
    }
    for (size_t i = 0; i < sizeof ts_cuda_syms / sizeof ts_cuda_syms[0]; i++) {
        void *fn = dlsym(api->lib, ts_cuda_syms[i].name);
        if (fn == NULL) {
            st = ts_err_set(err, TS_E_GPU_UNAVAILABLE, 0,
                            "the CUDA driver %s lacks %s: the driver is too old (the GPU "
                            "path needs a driver for CUDA 11.0 or newer)",
                            path, ts_cuda_syms[i].name);
            goto error;
        }
        /* POSIX guarantees object and function pointers convert through dlsym. */
        memcpy((char *)api + ts_cuda_syms[i].offset, &fn, sizeof fn);
    }
    for (size_t i = 0; i < sizeof ts_cuda_optional_syms / sizeof ts_cuda_optional_syms[0]; i++) {
        void *fn = dlsym(api->lib, ts_cuda_optional_syms[i].name);
        if (fn != NULL) memcpy((char *)api + ts_cuda_optional_syms[i].offset, &fn, sizeof fn);
    }
    if (ts_cuda_calls_begin() != 0) {
        st = ts_err_set(err, TS_E_GPU_UNAVAILABLE, 0,
                        "this process is exiting: the CUDA driver is shutting down");
        goto error;
    }
    CUresult rc = api->Init(0);
    if (rc == CUDA_SUCCESS) api->DriverGetVersion(&api->base.version);
    ts_cuda_calls_end();
    if (rc != CUDA_SUCCESS) {
        ts_cuda_fail(api, err, rc, "cuInit failed, no usable GPU");
        if (err != NULL) err->code = TS_E_GPU_UNAVAILABLE;
        st = TS_E_GPU_UNAVAILABLE;
        goto error;
    }
    pthread_once(&ts_cuda_exit_once, ts_cuda_register_exit);
    *out = api;
    return TS_OK;

error:
    /* The handle stays open (RTLD_NODELETE, and cuInit may have run): only the table goes. */
    free(api);
    return st;
}

/* Take a reference on the table. */
void ts_cuda_ref(ts_cuda_api *api)
{
    ts_device_driver_ref(&api->base);
}

/* Drop a reference; the table is freed at zero (ts_cuda_unload). */
void ts_cuda_unref(ts_cuda_api *api)
{
    if (api != NULL) ts_device_driver_unref(&api->base);
}

/* The table of a driver the CUDA backend loaded (base is its first member). */
ts_cuda_api *ts_cuda_of(ts_device_driver *driver)
{
    return (ts_cuda_api *)driver;
}

/* Free the table; the library stays loaded (never dlclose a driver after cuInit). */
void ts_cuda_unload(ts_device_driver *driver)
{
    free(ts_cuda_of(driver));
}

/* Record a failed driver call in err: "<what>: CUDA_ERROR_X (text)". */
ts_status ts_cuda_fail(const ts_cuda_api *api, ts_err *err, CUresult rc, const char *what)
{
    const char *name = NULL, *text = NULL;
    if (api != NULL && api->GetErrorName != NULL && ts_cuda_calls_begin() == 0) {
        api->GetErrorName(rc, &name);
        api->GetErrorString(rc, &text);
        ts_cuda_calls_end();
    }
    return ts_err_set(err, TS_E_CUDA, 0, "%s: %s (%s)", what, name ? name : "CUDA error",
                      text ? text : "no description");
}

/* The UUID that identifies device: _v2's where the driver has it, else v1's. */
CUresult ts_cuda_device_uuid(const ts_cuda_api *api, CUuuid *uuid, CUdevice device)
{
    if (api->DeviceGetUuid_v2 != NULL) return api->DeviceGetUuid_v2(uuid, device);
    return api->DeviceGetUuid(uuid, device);
}

/* The name of the call ts_cuda_device_uuid makes. */
const char *ts_cuda_uuid_call(const ts_cuda_api *api)
{
    return api->DeviceGetUuid_v2 != NULL ? "cuDeviceGetUuid_v2" : "cuDeviceGetUuid";
}

/* The ordinal of the visible device with this UUID, or -1. */
int ts_cuda_find_device(const ts_cuda_api *api, const CUuuid *uuid)
{
    int count = 0;
    if (api->DeviceGetCount(&count) != CUDA_SUCCESS) return -1;
    for (int i = 0; i < count; i++) {
        CUdevice dev;
        CUuuid u;
        if (api->DeviceGet(&dev, i) != CUDA_SUCCESS) continue;
        if (ts_cuda_device_uuid(api, &u, dev) != CUDA_SUCCESS) continue;
        if (memcmp(u.bytes, uuid->bytes, sizeof u.bytes) == 0) return i;
    }
    return -1;
}
