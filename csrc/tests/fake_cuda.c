/* fake_cuda.c - a test double of the CUDA driver API (libfakecuda.so).
 *
 * tensorsocket loads it instead of libcuda.so.1 when TENSORSOCKET_LIBCUDA
 * names it, so the GPU path runs, with real processes, on machines without a
 * GPU. It models what the core relies on, and is stricter than the real
 * driver where a mistake of ours would otherwise pass unnoticed:
 *
 *   - "device memory" is a POSIX shm object /fakecuda-<pid>-<n> mapped into
 *     the allocating process; an IPC mem handle names it, and another process
 *     maps it, so an importer reads exactly what the exporter wrote;
 *   - every memory, stream, event and IPC call needs a (retained) context
 *     pushed on the calling thread, else CUDA_ERROR_INVALID_CONTEXT;
 *   - each stream is a worker thread running a FIFO of operations, each one
 *     delayed by FAKECUDA_OP_DELAY_US, so asynchrony is visible: a pageable
 *     host-to-device copy is staged when called, a registered one reads the
 *     host bytes only when the stream reaches it;
 *   - an event is {recorded generation, completed generation}, in a shm
 *     object /fakecuda-ev-<pid>-<n> when interprocess, so a stream of one
 *     process can wait for work recorded by another; waiting on an event
 *     nobody recorded is CUDA_ERROR_ILLEGAL_STATE.
 *
 * Environment: FAKECUDA_DEVICES, FAKECUDA_VISIBLE, FAKECUDA_FAIL_INIT,
 * FAKECUDA_NO_IPC_EVENTS, FAKECUDA_MIG, FAKECUDA_MEM_LIMIT,
 * FAKECUDA_OP_DELAY_US, FAKECUDA_COMPUTE_MODE (the value of that attribute),
 * FAKECUDA_NO_PEER and FAKECUDA_MIG_GPUS (see "Two GPUs and MIG" below),
 * FAKECUDA_REJECT_ATTRIBUTES, FAKECUDA_FAIL_OP (an op name, as in the log: every call of it fails after
 * cuInit) with FAKECUDA_FAIL_CODE (default 801, CUDA_ERROR_NOT_SUPPORTED)
 * (read by cuInit) and FAKECUDA_LOG (a file every call appends one line to:
 * "<pid> <op> key=value ..."). FAKECUDA_DRIVER_VERSION (default 12080) is what
 * cuDriverGetVersion reports: below 12050 the core does not use cuCtxRecordEvent.
 *
 * Contexts: one primary context per visible device. Streams, events and the legacy default
 * stream (handles 0, 1 and 2) belong to the context current when they were made (or used,
 * for the default stream): cuCtxSynchronize and cuCtxRecordEvent cover the streams of that
 * one context, an event recorded on a stream of another context, or given to
 * cuCtxRecordEvent with another context, is CUDA_ERROR_INVALID_HANDLE, and a process may
 * open an IPC memory handle in one context per device only (docs/gpu.md, "The driver
 * double", cites the driver's sentence for each of these).
 *
 * Stream capture (CUDA graphs) is simulated, not recorded: fakecuda_begin_capture marks
 * a stream as capturing (its operations still run); while it is, the calls the driver
 * documents as invalid during a capture fail and invalidate it (counter
 * "capture_invalidated"): cuCtxSynchronize and cuCtxRecordEvent on its context from any
 * thread (CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED), cuStreamSynchronize of the capturing
 * stream, a sync or query of an event recorded on it (CUDA_ERROR_CAPTURED_EVENT), a wait
 * of the capturing stream on an event recorded outside the capture without
 * CU_EVENT_WAIT_EXTERNAL (CUDA_ERROR_STREAM_CAPTURE_ISOLATION), any use of the legacy
 * stream while a blocking stream of its context captures (CUDA_ERROR_STREAM_CAPTURE_IMPLICIT;
 * cuStreamIsCapturing of it says so without invalidating), and cuMemFree from a thread
 * whose capture mode (cuThreadExchangeStreamCaptureMode) the capture's mode does not allow.
 *
 * Process exit: the first cuInit registers an exit handler (with a NULL DSO handle, so that
 * only exit() runs it, as a driver's own teardown): from then on every call returns
 * CUDA_ERROR_DEINITIALIZED and is logged as "after_teardown op=<op>", and waits in progress
 * return it too. The library is not pinned in memory: a dlclose that unloads it after
 * cuInit (its exit handler and threads would then run unmapped code) is logged as
 * "unloaded_after_init" and aborts the process at once, where the real driver would crash
 * later. FAKECUDA_REJECT_ATTRIBUTES ("125,...") makes cuDeviceGetAttribute refuse those
 * attributes with CUDA_ERROR_INVALID_VALUE, as a driver older than the attribute does.
 *
 * Build (from the repository root):
 *   cc -std=c11 -Wall -Wextra -Werror -O1 -g -shared -fPIC -pthread -fvisibility=default \
 *      -Icsrc csrc/tests/fake_cuda.c -o libfakecuda.so -lrt
 * tests/fakecuda.py builds it and wraps it for Python tests. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "device/ts_cuda_api.h"

/* Error codes ts_cuda_api.h does not need but the double returns or names. */
#define CUDA_ERROR_ILLEGAL_STATE 401
#define CUDA_ERROR_UNKNOWN 999

/* Host registration flags the real driver accepts (PORTABLE|DEVICEMAP|IOMEMORY|READ_ONLY). */
#define FC_HOSTREGISTER_ALL 0xfu
/* Event flags the real driver accepts (BLOCKING_SYNC|DISABLE_TIMING|INTERPROCESS). */
#define FC_EVENT_ALL 0x7u

#define FC_API __attribute__((visibility("default")))
#define FC_MAX_DEV 16
#define FC_NAME 40
#define FC_STACK 64
#define FC_PAGE 4096ULL
#define FC_MEM_MAGIC 0x484d4346u   /* "FCMH" */
#define FC_EV_MAGIC 0x48454346u    /* "FCEH" */
#define FC_STATE_MAGIC 0x53454346u /* "FCES" */

/* The prototypes of the exports: -Wmissing-prototypes stays quiet, and a
 * signature that drifts from ts_cuda_api.h's table is a compile error. */
FC_API CUresult cuInit(unsigned int flags);
FC_API CUresult cuDriverGetVersion(int *version);
FC_API CUresult cuGetErrorName(CUresult error, const char **name);
FC_API CUresult cuGetErrorString(CUresult error, const char **text);
FC_API CUresult cuDeviceGetCount(int *count);
FC_API CUresult cuDeviceGet(CUdevice *device, int ordinal);
FC_API CUresult cuDeviceGetAttribute(int *value, int attribute, CUdevice device);
FC_API CUresult cuDeviceGetUuid(CUuuid *uuid, CUdevice device);
FC_API CUresult cuDeviceGetName(char *name, int len, CUdevice device);
FC_API CUresult cuDevicePrimaryCtxRetain(CUcontext *ctx, CUdevice device);
FC_API CUresult cuDevicePrimaryCtxRelease_v2(CUdevice device);
FC_API CUresult cuCtxPushCurrent_v2(CUcontext ctx);
FC_API CUresult cuCtxPopCurrent_v2(CUcontext *ctx);
FC_API CUresult cuCtxSynchronize(void);
FC_API CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytes);
FC_API CUresult cuMemFree_v2(CUdeviceptr dptr);
FC_API CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t bytes, CUstream s);
FC_API CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t bytes, CUstream s);
FC_API CUresult cuMemHostRegister_v2(void *p, size_t bytes, unsigned int flags);
FC_API CUresult cuMemHostUnregister(void *p);
FC_API CUresult cuStreamCreate(CUstream *stream, unsigned int flags);
FC_API CUresult cuStreamDestroy_v2(CUstream stream);
FC_API CUresult cuStreamSynchronize(CUstream stream);
FC_API CUresult cuStreamWaitEvent(CUstream stream, CUevent event, unsigned int flags);
FC_API CUresult cuEventCreate(CUevent *event, unsigned int flags);
FC_API CUresult cuEventDestroy_v2(CUevent event);
FC_API CUresult cuEventRecord(CUevent event, CUstream stream);
FC_API CUresult cuEventQuery(CUevent event);
FC_API CUresult cuEventSynchronize(CUevent event);
FC_API CUresult cuIpcGetMemHandle(CUipcMemHandle *handle, CUdeviceptr dptr);
FC_API CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *dptr, CUipcMemHandle handle, unsigned int flags);
FC_API CUresult cuIpcCloseMemHandle(CUdeviceptr dptr);
FC_API CUresult cuIpcGetEventHandle(CUipcEventHandle *handle, CUevent event);
FC_API CUresult cuIpcOpenEventHandle(CUevent *event, CUipcEventHandle handle);
FC_API CUresult fakecuda_launch_read(CUstream s, CUdeviceptr p, size_t n, unsigned long long *out,
                                     unsigned delay_us);
FC_API int fakecuda_counter(const char *op);
FC_API CUresult cuDeviceCanAccessPeer(int *can_access, CUdevice dev, CUdevice peer_dev);
#ifndef FAKECUDA_NO_UUID_V2
FC_API CUresult cuDeviceGetUuid_v2(CUuuid *uuid, CUdevice device);
#endif

/* Two GPUs and MIG (their section, at the end). */
static const char *fc_peer_configure(void);
static void fc_peer_uuid(int phys, int v2, char out[16]);
static int fc_peer_possible(int phys, int peer_phys);
FC_API CUresult cuCtxRecordEvent(CUcontext hctx, CUevent event);
FC_API CUresult cuThreadExchangeStreamCaptureMode(int *mode);
FC_API CUresult cuStreamIsCapturing(CUstream stream, int *status);
FC_API CUresult fakecuda_launch_sleep(CUstream s, unsigned delay_us);
FC_API CUresult fakecuda_begin_capture(CUstream s, int mode);
FC_API CUresult fakecuda_end_capture(CUstream s);
FC_API CUresult fakecuda_launch_gate(CUstream s, const int *open);
FC_API void fakecuda_teardown(void);

/* ==========================================================================
 * State
 * ========================================================================== */

/* A primary context: one per visible device. */
typedef struct fc_ctx {
    int ordinal;       /* visible ordinal (the CUdevice) */
    int phys;          /* physical device id */
    _Atomic int refs;  /* cuDevicePrimaryCtxRetain count */
} fc_ctx;

/* Device memory this process can address: an allocation or an IPC mapping. */
typedef struct fc_region {
    struct fc_region *next;
    int ipc;             /* 0: cuMemAlloc of this process; 1: cuIpcOpenMemHandle */
    uint8_t *base;       /* owns: the mapping (unmapped when pins drops to 0) */
    size_t size;
    char name[FC_NAME];  /* the shm object */
    int ordinal, phys;   /* device of the context it was created in */
    pid_t owner;         /* the allocating process */
    int opens;           /* ipc: open count (cuIpcCloseMemHandle unmaps at 0) */
    int pins;            /* the table's reference (while listed) + queued operations */
} fc_region;

/* A page-locked (registered) host range. */
typedef struct fc_host {
    struct fc_host *next;
    uintptr_t base;
    size_t size;
    unsigned flags;
} fc_host;

/* The shared part of an event: interprocess events keep it in shm. */
typedef struct fc_evstate {
    uint32_t magic;
    uint32_t pad;
    _Atomic uint64_t gen;  /* generation of the latest cuEventRecord */
    _Atomic uint64_t done; /* highest generation whose work completed */
} fc_evstate;

/* An event handle (CUevent) of this process. */
typedef struct fc_event {
    struct fc_event *next;
    fc_evstate *st;      /* owns: calloc'd (local) or a shm mapping (interprocess) */
    unsigned flags;
    int ipc;             /* interprocess: st is shared */
    int opened;          /* from cuIpcOpenEventHandle (destroy only unmaps) */
    int ordinal, phys;   /* device of the context it was created or opened in */
    pid_t creator;       /* the process that created the shm state */
    int refs;            /* the table's reference (while listed) + queued operations */
    char id[FC_NAME];    /* the shm name (interprocess) or local-<pid>-<n> */
    int captured;        /* under g_lock: last recorded on a capturing stream */
} fc_event;

/* What a queued stream operation does. */
typedef enum {
    FC_EX_HTOD, FC_EX_DTOD, FC_EX_RECORD, FC_EX_WAIT, FC_EX_READ,
    FC_EX_JOIN,  /* one stream's part of a cuCtxRecordEvent */
    FC_EX_SLEEP, /* fakecuda_launch_sleep: a slow kernel that touches nothing */
    FC_EX_GATE,  /* fakecuda_launch_gate: a kernel that runs until the host opens it */
} fc_kind;

struct fc_join;

/* One queued stream operation. */
typedef struct fc_op {
    struct fc_op *next;
    fc_kind kind;
    fc_region *dst_r, *src_r; /* pinned regions of dst and (DtoD) src */
    uint8_t *dst;
    const uint8_t *src;       /* device source, registered host source, or staging */
    uint8_t *staging;         /* owns: pageable HtoD copy of the source */
    size_t bytes;
    fc_event *ev;             /* RECORD/WAIT: a reference */
    uint64_t gen;             /* RECORD: generation to complete; WAIT: to wait for */
    unsigned long long *out;  /* READ: where the checksum goes */
    unsigned delay_us;        /* READ, SLEEP: extra "kernel" time */
    struct fc_join *join;     /* JOIN: the context-wide record it is part of */
    const int *gate;          /* GATE: runs until *gate != 0 (caller's memory) */
} fc_op;

/* A stream: a worker thread running a FIFO of operations. */
typedef struct fc_stream {
    struct fc_stream *next;
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t work_cv;  /* an operation arrived, or stop */
    pthread_cond_t idle_cv;  /* the queue drained */
    fc_op *head, *tail;      /* head is the running operation while running */
    int running;
    int stop;
    int refs;                /* under g_lock: the table's + callers' in flight */
    int is_default;          /* the legacy default stream of its context */
    int nonblocking;         /* created with CU_STREAM_NON_BLOCKING (the legacy stream does
                              * not wait for it, nor it for the legacy stream) */
    int ordinal, phys;       /* its context's device */
    char id[32];             /* <pid>-<n>, or "default" (device 0) / "default<d>" */
} fc_stream;

/* Settings read from the environment by cuInit. */
static struct {
    int ndev;                 /* physical devices */
    int nvis;                 /* visible devices */
    int vis[FC_MAX_DEV];      /* visible ordinal -> physical id */
    int no_ipc_events;
    int mig;
    unsigned long long mem_limit; /* 0: none */
    unsigned op_delay_us;
    int compute_mode;   /* CU_DEVICE_ATTRIBUTE_COMPUTE_MODE of every device */
    int fail_op;        /* an fc_opcode that always fails, or -1 */
    CUresult fail_code; /* what it fails with */
    int rejected[8];    /* FAKECUDA_REJECT_ATTRIBUTES: attributes this driver predates */
    int n_rejected;
} g_cfg;

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER; /* guards everything below */
static _Atomic int g_inited;
static fc_ctx g_ctx[FC_MAX_DEV];
static fc_region *g_regions;
static fc_host *g_hosts;
static fc_event *g_events;
static fc_stream *g_streams;
static fc_stream *g_default_stream[FC_MAX_DEV]; /* per context, made on first use */
static unsigned long long g_mem_used;
static _Atomic int g_deinit; /* exit() has begun: the driver is torn down */
static _Atomic unsigned g_seq;  /* names of shm objects */
static _Atomic unsigned g_sseq; /* stream ids */
static _Atomic unsigned g_eseq; /* local event ids */

/* The calling thread's context stack. */
static _Thread_local fc_ctx *t_stack[FC_STACK];
static _Thread_local int t_depth;

/* ==========================================================================
 * Log and counters
 * ========================================================================== */

