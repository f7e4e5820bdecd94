/* ts_cuda_api.h - the CUDA driver API, loaded at run time.
 *
 * tensorsocket builds and imports without a CUDA toolkit or a GPU: it never
 * links libcuda. The few driver types and constants it needs are declared
 * here (same ABI as cuda.h), and the functions are looked up once with
 * dlopen("libcuda.so.1") + dlsym of the versioned names into a table. The
 * environment variable TENSORSOCKET_LIBCUDA names another library to load
 * (the tests use it to load a test double of the driver).
 *
 * The table is a ts_device_driver (ts_device.h): reference counted, and known to the
 * ring only as the driver of the CUDA backend (ts_device_cuda.c), never by its functions.
 *
 * Process exit: the driver tears itself down from exit handlers, after which its calls fail
 * with CUDA_ERROR_DEINITIALIZED ("the CUDA driver is in the process of shutting down"), and
 * unloading it after cuInit in a process that lives on is a known crash (its handlers and
 * threads would run unmapped code). So the library is opened with RTLD_NODELETE and never
 * closed, and every section of driver calls is bracketed by ts_cuda_calls_begin/_end: the
 * exit handler registered after the first cuInit (so that it runs before the driver's own)
 * marks exit as begun, after which no section begins, and waits for the sections under way
 * to end (docs/gpu.md, "At close and exit"). */
#ifndef TS_CUDA_H
#define TS_CUDA_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "device/ts_device.h"
#include "base/ts_error.h"

/* ---- driver types (ABI of cuda.h) ------------------------------------------ */

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef struct CUctx_st *CUcontext;
typedef struct CUstream_st *CUstream;
typedef struct CUevent_st *CUevent;
typedef struct CUuuid_st {
    char bytes[16];
} CUuuid;
typedef struct CUipcMemHandle_st {
    char reserved[64];
} CUipcMemHandle;
typedef struct CUipcEventHandle_st {
    char reserved[64];
} CUipcEventHandle;

#define CUDA_SUCCESS 0
#define CUDA_ERROR_INVALID_VALUE 1
#define CUDA_ERROR_OUT_OF_MEMORY 2
#define CUDA_ERROR_NOT_INITIALIZED 3
#define CUDA_ERROR_DEINITIALIZED 4
#define CUDA_ERROR_NO_DEVICE 100
#define CUDA_ERROR_INVALID_DEVICE 101
#define CUDA_ERROR_INVALID_CONTEXT 201
#define CUDA_ERROR_MAP_FAILED 205
#define CUDA_ERROR_PEER_ACCESS_UNSUPPORTED 217
#define CUDA_ERROR_INVALID_HANDLE 400
#define CUDA_ERROR_NOT_READY 600
#define CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED 712
#define CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED 713
#define CUDA_ERROR_NOT_SUPPORTED 801
#define CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED 900
#define CUDA_ERROR_STREAM_CAPTURE_INVALIDATED 901
#define CUDA_ERROR_STREAM_CAPTURE_ISOLATION 905
#define CUDA_ERROR_STREAM_CAPTURE_IMPLICIT 906
#define CUDA_ERROR_CAPTURED_EVENT 907

#define CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING 41
#define CU_DEVICE_ATTRIBUTE_IPC_EVENT_SUPPORTED 125
#define CU_DEVICE_ATTRIBUTE_COMPUTE_MODE 20
#define CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED 113
#define CU_COMPUTEMODE_DEFAULT 0
#define CU_COMPUTEMODE_PROHIBITED 2
#define CU_COMPUTEMODE_EXCLUSIVE_PROCESS 3

#define CU_EVENT_BLOCKING_SYNC 0x1
#define CU_EVENT_DISABLE_TIMING 0x2
#define CU_EVENT_INTERPROCESS 0x4
#define CU_STREAM_NON_BLOCKING 0x1
#define CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS 0x1
#define CU_MEMHOSTREGISTER_PORTABLE 0x1
#define CU_MEMHOSTREGISTER_READ_ONLY 0x8
/* CUstreamCaptureMode (cuda.h): RELAXED lets a thread make calls that are unsafe during
 * another thread's stream capture without invalidating it. */