/* Operations, as logged and counted. */
typedef enum {
    FC_OP_INIT, FC_OP_DRIVER_VERSION, FC_OP_ERROR_NAME, FC_OP_ERROR_STRING,
    FC_OP_DEVICE_COUNT, FC_OP_DEVICE_GET, FC_OP_DEVICE_ATTR, FC_OP_DEVICE_UUID,
    FC_OP_DEVICE_NAME, FC_OP_CTX_RETAIN, FC_OP_CTX_RELEASE, FC_OP_CTX_PUSH, FC_OP_CTX_POP,
    FC_OP_CTX_SYNC, FC_OP_ALLOC, FC_OP_FREE, FC_OP_HTOD, FC_OP_DTOD, FC_OP_HOST_REGISTER,
    FC_OP_HOST_UNREGISTER, FC_OP_STREAM_CREATE, FC_OP_STREAM_DESTROY, FC_OP_STREAM_SYNC,
    FC_OP_STREAM_WAIT_EVENT, FC_OP_EVENT_CREATE, FC_OP_EVENT_DESTROY, FC_OP_EVENT_RECORD,
    FC_OP_EVENT_QUERY, FC_OP_EVENT_SYNC, FC_OP_IPC_GET_MEM, FC_OP_IPC_OPEN_MEM,
    FC_OP_IPC_CLOSE_MEM, FC_OP_IPC_GET_EVENT, FC_OP_IPC_OPEN_EVENT, FC_OP_LAUNCH_READ,
    FC_OP_EXEC_HTOD, FC_OP_EXEC_DTOD, FC_OP_EXEC_RECORD, FC_OP_EXEC_WAIT, FC_OP_EXEC_READ,
    FC_OP_FAIL, FC_OP_DEVICE_UUID_V2, FC_OP_CAN_ACCESS_PEER, FC_OP_FREED_WHILE_IMPORTED,
    FC_OP_USE_AFTER_FREE, FC_OP_CTX_RECORD_EVENT, FC_OP_EXCHANGE_CAPTURE_MODE,
    FC_OP_LAUNCH_SLEEP, FC_OP_EXEC_JOIN, FC_OP_EXEC_SLEEP, FC_OP_BEGIN_CAPTURE,
    FC_OP_END_CAPTURE, FC_OP_CAPTURE_INVALIDATED, FC_OP_LAUNCH_GATE, FC_OP_EXEC_GATE,
    FC_OP_STREAM_IS_CAPTURING, FC_OP_TEARDOWN, FC_OP_AFTER_TEARDOWN, FC_OP_UNLOADED,
    FC_OP_COUNT
} fc_opcode;

static const char *const fc_op_names[FC_OP_COUNT] = {
    "init", "driver_version", "error_name", "error_string",
    "device_count", "device_get", "device_attr", "device_uuid",
    "device_name", "ctx_retain", "ctx_release", "ctx_push", "ctx_pop",
    "ctx_sync", "alloc", "free", "htod", "dtod", "host_register",
    "host_unregister", "stream_create", "stream_destroy", "stream_sync",
    "stream_wait_event", "event_create", "event_destroy", "event_record",
    "event_query", "event_sync", "ipc_get_mem", "ipc_open_mem",
    "ipc_close_mem", "ipc_get_event", "ipc_open_event", "launch_read",
    "exec_htod", "exec_dtod", "exec_record", "exec_wait", "exec_read",
    "fail", "device_uuid_v2", "can_access_peer", "freed_while_imported", "use_after_free",
    "ctx_record_event", "exchange_capture_mode", "launch_sleep",
    "exec_join", "exec_sleep", "begin_capture", "end_capture",
    "capture_invalidated", "launch_gate", "exec_gate",
    "stream_is_capturing", "teardown", "after_teardown", "unloaded_after_init",
};

static _Atomic int g_counts[FC_OP_COUNT];
static pthread_once_t g_log_once = PTHREAD_ONCE_INIT;
static int g_log_fd = -1;

/* Open $FAKECUDA_LOG for appending (once per process). */
static void fc_log_open(void)
{
    const char *path = getenv("FAKECUDA_LOG");
    if (path != NULL && path[0] != '\0')
        g_log_fd = open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
}

/* Count op and append "<pid> <op> <fields>\n" to the log with a single write(). */
__attribute__((format(printf, 2, 3))) static void fc_log(fc_opcode op, const char *fmt, ...)
{
    atomic_fetch_add_explicit(&g_counts[op], 1, memory_order_relaxed);
    pthread_once(&g_log_once, fc_log_open);
    if (g_log_fd < 0) return;
    char line[1024];
    int n = snprintf(line, sizeof line, "%d %s", (int)getpid(), fc_op_names[op]);
    if (fmt[0] != '\0' && n < (int)sizeof line - 2) {
        line[n++] = ' ';
        va_list ap;
        va_start(ap, fmt);
        int m = vsnprintf(line + n, sizeof line - (size_t)n, fmt, ap);
        va_end(ap);
        if (m > 0) n += m;
    }
    if (n > (int)sizeof line - 2) n = (int)sizeof line - 2;
    line[n++] = '\n';
    ssize_t w;
    do {
        w = write(g_log_fd, line, (size_t)n);
    } while (w < 0 && errno == EINTR);
}

/* ==========================================================================
 * Error names
 * ========================================================================== */

/* One error code the double returns, with its driver name and description. */
typedef struct fc_errdesc {
    CUresult code;
    const char *name;
    const char *text;
} fc_errdesc;