#define CU_STREAM_CAPTURE_MODE_GLOBAL 0
#define CU_STREAM_CAPTURE_MODE_THREAD_LOCAL 1
#define CU_STREAM_CAPTURE_MODE_RELAXED 2
/* CUstreamCaptureStatus (cuda.h), as cuStreamIsCapturing reports it. */
#define CU_STREAM_CAPTURE_STATUS_NONE 0
#define CU_STREAM_CAPTURE_STATUS_ACTIVE 1
#define CU_STREAM_CAPTURE_STATUS_INVALIDATED 2
/* CUevent_wait_flags (cuda.h): "Event is captured in the graph as an external event node when
 * performing stream capture. This flag is invalid outside of stream capture." */
#define CU_EVENT_WAIT_EXTERNAL 0x1

/* The DLPack stream numbers 1 and 2 are these handles (cuda.h). */
#define TS_CU_STREAM_LEGACY ((CUstream)0x1)
#define TS_CU_STREAM_PER_THREAD ((CUstream)0x2)

/* ---- the function table ------------------------------------------------------ */

typedef struct ts_cuda_api {
    ts_device_driver base; /* refs, version (cuDriverGetVersion), path; first member */
    void *lib;             /* the dlopen handle (RTLD_NODELETE: never closed) */

    CUresult (*Init)(unsigned int flags);
    CUresult (*DriverGetVersion)(int *version);
    CUresult (*GetErrorName)(CUresult error, const char **name);
    CUresult (*GetErrorString)(CUresult error, const char **text);
    CUresult (*DeviceGetCount)(int *count);
    CUresult (*DeviceGet)(CUdevice *device, int ordinal);
    CUresult (*DeviceGetAttribute)(int *value, int attribute, CUdevice device);
    CUresult (*DeviceGetUuid)(CUuuid *uuid, CUdevice device);
    CUresult (*DeviceGetName)(char *name, int len, CUdevice device);
    CUresult (*DevicePrimaryCtxRetain)(CUcontext *ctx, CUdevice device);
    CUresult (*DevicePrimaryCtxRelease)(CUdevice device);
    CUresult (*CtxPushCurrent)(CUcontext ctx);
    CUresult (*CtxPopCurrent)(CUcontext *ctx);
    CUresult (*MemAlloc)(CUdeviceptr *dptr, size_t bytes);
    CUresult (*MemFree)(CUdeviceptr dptr);
    CUresult (*MemcpyHtoDAsync)(CUdeviceptr dst, const void *src, size_t bytes, CUstream s);
    CUresult (*MemHostRegister)(void *p, size_t bytes, unsigned int flags);
    CUresult (*MemHostUnregister)(void *p);
    CUresult (*StreamCreate)(CUstream *stream, unsigned int flags);
    CUresult (*StreamDestroy)(CUstream stream);
    CUresult (*StreamSynchronize)(CUstream stream);
    CUresult (*StreamIsCapturing)(CUstream stream, int *status);
    CUresult (*EventCreate)(CUevent *event, unsigned int flags);
    CUresult (*EventDestroy)(CUevent event);
    CUresult (*EventRecord)(CUevent event, CUstream stream);
    CUresult (*EventSynchronize)(CUevent event);
    CUresult (*IpcGetMemHandle)(CUipcMemHandle *handle, CUdeviceptr dptr);
    CUresult (*IpcOpenMemHandle)(CUdeviceptr *dptr, CUipcMemHandle handle, unsigned int flags);
    CUresult (*IpcCloseMemHandle)(CUdeviceptr dptr);
    CUresult (*DeviceCanAccessPeer)(int *can_access, CUdevice dev, CUdevice peer_dev);

    /* Optional: NULL where the driver lacks them (ts_cuda_optional_syms). */
    /* cuDeviceGetUuid_v2 (CUDA 11.4): a MIG instance's own UUID (ts_cuda_device_uuid). */
    CUresult (*DeviceGetUuid_v2)(CUuuid *uuid, CUdevice device);
    /* cuThreadExchangeStreamCaptureMode (CUDA 10.1): swaps the calling thread's mode. */
    CUresult (*ThreadExchangeStreamCaptureMode)(int *mode);
} ts_cuda_api;

/* Load the driver (dlopen, symbols, cuInit). On failure err says why, in
 * words a user can act on (TS_E_GPU_UNAVAILABLE). */
ts_status ts_cuda_load(ts_cuda_api **out, ts_err *err);

/* Take a reference on the table. */
void ts_cuda_ref(ts_cuda_api *api);

/* Drop a reference (NULL is fine); the table is freed at zero (the library stays). */
void ts_cuda_unref(ts_cuda_api *api);

/* The table of a driver the CUDA backend loaded. */
ts_cuda_api *ts_cuda_of(ts_device_driver *driver);

/* Free the table (its last reference went); the library stays loaded. */
void ts_cuda_unload(ts_device_driver *driver);

/* Record a failed driver call in err: "<what>: CUDA_ERROR_X (text)". */
ts_status ts_cuda_fail(const ts_cuda_api *api, ts_err *err, CUresult rc, const char *what);

/* Begin a section of driver calls: 0, or -1 once the process's exit has begun (then make
 * none: the driver tears down from its own exit handler). Every 0 is paired with one
 * ts_cuda_calls_end. Any thread, no lock. */
int ts_cuda_calls_begin(void);

/* End a section begun by ts_cuda_calls_begin. */
void ts_cuda_calls_end(void);

/* 1 once the process's exit has begun (no driver call may start any more). */
int ts_cuda_exiting(void);

/* Begin a section of driver calls (ts_cuda_calls_begin), make ctx current on this thread,
 * and set the thread's stream capture mode to RELAXED for the section: no call of ours may
 * invalidate a CUDA-graph capture of another thread ("CU_STREAM_CAPTURE_MODE_RELAXED: The
 * local thread is not prohibited from potentially unsafe API calls", whereas in the
 * default GLOBAL mode "if any other thread has a concurrent capture sequence initiated
 * with CU_STREAM_CAPTURE_MODE_GLOBAL, this thread is prohibited from potentially unsafe
 * API calls", cuThreadExchangeStreamCaptureMode). TS_E_GPU_UNAVAILABLE once the process's
 * exit has begun, TS_E_CUDA if the push failed. Sections may nest. */
ts_status ts_cuda_enter(const ts_cuda_api *api, CUcontext ctx, ts_err *err);

/* Undo ts_cuda_enter (the capture mode goes back to what it was). */
void ts_cuda_leave(const ts_cuda_api *api);

/* Run fn(deadline_ns) from the exit handler, once no driver call can start any more and
 * before it waits for the calls under way (the release queues stop their threads there,
 * ts_cuda_release.c). One hook; set once. */
void ts_cuda_on_exit(void (*fn)(uint64_t deadline_ns));

/* The UUID that identifies device: cuDeviceGetUuid_v2's (a MIG instance's own UUID), or
 * cuDeviceGetUuid's where the driver is too old for _v2. */
CUresult ts_cuda_device_uuid(const ts_cuda_api *api, CUuuid *uuid, CUdevice device);

/* The name of the call ts_cuda_device_uuid makes, for error messages. */
const char *ts_cuda_uuid_call(const ts_cuda_api *api);

/* The ordinal of the visible device with this UUID (ts_cuda_device_uuid's), or -1. */
int ts_cuda_find_device(const ts_cuda_api *api, const CUuuid *uuid);

#endif /* TS_CUDA_H */