static const fc_errdesc fc_errors[] = {
    {CUDA_SUCCESS, "CUDA_SUCCESS", "no error"},
    {CUDA_ERROR_INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {CUDA_ERROR_OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
    {CUDA_ERROR_NOT_INITIALIZED, "CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
    {CUDA_ERROR_DEINITIALIZED, "CUDA_ERROR_DEINITIALIZED", "driver shutting down"},
    {CUDA_ERROR_NO_DEVICE, "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"},
    {CUDA_ERROR_INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
    {CUDA_ERROR_INVALID_CONTEXT, "CUDA_ERROR_INVALID_CONTEXT", "invalid device context"},
    {CUDA_ERROR_MAP_FAILED, "CUDA_ERROR_MAP_FAILED", "mapping of buffer object failed"},
    {CUDA_ERROR_PEER_ACCESS_UNSUPPORTED, "CUDA_ERROR_PEER_ACCESS_UNSUPPORTED",
     "peer access is not supported between these two devices"},
    {CUDA_ERROR_INVALID_HANDLE, "CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"},
    {CUDA_ERROR_ILLEGAL_STATE, "CUDA_ERROR_ILLEGAL_STATE",
     "the operation cannot be performed in the present state"},
    {CUDA_ERROR_NOT_READY, "CUDA_ERROR_NOT_READY", "device not ready"},
    {CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED, "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED",
     "part or all of the requested memory range is already mapped"},
    {CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED, "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED",
     "pointer does not correspond to a registered memory region"},
    {CUDA_ERROR_NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED", "operation not supported"},
    {CUDA_ERROR_UNKNOWN, "CUDA_ERROR_UNKNOWN", "unknown error"},
    {CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
     "operation not permitted when stream is capturing"},
    {CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED",
     "operation failed due to a previous error during capture"},
    {CUDA_ERROR_STREAM_CAPTURE_ISOLATION, "CUDA_ERROR_STREAM_CAPTURE_ISOLATION",
     "dependency created on uncaptured work in another stream"},
    {CUDA_ERROR_STREAM_CAPTURE_IMPLICIT, "CUDA_ERROR_STREAM_CAPTURE_IMPLICIT",
     "operation would make the legacy stream depend on a capturing blocking stream"},
    {CUDA_ERROR_CAPTURED_EVENT, "CUDA_ERROR_CAPTURED_EVENT",
     "operation not permitted on an event last recorded in a capturing stream"},
};

/* The description of code, or NULL if the double does not know it. */
static const fc_errdesc *fc_error(CUresult code)
{
    for (size_t i = 0; i < sizeof fc_errors / sizeof fc_errors[0]; i++)
        if (fc_errors[i].code == code) return &fc_errors[i];
    return NULL;
}

/* Log "fail op=<op> rc=<rc> err=<name> why=<why>", count it, and return rc. */
static CUresult fc_fail(fc_opcode op, CUresult rc, const char *why)
{
    const fc_errdesc *d = fc_error(rc);
    fc_log(FC_OP_FAIL, "op=%s rc=%d err=%s why=%s", fc_op_names[op], rc,
           d != NULL ? d->name : "?", why);
    return rc;
}

/* ==========================================================================
 * Small helpers
 * ========================================================================== */

/* Sleep us microseconds (signals do not cut it short). */
static void fc_sleep_us(unsigned long long us)
{
    if (us == 0) return;
    struct timespec ts = {(time_t)(us / 1000000ULL), (long)(us % 1000000ULL) * 1000L};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

/* Poll until *done reaches target (sleeps grow from 20 us to 1 ms); 0, or -1 if the driver
 * was torn down meanwhile (exit() began: a wait in progress then fails). */
static int fc_wait_done(_Atomic uint64_t *done, uint64_t target)
{
    unsigned long long nap = 20;
    while (atomic_load_explicit(done, memory_order_acquire) < target) {
        if (atomic_load_explicit(&g_deinit, memory_order_acquire)) return -1;
        fc_sleep_us(nap);
        if (nap < 1000) nap *= 2;
    }
    return 0;
}

/* Raise *done to gen unless it is already higher (records may complete out of order). */
static void fc_complete(_Atomic uint64_t *done, uint64_t gen)
{
    uint64_t cur = atomic_load_explicit(done, memory_order_acquire);
    while (cur < gen &&
           !atomic_compare_exchange_weak_explicit(done, &cur, gen, memory_order_acq_rel,
                                                  memory_order_acquire)) {
    }
}

/* FNV-1a 64 of n bytes at p. */
static unsigned long long fc_fnv1a(const uint8_t *p, size_t n)
{
    unsigned long long h = 0xcbf29ce484222325ULL;
    for (size_t i = 0; i < n; i++) {
        h ^= p[i];
        h *= 0x100000001b3ULL;
    }
    return h;
}

/* Parse a non-negative decimal environment variable; def if unset or malformed. */
static unsigned long long fc_env_ull(const char *name, unsigned long long def)
{
    const char *s = getenv(name);
    if (s == NULL || s[0] < '0' || s[0] > '9') return def;
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno != 0 || *end != '\0') return def;
    return v;
}

/* Whether an environment flag is set to something other than "" or "0". */
static int fc_env_flag(const char *name)
{
    const char *s = getenv(name);
    return s != NULL && s[0] != '\0' && strcmp(s, "0") != 0;
}

/* Create a new shm object "/<prefix>-<pid>-<n>" of bytes (mode 0600), committing its
 * pages. Returns the fd (name filled), or -1 with errno set. */
static int fc_shm_create(char name[FC_NAME], const char *prefix, size_t bytes)
{
    for (int tries = 0; tries < 1000; tries++) {
        unsigned n = atomic_fetch_add(&g_seq, 1) + 1;
        snprintf(name, FC_NAME, "/%s-%d-%u", prefix, (int)getpid(), n);
        int fd = shm_open(name, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
        if (fd < 0 && errno == EEXIST) continue; /* left over by a killed process */
        if (fd < 0) return -1;
        int rc = posix_fallocate(fd, 0, (off_t)bytes);
        if (rc != 0) {
            shm_unlink(name);
            close(fd);
            errno = rc;
            return -1;
        }
        return fd;
    }
    errno = EEXIST;
    return -1;
}

/* ==========================================================================
 * Contexts
 * ========================================================================== */

/* CUDA_SUCCESS unless the driver was torn down at exit: then log "after_teardown op=<op>"
 * and return CUDA_ERROR_DEINITIALIZED, "This indicates that the CUDA driver is in the
 * process of shutting down" (CUresult, cuda.h). */
static CUresult fc_alive(fc_opcode op)
{
    if (!atomic_load_explicit(&g_deinit, memory_order_acquire)) return CUDA_SUCCESS;
    fc_log(FC_OP_AFTER_TEARDOWN, "op=%s", fc_op_names[op]);
    return fc_fail(op, CUDA_ERROR_DEINITIALIZED, "driver_torn_down_at_exit");
}

/* CUDA_SUCCESS if cuInit succeeded (and the driver is not torn down), else log op's
 * failure. */
static CUresult fc_need_init(fc_opcode op)
{
    CUresult alive = fc_alive(op);
    if (alive != CUDA_SUCCESS) return alive;
    if (!atomic_load_explicit(&g_inited, memory_order_acquire))
        return fc_fail(op, CUDA_ERROR_NOT_INITIALIZED, "cuInit_not_called");
    if ((int)op == g_cfg.fail_op) return fc_fail(op, g_cfg.fail_code, "FAKECUDA_FAIL_OP");
    return CUDA_SUCCESS;
}

/* The calling thread's current context, which must be retained; else fail op. */
static CUresult fc_current(fc_opcode op, fc_ctx **out)
{
    CUresult rc = fc_need_init(op);
    if (rc != CUDA_SUCCESS) return rc;
    if (t_depth == 0) return fc_fail(op, CUDA_ERROR_INVALID_CONTEXT, "no_current_context");
    fc_ctx *c = t_stack[t_depth - 1];
    if (atomic_load(&c->refs) <= 0)
        return fc_fail(op, CUDA_ERROR_INVALID_CONTEXT, "current_context_released");
    *out = c;
    return CUDA_SUCCESS;
}

/* The context of visible device d, or NULL if d is out of range. */
static fc_ctx *fc_device(CUdevice d)
{
    if (d < 0 || d >= g_cfg.nvis) return NULL;
    return &g_ctx[d];
}

/* ==========================================================================
 * Regions (device memory) and registered host ranges
 * ========================================================================== */

/* The region containing [p, p+n) (n may be 0), pinned; NULL if none. */
static fc_region *fc_region_pin(uintptr_t p, size_t n)
{
    fc_region *found = NULL;
    pthread_mutex_lock(&g_lock);
    for (fc_region *r = g_regions; r != NULL; r = r->next) {
        uintptr_t b = (uintptr_t)r->base;
        if (p >= b && p < b + r->size && n <= r->size - (p - b)) {
            found = r;
            found->pins++;
            break;
        }
    }
    pthread_mutex_unlock(&g_lock);
    return found;
}

/* Drop a pin; the last one unmaps and frees the region. */
static void fc_region_unpin(fc_region *r)
{
    if (r == NULL) return;
    pthread_mutex_lock(&g_lock);
    int last = --r->pins == 0;
    pthread_mutex_unlock(&g_lock);
    if (!last) return;
    munmap(r->base, r->size);
    free(r);
}

/* Unlink r from the table (caller holds g_lock). */
static void fc_region_unlist(fc_region *r)
{
    for (fc_region **pp = &g_regions; *pp != NULL; pp = &(*pp)->next) {
        if (*pp == r) {
            *pp = r->next;
            return;
        }
    }
}

/* Whether [p, p+n) lies inside one registered host range. */
static int fc_host_registered(uintptr_t p, size_t n)
{
    int found = 0;
    pthread_mutex_lock(&g_lock);
    for (fc_host *h = g_hosts; h != NULL; h = h->next)
        if (p >= h->base && p - h->base < h->size && n <= h->size - (p - h->base)) found = 1;
    pthread_mutex_unlock(&g_lock);
    return found;
}

/* Check the pages of [lo, hi) in /proc/self/maps: 1 if all mapped (*writable
 * says whether all are writable), 0 if some page is unmapped, -1 if unreadable. */
static int fc_range_perms(uintptr_t lo, uintptr_t hi, int *writable)
{
    FILE *f = fopen("/proc/self/maps", "re");
    if (f == NULL) return -1;
    lo &= ~(uintptr_t)(FC_PAGE - 1);
    hi = (hi + FC_PAGE - 1) & ~(uintptr_t)(FC_PAGE - 1);
    uintptr_t cur = lo;
    char line[512];
    *writable = 1;
    while (cur < hi && fgets(line, sizeof line, f) != NULL) {
        size_t len = strlen(line);
        if (len > 0 && line[len - 1] != '\n') { /* a long path: skip the rest of the line */
            int c;
            while ((c = fgetc(f)) != EOF && c != '\n') {
            }
        }
        unsigned long a, b;
        char perms[8];
        if (sscanf(line, "%lx-%lx %7s", &a, &b, perms) != 3) continue;
        if (b <= cur) continue;
        if (a > cur) break; /* a hole */
        if (perms[1] != 'w') *writable = 0;
        cur = b;
    }
    fclose(f);
    return cur >= hi;
}

/* ==========================================================================
 * Importers of an allocation (freed_while_imported, use_after_free)
 * ========================================================================== */

/* The driver: "Calling cuMemFree on an exported memory region before calling
 * cuIpcCloseMemHandle in the importing context will result in undefined behavior"
 * (cuIpcOpenMemHandle). The double keeps, beside each allocation /fakecuda-<pid>-<n>, a
 * table /fakecuda-imp-<pid>-<n> of the processes that have it open, so that such a free
 * is logged ("freed_while_imported importer=<pid>") instead of passing silently, and an
 * importer's later stream operation on memory whose exporter freed it or exited is logged
 * as "use_after_free". */

#define FC_IMPORTERS 64
#define FC_IMP_MAGIC 0x49494346u /* "FCII" */

/* The shared table of one allocation's importers. */
typedef struct fc_imports {
    uint32_t magic;
    _Atomic uint32_t gone;              /* the exporter freed the allocation, or exited */
    _Atomic int32_t pid[FC_IMPORTERS];  /* processes that have it open (0: free entry) */
} fc_imports;

/* The table's name for allocation name ("/fakecuda-<pid>-<n>"). */
static void fc_imports_name(char out[FC_NAME], const char *alloc)
{
    snprintf(out, FC_NAME, "/fakecuda-imp-%s", alloc + strlen("/fakecuda-"));
}

/* Map allocation name's table (create: make it); NULL if there is none. */
static fc_imports *fc_imports_map(const char *alloc, int create)
{
    char name[FC_NAME];
    fc_imports_name(name, alloc);
    int fd = shm_open(name, O_RDWR | O_CLOEXEC | (create ? O_CREAT | O_EXCL : 0), 0600);
    if (fd < 0) return NULL;
    if (create && ftruncate(fd, sizeof(fc_imports)) != 0) {
        close(fd);
        shm_unlink(name);
        return NULL;
    }
    void *p = mmap(NULL, sizeof(fc_imports), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (p == MAP_FAILED) return NULL;
    fc_imports *t = p;
    if (create) t->magic = FC_IMP_MAGIC;
    return t;
}

/* Undo fc_imports_map. */
static void fc_imports_unmap(fc_imports *t)
{
    if (t != NULL) munmap(t, sizeof *t);
}

/* Whether process pid runs (a zombie does not). */
static int fc_pid_alive(pid_t pid)
{
    char path[64], buf[256];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return kill(pid, 0) == 0 || errno != ESRCH;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return 1;
    buf[n] = '\0';
    const char *paren = strrchr(buf, ')');
    return paren == NULL || paren[1] == '\0' || (paren[2] != 'Z' && paren[2] != 'X');
}

/* A new allocation: its (empty) importer table. */
static void fc_imports_create(const char *alloc)
{
    fc_imports_unmap(fc_imports_map(alloc, 1));
}

/* This process opened allocation alloc (its first open here). */
static void fc_imports_add(const char *alloc)
{
    fc_imports *t = fc_imports_map(alloc, 0);
    if (t == NULL) return;
    for (int i = 0; i < FC_IMPORTERS; i++) {
        int32_t want = 0;
        if (atomic_compare_exchange_strong(&t->pid[i], &want, (int32_t)getpid())) break;
    }
    fc_imports_unmap(t);
}

/* This process closed its last open of allocation alloc. */
static void fc_imports_drop(const char *alloc)
{
    fc_imports *t = fc_imports_map(alloc, 0);
    if (t == NULL) return;
    for (int i = 0; i < FC_IMPORTERS; i++) {
        int32_t want = (int32_t)getpid();
        if (atomic_compare_exchange_strong(&t->pid[i], &want, 0)) break;
    }
    fc_imports_unmap(t);
}

/* The exporter frees allocation alloc (or exits, how: "free" or "exit"): log each live
 * importer, mark the table gone and unlink it (importers keep their mapping of it). */
static void fc_imports_release(const char *alloc, const void *base, const char *how)
{
    fc_imports *t = fc_imports_map(alloc, 0);
    if (t == NULL) return;
    atomic_store(&t->gone, 1);
    for (int i = 0; i < FC_IMPORTERS; i++) {
        int32_t pid = atomic_load(&t->pid[i]);
        if (pid != 0 && fc_pid_alive(pid))
            fc_log(FC_OP_FREED_WHILE_IMPORTED, "name=%s ptr=%p importer=%d how=%s", alloc,
                   base, (int)pid, how);
    }
    fc_imports_unmap(t);
    char name[FC_NAME];
    fc_imports_name(name, alloc);
    shm_unlink(name);
}

/* An importer queues work on its mapping r of another process's allocation: log it if
 * that memory is gone (freed, its exporter exited or was killed). */
static void fc_imports_check_use(const fc_region *r, const char *op)
{
    if (!r->ipc) return;
    fc_imports *t = fc_imports_map(r->name, 0);
    int gone = t == NULL || atomic_load(&t->gone) || !fc_pid_alive(r->owner);
    fc_imports_unmap(t);
    if (gone)
        fc_log(FC_OP_USE_AFTER_FREE, "name=%s exporter=%d op=%s", r->name, (int)r->owner, op);
}

/* ==========================================================================
 * Events
 * ========================================================================== */

/* The event of handle h with a reference taken; NULL if h is not one. */
static fc_event *fc_event_get(CUevent h)
{
    fc_event *found = NULL;
    pthread_mutex_lock(&g_lock);
    for (fc_event *e = g_events; e != NULL; e = e->next) {
        if ((CUevent)e == h) {
            found = e;
            e->refs++;
            break;
        }
    }
    pthread_mutex_unlock(&g_lock);
    return found;
}

/* Drop a reference; the last one releases the state. */
static void fc_event_put(fc_event *e)
{
    if (e == NULL) return;
    pthread_mutex_lock(&g_lock);
    int last = --e->refs == 0;
    pthread_mutex_unlock(&g_lock);
    if (!last) return;
    if (e->ipc)
        munmap(e->st, FC_PAGE);
    else
        free(e->st);
    free(e);
}

/* Map the shm state of an interprocess event; MAP_FAILED's CUresult on error. */
static CUresult fc_event_map(const char *name, int create, fc_evstate **out)
{
    int fd = shm_open(name, O_RDWR | O_CLOEXEC, 0600);
    if (fd < 0) return CUDA_ERROR_MAP_FAILED;
    struct stat sb;
    void *p = MAP_FAILED;
    if (fstat(fd, &sb) == 0 && (unsigned long long)sb.st_size >= FC_PAGE)
        p = mmap(NULL, FC_PAGE, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (p == MAP_FAILED) return CUDA_ERROR_MAP_FAILED;
    fc_evstate *st = p;
    if (create) {
        st->magic = FC_STATE_MAGIC;
        atomic_init(&st->gen, 0);
        atomic_init(&st->done, 0);
    } else if (st->magic != FC_STATE_MAGIC) {
        munmap(p, FC_PAGE);
        return CUDA_ERROR_INVALID_VALUE;
    }
    *out = st;
    return CUDA_SUCCESS;
}

/* Capture simulation hooks (defined in the "Stream capture" section below). */
static void fc_join_part_done(struct fc_join *j);
static CUresult fc_capture_forbids_ctx(fc_opcode op, int ordinal);
static CUresult fc_capture_forbids_stream(fc_opcode op, const fc_stream *s);
static CUresult fc_capture_forbids_legacy(fc_opcode op, const fc_stream *s);
static CUresult fc_capture_forbids_event(fc_opcode op, fc_event *e);
static CUresult fc_capture_forbids_wait(fc_opcode op, const fc_stream *s, const fc_event *e,
                                        unsigned flags);
static CUresult fc_capture_forbids_unsafe(fc_opcode op);
static void fc_capture_note_record(fc_event *e, const fc_stream *s);

/* ==========================================================================
 * Streams
 * ========================================================================== */

/* Release what a finished operation holds. */
static void fc_op_free(fc_op *op)
{
    fc_region_unpin(op->dst_r);
    fc_region_unpin(op->src_r);
    fc_event_put(op->ev);
    free(op->staging);
    free(op);
}

/* Carry out one operation on stream s. */
static void fc_execute(fc_stream *s, fc_op *op)
{
    switch (op->kind) {
    case FC_EX_HTOD:
        if (op->bytes > 0) memcpy(op->dst, op->src, op->bytes);
        fc_log(FC_OP_EXEC_HTOD, "dst=%p bytes=%zu name=%s stream=%s", (void *)op->dst, op->bytes,
               op->dst_r->name, s->id);
        break;
    case FC_EX_DTOD:
        memmove(op->dst, op->src, op->bytes);
        fc_log(FC_OP_EXEC_DTOD, "dst=%p src=%p bytes=%zu dst_name=%s src_name=%s stream=%s",
               (void *)op->dst, (const void *)op->src, op->bytes, op->dst_r->name,
               op->src_r->name, s->id);
        break;
    case FC_EX_RECORD:
        fc_complete(&op->ev->st->done, op->gen);
        fc_log(FC_OP_EXEC_RECORD, "ev=%s gen=%llu stream=%s", op->ev->id,
               (unsigned long long)op->gen, s->id);
        break;
    case FC_EX_WAIT:
        (void)fc_wait_done(&op->ev->st->done, op->gen); /* at teardown the wait ends */
        fc_log(FC_OP_EXEC_WAIT, "ev=%s gen=%llu stream=%s", op->ev->id,
               (unsigned long long)op->gen, s->id);
        break;
    case FC_EX_READ: {
        fc_sleep_us(op->delay_us);
        unsigned long long sum = fc_fnv1a(op->src, op->bytes);
        *op->out = sum;
        fc_log(FC_OP_EXEC_READ, "ptr=%p bytes=%zu name=%s sum=%016llx stream=%s",
               (const void *)op->src, op->bytes, op->src_r->name, sum, s->id);
        break;
    }
    case FC_EX_JOIN:
        fc_log(FC_OP_EXEC_JOIN, "stream=%s", s->id);
        fc_join_part_done(op->join);
        break;
    case FC_EX_SLEEP:
        fc_sleep_us(op->delay_us);
        fc_log(FC_OP_EXEC_SLEEP, "us=%u stream=%s", op->delay_us, s->id);
        break;
    case FC_EX_GATE: {
        unsigned long long nap = 20;
        while (__atomic_load_n(op->gate, __ATOMIC_ACQUIRE) == 0) {
            fc_sleep_us(nap);
            if (nap < 1000) nap *= 2;
        }
        fc_log(FC_OP_EXEC_GATE, "stream=%s", s->id);
        break;
    }
    }
}

/* The worker thread of a stream: run queued operations in order until stopped and drained. */
static void *fc_worker(void *arg)
{
    fc_stream *s = arg;
    pthread_mutex_lock(&s->mu);
    for (;;) {
        while (s->head == NULL && !s->stop) pthread_cond_wait(&s->work_cv, &s->mu);
        if (s->head == NULL) break;
        fc_op *op = s->head;
        s->running = 1;
        pthread_mutex_unlock(&s->mu);
        fc_sleep_us(g_cfg.op_delay_us);
        fc_execute(s, op);
        pthread_mutex_lock(&s->mu);
        s->head = op->next;
        if (s->head == NULL) s->tail = NULL;
        pthread_mutex_unlock(&s->mu);
        fc_op_free(op);
        pthread_mutex_lock(&s->mu);
        s->running = 0;
        if (s->head == NULL) pthread_cond_broadcast(&s->idle_cv);
    }
    pthread_mutex_unlock(&s->mu);
    return NULL;
}

/* Allocate a stream on ctx's device and start its worker (signals blocked there). */
static fc_stream *fc_stream_new(const fc_ctx *ctx, int is_default, int nonblocking)
{
    fc_stream *s = calloc(1, sizeof *s);
    if (s == NULL) return NULL;
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->work_cv, NULL);
    pthread_cond_init(&s->idle_cv, NULL);
    s->refs = 1;
    s->is_default = is_default;
    s->nonblocking = nonblocking;
    s->ordinal = ctx->ordinal;
    s->phys = ctx->phys;
    if (is_default && ctx->ordinal == 0)
        snprintf(s->id, sizeof s->id, "default");
    else if (is_default)
        snprintf(s->id, sizeof s->id, "default%d", ctx->ordinal);
    else
        snprintf(s->id, sizeof s->id, "%d-%u", (int)getpid(), atomic_fetch_add(&g_sseq, 1) + 1);
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    int rc = pthread_create(&s->thread, NULL, fc_worker, s);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (rc != 0) {
        pthread_cond_destroy(&s->idle_cv);
        pthread_cond_destroy(&s->work_cv);
        pthread_mutex_destroy(&s->mu);
        free(s);
        return NULL;
    }
    return s;
}

/* The stream of handle h (0, 1 and 2: the legacy default stream of the current context,
 * created on first use; the double has no per-thread default streams) with a reference
 * taken; NULL if h is not one. */
static fc_stream *fc_stream_get(CUstream h, const fc_ctx *ctx)
{
    fc_stream *found = NULL;
    pthread_mutex_lock(&g_lock);
    if (h == NULL || h == TS_CU_STREAM_LEGACY || h == TS_CU_STREAM_PER_THREAD) {
        fc_stream **d = &g_default_stream[ctx->ordinal];
        if (*d == NULL) {
            *d = fc_stream_new(ctx, 1, 0);
            if (*d != NULL) {
                (*d)->next = g_streams;
                g_streams = *d;
            }
        }
        found = *d;
    } else {
        for (fc_stream *s = g_streams; s != NULL; s = s->next)
            if ((CUstream)s == h) found = s;
    }
    if (found != NULL) found->refs++;
    pthread_mutex_unlock(&g_lock);
    return found;
}

/* Drop a reference; the last one frees the (stopped, joined) stream. */
static void fc_stream_put(fc_stream *s)
{
    pthread_mutex_lock(&g_lock);
    int last = --s->refs == 0;
    pthread_mutex_unlock(&g_lock);
    if (!last) return;
    pthread_cond_destroy(&s->idle_cv);
    pthread_cond_destroy(&s->work_cv);
    pthread_mutex_destroy(&s->mu);
    free(s);
}

/* Append op to s; 0, or -1 (op not taken) if s is being destroyed. */
static int fc_enqueue(fc_stream *s, fc_op *op)
{
    pthread_mutex_lock(&s->mu);
    if (s->stop) {
        pthread_mutex_unlock(&s->mu);
        return -1;
    }
    op->next = NULL;
    if (s->tail != NULL)
        s->tail->next = op;
    else
        s->head = op;
    s->tail = op;
    pthread_cond_signal(&s->work_cv);
    pthread_mutex_unlock(&s->mu);
    return 0;
}

/* Block until s has nothing queued or running. */
static void fc_stream_drain(fc_stream *s)
{
    pthread_mutex_lock(&s->mu);
    while (s->head != NULL || s->running) pthread_cond_wait(&s->idle_cv, &s->mu);
    pthread_mutex_unlock(&s->mu);
}

/* Look up stream h for op; fail with CUDA_ERROR_INVALID_HANDLE if it is not one, or with
 * CUDA_ERROR_STREAM_CAPTURE_IMPLICIT for the legacy stream during a blocking capture. */
static CUresult fc_stream_for(fc_opcode op, CUstream h, const fc_ctx *ctx, fc_stream **out)
{
    *out = fc_stream_get(h, ctx);
    if (*out == NULL) return fc_fail(op, CUDA_ERROR_INVALID_HANDLE, "unknown_stream");
    CUresult rc = fc_capture_forbids_legacy(op, *out);
    if (rc != CUDA_SUCCESS) {
        fc_stream_put(*out);
        *out = NULL;
    }
    return rc;
}

/* Queue op on s for API call code; on failure free op and return the logged error. */
static CUresult fc_submit(fc_opcode code, fc_stream *s, fc_op *op)
{
    if (fc_enqueue(s, op) == 0) return CUDA_SUCCESS;
    fc_op_free(op);
    return fc_fail(code, CUDA_ERROR_INVALID_HANDLE, "stream_being_destroyed");
}

/* ==========================================================================
 * Initialization and devices
 * ========================================================================== */

/* Read the FAKECUDA_* settings (caller holds g_lock); 0 if some device is visible. */
static int fc_configure(void)
{
    unsigned long long nd = fc_env_ull("FAKECUDA_DEVICES", 1);
    g_cfg.ndev = nd > FC_MAX_DEV ? FC_MAX_DEV : (int)nd;
    g_cfg.nvis = 0;
    const char *vis = getenv("FAKECUDA_VISIBLE");
    if (vis == NULL) {
        for (int i = 0; i < g_cfg.ndev; i++) g_cfg.vis[g_cfg.nvis++] = i;
    } else {
        /* Like CUDA_VISIBLE_DEVICES: the list ends at the first invalid or repeated entry. */
        const char *p = vis;
        while (*p != '\0' && g_cfg.nvis < FC_MAX_DEV) {
            char *end;
            long id = strtol(p, &end, 10);
            if (end == p || id < 0 || id >= g_cfg.ndev) break;
            int dup = 0;
            for (int i = 0; i < g_cfg.nvis; i++) dup |= g_cfg.vis[i] == id;
            if (dup) break;
            g_cfg.vis[g_cfg.nvis++] = (int)id;
            while (*end == ' ') end++;
            if (*end != ',') break;
            p = end + 1;
        }
    }
    for (int i = 0; i < g_cfg.nvis; i++) {
        g_ctx[i].ordinal = i;
        g_ctx[i].phys = g_cfg.vis[i];
        atomic_init(&g_ctx[i].refs, 0);
    }
    g_cfg.no_ipc_events = fc_env_flag("FAKECUDA_NO_IPC_EVENTS");
    g_cfg.mig = fc_env_flag("FAKECUDA_MIG");
    g_cfg.mem_limit = fc_env_ull("FAKECUDA_MEM_LIMIT", 0);
    unsigned long long delay = fc_env_ull("FAKECUDA_OP_DELAY_US", 0);
    g_cfg.op_delay_us = delay > 60000000ULL ? 60000000u : (unsigned)delay;
    g_cfg.compute_mode = (int)fc_env_ull("FAKECUDA_COMPUTE_MODE", 0);
    g_cfg.fail_op = -1;
    const char *fail = getenv("FAKECUDA_FAIL_OP");
    for (int op = 0; fail != NULL && op < FC_OP_COUNT; op++)
        if (strcmp(fail, fc_op_names[op]) == 0) g_cfg.fail_op = op;
    g_cfg.fail_code = (CUresult)fc_env_ull("FAKECUDA_FAIL_CODE", CUDA_ERROR_NOT_SUPPORTED);
    g_cfg.n_rejected = 0;
    const char *rej = getenv("FAKECUDA_REJECT_ATTRIBUTES");
    for (const char *q = rej; q != NULL && *q != '\0' && g_cfg.n_rejected < 8;) {
        char *end;
        long a = strtol(q, &end, 10);
        if (end == q) break;
        g_cfg.rejected[g_cfg.n_rejected++] = (int)a;
        q = *end == ',' ? end + 1 : end;
    }
    if (fc_peer_configure() != NULL) return -2;
    return g_cfg.nvis > 0 ? 0 : -1;
}

static void fc_teardown(void *unused);
int __cxa_atexit(void (*fn)(void *), void *arg, void *dso); /* glibc, C++ ABI */

/* Initialize the driver: reads the environment once; FAKECUDA_FAIL_INIT=1 fails it. The
 * first success registers the driver's teardown at exit (fc_teardown). */
FC_API CUresult cuInit(unsigned int flags)
{
    CUresult alive = fc_alive(FC_OP_INIT);
    if (alive != CUDA_SUCCESS) return alive;
    if (flags != 0) return fc_fail(FC_OP_INIT, CUDA_ERROR_INVALID_VALUE, "flags_not_zero");
    if (fc_env_flag("FAKECUDA_FAIL_INIT"))
        return fc_fail(FC_OP_INIT, CUDA_ERROR_NO_DEVICE, "FAKECUDA_FAIL_INIT");
    pthread_mutex_lock(&g_lock);
    int bad = 0;
    if (!atomic_load(&g_inited)) {
        bad = fc_configure();
        if (!bad) {
            /* A NULL DSO handle: exit() runs it, a dlclose of this library does not. */
            __cxa_atexit(fc_teardown, NULL, NULL);
            atomic_store_explicit(&g_inited, 1, memory_order_release);
        }
    }
    pthread_mutex_unlock(&g_lock);
    if (bad == -2) return fc_fail(FC_OP_INIT, CUDA_ERROR_INVALID_VALUE, fc_peer_configure());
    if (bad) return fc_fail(FC_OP_INIT, CUDA_ERROR_NO_DEVICE, "no_visible_device");
    fc_log(FC_OP_INIT, "devices=%d visible=%d", g_cfg.ndev, g_cfg.nvis);
    return CUDA_SUCCESS;
}

/* The driver version: 12040 (CUDA 12.4); works before cuInit, like the real one. */
FC_API CUresult cuDriverGetVersion(int *version)
{
    CUresult alive = fc_alive(FC_OP_DRIVER_VERSION);
    if (alive != CUDA_SUCCESS) return alive;
    if (version == NULL) return fc_fail(FC_OP_DRIVER_VERSION, CUDA_ERROR_INVALID_VALUE, "null");
    *version = (int)fc_env_ull("FAKECUDA_DRIVER_VERSION", 12080);
    fc_log(FC_OP_DRIVER_VERSION, "version=%d", *version);
    return CUDA_SUCCESS;
}

/* The name of an error code; unknown codes leave *name NULL and fail. */
FC_API CUresult cuGetErrorName(CUresult error, const char **name)
{
    CUresult alive = fc_alive(FC_OP_ERROR_NAME);
    if (alive != CUDA_SUCCESS) return alive;
    if (name == NULL) return fc_fail(FC_OP_ERROR_NAME, CUDA_ERROR_INVALID_VALUE, "null");
    const fc_errdesc *d = fc_error(error);
    *name = d != NULL ? d->name : NULL;
    if (d == NULL) return fc_fail(FC_OP_ERROR_NAME, CUDA_ERROR_INVALID_VALUE, "unknown_code");
    fc_log(FC_OP_ERROR_NAME, "rc=%d", error);
    return CUDA_SUCCESS;
}

/* The description of an error code; unknown codes leave *text NULL and fail. */
FC_API CUresult cuGetErrorString(CUresult error, const char **text)
{
    CUresult alive = fc_alive(FC_OP_ERROR_STRING);
    if (alive != CUDA_SUCCESS) return alive;
    if (text == NULL) return fc_fail(FC_OP_ERROR_STRING, CUDA_ERROR_INVALID_VALUE, "null");
    const fc_errdesc *d = fc_error(error);
    *text = d != NULL ? d->text : NULL;
    if (d == NULL) return fc_fail(FC_OP_ERROR_STRING, CUDA_ERROR_INVALID_VALUE, "unknown_code");
    fc_log(FC_OP_ERROR_STRING, "rc=%d", error);
    return CUDA_SUCCESS;
}

/* The number of visible devices. */
FC_API CUresult cuDeviceGetCount(int *count)
{
    CUresult rc = fc_need_init(FC_OP_DEVICE_COUNT);
    if (rc != CUDA_SUCCESS) return rc;
    if (count == NULL) return fc_fail(FC_OP_DEVICE_COUNT, CUDA_ERROR_INVALID_VALUE, "null");
    *count = g_cfg.nvis;
    fc_log(FC_OP_DEVICE_COUNT, "count=%d", g_cfg.nvis);
    return CUDA_SUCCESS;
}

/* The device of a visible ordinal (the ordinal itself). */
FC_API CUresult cuDeviceGet(CUdevice *device, int ordinal)
{
    CUresult rc = fc_need_init(FC_OP_DEVICE_GET);
    if (rc != CUDA_SUCCESS) return rc;
    if (device == NULL) return fc_fail(FC_OP_DEVICE_GET, CUDA_ERROR_INVALID_VALUE, "null");
    fc_ctx *c = fc_device(ordinal);
    if (c == NULL) return fc_fail(FC_OP_DEVICE_GET, CUDA_ERROR_INVALID_DEVICE, "bad_ordinal");
    *device = ordinal;
    fc_log(FC_OP_DEVICE_GET, "dev=%d phys=%d", ordinal, c->phys);
    return CUDA_SUCCESS;
}

/* Attributes: unified addressing 1, IPC events 1 (0 with FAKECUDA_NO_IPC_EVENTS), read-only
 * host registration 1, compute mode FAKECUDA_COMPUTE_MODE (0: default), others 0; those in
 * FAKECUDA_REJECT_ATTRIBUTES are refused. */
FC_API CUresult cuDeviceGetAttribute(int *value, int attribute, CUdevice device)
{
    CUresult rc = fc_need_init(FC_OP_DEVICE_ATTR);
    if (rc != CUDA_SUCCESS) return rc;
    if (value == NULL) return fc_fail(FC_OP_DEVICE_ATTR, CUDA_ERROR_INVALID_VALUE, "null");
    if (fc_device(device) == NULL)
        return fc_fail(FC_OP_DEVICE_ATTR, CUDA_ERROR_INVALID_DEVICE, "bad_ordinal");
    /* A driver older than an attribute refuses it: CU_DEVICE_ATTRIBUTE_IPC_EVENT_SUPPORTED
     * (125) came with CUDA 12.0, and an 11.x driver's enum ends before it (its MAX is 125);
     * such a query returns CUDA_ERROR_INVALID_VALUE (FAKECUDA_REJECT_ATTRIBUTES). */
    for (int i = 0; i < g_cfg.n_rejected; i++)
        if (g_cfg.rejected[i] == attribute)
            return fc_fail(FC_OP_DEVICE_ATTR, CUDA_ERROR_INVALID_VALUE,
                           "attribute_unknown_to_this_driver");
    int v = 0;
    if (attribute == CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING) v = 1;
    if (attribute == CU_DEVICE_ATTRIBUTE_IPC_EVENT_SUPPORTED) v = !g_cfg.no_ipc_events;
    if (attribute == CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED) v = 1;
    if (attribute == CU_DEVICE_ATTRIBUTE_COMPUTE_MODE) v = g_cfg.compute_mode;
    *value = v;
    fc_log(FC_OP_DEVICE_ATTR, "dev=%d attr=%d value=%d", device, attribute, v);
    return CUDA_SUCCESS;
}

/* A UUID per physical device ("fakecuda-phys-NN"), the same in every process; a MIG
 * instance gets its parent GPU's ("fakecuda-gpu-NN", see FAKECUDA_MIG_GPUS). */
FC_API CUresult cuDeviceGetUuid(CUuuid *uuid, CUdevice device)
{
    CUresult rc = fc_need_init(FC_OP_DEVICE_UUID);
    if (rc != CUDA_SUCCESS) return rc;
    if (uuid == NULL) return fc_fail(FC_OP_DEVICE_UUID, CUDA_ERROR_INVALID_VALUE, "null");
    fc_ctx *c = fc_device(device);
    if (c == NULL) return fc_fail(FC_OP_DEVICE_UUID, CUDA_ERROR_INVALID_DEVICE, "bad_ordinal");
    fc_peer_uuid(c->phys, 0, uuid->bytes);
    fc_log(FC_OP_DEVICE_UUID, "dev=%d phys=%d", device, c->phys);
    return CUDA_SUCCESS;
}

/* "Fake CUDA Device <phys>", truncated to len bytes with its NUL. */
FC_API CUresult cuDeviceGetName(char *name, int len, CUdevice device)
{
    CUresult rc = fc_need_init(FC_OP_DEVICE_NAME);
    if (rc != CUDA_SUCCESS) return rc;
    if (name == NULL || len <= 0)
        return fc_fail(FC_OP_DEVICE_NAME, CUDA_ERROR_INVALID_VALUE, "bad_buffer");
    fc_ctx *c = fc_device(device);
    if (c == NULL) return fc_fail(FC_OP_DEVICE_NAME, CUDA_ERROR_INVALID_DEVICE, "bad_ordinal");
    snprintf(name, (size_t)len, "Fake CUDA Device %d", c->phys);
    fc_log(FC_OP_DEVICE_NAME, "dev=%d phys=%d", device, c->phys);
    return CUDA_SUCCESS;
}

/* ==========================================================================
 * Context API
 * ========================================================================== */

/* Retain the primary context of a device (reference counted). */
FC_API CUresult cuDevicePrimaryCtxRetain(CUcontext *ctx, CUdevice device)
{
    CUresult rc = fc_need_init(FC_OP_CTX_RETAIN);
    if (rc != CUDA_SUCCESS) return rc;
    if (ctx == NULL) return fc_fail(FC_OP_CTX_RETAIN, CUDA_ERROR_INVALID_VALUE, "null");
    fc_ctx *c = fc_device(device);
    if (c == NULL) return fc_fail(FC_OP_CTX_RETAIN, CUDA_ERROR_INVALID_DEVICE, "bad_ordinal");
    int refs = atomic_fetch_add(&c->refs, 1) + 1;
    *ctx = (CUcontext)c;
    fc_log(FC_OP_CTX_RETAIN, "dev=%d phys=%d refs=%d", device, c->phys, refs);
    return CUDA_SUCCESS;
}

/* Release a primary context reference; releasing an unretained one fails. */
FC_API CUresult cuDevicePrimaryCtxRelease_v2(CUdevice device)
{
    CUresult rc = fc_need_init(FC_OP_CTX_RELEASE);
    if (rc != CUDA_SUCCESS) return rc;
    fc_ctx *c = fc_device(device);
    if (c == NULL) return fc_fail(FC_OP_CTX_RELEASE, CUDA_ERROR_INVALID_DEVICE, "bad_ordinal");
    int refs = atomic_load(&c->refs);
    do {
        if (refs <= 0)
            return fc_fail(FC_OP_CTX_RELEASE, CUDA_ERROR_INVALID_CONTEXT, "not_retained");
    } while (!atomic_compare_exchange_weak(&c->refs, &refs, refs - 1));
    fc_log(FC_OP_CTX_RELEASE, "dev=%d phys=%d refs=%d", device, c->phys, refs - 1);
    return CUDA_SUCCESS;
}

/* Push a (retained) primary context on the calling thread's stack. */
FC_API CUresult cuCtxPushCurrent_v2(CUcontext ctx)
{
    CUresult rc = fc_need_init(FC_OP_CTX_PUSH);
    if (rc != CUDA_SUCCESS) return rc;
    fc_ctx *c = NULL;
    for (int i = 0; i < g_cfg.nvis; i++)
        if ((CUcontext)&g_ctx[i] == ctx) c = &g_ctx[i];
    if (c == NULL) return fc_fail(FC_OP_CTX_PUSH, CUDA_ERROR_INVALID_CONTEXT, "not_a_context");
    if (atomic_load(&c->refs) <= 0)
        return fc_fail(FC_OP_CTX_PUSH, CUDA_ERROR_INVALID_CONTEXT, "context_not_retained");
    if (t_depth == FC_STACK)
        return fc_fail(FC_OP_CTX_PUSH, CUDA_ERROR_INVALID_VALUE, "stack_full");
    t_stack[t_depth++] = c;
    fc_log(FC_OP_CTX_PUSH, "dev=%d depth=%d", c->ordinal, t_depth);
    return CUDA_SUCCESS;
}

/* Pop the calling thread's current context (ctx may be NULL). */
FC_API CUresult cuCtxPopCurrent_v2(CUcontext *ctx)
{
    CUresult rc = fc_need_init(FC_OP_CTX_POP);
    if (rc != CUDA_SUCCESS) return rc;
    if (t_depth == 0) return fc_fail(FC_OP_CTX_POP, CUDA_ERROR_INVALID_CONTEXT, "stack_empty");
    fc_ctx *c = t_stack[--t_depth];
    if (ctx != NULL) *ctx = (CUcontext)c;
    fc_log(FC_OP_CTX_POP, "dev=%d depth=%d", c->ordinal, t_depth);
    return CUDA_SUCCESS;
}

/* Wait until every stream of the current context is idle: "Blocks until the current
 * context has completed all preceding requested tasks" (cuCtxSynchronize); streams of other
 * devices' contexts are not waited for. */
FC_API CUresult cuCtxSynchronize(void)
{
    fc_ctx *ctx;
    CUresult rc = fc_current(FC_OP_CTX_SYNC, &ctx);
    if (rc != CUDA_SUCCESS) return rc;
    if ((rc = fc_capture_forbids_ctx(FC_OP_CTX_SYNC, ctx->ordinal)) != CUDA_SUCCESS) return rc;
    size_t n = 0, cap = 0;
    fc_stream **all = NULL;
    pthread_mutex_lock(&g_lock);
    for (fc_stream *s = g_streams; s != NULL; s = s->next) cap++;
    all = cap > 0 ? calloc(cap, sizeof *all) : NULL;
    for (fc_stream *s = g_streams; s != NULL && all != NULL; s = s->next) {
        if (s->ordinal != ctx->ordinal) continue;
        s->refs++;
        all[n++] = s;
    }
    pthread_mutex_unlock(&g_lock);
    if (cap > 0 && all == NULL) return fc_fail(FC_OP_CTX_SYNC, CUDA_ERROR_OUT_OF_MEMORY, "calloc");
    for (size_t i = 0; i < n; i++) {
        fc_stream_drain(all[i]);
        fc_stream_put(all[i]);
    }
    free(all);
    fc_log(FC_OP_CTX_SYNC, "streams=%zu dev=%d", n, ctx->ordinal);
    return CUDA_SUCCESS;
}

/* ==========================================================================
 * Device memory
 * ========================================================================== */

/* Allocate device memory: a shm object /fakecuda-<pid>-<n> mapped here. */
FC_API CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytes)
{
    fc_ctx *ctx;
    CUresult rc = fc_current(FC_OP_ALLOC, &ctx);
    if (rc != CUDA_SUCCESS) return rc;
    if (dptr == NULL || bytes == 0)
        return fc_fail(FC_OP_ALLOC, CUDA_ERROR_INVALID_VALUE, "bad_argument");
    pthread_mutex_lock(&g_lock);
    int over = g_cfg.mem_limit != 0 && bytes > g_cfg.mem_limit - g_mem_used;
    if (!over) g_mem_used += bytes;
    pthread_mutex_unlock(&g_lock);
    if (over) return fc_fail(FC_OP_ALLOC, CUDA_ERROR_OUT_OF_MEMORY, "FAKECUDA_MEM_LIMIT");
    fc_region *r = calloc(1, sizeof *r);
    int fd = -1;
    void *p = MAP_FAILED;
    const char *why = "calloc";
    if (r != NULL) {
        fd = fc_shm_create(r->name, "fakecuda", bytes);
        why = "shm_create";
    }
    if (fd >= 0) {
        p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        why = "mmap";
        close(fd);
        if (p == MAP_FAILED) shm_unlink(r->name);
    }
    if (p == MAP_FAILED) {
        free(r);
        pthread_mutex_lock(&g_lock);
        g_mem_used -= bytes;
        pthread_mutex_unlock(&g_lock);
        return fc_fail(FC_OP_ALLOC, CUDA_ERROR_OUT_OF_MEMORY, why);
    }
    r->base = p;
    r->size = bytes;
    r->ordinal = ctx->ordinal;
    r->phys = ctx->phys;
    r->owner = getpid();
    r->pins = 1;
    pthread_mutex_lock(&g_lock);
    r->next = g_regions;
    g_regions = r;
    pthread_mutex_unlock(&g_lock);
    fc_imports_create(r->name);
    *dptr = (CUdeviceptr)(uintptr_t)p;
    fc_log(FC_OP_ALLOC, "ptr=%p bytes=%zu dev=%d phys=%d name=%s", p, bytes, ctx->ordinal,
           ctx->phys, r->name);
    return CUDA_SUCCESS;
}

/* Free an allocation (its base): unlink the shm object; unmap once queued work is done. */
FC_API CUresult cuMemFree_v2(CUdeviceptr dptr)
{
    fc_ctx *ctx;
    CUresult rc = fc_current(FC_OP_FREE, &ctx);
    if (rc != CUDA_SUCCESS) return rc;
    if ((rc = fc_capture_forbids_unsafe(FC_OP_FREE)) != CUDA_SUCCESS) return rc;
    fc_region *found = NULL;
    pthread_mutex_lock(&g_lock);
    for (fc_region *r = g_regions; r != NULL; r = r->next)
        if (!r->ipc && (CUdeviceptr)(uintptr_t)r->base == dptr) found = r;
    if (found != NULL) {
        fc_region_unlist(found);
        g_mem_used -= found->size;
    }
    pthread_mutex_unlock(&g_lock);
    if (found == NULL) return fc_fail(FC_OP_FREE, CUDA_ERROR_INVALID_VALUE, "not_an_allocation");
    fc_imports_release(found->name, found->base, "free");
    shm_unlink(found->name);
    fc_log(FC_OP_FREE, "ptr=%p bytes=%zu name=%s", (void *)found->base, found->size,
           found->name);
    fc_region_unpin(found);
    return CUDA_SUCCESS;
}

/* Queue a host-to-device copy: staged now from pageable memory, read at execution from
 * registered memory. */
FC_API CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t bytes, CUstream s)
{
    fc_ctx *ctx;
    CUresult rc = fc_current(FC_OP_HTOD, &ctx);
    if (rc != CUDA_SUCCESS) return rc;
    if (src == NULL && bytes > 0) return fc_fail(FC_OP_HTOD, CUDA_ERROR_INVALID_VALUE, "null_src");
    fc_stream *st;
    rc = fc_stream_for(FC_OP_HTOD, s, ctx, &st);
    if (rc != CUDA_SUCCESS) return rc;
    fc_region *r = fc_region_pin((uintptr_t)dst, bytes);
    fc_op *op = r != NULL ? calloc(1, sizeof *op) : NULL;
    if (op == NULL) {
        fc_region_unpin(r);
        fc_stream_put(st);
        return fc_fail(FC_OP_HTOD, r == NULL ? CUDA_ERROR_INVALID_VALUE : CUDA_ERROR_OUT_OF_MEMORY,
                       r == NULL ? "dst_not_device_memory" : "calloc");
    }
    int pinned = fc_host_registered((uintptr_t)src, bytes);
    op->kind = FC_EX_HTOD;
    op->dst_r = r;
    op->dst = (uint8_t *)(uintptr_t)dst;
    op->bytes = bytes;
    op->src = src;
    if (!pinned && bytes > 0) {
        op->staging = malloc(bytes);
        if (op->staging == NULL) {
            fc_op_free(op);
            fc_stream_put(st);
            return fc_fail(FC_OP_HTOD, CUDA_ERROR_OUT_OF_MEMORY, "staging");
        }
        memcpy(op->staging, src, bytes);
        op->src = op->staging;
    }
    char name[FC_NAME];
    memcpy(name, r->name, sizeof name);
    rc = fc_submit(FC_OP_HTOD, st, op);
    if (rc == CUDA_SUCCESS)
        fc_log(FC_OP_HTOD, "dst=%p bytes=%zu stream=%s pinned=%d name=%s", (void *)(uintptr_t)dst,
               bytes, st->id, pinned, name);
    fc_stream_put(st);
    return rc;
}

/* Queue a device-to-device copy (both ranges device memory). */
FC_API CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t bytes, CUstream s)
{
    fc_ctx *ctx;
    CUresult rc = fc_current(FC_OP_DTOD, &ctx);
    if (rc != CUDA_SUCCESS) return rc;
    fc_stream *st;
    rc = fc_stream_for(FC_OP_DTOD, s, ctx, &st);
    if (rc != CUDA_SUCCESS) return rc;
    fc_region *dr = fc_region_pin((uintptr_t)dst, bytes);
    fc_region *sr = fc_region_pin((uintptr_t)src, bytes);
    fc_op *op = dr != NULL && sr != NULL ? calloc(1, sizeof *op) : NULL;
    if (op == NULL) {
        fc_region_unpin(dr);
        fc_region_unpin(sr);
        fc_stream_put(st);
        if (dr == NULL)
            return fc_fail(FC_OP_DTOD, CUDA_ERROR_INVALID_VALUE, "dst_not_device_memory");
        if (sr == NULL)
            return fc_fail(FC_OP_DTOD, CUDA_ERROR_INVALID_VALUE, "src_not_device_memory");
        return fc_fail(FC_OP_DTOD, CUDA_ERROR_OUT_OF_MEMORY, "calloc");
    }
    fc_imports_check_use(dr, "dtod");
    fc_imports_check_use(sr, "dtod");
    op->kind = FC_EX_DTOD;
    op->dst_r = dr;
    op->src_r = sr;
    op->dst = (uint8_t *)(uintptr_t)dst;
    op->src = (const uint8_t *)(uintptr_t)src;
    op->bytes = bytes;
    char dname[FC_NAME], sname[FC_NAME];
    memcpy(dname, dr->name, sizeof dname);
    memcpy(sname, sr->name, sizeof sname);
    rc = fc_submit(FC_OP_DTOD, st, op);
    if (rc == CUDA_SUCCESS)
        fc_log(FC_OP_DTOD, "dst=%p src=%p bytes=%zu stream=%s dst_name=%s src_name=%s",
               (void *)(uintptr_t)dst, (void *)(uintptr_t)src, bytes, st->id, dname, sname);
    fc_stream_put(st);
    return rc;
}

/* ==========================================================================
 * Host registration
 * ========================================================================== */

/* Page-lock a host range: no overlap with another registration, and writable pages unless
 * CU_MEMHOSTREGISTER_READ_ONLY. */
FC_API CUresult cuMemHostRegister_v2(void *p, size_t bytes, unsigned int flags)
{
    fc_ctx *ctx;
    CUresult rc = fc_current(FC_OP_HOST_REGISTER, &ctx);
    if (rc != CUDA_SUCCESS) return rc;
    uintptr_t lo = (uintptr_t)p;
    if (p == NULL || bytes == 0 || (flags & ~FC_HOSTREGISTER_ALL) != 0 || lo + bytes < lo)
        return fc_fail(FC_OP_HOST_REGISTER, CUDA_ERROR_INVALID_VALUE, "bad_argument");
    fc_host *h = calloc(1, sizeof *h);
    if (h == NULL) return fc_fail(FC_OP_HOST_REGISTER, CUDA_ERROR_OUT_OF_MEMORY, "calloc");
    h->base = lo;
    h->size = bytes;
    h->flags = flags;
    const char *why = NULL;
    pthread_mutex_lock(&g_lock);
    for (fc_host *o = g_hosts; o != NULL && why == NULL; o = o->next)
        if (lo < o->base + o->size && o->base < lo + bytes) why = "overlaps_registered_range";
    if (why != NULL) {
        pthread_mutex_unlock(&g_lock);
        free(h);
        return fc_fail(FC_OP_HOST_REGISTER, CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED, why);
    }
    int writable = 0;
    int mapped = fc_range_perms(lo, lo + bytes, &writable);
    if (mapped != 1)
        why = mapped < 0 ? "proc_maps_unreadable" : "range_not_mapped";
    else if (!writable && !(flags & CU_MEMHOSTREGISTER_READ_ONLY))
        why = "read_only_pages_without_READ_ONLY_flag";
    if (why == NULL) {
        h->next = g_hosts;
        g_hosts = h;
    }
    pthread_mutex_unlock(&g_lock);
    if (why != NULL) {
        free(h);
        return fc_fail(FC_OP_HOST_REGISTER, CUDA_ERROR_INVALID_VALUE, why);
    }
    fc_log(FC_OP_HOST_REGISTER, "ptr=%p bytes=%zu flags=0x%x writable=%d", p, bytes, flags,
           writable);
    return CUDA_SUCCESS;
}

/* Unregister a host range by its base. */
FC_API CUresult cuMemHostUnregister(void *p)
{
    fc_ctx *ctx;
    CUresult rc = fc_current(FC_OP_HOST_UNREGISTER, &ctx);
    if (rc != CUDA_SUCCESS) return rc;
    fc_host *found = NULL;
    pthread_mutex_lock(&g_lock);
    for (fc_host **pp = &g_hosts; *pp != NULL; pp = &(*pp)->next) {
        if ((*pp)->base == (uintptr_t)p) {
            found = *pp;
            *pp = found->next;
            break;
        }
    }
    pthread_mutex_unlock(&g_lock);
    if (found == NULL)
        return fc_fail(FC_OP_HOST_UNREGISTER, CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED,
                       "not_a_registered_base");
    fc_log(FC_OP_HOST_UNREGISTER, "ptr=%p bytes=%zu", p, found->size);
    free(found);
    return CUDA_SUCCESS;
}

/* ==========================================================================
 * Stream API
 * ========================================================================== */

/* Create a stream with its own worker thread. */
FC_API CUresult cuStreamCreate(CUstream *stream, unsigned int flags)
{
    fc_ctx *ctx;
    CUresult rc = fc_current(FC_OP_STREAM_CREATE, &ctx);
    if (rc != CUDA_SUCCESS) return rc;
    if (stream == NULL || (flags & ~(unsigned)CU_STREAM_NON_BLOCKING) != 0)
        return fc_fail(FC_OP_STREAM_CREATE, CUDA_ERROR_INVALID_VALUE, "bad_argument");
    fc_stream *s = fc_stream_new(ctx, 0, (flags & CU_STREAM_NON_BLOCKING) != 0);
    if (s == NULL) return fc_fail(FC_OP_STREAM_CREATE, CUDA_ERROR_OUT_OF_MEMORY, "thread");
    pthread_mutex_lock(&g_lock);
    s->next = g_streams;
    g_streams = s;
    pthread_mutex_unlock(&g_lock);
    *stream = (CUstream)s;
    fc_log(FC_OP_STREAM_CREATE, "stream=%s dev=%d flags=0x%x", s->id, ctx->ordinal, flags);
    return CUDA_SUCCESS;
}

/* Destroy a stream: run what is queued, then join its worker. */
FC_API CUresult cuStreamDestroy_v2(CUstream stream)
{
    fc_ctx *ctx;
    CUresult rc = fc_current(FC_OP_STREAM_DESTROY, &ctx);
    if (rc != CUDA_SUCCESS) return rc;
    fc_stream *found = NULL;
    pthread_mutex_lock(&g_lock);
    for (fc_stream **pp = &g_streams; *pp != NULL; pp = &(*pp)->next) {
        if ((CUstream)*pp == stream && !(*pp)->is_default) {
            found = *pp;
            *pp = found->next;
            break;
        }
    }
    pthread_mutex_unlock(&g_lock);
    if (found == NULL)
        return fc_fail(FC_OP_STREAM_DESTROY, CUDA_ERROR_INVALID_HANDLE, "unknown_stream");
    char id[sizeof found->id];
    memcpy(id, found->id, sizeof id);
    pthread_mutex_lock(&found->mu);
    found->stop = 1;
    pthread_cond_signal(&found->work_cv);
    pthread_mutex_unlock(&found->mu);
    pthread_join(found->thread, NULL);
    fc_stream_put(found);
    fc_log(FC_OP_STREAM_DESTROY, "stream=%s", id);
    return CUDA_SUCCESS;
}

/* Wait until a stream has nothing queued or running. */
FC_API CUresult cuStreamSynchronize(CUstream stream)
{
    fc_ctx *ctx;
    CUresult rc = fc_current(FC_OP_STREAM_SYNC, &ctx);
    if (rc != CUDA_SUCCESS) return rc;
    fc_stream *st;
    rc = fc_stream_for(FC_OP_STREAM_SYNC, stream, ctx, &st);
    if (rc != CUDA_SUCCESS) return rc;
    if ((rc = fc_capture_forbids_stream(FC_OP_STREAM_SYNC, st)) != CUDA_SUCCESS) {
        fc_stream_put(st);
        return rc;
    }
    fc_stream_drain(st);
    fc_log(FC_OP_STREAM_SYNC, "stream=%s", st->id);
    fc_stream_put(st);
    return CUDA_SUCCESS;
}

/* Make a stream wait for the event's latest record ("hEvent may be from a different context
 * or device than hStream"); an event never recorded is CUDA_ERROR_ILLEGAL_STATE (stricter
 * than the driver, which would not wait). flags: 0, or CU_EVENT_WAIT_EXTERNAL during a
 * capture of the stream (fc_capture_forbids_wait). */
FC_API CUresult cuStreamWaitEvent(CUstream stream, CUevent event, unsigned int flags)
{
    fc_ctx *ctx;
    CUresult rc = fc_current(FC_OP_STREAM_WAIT_EVENT, &ctx);
    if (rc != CUDA_SUCCESS) return rc;
    if (flags != 0 && flags != CU_EVENT_WAIT_EXTERNAL)
        return fc_fail(FC_OP_STREAM_WAIT_EVENT, CUDA_ERROR_INVALID_VALUE, "unknown_flags");
    fc_stream *st;
    rc = fc_stream_for(FC_OP_STREAM_WAIT_EVENT, stream, ctx, &st);
    if (rc != CUDA_SUCCESS) return rc;
    fc_event *e = fc_event_get(event);
    if (e == NULL) {
        fc_stream_put(st);
        return fc_fail(FC_OP_STREAM_WAIT_EVENT, CUDA_ERROR_INVALID_HANDLE, "unknown_event");
    }
    if ((rc = fc_capture_forbids_wait(FC_OP_STREAM_WAIT_EVENT, st, e, flags)) != CUDA_SUCCESS) {
        fc_event_put(e);
        fc_stream_put(st);
        return rc;
    }
    uint64_t gen = atomic_load_explicit(&e->st->gen, memory_order_acquire);
    fc_op *op = gen != 0 ? calloc(1, sizeof *op) : NULL;
    if (op == NULL) {
        fc_event_put(e);
        fc_stream_put(st);
        if (gen == 0)
            return fc_fail(FC_OP_STREAM_WAIT_EVENT, CUDA_ERROR_ILLEGAL_STATE,
                           "event_never_recorded");
        return fc_fail(FC_OP_STREAM_WAIT_EVENT, CUDA_ERROR_OUT_OF_MEMORY, "calloc");
    }
    op->kind = FC_EX_WAIT;
    op->ev = e;
    op->gen = gen;
    char id[FC_NAME];
    memcpy(id, e->id, sizeof id);
    rc = fc_submit(FC_OP_STREAM_WAIT_EVENT, st, op);
    if (rc == CUDA_SUCCESS)
        fc_log(FC_OP_STREAM_WAIT_EVENT, "stream=%s ev=%s gen=%llu", st->id, id,
               (unsigned long long)gen);
    fc_stream_put(st);
    return rc;
}

/* ==========================================================================
 * Event API
 * ========================================================================== */

/* Create an event; CU_EVENT_INTERPROCESS needs CU_EVENT_DISABLE_TIMING and puts the
 * state in a shm object /fakecuda-ev-<pid>-<n>. */
FC_API CUresult cuEventCreate(CUevent *event, unsigned int flags)
{
    fc_ctx *ctx;
    CUresult rc = fc_current(FC_OP_EVENT_CREATE, &ctx);
    if (rc != CUDA_SUCCESS) return rc;
    if (event == NULL || (flags & ~FC_EVENT_ALL) != 0)
        return fc_fail(FC_OP_EVENT_CREATE, CUDA_ERROR_INVALID_VALUE, "bad_argument");
    int ipc = (flags & CU_EVENT_INTERPROCESS) != 0;
    if (ipc && !(flags & CU_EVENT_DISABLE_TIMING))
        return fc_fail(FC_OP_EVENT_CREATE, CUDA_ERROR_INVALID_VALUE,
                       "INTERPROCESS_without_DISABLE_TIMING");
    fc_event *e = calloc(1, sizeof *e);
    if (e == NULL) return fc_fail(FC_OP_EVENT_CREATE, CUDA_ERROR_OUT_OF_MEMORY, "calloc");
    e->flags = flags;
    e->ipc = ipc;
    e->ordinal = ctx->ordinal;
    e->phys = ctx->phys;
    e->creator = getpid();
    e->refs = 1;
    if (ipc) {
        int fd = fc_shm_create(e->id, "fakecuda-ev", FC_PAGE);
        rc = CUDA_ERROR_OUT_OF_MEMORY;
        if (fd >= 0) {
            close(fd);
            rc = fc_event_map(e->id, 1, &e->st);
            if (rc != CUDA_SUCCESS) shm_unlink(e->id);
        }
    } else {
        snprintf(e->id, sizeof e->id, "local-%d-%u", (int)getpid(),
                 atomic_fetch_add(&g_eseq, 1) + 1);
        e->st = calloc(1, sizeof *e->st);
        rc = e->st != NULL ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (rc != CUDA_SUCCESS) {
        free(e);
        return fc_fail(FC_OP_EVENT_CREATE, CUDA_ERROR_OUT_OF_MEMORY, "event_state");
    }
    pthread_mutex_lock(&g_lock);
    e->next = g_events;
    g_events = e;
    pthread_mutex_unlock(&g_lock);
    *event = (CUevent)e;
    fc_log(FC_OP_EVENT_CREATE, "ev=%s flags=0x%x dev=%d", e->id, flags, ctx->ordinal);
    return CUDA_SUCCESS;
}

/* Destroy an event: an owned interprocess one unlinks its shm, an opened one only unmaps;
 * queued records and waits keep the state until they ran. */
FC_API CUresult cuEventDestroy_v2(CUevent event)
{
    fc_ctx *ctx;
    CUresult rc = fc_current(FC_OP_EVENT_DESTROY, &ctx);
    if (rc != CUDA_SUCCESS) return rc;
    fc_event *found = NULL;
    pthread_mutex_lock(&g_lock);
    for (fc_event **pp = &g_events; *pp != NULL; pp = &(*pp)->next) {
        if ((CUevent)*pp == event) {
            found = *pp;
            *pp = found->next;
            break;
        }
    }
    pthread_mutex_unlock(&g_lock);
    if (found == NULL)
        return fc_fail(FC_OP_EVENT_DESTROY, CUDA_ERROR_INVALID_HANDLE, "unknown_event");
    if (found->ipc && !found->opened) shm_unlink(found->id);
    fc_log(FC_OP_EVENT_DESTROY, "ev=%s opened=%d", found->id, found->opened);
    fc_event_put(found);
    return CUDA_SUCCESS;
}

/* Record an event on a stream: a new generation now, completed when the stream gets there. */
FC_API CUresult cuEventRecord(CUevent event, CUstream stream)
{
    fc_ctx *ctx;
    CUresult rc = fc_current(FC_OP_EVENT_RECORD, &ctx);
    if (rc != CUDA_SUCCESS) return rc;
    fc_stream *st;
    rc = fc_stream_for(FC_OP_EVENT_RECORD, stream, ctx, &st);
    if (rc != CUDA_SUCCESS) return rc;
    fc_event *e = fc_event_get(event);
    const char *why = e == NULL ? "unknown_event" : NULL;
    /* "hEvent and hStream must be from the same context otherwise CUDA_ERROR_INVALID_HANDLE
     * is returned" (cuEventRecord). */
    if (e != NULL && e->ordinal != st->ordinal) why = "event_and_stream_contexts_differ";
    fc_op *op = why == NULL ? calloc(1, sizeof *op) : NULL;
    if (op == NULL) {
        fc_event_put(e);
        fc_stream_put(st);
        if (why != NULL) return fc_fail(FC_OP_EVENT_RECORD, CUDA_ERROR_INVALID_HANDLE, why);
        return fc_fail(FC_OP_EVENT_RECORD, CUDA_ERROR_OUT_OF_MEMORY, "calloc");
    }
    char id[FC_NAME];
    memcpy(id, e->id, sizeof id);
    fc_capture_note_record(e, st);
    pthread_mutex_lock(&st->mu); /* generations enter this stream's queue in order */
    uint64_t gen = 0;
    if (!st->stop) {
        gen = atomic_fetch_add_explicit(&e->st->gen, 1, memory_order_acq_rel) + 1;
        op->kind = FC_EX_RECORD;
        op->ev = e;
        op->gen = gen;
        op->next = NULL;
        if (st->tail != NULL)
            st->tail->next = op;
        else
            st->head = op;
        st->tail = op;
        pthread_cond_signal(&st->work_cv);
    }
    pthread_mutex_unlock(&st->mu);
    if (gen == 0) {
        op->ev = e;
        fc_op_free(op);
        fc_stream_put(st);
        return fc_fail(FC_OP_EVENT_RECORD, CUDA_ERROR_INVALID_HANDLE, "stream_being_destroyed");
    }
    fc_log(FC_OP_EVENT_RECORD, "ev=%s stream=%s gen=%llu", id, st->id, (unsigned long long)gen);
    fc_stream_put(st);
    return CUDA_SUCCESS;
}

/* CUDA_SUCCESS if the latest record completed (or none was made), else CUDA_ERROR_NOT_READY. */
FC_API CUresult cuEventQuery(CUevent event)
{
    fc_ctx *ctx;
    CUresult rc = fc_current(FC_OP_EVENT_QUERY, &ctx);
    if (rc != CUDA_SUCCESS) return rc;
    fc_event *e = fc_event_get(event);
    if (e == NULL) return fc_fail(FC_OP_EVENT_QUERY, CUDA_ERROR_INVALID_HANDLE, "unknown_event");
    if ((rc = fc_capture_forbids_event(FC_OP_EVENT_QUERY, e)) != CUDA_SUCCESS) {
        fc_event_put(e);
        return rc;
    }
    uint64_t gen = atomic_load_explicit(&e->st->gen, memory_order_acquire);
    uint64_t done = atomic_load_explicit(&e->st->done, memory_order_acquire);
    int ready = done >= gen;
    fc_log(FC_OP_EVENT_QUERY, "ev=%s gen=%llu done=%llu ready=%d", e->id, (unsigned long long)gen,
           (unsigned long long)done, ready);
    fc_event_put(e);
    return ready ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}

/* Block until the record that was latest at the call has completed. */
FC_API CUresult cuEventSynchronize(CUevent event)
{
    fc_ctx *ctx;
    CUresult rc = fc_current(FC_OP_EVENT_SYNC, &ctx);
    if (rc != CUDA_SUCCESS) return rc;
    fc_event *e = fc_event_get(event);
    if (e == NULL) return fc_fail(FC_OP_EVENT_SYNC, CUDA_ERROR_INVALID_HANDLE, "unknown_event");
    if ((rc = fc_capture_forbids_event(FC_OP_EVENT_SYNC, e)) != CUDA_SUCCESS) {
        fc_event_put(e);
        return rc;
    }
    uint64_t gen = atomic_load_explicit(&e->st->gen, memory_order_acquire);
    int torn = fc_wait_done(&e->st->done, gen) != 0;
    if (!torn) fc_log(FC_OP_EVENT_SYNC, "ev=%s gen=%llu", e->id, (unsigned long long)gen);
    fc_event_put(e);
    if (torn) return fc_alive(FC_OP_EVENT_SYNC); /* exit() began while it waited */
    return CUDA_SUCCESS;
}

/* ==========================================================================
 * IPC
 * ========================================================================== */

/* What a CUipcMemHandle holds. */
typedef struct fc_memhandle {
    uint32_t magic;
    int32_t pid;  /* the exporter */
    int32_t phys; /* physical device of the allocation */
    uint32_t pad;
    uint64_t size;
    char name[FC_NAME];
} fc_memhandle;

/* What a CUipcEventHandle holds. */
typedef struct fc_evhandle {
    uint32_t magic;
    int32_t pid; /* the creator of the shm state */
    char name[FC_NAME];
} fc_evhandle;

_Static_assert(sizeof(fc_memhandle) <= sizeof(CUipcMemHandle), "mem handle too big");
_Static_assert(sizeof(fc_evhandle) <= sizeof(CUipcEventHandle), "event handle too big");

/* Export an allocation (its base) of this process; FAKECUDA_MIG=1 refuses. */
FC_API CUresult cuIpcGetMemHandle(CUipcMemHandle *handle, CUdeviceptr dptr)
{
    fc_ctx *ctx;
    CUresult rc = fc_current(FC_OP_IPC_GET_MEM, &ctx);
    if (rc != CUDA_SUCCESS) return rc;
    if (g_cfg.mig) return fc_fail(FC_OP_IPC_GET_MEM, CUDA_ERROR_NOT_SUPPORTED, "FAKECUDA_MIG");
    if (handle == NULL) return fc_fail(FC_OP_IPC_GET_MEM, CUDA_ERROR_INVALID_VALUE, "null");
    fc_memhandle h;
    memset(&h, 0, sizeof h);
    int found = 0;
    pthread_mutex_lock(&g_lock);
    for (fc_region *r = g_regions; r != NULL && !found; r = r->next) {
        if (!r->ipc && (CUdeviceptr)(uintptr_t)r->base == dptr) {
            found = 1;
            h.magic = FC_MEM_MAGIC;
            h.pid = (int32_t)r->owner;
            h.phys = r->phys;
            h.size = r->size;
            memcpy(h.name, r->name, sizeof h.name);
        }
    }
    pthread_mutex_unlock(&g_lock);
    if (!found)
        return fc_fail(FC_OP_IPC_GET_MEM, CUDA_ERROR_INVALID_VALUE, "not_an_allocation_base");
    memset(handle, 0, sizeof *handle);
    memcpy(handle->reserved, &h, sizeof h);
    fc_log(FC_OP_IPC_GET_MEM, "ptr=%p name=%s bytes=%llu", (void *)(uintptr_t)dptr, h.name,
           (unsigned long long)h.size);
    return CUDA_SUCCESS;
}

/* Map another process's allocation; the same handle again returns the same pointer. */
FC_API CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *dptr, CUipcMemHandle handle, unsigned int flags)
{
    fc_ctx *ctx;
    CUresult rc = fc_current(FC_OP_IPC_OPEN_MEM, &ctx);
    if (rc != CUDA_SUCCESS) return rc;
    fc_memhandle h;
    memcpy(&h, handle.reserved, sizeof h);
    h.name[FC_NAME - 1] = '\0';
    if (dptr == NULL) return fc_fail(FC_OP_IPC_OPEN_MEM, CUDA_ERROR_INVALID_VALUE, "bad_argument");
    /* The driver documents the flag as required and a real one (H100, driver 580) refuses
     * 0 with CUDA_ERROR_INVALID_VALUE, for the exporter's own device too. */
    if (flags != CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
        return fc_fail(FC_OP_IPC_OPEN_MEM, CUDA_ERROR_INVALID_VALUE,
                       "flags_must_be_LAZY_ENABLE_PEER_ACCESS");
    if (h.magic != FC_MEM_MAGIC || h.size == 0 || h.name[0] != '/')
        return fc_fail(FC_OP_IPC_OPEN_MEM, CUDA_ERROR_INVALID_VALUE, "not_a_mem_handle");
    if (h.pid == (int32_t)getpid())
        return fc_fail(FC_OP_IPC_OPEN_MEM, CUDA_ERROR_INVALID_CONTEXT, "handle_of_this_process");
    int peer = h.phys != ctx->phys;
    if (peer && !fc_peer_possible(ctx->phys, h.phys))
        return fc_fail(FC_OP_IPC_OPEN_MEM, CUDA_ERROR_PEER_ACCESS_UNSUPPORTED, "no_peer_access");
    /* Already open here: in the same context, the same mapping, one more open ("If the memory
     * handle has already been opened by the current context, the reference count on the
     * handle is incremented by 1 and the existing device pointer is returned"); in another
     * context, refused: handles "may only be opened by one CUcontext per CUdevice per other
     * process" (cuIpcOpenMemHandle; the error is not documented: INVALID_CONTEXT here). */
    uint8_t *base = NULL;
    int other_ctx = -1;
    pthread_mutex_lock(&g_lock);
    for (fc_region *r = g_regions; r != NULL && base == NULL; r = r->next) {
        if (r->ipc && strcmp(r->name, h.name) == 0) {
            if (r->ordinal != ctx->ordinal) {
                other_ctx = r->ordinal;
                break;
            }
            r->opens++;
            base = r->base;
        }
    }
    pthread_mutex_unlock(&g_lock);
    if (other_ctx >= 0)
        return fc_fail(FC_OP_IPC_OPEN_MEM, CUDA_ERROR_INVALID_CONTEXT,
                       "already_open_in_another_context_of_this_process");
    if (base != NULL) {
        *dptr = (CUdeviceptr)(uintptr_t)base;
        fc_log(FC_OP_IPC_OPEN_MEM, "name=%s ptr=%p cached=1 peer=%d bytes=%llu", h.name,
               (void *)base, peer, (unsigned long long)h.size);
        return CUDA_SUCCESS;
    }
    int fd = shm_open(h.name, O_RDWR | O_CLOEXEC, 0600);
    if (fd < 0) return fc_fail(FC_OP_IPC_OPEN_MEM, CUDA_ERROR_MAP_FAILED, "shm_gone");
    struct stat sb;
    void *p = MAP_FAILED;
    if (fstat(fd, &sb) == 0 && (unsigned long long)sb.st_size >= h.size)
        p = mmap(NULL, h.size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (p == MAP_FAILED) return fc_fail(FC_OP_IPC_OPEN_MEM, CUDA_ERROR_MAP_FAILED, "mmap");
    fc_region *r = calloc(1, sizeof *r);
    if (r == NULL) {
        munmap(p, h.size);
        return fc_fail(FC_OP_IPC_OPEN_MEM, CUDA_ERROR_OUT_OF_MEMORY, "calloc");
    }
    r->ipc = 1;
    r->base = p;
    r->size = h.size;
    memcpy(r->name, h.name, sizeof r->name);
    r->ordinal = ctx->ordinal;
    r->phys = h.phys;
    r->owner = h.pid;
    r->opens = 1;
    r->pins = 1;
    /* Another thread may have opened it meanwhile: keep the first mapping. */
    fc_region *dup = NULL;
    pthread_mutex_lock(&g_lock);
    for (fc_region *o = g_regions; o != NULL && dup == NULL; o = o->next) {
        if (o->ipc && strcmp(o->name, h.name) == 0) {
            if (o->ordinal == ctx->ordinal) o->opens++;
            dup = o;
        }
    }
    if (dup == NULL) {
        r->next = g_regions;
        g_regions = r;
    }
    base = dup != NULL ? dup->base : r->base;
    int dup_elsewhere = dup != NULL && dup->ordinal != ctx->ordinal;
    pthread_mutex_unlock(&g_lock);
    if (dup != NULL) {
        munmap(p, h.size);
        free(r);
        if (dup_elsewhere)
            return fc_fail(FC_OP_IPC_OPEN_MEM, CUDA_ERROR_INVALID_CONTEXT,
                           "already_open_in_another_context_of_this_process");
    } else {
        fc_imports_add(h.name);
    }
    *dptr = (CUdeviceptr)(uintptr_t)base;
    fc_log(FC_OP_IPC_OPEN_MEM, "name=%s ptr=%p cached=%d peer=%d bytes=%llu", h.name,
           (void *)base, dup != NULL, peer, (unsigned long long)h.size);
    return CUDA_SUCCESS;
}

/* Close one open of an IPC mapping; the last one unmaps (once queued work is done). */
FC_API CUresult cuIpcCloseMemHandle(CUdeviceptr dptr)
{
    fc_ctx *ctx;
    CUresult rc = fc_current(FC_OP_IPC_CLOSE_MEM, &ctx);
    if (rc != CUDA_SUCCESS) return rc;
    fc_region *found = NULL;
    int opens = 0;
    char name[FC_NAME];
    pthread_mutex_lock(&g_lock);
    for (fc_region *r = g_regions; r != NULL && found == NULL; r = r->next)
        if (r->ipc && (CUdeviceptr)(uintptr_t)r->base == dptr) found = r;
    if (found != NULL) {
        opens = --found->opens;
        memcpy(name, found->name, sizeof name);
        if (opens == 0) fc_region_unlist(found);
    }
    pthread_mutex_unlock(&g_lock);
    if (found == NULL)
        return fc_fail(FC_OP_IPC_CLOSE_MEM, CUDA_ERROR_INVALID_VALUE, "not_an_ipc_mapping");
    fc_log(FC_OP_IPC_CLOSE_MEM, "ptr=%p name=%s opens=%d", (void *)(uintptr_t)dptr, name, opens);
    if (opens == 0) {
        fc_imports_drop(name);
        fc_region_unpin(found);
    }
    return CUDA_SUCCESS;
}

/* Export an interprocess event. */
FC_API CUresult cuIpcGetEventHandle(CUipcEventHandle *handle, CUevent event)
{
    fc_ctx *ctx;
    CUresult rc = fc_current(FC_OP_IPC_GET_EVENT, &ctx);
    if (rc != CUDA_SUCCESS) return rc;
    if (handle == NULL) return fc_fail(FC_OP_IPC_GET_EVENT, CUDA_ERROR_INVALID_VALUE, "null");
    fc_event *e = fc_event_get(event);
    if (e == NULL) return fc_fail(FC_OP_IPC_GET_EVENT, CUDA_ERROR_INVALID_HANDLE, "unknown_event");
    if (!e->ipc) {
        fc_event_put(e);
        return fc_fail(FC_OP_IPC_GET_EVENT, CUDA_ERROR_INVALID_VALUE, "not_INTERPROCESS");
    }
    fc_evhandle h;
    memset(&h, 0, sizeof h);
    h.magic = FC_EV_MAGIC;
    h.pid = (int32_t)e->creator;
    memcpy(h.name, e->id, sizeof h.name);
    memset(handle, 0, sizeof *handle);
    memcpy(handle->reserved, &h, sizeof h);
    fc_log(FC_OP_IPC_GET_EVENT, "ev=%s", e->id);
    fc_event_put(e);
    return CUDA_SUCCESS;
}

/* Open another process's interprocess event (a new CUevent sharing its state). */
FC_API CUresult cuIpcOpenEventHandle(CUevent *event, CUipcEventHandle handle)
{
    fc_ctx *ctx;
    CUresult rc = fc_current(FC_OP_IPC_OPEN_EVENT, &ctx);
    if (rc != CUDA_SUCCESS) return rc;
    fc_evhandle h;
    memcpy(&h, handle.reserved, sizeof h);
    h.name[FC_NAME - 1] = '\0';
    if (event == NULL) return fc_fail(FC_OP_IPC_OPEN_EVENT, CUDA_ERROR_INVALID_VALUE, "null");
    if (h.magic != FC_EV_MAGIC || h.name[0] != '/')
        return fc_fail(FC_OP_IPC_OPEN_EVENT, CUDA_ERROR_INVALID_VALUE, "not_an_event_handle");
    if (h.pid == (int32_t)getpid())
        return fc_fail(FC_OP_IPC_OPEN_EVENT, CUDA_ERROR_INVALID_CONTEXT, "handle_of_this_process");
    fc_event *e = calloc(1, sizeof *e);
    if (e == NULL) return fc_fail(FC_OP_IPC_OPEN_EVENT, CUDA_ERROR_OUT_OF_MEMORY, "calloc");
    rc = fc_event_map(h.name, 0, &e->st);
    if (rc != CUDA_SUCCESS) {
        free(e);
        return fc_fail(FC_OP_IPC_OPEN_EVENT, rc,
                       rc == CUDA_ERROR_MAP_FAILED ? "shm_gone" : "bad_state_magic");
    }
    e->flags = CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING;
    e->ipc = 1;
    e->opened = 1;
    e->ordinal = ctx->ordinal;
    e->phys = ctx->phys;
    e->creator = h.pid;
    e->refs = 1;
    memcpy(e->id, h.name, sizeof e->id);
    pthread_mutex_lock(&g_lock);
    e->next = g_events;
    g_events = e;
    pthread_mutex_unlock(&g_lock);
    *event = (CUevent)e;
    fc_log(FC_OP_IPC_OPEN_EVENT, "ev=%s dev=%d", e->id, ctx->ordinal);
    return CUDA_SUCCESS;
}

/* ==========================================================================
 * Test-only exports
 * ========================================================================== */

/* Queue a fake kernel on s: after delay_us it stores FNV-1a 64 of [p, p+n) in *out. */
FC_API CUresult fakecuda_launch_read(CUstream s, CUdeviceptr p, size_t n, unsigned long long *out,
                                     unsigned delay_us)
{
    fc_ctx *ctx;
    CUresult rc = fc_current(FC_OP_LAUNCH_READ, &ctx);
    if (rc != CUDA_SUCCESS) return rc;
    if (out == NULL) return fc_fail(FC_OP_LAUNCH_READ, CUDA_ERROR_INVALID_VALUE, "null_out");
    fc_stream *st;
    rc = fc_stream_for(FC_OP_LAUNCH_READ, s, ctx, &st);
    if (rc != CUDA_SUCCESS) return rc;
    fc_region *r = fc_region_pin((uintptr_t)p, n);
    fc_op *op = r != NULL ? calloc(1, sizeof *op) : NULL;
    if (op == NULL) {
        fc_region_unpin(r);
        fc_stream_put(st);
        return fc_fail(FC_OP_LAUNCH_READ,
                       r == NULL ? CUDA_ERROR_INVALID_VALUE : CUDA_ERROR_OUT_OF_MEMORY,
                       r == NULL ? "not_device_memory" : "calloc");
    }
    fc_imports_check_use(r, "launch_read");
    op->kind = FC_EX_READ;
    op->src_r = r;
    op->src = (const uint8_t *)(uintptr_t)p;
    op->bytes = n;
    op->out = out;
    op->delay_us = delay_us;
    char name[FC_NAME];
    memcpy(name, r->name, sizeof name);
    rc = fc_submit(FC_OP_LAUNCH_READ, st, op);
    if (rc == CUDA_SUCCESS)
        fc_log(FC_OP_LAUNCH_READ, "stream=%s ptr=%p bytes=%zu name=%s", st->id,
               (void *)(uintptr_t)p, n, name);
    fc_stream_put(st);
    return rc;
}

/* How many times this process performed op (a log op name); -1 for an unknown name. */
FC_API int fakecuda_counter(const char *op)
{
    for (int i = 0; op != NULL && i < FC_OP_COUNT; i++)
        if (strcmp(op, fc_op_names[i]) == 0) return atomic_load(&g_counts[i]);
    return -1;
}

/* ==========================================================================
 * Two GPUs and MIG
 *
 * FAKECUDA_NO_PEER: "all", or pairs of physical devices "a-b,c-d" that cannot access each
 * other's memory (cuDeviceCanAccessPeer gives 0 both ways); other pairs of whole GPUs can.
 *
 * FAKECUDA_MIG_GPUS: per physical device, in order, the GPU it is a MIG instance of, or "-"
 * for a whole GPU ("0,0": devices 0 and 1 are two instances of GPU 0). An instance has its
 * own cuDeviceGetUuid_v2 UUID ("fakecuda-mig-NN", NN its physical id) and its parent's
 * cuDeviceGetUuid one ("fakecuda-gpu-NN"), like a real MIG instance: _v2 "returns its MIG
 * UUID which uniquely identifies the subscribed MIG compute instance" (driver API, Device
 * Management). An instance has no peer access to any other device (the MIG user guide
 * lists GPU-to-GPU P2P, PCIe or NVLink, as unsupported in MIG mode; not yet checked on a
 * real MIG instance). IPC within one instance works here; FAKECUDA_MIG=1 is the other
 * model, no CUDA IPC at all.
 *
 * cuIpcOpenMemHandle refuses a handle of a device this one has no peer access to, with
 * CUDA_ERROR_PEER_ACCESS_UNSUPPORTED: the flag CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS enables
 * peer access "as if the user called cuCtxEnablePeerAccess", which fails so where
 * cuDeviceCanAccessPeer says no. Built with -DFAKECUDA_NO_UUID_V2, the library lacks
 * cuDeviceGetUuid_v2, like a driver older than CUDA 11.4.
 * ========================================================================== */

static struct {
    int parent[FC_MAX_DEV];                  /* MIG: the instance's GPU, or -1 (whole GPU) */
    unsigned char no_peer[FC_MAX_DEV][FC_MAX_DEV]; /* 1: [a][b] cannot access each other */
    const char *bad;                          /* why a knob was refused, or NULL */
} g_peer;

/* Parse a device number in [0, FC_MAX_DEV) at *p; -1 if there is none. */
static int fc_peer_number(const char **p)
{
    char *end;
    if (**p < '0' || **p > '9') return -1;
    long v = strtol(*p, &end, 10);
    if (v >= FC_MAX_DEV) return -1;
    *p = end;
    return (int)v;
}

/* Read FAKECUDA_NO_PEER and FAKECUDA_MIG_GPUS (cuInit, under g_lock); NULL, or why one of
 * them was refused. */
static const char *fc_peer_configure(void)
{
    if (g_peer.bad != NULL) return g_peer.bad;
    memset(g_peer.no_peer, 0, sizeof g_peer.no_peer);
    for (int i = 0; i < FC_MAX_DEV; i++) g_peer.parent[i] = -1;
    const char *s = getenv("FAKECUDA_NO_PEER");
    if (s != NULL && strcmp(s, "all") == 0) {
        memset(g_peer.no_peer, 1, sizeof g_peer.no_peer);
    } else if (s != NULL && s[0] != '\0') {
        for (const char *p = s;;) {
            int a = fc_peer_number(&p);
            int b = *p == '-' ? (p++, fc_peer_number(&p)) : -1;
            if (a < 0 || b < 0 || (*p != ',' && *p != '\0'))
                return g_peer.bad = "FAKECUDA_NO_PEER_wants_all_or_pairs_like_0-1,2-3";
            g_peer.no_peer[a][b] = g_peer.no_peer[b][a] = 1;
            if (*p++ == '\0') break;
        }
    }
    s = getenv("FAKECUDA_MIG_GPUS");
    if (s != NULL && s[0] != '\0') {
        int i = 0;
        for (const char *p = s;; i++) {
            int parent = -1;
            if (*p == '-') p++;
            else if ((parent = fc_peer_number(&p)) < 0) i = FC_MAX_DEV;
            if (i >= FC_MAX_DEV || (*p != ',' && *p != '\0'))
                return g_peer.bad = "FAKECUDA_MIG_GPUS_wants_a_GPU_number_or_-_per_device";
            g_peer.parent[i] = parent;
            if (*p++ == '\0') break;
        }
    }
    return NULL;
}

/* The 16-byte UUID of physical device phys: v2 (cuDeviceGetUuid_v2) or v1's. */
static void fc_peer_uuid(int phys, int v2, char out[16])
{
    char buf[32];
    int parent = g_peer.parent[phys];
    if (parent < 0) snprintf(buf, sizeof buf, "fakecuda-phys-%02d", phys);
    else if (v2) snprintf(buf, sizeof buf, "fakecuda-mig-%02d", phys);
    else snprintf(buf, sizeof buf, "fakecuda-gpu-%02d", parent);
    memcpy(out, buf, 16);
}

/* Whether physical device phys can access the memory of another one, peer_phys. */
static int fc_peer_possible(int phys, int peer_phys)
{
    if (g_peer.parent[phys] >= 0 || g_peer.parent[peer_phys] >= 0) return 0;
    return !g_peer.no_peer[phys][peer_phys];
}

/* 1 if dev can access peer_dev's memory, else 0 (FAKECUDA_NO_PEER, MIG instances). The
 * same device twice is CUDA_ERROR_INVALID_DEVICE: stricter than needed, as the core never
 * asks it. */
FC_API CUresult cuDeviceCanAccessPeer(int *can_access, CUdevice dev, CUdevice peer_dev)
{
    CUresult rc = fc_need_init(FC_OP_CAN_ACCESS_PEER);
    if (rc != CUDA_SUCCESS) return rc;
    if (can_access == NULL) return fc_fail(FC_OP_CAN_ACCESS_PEER, CUDA_ERROR_INVALID_VALUE, "null");
    fc_ctx *c = fc_device(dev), *p = fc_device(peer_dev);
    if (c == NULL || p == NULL)
        return fc_fail(FC_OP_CAN_ACCESS_PEER, CUDA_ERROR_INVALID_DEVICE, "bad_ordinal");
    if (c == p) return fc_fail(FC_OP_CAN_ACCESS_PEER, CUDA_ERROR_INVALID_DEVICE, "same_device");
    *can_access = fc_peer_possible(c->phys, p->phys);
    fc_log(FC_OP_CAN_ACCESS_PEER, "dev=%d phys=%d peer=%d peer_phys=%d value=%d", dev, c->phys,
           peer_dev, p->phys, *can_access);
    return CUDA_SUCCESS;
}

#ifndef FAKECUDA_NO_UUID_V2
/* The device's own UUID: a MIG instance's ("fakecuda-mig-NN"), else as cuDeviceGetUuid. */
FC_API CUresult cuDeviceGetUuid_v2(CUuuid *uuid, CUdevice device)
{
    CUresult rc = fc_need_init(FC_OP_DEVICE_UUID_V2);
    if (rc != CUDA_SUCCESS) return rc;
    if (uuid == NULL) return fc_fail(FC_OP_DEVICE_UUID_V2, CUDA_ERROR_INVALID_VALUE, "null");
    fc_ctx *c = fc_device(device);
    if (c == NULL) return fc_fail(FC_OP_DEVICE_UUID_V2, CUDA_ERROR_INVALID_DEVICE, "bad_ordinal");
    fc_peer_uuid(c->phys, 1, uuid->bytes);
    fc_log(FC_OP_DEVICE_UUID_V2, "dev=%d phys=%d mig=%d", device, c->phys,
           g_peer.parent[c->phys] >= 0);
    return CUDA_SUCCESS;
}
#endif

/* ==========================================================================
 * Context-wide events, stream capture, slow kernels (issue 23)
 * ========================================================================== */

/* A cuCtxRecordEvent in flight: the event completes when every stream got there. */
typedef struct fc_join {
    _Atomic int parts; /* streams still to get there, + 1 while queueing */
    fc_event *ev;      /* a reference */
    uint64_t gen;
} fc_join;

/* The simulated capture (under g_lock). */
static fc_stream *g_capture;         /* the capturing stream, or NULL */
static int g_capture_mode;           /* its CUstreamCaptureMode */
static pthread_t g_capture_thread;   /* the thread that began it */
static int g_capture_invalid;        /* it was invalidated */
static _Thread_local int t_capture_mode; /* this thread's mode (0: GLOBAL, the default) */

/* One stream's part of a context-wide record is done; the last completes the event. */
static void fc_join_part_done(fc_join *j)
{
    if (atomic_fetch_sub(&j->parts, 1) != 1) return;
    fc_complete(&j->ev->st->done, j->gen);
    fc_event_put(j->ev);
    free(j);
}

/* Invalidate the capture (caller holds g_lock) and return op's logged failure rc.
 * "When an invalid operation is attempted during stream capture, any associated capture
 * graphs are invalidated" (CUDA Programming Guide, stream capture, Invalidation). */
static CUresult fc_capture_invalidate_locked(fc_opcode op, CUresult rc, const char *why)
{
    g_capture_invalid = 1;
    pthread_mutex_unlock(&g_lock);
    fc_log(FC_OP_CAPTURE_INVALIDATED, "op=%s why=%s", fc_op_names[op], why);
    rc = fc_fail(op, rc, why);
    pthread_mutex_lock(&g_lock);
    return rc;
}

/* cuCtxSynchronize, cuCtxRecordEvent on the context of device ordinal: not while a stream
 * of that context captures, from any thread ("It is also invalid to query the execution
 * status of or synchronize a broader handle which encompasses an active stream capture,
 * such as a device or context handle when any associated stream is in capture mode",
 * Programming Guide; cuCtxRecordEvent: "will return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED
 * if the specified context hCtx has a stream in the capture mode. In such a case, the call
 * will invalidate all the conflicting captures"). Another context's capture is no concern. */
static CUresult fc_capture_forbids_ctx(fc_opcode op, int ordinal)
{
    CUresult rc = CUDA_SUCCESS;
    pthread_mutex_lock(&g_lock);
    if (g_capture != NULL && g_capture->ordinal == ordinal)
        rc = fc_capture_invalidate_locked(op, CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,
                                          "context_call_during_capture");
    pthread_mutex_unlock(&g_lock);
    return rc;
}

/* A synchronize of the capturing stream itself ("It is invalid to synchronize or query the
 * execution status of a stream which is being captured"). */
static CUresult fc_capture_forbids_stream(fc_opcode op, const fc_stream *s)
{
    CUresult rc = CUDA_SUCCESS;
    pthread_mutex_lock(&g_lock);
    if (g_capture != NULL && g_capture == s)
        rc = fc_capture_invalidate_locked(op, CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,
                                          "sync_of_capturing_stream");
    pthread_mutex_unlock(&g_lock);
    return rc;
}

/* Any use of the legacy stream s while a blocking stream of its context captures: "When a
 * blocking stream is capturing, the legacy stream is in an unusable state until the
 * blocking stream capture is terminated. The legacy stream is not supported for stream
 * capture, but attempted use would have an implicit dependency on the capturing stream(s)"
 * (cuStreamIsCapturing); CUDA_ERROR_STREAM_CAPTURE_IMPLICIT: "a disallowed implicit
 * dependency on a current capture sequence from cudaStreamLegacy". */
static CUresult fc_capture_forbids_legacy(fc_opcode op, const fc_stream *s)
{
    CUresult rc = CUDA_SUCCESS;
    pthread_mutex_lock(&g_lock);
    if (s->is_default && g_capture != NULL && g_capture->ordinal == s->ordinal &&
        !g_capture->nonblocking)
        rc = fc_capture_invalidate_locked(op, CUDA_ERROR_STREAM_CAPTURE_IMPLICIT,
                                          "legacy_stream_during_blocking_capture");
    pthread_mutex_unlock(&g_lock);
    return rc;
}

/* A sync or query of an event recorded on the capturing stream during the capture:
 * CUDA_ERROR_CAPTURED_EVENT, "the operation is not permitted on an event which was last
 * recorded in a capturing stream". */
static CUresult fc_capture_forbids_event(fc_opcode op, fc_event *e)
{
    CUresult rc = CUDA_SUCCESS;
    pthread_mutex_lock(&g_lock);
    if (g_capture != NULL && e->captured)
        rc = fc_capture_invalidate_locked(op, CUDA_ERROR_CAPTURED_EVENT,
                                          "sync_of_captured_event");
    pthread_mutex_unlock(&g_lock);
    return rc;
}

/* A wait of stream s on event e with flags: CU_EVENT_WAIT_EXTERNAL only during s's capture
 * ("This flag is invalid outside of stream capture"), and a capturing stream may not wait
 * without it on an event recorded outside the capture ("It is invalid to wait on a
 * non-captured event from a stream which is being captured without specifying the
 * cudaEventWaitExternal flag", Programming Guide): CUDA_ERROR_STREAM_CAPTURE_ISOLATION,
 * "a dependency would have been created which crosses the capture sequence boundary". */
static CUresult fc_capture_forbids_wait(fc_opcode op, const fc_stream *s, const fc_event *e,
                                        unsigned flags)
{
    CUresult rc = CUDA_SUCCESS;
    pthread_mutex_lock(&g_lock);
    int capturing = g_capture != NULL && g_capture == s;
    if (flags == CU_EVENT_WAIT_EXTERNAL && !capturing) {
        pthread_mutex_unlock(&g_lock);
        return fc_fail(op, CUDA_ERROR_INVALID_VALUE, "WAIT_EXTERNAL_outside_capture");
    }
    if (capturing && !e->captured && flags != CU_EVENT_WAIT_EXTERNAL)
        rc = fc_capture_invalidate_locked(op, CUDA_ERROR_STREAM_CAPTURE_ISOLATION,
                                          "wait_on_event_from_outside_the_capture");
    pthread_mutex_unlock(&g_lock);
    return rc;
}

/* A call unsafe during capture (cuMemFree): refused unless the modes allow it. GLOBAL
 * capture: any thread not RELAXED; THREAD_LOCAL: the capturing thread, unless RELAXED;
 * RELAXED capture: none (cuThreadExchangeStreamCaptureMode's description of the modes). */
static CUresult fc_capture_forbids_unsafe(fc_opcode op)
{
    CUresult rc = CUDA_SUCCESS;
    pthread_mutex_lock(&g_lock);
    if (g_capture != NULL && t_capture_mode != CU_STREAM_CAPTURE_MODE_RELAXED &&
        (g_capture_mode == CU_STREAM_CAPTURE_MODE_GLOBAL ||
         (g_capture_mode == CU_STREAM_CAPTURE_MODE_THREAD_LOCAL &&
          pthread_equal(g_capture_thread, pthread_self()))))
        rc = fc_capture_invalidate_locked(op, CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,
                                          "unsafe_call_during_capture");
    pthread_mutex_unlock(&g_lock);
    return rc;
}

/* An event recorded on the capturing stream becomes a captured event; elsewhere, not. */
static void fc_capture_note_record(fc_event *e, const fc_stream *s)
{
    pthread_mutex_lock(&g_lock);
    e->captured = g_capture != NULL && g_capture == s;
    pthread_mutex_unlock(&g_lock);
}

/* Record in event the completion of all work queued so far on every stream of the context
 * hctx in this process (the double has one context per device). */
FC_API CUresult cuCtxRecordEvent(CUcontext hctx, CUevent event)
{
    CUresult rc = fc_need_init(FC_OP_CTX_RECORD_EVENT);
    if (rc != CUDA_SUCCESS) return rc;
    fc_ctx *c = (fc_ctx *)hctx;
    int known = 0;
    for (int i = 0; i < g_cfg.nvis; i++) known |= c == &g_ctx[i];
    if (!known || atomic_load(&c->refs) <= 0)
        return fc_fail(FC_OP_CTX_RECORD_EVENT, CUDA_ERROR_INVALID_CONTEXT,
                       "not_a_retained_context");
    fc_event *e = fc_event_get(event);
    if (e == NULL)
        return fc_fail(FC_OP_CTX_RECORD_EVENT, CUDA_ERROR_INVALID_HANDLE, "unknown_event");
    /* "hEvent and hCtx must be from the same CUDA context, otherwise
     * CUDA_ERROR_INVALID_HANDLE will be returned." */
    if (e->ordinal != c->ordinal) {
        fc_event_put(e);
        return fc_fail(FC_OP_CTX_RECORD_EVENT, CUDA_ERROR_INVALID_HANDLE,
                       "event_of_another_context");
    }
    if ((rc = fc_capture_forbids_ctx(FC_OP_CTX_RECORD_EVENT, c->ordinal)) != CUDA_SUCCESS) {
        fc_event_put(e);
        return rc;
    }
    fc_join *j = calloc(1, sizeof *j);
    size_t n = 0, cap = 0;
    fc_stream **all = NULL;
    pthread_mutex_lock(&g_lock);
    for (fc_stream *s = g_streams; s != NULL; s = s->next) cap++;
    all = cap > 0 ? calloc(cap, sizeof *all) : NULL;
    for (fc_stream *s = g_streams; s != NULL && all != NULL; s = s->next) {
        if (s->ordinal != c->ordinal) continue; /* the given context's streams only */
        s->refs++;
        all[n++] = s;
    }
    pthread_mutex_unlock(&g_lock);
    if (j == NULL || (cap > 0 && all == NULL)) {
        free(j);
        free(all);
        fc_event_put(e);
        return fc_fail(FC_OP_CTX_RECORD_EVENT, CUDA_ERROR_OUT_OF_MEMORY, "calloc");
    }
    j->ev = e;
    j->gen = atomic_fetch_add_explicit(&e->st->gen, 1, memory_order_acq_rel) + 1;
    atomic_init(&j->parts, (int)n + 1);
    for (size_t i = 0; i < n; i++) {
        fc_op *op = calloc(1, sizeof *op);
        if (op != NULL) {
            op->kind = FC_EX_JOIN;
            op->join = j;
        }
        if (op == NULL || fc_enqueue(all[i], op) != 0) {
            free(op);
            fc_join_part_done(j); /* nothing runs there any more */
        }
        fc_stream_put(all[i]);
    }
    free(all);
    fc_log(FC_OP_CTX_RECORD_EVENT, "ev=%s gen=%llu streams=%zu dev=%d", e->id,
           (unsigned long long)j->gen, n, c->ordinal);
    fc_join_part_done(j);
    return CUDA_SUCCESS;
}

/* The capture status of a stream: ACTIVE (INVALIDATED once invalidated) for the capturing
 * stream, NONE for others; for the legacy stream while a blocking stream of its context
 * captures, CUDA_ERROR_STREAM_CAPTURE_IMPLICIT without invalidating anything: "if this is
 * called on CU_STREAM_LEGACY (the "null stream") while a blocking stream in the same
 * context is capturing, it will return CUDA_ERROR_STREAM_CAPTURE_IMPLICIT and
 * *captureStatus is unspecified after the call. The blocking stream capture is not
 * invalidated." (cuStreamIsCapturing). */
FC_API CUresult cuStreamIsCapturing(CUstream stream, int *status)
{
    fc_ctx *ctx;
    CUresult rc = fc_current(FC_OP_STREAM_IS_CAPTURING, &ctx);
    if (rc != CUDA_SUCCESS) return rc;
    if (status == NULL)
        return fc_fail(FC_OP_STREAM_IS_CAPTURING, CUDA_ERROR_INVALID_VALUE, "null");
    fc_stream *st = fc_stream_get(stream, ctx);
    if (st == NULL)
        return fc_fail(FC_OP_STREAM_IS_CAPTURING, CUDA_ERROR_INVALID_HANDLE, "unknown_stream");
    int implicit = 0, v = CU_STREAM_CAPTURE_STATUS_NONE;
    pthread_mutex_lock(&g_lock);
    if (g_capture != NULL && g_capture == st)
        v = g_capture_invalid ? CU_STREAM_CAPTURE_STATUS_INVALIDATED
                              : CU_STREAM_CAPTURE_STATUS_ACTIVE;
    else if (st->is_default && g_capture != NULL && g_capture->ordinal == st->ordinal &&
             !g_capture->nonblocking)
        implicit = 1;
    pthread_mutex_unlock(&g_lock);
    char id[sizeof st->id];
    memcpy(id, st->id, sizeof id);
    fc_stream_put(st);
    if (implicit)
        return fc_fail(FC_OP_STREAM_IS_CAPTURING, CUDA_ERROR_STREAM_CAPTURE_IMPLICIT,
                       "legacy_stream_during_blocking_capture");
    *status = v;
    fc_log(FC_OP_STREAM_IS_CAPTURING, "stream=%s status=%d", id, v);
    return CUDA_SUCCESS;
}

/* Swap the calling thread's capture mode. */
FC_API CUresult cuThreadExchangeStreamCaptureMode(int *mode)
{
    CUresult alive = fc_alive(FC_OP_EXCHANGE_CAPTURE_MODE);
    if (alive != CUDA_SUCCESS) return alive;
    if (mode == NULL)
        return fc_fail(FC_OP_EXCHANGE_CAPTURE_MODE, CUDA_ERROR_INVALID_VALUE, "null");
    int old = t_capture_mode;
    t_capture_mode = *mode;
    *mode = old;
    fc_log(FC_OP_EXCHANGE_CAPTURE_MODE, "mode=%d old=%d", t_capture_mode, old);
    return CUDA_SUCCESS;
}

/* Queue a slow kernel on s that touches no memory: later work on s waits delay_us more. */
FC_API CUresult fakecuda_launch_sleep(CUstream s, unsigned delay_us)
{
    fc_ctx *ctx;
    CUresult rc = fc_current(FC_OP_LAUNCH_SLEEP, &ctx);
    if (rc != CUDA_SUCCESS) return rc;
    fc_stream *st;
    rc = fc_stream_for(FC_OP_LAUNCH_SLEEP, s, ctx, &st);
    if (rc != CUDA_SUCCESS) return rc;
    fc_op *op = calloc(1, sizeof *op);
    if (op == NULL) {
        fc_stream_put(st);
        return fc_fail(FC_OP_LAUNCH_SLEEP, CUDA_ERROR_OUT_OF_MEMORY, "calloc");
    }
    op->kind = FC_EX_SLEEP;
    op->delay_us = delay_us;
    rc = fc_submit(FC_OP_LAUNCH_SLEEP, st, op);
    if (rc == CUDA_SUCCESS) fc_log(FC_OP_LAUNCH_SLEEP, "stream=%s us=%u", st->id, delay_us);
    fc_stream_put(st);
    return rc;
}

/* Queue a kernel on s that runs until the int at open (the caller's, kept alive until
 * then) is not 0: later work on s waits for the host to open the gate. */
FC_API CUresult fakecuda_launch_gate(CUstream s, const int *open)
{
    fc_ctx *ctx;
    CUresult rc = fc_current(FC_OP_LAUNCH_GATE, &ctx);
    if (rc != CUDA_SUCCESS) return rc;
    if (open == NULL) return fc_fail(FC_OP_LAUNCH_GATE, CUDA_ERROR_INVALID_VALUE, "null");
    fc_stream *st;
    rc = fc_stream_for(FC_OP_LAUNCH_GATE, s, ctx, &st);
    if (rc != CUDA_SUCCESS) return rc;
    fc_op *op = calloc(1, sizeof *op);
    if (op == NULL) {
        fc_stream_put(st);
        return fc_fail(FC_OP_LAUNCH_GATE, CUDA_ERROR_OUT_OF_MEMORY, "calloc");
    }
    op->kind = FC_EX_GATE;
    op->gate = open;
    rc = fc_submit(FC_OP_LAUNCH_GATE, st, op);
    if (rc == CUDA_SUCCESS) fc_log(FC_OP_LAUNCH_GATE, "stream=%s", st->id);
    fc_stream_put(st);
    return rc;
}

/* Begin a simulated capture of s in mode (0 GLOBAL, 1 THREAD_LOCAL, 2 RELAXED); one at
 * a time. */
FC_API CUresult fakecuda_begin_capture(CUstream s, int mode)
{
    fc_ctx *ctx;
    CUresult rc = fc_current(FC_OP_BEGIN_CAPTURE, &ctx);
    if (rc != CUDA_SUCCESS) return rc;
    fc_stream *st;
    rc = fc_stream_for(FC_OP_BEGIN_CAPTURE, s, ctx, &st);
    if (rc != CUDA_SUCCESS) return rc;
    if (st->is_default) { /* "Capture may not be initiated if stream is CU_STREAM_LEGACY" */
        fc_stream_put(st);
        return fc_fail(FC_OP_BEGIN_CAPTURE, CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,
                       "legacy_stream");
    }
    pthread_mutex_lock(&g_lock);
    int busy = g_capture != NULL;
    if (!busy) {
        g_capture = st;
        g_capture_mode = mode;
        g_capture_thread = pthread_self();
        g_capture_invalid = 0;
    }
    pthread_mutex_unlock(&g_lock);
    if (busy) {
        fc_stream_put(st);
        return fc_fail(FC_OP_BEGIN_CAPTURE, CUDA_ERROR_ILLEGAL_STATE, "already_capturing");
    }
    fc_log(FC_OP_BEGIN_CAPTURE, "stream=%s mode=%d", st->id, mode);
    return CUDA_SUCCESS; /* the capture keeps the stream reference */
}

/* End the capture of s: CUDA_ERROR_STREAM_CAPTURE_INVALIDATED if something invalidated it. */
FC_API CUresult fakecuda_end_capture(CUstream s)
{
    CUresult alive = fc_alive(FC_OP_END_CAPTURE);
    if (alive != CUDA_SUCCESS) return alive;
    fc_stream *st = NULL;
    int invalid = 0;
    pthread_mutex_lock(&g_lock);
    if (g_capture != NULL && (CUstream)g_capture == s) {
        st = g_capture;
        invalid = g_capture_invalid;
        g_capture = NULL;
        for (fc_event *e = g_events; e != NULL; e = e->next) e->captured = 0;
    }
    pthread_mutex_unlock(&g_lock);
    if (st == NULL) return fc_fail(FC_OP_END_CAPTURE, CUDA_ERROR_ILLEGAL_STATE, "not_capturing");
    fc_log(FC_OP_END_CAPTURE, "stream=%s invalidated=%d", st->id, invalid);
    fc_stream_put(st);
    return invalid ? CUDA_ERROR_STREAM_CAPTURE_INVALIDATED : CUDA_SUCCESS;
}

/* ==========================================================================
 * Process exit
 * ========================================================================== */

/* The driver's teardown, run by exit() (registered by the first cuInit): from here on every
 * call returns CUDA_ERROR_DEINITIALIZED (fc_alive), as the real driver's do once "the CUDA
 * driver is in the process of shutting down"; the shm objects this process still owns are
 * unlinked: the device memory of a process that ends is gone, as on a real GPU (a killed
 * process leaves them). */
static void fc_teardown(void *unused)
{
    (void)unused;
    if (atomic_exchange(&g_deinit, 1)) return;
    fc_log(FC_OP_TEARDOWN, "pid=%d", (int)getpid());
    pid_t me = getpid();
    pthread_mutex_lock(&g_lock);
    for (fc_region *r = g_regions; r != NULL; r = r->next)
        if (!r->ipc && r->owner == me) {
            fc_imports_release(r->name, r->base, "exit");
            shm_unlink(r->name);
        }
    for (fc_event *e = g_events; e != NULL; e = e->next)
        if (e->ipc && !e->opened && e->creator == me) shm_unlink(e->id);
    pthread_mutex_unlock(&g_lock);
}

/* Test-only: what exit() does to the driver, now (a test then sees the calls after it). */
FC_API void fakecuda_teardown(void)
{
    fc_teardown(NULL);
}

/* The library is unmapped (dlclose) or the process ends (after fc_teardown). Unloaded after
 * cuInit while the process lives, the real driver's exit handlers and threads would run
 * unmapped code: a crash, later (JuliaGPU/CUDA.jl#1848). The double makes it immediate and
 * named. */
__attribute__((destructor)) static void fc_unloaded(void)
{
    if (!atomic_load(&g_inited) || atomic_load(&g_deinit)) return;
    fc_log(FC_OP_UNLOADED, "pid=%d", (int)getpid());
    static const char msg[] = "fakecuda: the driver library was unloaded (dlclose) after cuInit "
                              "in a living process: its exit handler would run unmapped code\n";
    ssize_t w = write(2, msg, sizeof msg - 1);
    (void)w;
    abort();
}
