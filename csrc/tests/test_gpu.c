/* test_gpu.c - C-level unit tests of the GPU ring (ts_device_cuda.c, the device paths of ts_ring.c
 * and ts_export.c), on the CUDA driver test double (csrc/tests/fake_cuda.c).
 *
 * The double refuses to open an IPC handle in the process that exported it, as the real
 * driver does, so a producer and its consumers are different processes. Each test group
 * runs in a process of its own, forked by main, which never loads the driver: the group
 * process is the producer; it forks its consumers FIRST and only then loads the driver,
 * and each consumer loads it for itself (no CUDA state crosses a fork). Producer and
 * consumers talk over pipes; a consumer's failed checks make it exit non-zero, which the
 * producer counts as a failure of the group.
 *
 * Build (from the repository root):
 *   cc -std=c11 -Wall -Wextra -Werror -O1 -g -pthread -Icsrc csrc/tests/test_gpu.c \
 *      $(ls csrc/ts_*.c | grep -v 'ts_module.c\|ts_py_') -o test_gpu -lrt -ldl
 * Run:  TENSORSOCKET_LIBCUDA=path/to/libfakecuda.so ./test_gpu [NAME]
 * (tests/fakecuda.py builds the double; tests/test_c_gpu.py does all of it.)
 * NAME runs the groups whose name contains it. The last line is "N passed, M failed";
 * the exit status is non-zero if any failed. */
#define _GNU_SOURCE
#include <dirent.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "base/ts_clock.h"
#include "device/ts_cuda_api.h"
#include "base/ts_error.h"
#include "ring/ts_export.h"
#include "base/ts_proc.h"
#include "ring/ts_ring.h"

#include "ts_check.h"

/* ---- driver checks (the rest of the framework is in ts_check.h) ---------------------- */

/* CHECK_CU: fail unless the driver call returned CUDA_SUCCESS. */
static int ts_check_cu(CUresult rc, const char *expr, const char *file, int line)
{
    if (rc != CUDA_SUCCESS) ts_fail(file, line, "%s returned CUresult %d\n", expr, rc);
    return rc == CUDA_SUCCESS;
}

#define CHECK_CU(call) ts_check_cu((call), #call, __FILE__, __LINE__)
#define REQUIRE_CU(call) do { if (!CHECK_CU(call)) goto out; } while (0)

/* ---- processes and messages ------------------------------------------------------- */

/* The segment name of the running group (set by main before it forks the group). */
static char g_name[96];

/* A consumer process, seen from its producer. */
typedef struct peer {
    pid_t pid;
    int to;   /* write end of producer -> consumer */
    int from; /* read end of consumer -> producer */
} peer;

/* Pipe ends this process holds towards its children: a later child closes them. */
#define MAX_FDS 16
static int g_fds[MAX_FDS];
static int g_nfds;

enum {
    M_HELLO = 1, /* producer -> consumer: a = consumer index, b = token */
    M_READY,     /* consumer -> producer: ring opened, bound and imported */
    M_GO,        /* producer -> consumer: go on to the next step */
    M_DONE,      /* consumer -> producer: the step is done */
    M_BYE,       /* producer -> consumer: clean up and exit */
};

typedef struct msg {
    uint32_t tag;
    uint32_t pad;
    uint64_t a, b;
} msg;

/* Send message tag (a, b) on fd in one write; 1 if all of it was written. */
static int send_msg(int fd, uint32_t tag, uint64_t a, uint64_t b)
{
    msg m = {tag, 0, a, b};
    ssize_t n;
    do n = write(fd, &m, sizeof m); /* < PIPE_BUF: atomic */
    while (n < 0 && errno == EINTR);
    return n == (ssize_t)sizeof m;
}

/* Receive one message within timeout_ms; it must have tag want. */
static int recv_msg_(int fd, uint32_t want, msg *m, int timeout_ms, const char *file, int line)
{
    uint64_t dl = deadline_ms((uint64_t)timeout_ms);
    size_t got = 0;
    while (got < sizeof *m) {
        uint64_t now = ts_now_ns();
        if (now >= dl) {
            ts_fail(file, line, "no message %u within %d ms\n", want, timeout_ms);
            return 0;
        }
        struct pollfd p = {fd, POLLIN, 0};
        int rc = poll(&p, 1, (int)((dl - now) / MS) + 1);
        if (rc < 0 && errno == EINTR) continue;
        if (rc <= 0) continue;
        ssize_t n = read(fd, (char *)m + got, sizeof *m - got);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) {
            ts_fail(file, line, "the other process hung up while message %u was expected\n",
                    want);
            return 0;
        }
        got += (size_t)n;
    }
    if (m->tag != want) {
        ts_fail(file, line, "message %u received, %u expected\n", m->tag, want);
        return 0;
    }
    return 1;
}
#define RECV(fd, tag, m) REQUIRE(recv_msg_((fd), (tag), &(m), 20000, __FILE__, __LINE__))
#define SEND(fd, tag, a, b) REQUIRE(send_msg((fd), (tag), (a), (b)))

typedef void (*child_fn)(int in, int out);

/* End a forked process: status 1 if one of its checks failed, else 0. */
static _Noreturn void exit_checked(void)
{
    fflush(stdout);
    exit(atomic_load(&g_failed_checks) != 0 ? 1 : 0); /* exit: LeakSanitizer runs */
}

/* Fork a consumer running fn(in, out); it exits non-zero if a check failed. The caller
 * must not have loaded the driver yet. */
static int spawn(peer *p, child_fn fn)
{
    int down[2], up[2];
    p->pid = -1;
    p->to = p->from = -1;
    if (pipe(down) != 0) return CHECK(0), -1;
    if (pipe(up) != 0) {
        close(down[0]);
        close(down[1]);
        return CHECK(0), -1;
    }
    fflush(stdout);
    pid_t pid = fork();
    if (pid < 0) return CHECK(pid >= 0), -1;
    if (pid == 0) {
        for (int i = 0; i < g_nfds; i++) close(g_fds[i]);
        g_nfds = 0;
        close(down[1]);
        close(up[0]);
        g_role = "consumer";
        atomic_store(&g_failed_checks, 0);
        alarm(60); /* a hung consumer dies and fails the group */
        fn(down[0], up[1]);
        close(down[0]);
        close(up[1]);
        exit_checked();
    }
    close(down[0]);
    close(up[1]);
    p->pid = pid;
    p->to = down[1];
    p->from = up[0];
    if (g_nfds + 2 <= MAX_FDS) {
        g_fds[g_nfds++] = p->to;
        g_fds[g_nfds++] = p->from;
    }
    return 0;
}

/* Take fd off the pipe ends a later child closes (the caller is closing it). */
static void forget_fd(int fd)
{
    for (int i = 0; i < g_nfds; i++)
        if (g_fds[i] == fd) g_fds[i] = g_fds[--g_nfds];
}

/* Wait (30 s at most) for the consumer to exit; with expect_ok, it must exit 0. */
static void reap(peer *p, int expect_ok)
{
    if (p->pid <= 0) return;
    if (p->to >= 0) {
        forget_fd(p->to);
        close(p->to);
    }
    p->to = -1;
    int status = 0;
    pid_t r = 0;
    uint64_t dl = deadline_ms(30000);
    while ((r = waitpid(p->pid, &status, WNOHANG)) == 0 && ts_now_ns() < dl) sleep_us(1000);
    if (r == 0) {
        kill(p->pid, SIGKILL);
        waitpid(p->pid, &status, 0);
        CHECK(!"the consumer did not exit within 30 s");
    } else if (expect_ok && !(WIFEXITED(status) && WEXITSTATUS(status) == 0)) {
        ts_fail(__FILE__, __LINE__, "consumer %d failed: %s %d\n", (int)p->pid,
                WIFEXITED(status) ? "exit status" : "signal",
                WIFEXITED(status) ? WEXITSTATUS(status) : WTERMSIG(status));
    }
    if (p->from >= 0) {
        forget_fd(p->from);
        close(p->from);
    }
    p->from = -1;
    p->pid = -1;
}

/* The fakecuda shm objects (device memory, interprocess events) of process pid. */
static int fakecuda_objects(pid_t pid, int unlink_them)
{
    char a[48], b[48];
    int n = 0;
    snprintf(a, sizeof a, "fakecuda-%d-", (int)pid);
    snprintf(b, sizeof b, "fakecuda-ev-%d-", (int)pid);
    DIR *d = opendir("/dev/shm");
    if (d == NULL) return 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (strncmp(e->d_name, a, strlen(a)) != 0 && strncmp(e->d_name, b, strlen(b)) != 0)
            continue;
        n++;
        if (unlink_them) {
            char path[300];
            snprintf(path, sizeof path, "/dev/shm/%s", e->d_name);
            unlink(path);
        }
    }
    closedir(d);
    return n;
}

/* Threads of this process. */
static int thread_count(void)
{
    int n = 0;
    DIR *d = opendir("/proc/self/task");
    if (d == NULL) return -1;
    struct dirent *e;
    while ((e = readdir(d)) != NULL)
        if (e->d_name[0] != '.') n++;
    closedir(d);
    return n;
}

/* 1 if there is no segment named g_name. */
static int no_segment(void)
{
    errno = 0;
    int fd = shm_open(g_name, O_RDONLY, 0);
    int none = fd < 0 && errno == ENOENT;
    if (fd >= 0) close(fd);
    return none;
}

/* ---- batches ------------------------------------------------------------------------ */

#define SLOTS 4
static const int64_t shape8[1] = {8}, stride4[1] = {4}, shape3[1] = {3}, stride1[1] = {1};

/* The bytes of leaf i of batch tag: int32[8] = tag*100+j, or uint8[3] = tag+j+1. */
static size_t leaf_bytes(uint64_t tag, uint32_t i, uint8_t out[32])
{
    if (i == 0) {
        int32_t a[8];
        for (int j = 0; j < 8; j++) a[j] = (int32_t)(tag * 100 + (uint64_t)j);
        memcpy(out, a, sizeof a);
        return sizeof a;
    }
    for (int j = 0; j < 3; j++) out[j] = (uint8_t)(tag + (uint64_t)j + 1);
    return 3;
}

/* Publish batch tag (epoch 0, index tag) with meta "meta-<tag>", waiting up to 5 s. */
static ts_status publish_batch(ts_ring *prod, uint64_t tag, ts_err *err)
{
    uint8_t a[32], b[32];
    char meta[32];
    leaf_bytes(tag, 0, a);
    leaf_bytes(tag, 1, b);
    ts_src_leaf leaves[2] = {{a, 1, shape8, stride4, 4, {kDLInt, 32, 1}},
                             {b, 1, shape3, stride1, 1, {kDLUInt, 8, 1}}};
    int m = snprintf(meta, sizeof meta, "meta-%llu", (unsigned long long)tag);
    return ts_ring_publish(prod, TS_ENTRY_BATCH, 0, tag, leaves, 2, meta, (uint64_t)m,
                           deadline_ms(5000), err);
}

/* FNV-1a 64, as fakecuda_launch_read computes it. */
static unsigned long long fnv1a(const uint8_t *p, size_t n)
{
    unsigned long long h = 0xcbf29ce484222325ULL;
    for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 0x100000001b3ULL;
    return h;
}

/* Poll (deadline ms) until slot k of r no longer carries bit; 1 if it cleared. */
static int wait_bit_clear(const ts_ring *r, uint32_t k, uint64_t bit, uint64_t ms)
{
    uint64_t dl = deadline_ms(ms);
    while (readers_of(r, k) & bit) {
        if (ts_now_ns() >= dl) return 0;
        sleep_us(500);
    }
    return 1;
}

/* Flush the consumer's queued GPU releases (the consumer's next call does it in Python),
 * with no current stream known, waiting up to wait_ms for the release thread to finish
 * them. */
static ts_status flush_releases(ts_ring *r, uint32_t wait_ms, ts_err *err)
{
    return r->dev->device->flush(r->dev, 0, wait_ms, err);
}

/* The importer entry's state (TS_IMPORTER_*), 0 if free, and its pid. */
static uint32_t importer_state(const ts_importer *e, pid_t *pid)
{
    uint64_t claim = atomic_load(&((ts_importer *)e)->claim);
    if (pid != NULL) *pid = (pid_t)(claim >> 2);
    return (uint32_t)(claim & 3);
}

/* 1 if some byte of the n bytes at p is not zero. */
static int nonzero(const void *p, size_t n)
{
    const uint8_t *b = p;
    for (size_t i = 0; i < n; i++)
        if (b[i] != 0) return 1;
    return 0;
}

/* ---- the double's test-only exports -------------------------------------------------- */

typedef CUresult (*launch_read_fn)(CUstream, CUdeviceptr, size_t, unsigned long long *,
                                   unsigned);
typedef int (*counter_fn)(const char *);

/* The same library the core loaded (api->lib is its dlopen handle). */
static launch_read_fn launch_read_of(const ts_cuda_api *api)
{
    launch_read_fn f = NULL;
    void *p = dlsym(api->lib, "fakecuda_launch_read");
    if (p != NULL) memcpy(&f, &p, sizeof f);
    return f;
}

/* How often this process performed op on the double (-1 if unavailable). */
static int fc_counter(const ts_cuda_api *api, const char *op)
{
    counter_fn f = NULL;
    void *p = dlsym(api->lib, "fakecuda_counter");
    if (p == NULL) return -1;
    memcpy(&f, &p, sizeof f);
    return f(op);
}

typedef CUresult (*gate_fn)(CUstream, const int *);
typedef CUresult (*capture_fn)(CUstream, int);
typedef CUresult (*end_capture_fn)(CUstream);

/* An export of the double by name (NULL if it has none). */
static void *fc_sym(const ts_cuda_api *api, const char *name)
{
    return dlsym(api->lib, name);
}

/* ---- producer and consumer sides ------------------------------------------------------ */

typedef struct prod {
    ts_cuda_api *api;
    ts_ring *ring;
} prod;

/* Load the driver and create the CUDA ring g_name (SLOTS slots) on device 0. */
static int prod_open(prod *p)
{
    ts_err err = {0};
    ts_geometry g = {SLOTS, 2, 4096, 1};
    memset(p, 0, sizeof *p);
    if (!CHECK_ST(ts_cuda_load(&p->api, &err), TS_OK)) return -1;
    ts_ring_unlink_name(g_name, NULL);
    if (!CHECK_ST(ts_ring_create_on_device(g_name, &g, &p->api->base, 0, &p->ring, &err), TS_OK))
        return -1;
    return 0;
}

/* Reserve and activate a consumer entry for c and send it the handshake. */
static int prod_add(prod *p, peer *c, uint32_t *index)
{
    ts_err err = {0};
    uint64_t token = 0, start = 0;
    if (!CHECK_ST(ts_ring_reserve(p->ring, c->pid, ts_proc_start_time(c->pid), 0, index, &token,
                                  &err), TS_OK) ||
        !CHECK_ST(ts_ring_activate(p->ring, *index, 0, &start, &err), TS_OK))
        return -1;
    return CHECK(send_msg(c->to, M_HELLO, *index, token)) ? 0 : -1;
}

/* Fork a consumer running fn, create the ring, and hand it its entry; 0 once it is READY. */
static int prod_start(prod *p, peer *c, child_fn fn, uint32_t *index)
{
    msg m;
    if (!CHECK(spawn(c, fn) == 0) || prod_open(p) != 0 || prod_add(p, c, index) != 0) return -1;
    return recv_msg_(c->from, M_READY, &m, 20000, __FILE__, __LINE__) ? 0 : -1;
}

/* Tell consumer c to exit, reap it (it must exit 0), and wait for the pool to be released. */
static int prod_finish(prod *p, peer *c)
{
    ts_err err = {0};
    if (!CHECK(send_msg(c->to, M_BYE, 0, 0))) return -1;
    reap(c, 1);
    return CHECK_ST(ts_ring_wait_released(p->ring, deadline_ms(2000), &err), TS_OK) ? 0 : -1;
}

/* Drop the ring (its pool, events and stream go) and the driver. */
static void prod_close(prod *p)
{
    if (p->ring != NULL) ts_ring_unref(p->ring);
    p->ring = NULL;
    ts_ring_unlink_name(g_name, NULL);
    ts_cuda_unref(p->api);
    p->api = NULL;
    CHECK_EQ(fakecuda_objects(getpid(), 0), 0); /* no device memory or event left */
}

typedef struct cons {
    ts_cuda_api *api;
    ts_ring *ring; /* bound to our entry, pool imported on device 0 */
    uint32_t index;
    uint64_t token;
    CUdevice dev;
    CUcontext ctx;
    int retained, pushed;
    CUstream stream; /* ours, created in the primary context */
} cons;

/* Handshake, open and bind the ring, load the driver, make a stream, import the pool. */
static int cons_open(cons *c, int in)
{
    ts_err err = {0};
    msg m;
    memset(c, 0, sizeof *c);
    if (!recv_msg_(in, M_HELLO, &m, 20000, __FILE__, __LINE__)) return -1;
    c->index = (uint32_t)m.a;
    c->token = m.b;
    if (!CHECK_ST(ts_ring_open(g_name, &c->ring, &err), TS_OK)) return -1;
    if (!CHECK_ST(ts_ring_bind_consumer(c->ring, c->index, c->token, &err), TS_OK)) return -1;
    if (!CHECK_ST(ts_cuda_load(&c->api, &err), TS_OK)) return -1;
    if (!CHECK_CU(c->api->DeviceGet(&c->dev, 0))) return -1;
    if (!CHECK_CU(c->api->DevicePrimaryCtxRetain(&c->ctx, c->dev))) return -1;
    c->retained = 1;
    if (!CHECK_CU(c->api->CtxPushCurrent(c->ctx))) return -1;
    c->pushed = 1;
    if (!CHECK_CU(c->api->StreamCreate(&c->stream, CU_STREAM_NON_BLOCKING))) return -1;
    if (!CHECK_ST(ts_ring_import_device(c->ring, &c->api->base, 0, &err), TS_OK)) return -1;
    return 0;
}

/* Undo cons_open (ring, stream, context, driver); no device memory or event may be left. */
static void cons_close(cons *c)
{
    if (c->ring != NULL) ts_ring_unref(c->ring); /* joins the release thread, closes the mappings */
    c->ring = NULL;
    if (c->stream != NULL) CHECK_CU(c->api->StreamDestroy(c->stream));
    c->stream = NULL;
    if (c->pushed) CHECK_CU(c->api->CtxPopCurrent(NULL));
    c->pushed = 0;
    if (c->retained) CHECK_CU(c->api->DevicePrimaryCtxRelease(c->dev));
    c->retained = 0;
    ts_cuda_unref(c->api);
    c->api = NULL;
    CHECK_EQ(fakecuda_objects(getpid(), 0), 0); /* device copies were freed */
}

/* cons_open, find the double's reading kernel (with launch), and tell the producer READY. */
static int cons_ready(cons *c, int in, int out, launch_read_fn *launch)
{
    if (cons_open(c, in) != 0) return -1;
    if (launch != NULL) {
        *launch = launch_read_of(c->api);
        if (!CHECK(*launch != NULL)) return -1;
    }
    return CHECK(send_msg(out, M_READY, 0, 0)) ? 0 : -1;
}

/* The DLPack stream argument that names CUDA stream s. */
static int64_t stream_arg(CUstream s) { return (int64_t)(uintptr_t)s; }

/* Export leaf i of the lease as a device tensor. */
static void *export_dev(ts_lease *l, uint32_t i, int versioned, int copy, int64_t stream,
                        ts_err *err)
{
    ts_export_opts o = {.versioned = versioned, .minor = 1, .copy = copy, .device = 1,
                        .stream = stream};
    return ts_export_leaf(l, i, &o, err);
}

/* The DLTensor of an exported tensor, versioned or legacy. */
static DLTensor *tensor_of(void *managed, int versioned)
{
    return versioned ? &((DLManagedTensorVersioned *)managed)->dl_tensor
                     : &((DLManagedTensor *)managed)->dl_tensor;
}

/* Queue a kernel (us µs) hashing n bytes of entry a's leaf 0 into *sum, through a device view
 * on our stream, at *t_launch (if not NULL); then drop the view and its lease. 0 if queued. */
static int launch_and_drop(cons *c, launch_read_fn launch, const ts_acquired *a, size_t n,
                           unsigned long long *sum, unsigned us, uint64_t *t_launch)
{
    ts_err err = {0};
    ts_lease *l = ts_lease_new(c->ring, a->slot, a->seq);
    if (!CHECK(l != NULL)) return -1;
    void *t = export_dev(l, 0, 1, 0, stream_arg(c->stream), &err);
    if (!CHECK_ST(t != NULL ? TS_OK : err.code, TS_OK)) return -1;
    if (!CHECK_CU(launch(c->stream, (CUdeviceptr)(uintptr_t)tensor_of(t, 1)->data, n, sum, us)))
        return -1;
    if (t_launch != NULL) *t_launch = ts_now_ns();
    ts_export_delete(t, 1);
    ts_lease_unref(l, TS_USE_WHOLE);
    if (!CHECK_ST(flush_releases(c->ring, 0, &err), TS_OK)) return -1;
    return 0;
}

/* 1 if the device tensor t is leaf i of batch tag, read at the device pointer. */
static int device_leaf_ok(const cons *c, const DLTensor *t, uint32_t slot, uint32_t i,
                          uint64_t tag, int copy)
{
    uint8_t want[32];
    size_t n = leaf_bytes(tag, i, want);
    const ts_leaf *leaf = &ts_ring_slot(c->ring, slot)->leaves[i];
    CUdeviceptr at = ts_ring_device_ptr(c->ring, slot) + leaf->offset;
    int ok = CHECK_EQ(t->device.device_type, kDLCUDA) && CHECK_EQ(t->device.device_id, 0) &&
             CHECK_EQ(t->ndim, 1) && CHECK_EQ(t->shape[0], i == 0 ? 8 : 3) &&
             CHECK_EQ(t->strides[0], 1) && CHECK_EQ(t->byte_offset, 0) &&
             CHECK_EQ(t->dtype.code, i == 0 ? kDLInt : kDLUInt) &&
             CHECK_EQ(t->dtype.bits, i == 0 ? 32 : 8) && CHECK_EQ(leaf->nbytes, n);
    if (copy) ok = ok && CHECK((CUdeviceptr)(uintptr_t)t->data != at);
    else ok = ok && CHECK_EQ((CUdeviceptr)(uintptr_t)t->data, at);
    /* The double's device memory is mapped here: the device pointer reads as host memory. */
    if (ok && !CHECK(memcmp(t->data, want, n) == 0)) {
        printf("    batch %llu leaf %u: device bytes differ from the published ones\n",
               (unsigned long long)tag, i);
        ok = 0;
    }
    return ok;
}

/* ==========================================================================
 * 1. Creating a CUDA ring, importing its pool
 * ========================================================================== */

/* Consumer: the imported pool, repeated and other-device imports; unref closes the mappings. */
static void import_consumer(int in, int out)
{
    cons c;
    ts_err err = {0};
    msg m;
    CUdeviceptr ptrs[SLOTS];
    if (cons_open(&c, in) != 0) goto out;
    const ts_header *h = c.ring->hdr;
    CHECK_EQ(h->device_type, kDLCUDA);
    CHECK_EQ(ts_ring_imported_device(c.ring), 0);
    for (uint32_t k = 0; k < SLOTS; k++) {
        ptrs[k] = ts_ring_device_ptr(c.ring, k);
        CHECK(ptrs[k] != 0);
        for (uint32_t j = 0; j < k; j++) CHECK(ptrs[j] != ptrs[k]);
        const ts_device_ipc *e = ts_ring_ipc_entry(c.ring, k);
        REQUIRE(e != NULL);
        CHECK(nonzero(e->mem, sizeof e->mem));
    }
    CHECK_EQ(ts_ring_device_ptr(c.ring, SLOTS), 0); /* out of range */
    CHECK_EQ(fc_counter(c.api, "ipc_open_mem"), SLOTS);
    CHECK_EQ(fc_counter(c.api, "ipc_open_event"), 0); /* no event crosses processes */

    /* Importing again changes nothing and opens nothing. */
    REQUIRE_OK(ts_ring_import_device(c.ring, &c.api->base, 0, &err));
    CHECK_EQ(ts_ring_imported_device(c.ring), 0);
    for (uint32_t k = 0; k < SLOTS; k++) CHECK_EQ(ts_ring_device_ptr(c.ring, k), ptrs[k]);
    CHECK_EQ(fc_counter(c.api, "ipc_open_mem"), SLOTS);
    /* Another device than the one imported on is refused, the import stays. */
    CHECK_ST(ts_ring_import_device(c.ring, &c.api->base, 1, &err), TS_E_INVALID);
    CHECK(strstr(err.msg, "GPU 0") != NULL);
    CHECK_EQ(ts_ring_imported_device(c.ring), 0);

    SEND(out, M_READY, 0, 0);
    RECV(in, M_GO, m);
    /* Dropping the ring closes the mappings and the importer entry. */
    ts_ring_unref(c.ring);
    c.ring = NULL;
    CHECK_EQ(fc_counter(c.api, "ipc_close_mem"), SLOTS);
    SEND(out, M_DONE, 0, 0);
    RECV(in, M_BYE, m);
out:
    cons_close(&c);
}

/* A CUDA ring's header and IPC table, and the importer entry while a consumer maps its pool. */
static void test_import(void)
{
    prod p = {0};
    peer c = {0};
    ts_err err = {0};
    msg m;
    uint32_t index = 0;
    REQUIRE(spawn(&c, import_consumer) == 0);
    REQUIRE(prod_open(&p) == 0);
    const ts_header *h = p.ring->hdr;
    CHECK_EQ(h->device_type, kDLCUDA);
    CHECK_EQ(h->device_ordinal, 0);
    CHECK(h->ipc_offset != 0);
    CHECK(nonzero(h->device_uuid, sizeof h->device_uuid));
    CHECK_EQ(h->host_pinned, 1);
    /* The IPC table: one memory handle per slot, all different. */
    for (uint32_t k = 0; k < SLOTS; k++) {
        const ts_device_ipc *e = ts_ring_ipc_entry(p.ring, k);
        REQUIRE(e != NULL);
        CHECK(nonzero(e->mem, sizeof e->mem));
        for (uint32_t j = 0; j < k; j++) {
            const ts_device_ipc *f = ts_ring_ipc_entry(p.ring, j);
            CHECK(memcmp(e->mem, f->mem, sizeof e->mem) != 0);
        }
    }
    CHECK_EQ(fc_counter(p.api, "ipc_get_event"), 0);
    CHECK(ts_ring_ipc_entry(p.ring, SLOTS) == NULL);
    CHECK_EQ(fc_counter(p.api, "alloc"), SLOTS);
    CHECK_EQ(fc_counter(p.api, "ipc_get_mem"), SLOTS);
    CHECK_EQ(ts_ring_importers(p.ring), 0);

    REQUIRE(prod_add(&p, &c, &index) == 0);
    RECV(c.from, M_READY, m);
    CHECK_EQ(ts_ring_importers(p.ring), 1);
    int found = 0;
    for (int i = 0; i < TS_MAX_CONSUMERS; i++) {
        pid_t pid = 0;
        uint32_t state = importer_state(&h->importers[i], &pid);
        if (state == 0) continue;
        found++;
        CHECK_EQ(state, TS_IMPORTER_MAPPED);
        CHECK_EQ(pid, c.pid);
    }
    CHECK_EQ(found, 1);
    SEND(c.to, M_GO, 0, 0);
    RECV(c.from, M_DONE, m);
    /* The consumer is alive but closed its mapping: nobody maps the pool. */
    CHECK_EQ(ts_ring_importers(p.ring), 0);
    CHECK_ST(ts_ring_wait_released(p.ring, deadline_ms(2000), &err), TS_OK);
    SEND(c.to, M_BYE, 0, 0);
out:
    reap(&c, 1);
    prod_close(&p);
}

/* ==========================================================================
 * 2. Device views of published batches
 * ========================================================================== */

#define DV_BATCHES 10

/* Consumer: read DV_BATCHES batches through device views; every deferred release happens. */
static void views_consumer(int in, int out)
{
    cons c;
    ts_err err = {0};
    ts_acquired a;
    msg m;
    if (cons_ready(&c, in, out, NULL) != 0) goto out;
    for (uint64_t n = 0; n < DV_BATCHES; n++) {
        REQUIRE_OK(ts_ring_acquire(c.ring, deadline_ms(5000), &a, &err));
        CHECK_EQ(a.seq, n);
        CHECK_EQ(a.slot, n % SLOTS);
        CHECK_EQ(a.kind, TS_ENTRY_BATCH);
        CHECK_EQ(a.index, n);
        ts_lease *l = ts_lease_new(c.ring, a.slot, a.seq);
        REQUIRE(l != NULL);
        /* Leaf 0 versioned, leaf 1 legacy, both on our stream. */
        void *t0 = export_dev(l, 0, 1, 0, stream_arg(c.stream), &err);
        CHECK_ST(t0 != NULL ? TS_OK : err.code, TS_OK);
        void *t1 = export_dev(l, 1, 0, 0, stream_arg(c.stream), &err);
        CHECK_ST(t1 != NULL ? TS_OK : err.code, TS_OK);
        CHECK_EQ(l->n_streams, 1);
        CHECK(l->streams[0] == (ts_device_stream)c.stream);
        CHECK_CU(c.api->StreamSynchronize(c.stream));
        if (t0 != NULL) {
            const DLManagedTensorVersioned *v = t0;
            CHECK_EQ(v->version.major, TS_DLPACK_MAJOR);
            CHECK_EQ(v->flags, TS_DLPACK_FLAG_READ_ONLY);
            CHECK(device_leaf_ok(&c, tensor_of(t0, 1), a.slot, 0, n, 0));
            ts_export_delete(t0, 1);
        }
        if (t1 != NULL) {
            CHECK(device_leaf_ok(&c, tensor_of(t1, 0), a.slot, 1, n, 0));
            ts_export_delete(t1, 0);
        }
        ts_lease_unref(l, TS_USE_WHOLE);
        CHECK_ST(flush_releases(c.ring, 0, &err), TS_OK);
    }
    /* Every deferred release happens. */
    uint64_t dl = deadline_ms(5000);
    while (bit_in_use(c.ring, 1ULL << c.index) && ts_now_ns() < dl) sleep_us(500);
    CHECK(!bit_in_use(c.ring, 1ULL << c.index));
    CHECK_EQ(atomic_load(&c.ring->refs), 1);
    SEND(out, M_DONE, 0, 0);
    RECV(in, M_BYE, m);
out:
    cons_close(&c);
}

/* Device views of 10 batches through 4 slots: right bytes, one copy per batch, slots reused. */
static void test_device_views(void)
{
    prod p = {0};
    peer c = {0};
    ts_err err = {0};
    msg m;
    uint32_t index = 0;
    REQUIRE(prod_start(&p, &c, views_consumer, &index) == 0);
    /* 10 batches through 4 slots: slots are reused after their deferred releases. */
    for (uint64_t n = 0; n < DV_BATCHES; n++) REQUIRE_OK(publish_batch(p.ring, n, &err));
    RECV(c.from, M_DONE, m);
    CHECK_EQ(atomic_load(&p.ring->hdr->published), DV_BATCHES);
    CHECK_EQ(atomic_load(&p.ring->hdr->consumers[index].delivered), DV_BATCHES);
    /* One host-to-device copy per batch. */
    CHECK_EQ(fc_counter(p.api, "htod"), DV_BATCHES);
    CHECK(prod_finish(&p, &c) == 0);
out:
    reap(&c, 1);
    prod_close(&p);
}

/* ==========================================================================
 * 3. A dropped device view releases its slot only after the queued kernel ran
 * ========================================================================== */

#define KERNEL_US 200000

/* Consumer: drop a view with a kernel queued on it; the slot is released only after the kernel. */
static void deferred_consumer(int in, int out)
{
    cons c;
    ts_err err = {0};
    ts_acquired a;
    msg m;
    launch_read_fn launch = NULL;
    unsigned long long sum = 0;
    uint8_t want[32];
    size_t n = leaf_bytes(7, 0, want);
    uint64_t t_launch = 0;
    if (cons_ready(&c, in, out, &launch) != 0) goto out;
    REQUIRE_OK(ts_ring_acquire(c.ring, deadline_ms(5000), &a, &err));
    CHECK_EQ(a.index, 7);
    uint64_t bit = 1ULL << c.index;
    /* Drop every reference at once: the slot stays ours while the kernel may read it. */
    REQUIRE(launch_and_drop(&c, launch, &a, n, &sum, KERNEL_US, &t_launch) == 0);
    CHECK(readers_of(c.ring, a.slot) & bit);
    CHECK_EQ(atomic_load(&c.ring->refs), 2); /* ours + the pending release's */
    CHECK(wait_bit_clear(c.ring, a.slot, bit, 5000));
    uint64_t waited = ts_now_ns() - t_launch;
    /* Released after the kernel: its result is there already, without a sync. */
    CHECK_EQ(sum, fnv1a(want, n));
    CHECK(waited >= KERNEL_US * 1000ULL);
    CHECK_CU(c.api->StreamSynchronize(c.stream));
    CHECK_EQ(sum, fnv1a(want, n));
    uint64_t dl_refs = deadline_ms(2000);
    while (atomic_load(&c.ring->refs) != 1 && ts_now_ns() < dl_refs) sleep_us(500);
    CHECK_EQ(atomic_load(&c.ring->refs), 1);
    SEND(out, M_DONE, 0, 0);
    RECV(in, M_BYE, m);
out:
    cons_close(&c);
}

/* A dropped device view releases its slot only once the kernel queued on it has run. */
static void test_deferred_release(void)
{
    prod p = {0};
    peer c = {0};
    ts_err err = {0};
    msg m;
    uint32_t index = 0;
    REQUIRE(prod_start(&p, &c, deferred_consumer, &index) == 0);
    REQUIRE_OK(publish_batch(p.ring, 7, &err));
    RECV(c.from, M_DONE, m);
    CHECK_EQ(readers_of(p.ring, 0), 0);
    CHECK(prod_finish(&p, &c) == 0);
out:
    reap(&c, 1);
    prod_close(&p);
}

/* A view exported with stream -1 (the caller orders its own work) or 2 (the exporting
 * thread's per-thread stream) names no stream its release can follow: it is released only
 * after the work queued on the legacy default stream (which the per-thread streams and the
 * blocking streams synchronize with): here a kernel queued there. The batch is made ready
 * first through a view on our stream, dropped at once. */
static void unfollowed_consumer(int in, int out)
{
    cons c;
    ts_err err = {0};
    ts_acquired a;
    msg m;
    launch_read_fn launch = NULL;
    uint8_t want[32];
    size_t n = leaf_bytes(5, 0, want);
    if (cons_ready(&c, in, out, &launch) != 0) goto out;
    for (int round = 0; round < 2; round++) {
        const int64_t stream = round == 0 ? -1 : 2;
        unsigned long long sum = 0;
        REQUIRE_OK(ts_ring_acquire(c.ring, deadline_ms(5000), &a, &err));
        CHECK_EQ(a.index, 5);
        uint64_t bit = 1ULL << c.index;
        ts_lease *l = ts_lease_new(c.ring, a.slot, a.seq);
        REQUIRE(l != NULL);
        void *ready = export_dev(l, 0, 1, 0, stream_arg(c.stream), &err);
        REQUIRE(CHECK_ST(ready != NULL ? TS_OK : err.code, TS_OK));
        CHECK_CU(c.api->StreamSynchronize(c.stream));
        ts_export_delete(ready, 1);
        void *t = export_dev(l, 0, 1, 0, stream, &err);
        REQUIRE(CHECK_ST(t != NULL ? TS_OK : err.code, TS_OK));
        CHECK_EQ(l->unnamed, 1);
        REQUIRE(CHECK_CU(launch(TS_CU_STREAM_LEGACY, (CUdeviceptr)(uintptr_t)tensor_of(t, 1)->data,
                                n, &sum, KERNEL_US)));
        uint64_t t_launch = ts_now_ns();
        ts_export_delete(t, 1);
        ts_lease_unref(l, TS_USE_WHOLE);
        CHECK(readers_of(c.ring, a.slot) & bit);
        CHECK_ST(flush_releases(c.ring, 0, &err), TS_OK);
        CHECK(wait_bit_clear(c.ring, a.slot, bit, 5000));
        uint64_t waited = ts_now_ns() - t_launch;
        if (!CHECK(waited >= KERNEL_US * 1000ULL))
            printf("    stream %lld: released %llu us after the kernel was queued\n",
                   (long long)stream, (unsigned long long)(waited / 1000));
        CHECK_EQ(sum, fnv1a(want, n)); /* the kernel ran before the release */
        SEND(out, M_DONE, 0, 0);
    }
    RECV(in, M_BYE, m);
out:
    cons_close(&c);
}

/* Views on stream -1 or 2 are released only after a kernel on the legacy stream. */
static void test_unfollowed_streams(void)
{
    prod p = {0};
    peer c = {0};
    ts_err err = {0};
    msg m;
    uint32_t index = 0;
    REQUIRE(prod_start(&p, &c, unfollowed_consumer, &index) == 0);
    for (uint64_t round = 0; round < 2; round++) {
        REQUIRE_OK(publish_batch(p.ring, 5, &err));
        RECV(c.from, M_DONE, m);
    }
    CHECK(prod_finish(&p, &c) == 0);
out:
    reap(&c, 1);
    prod_close(&p);
}

/* ==========================================================================
 * 4. The streams a release follows; no device copies of ours
 * ========================================================================== */

/* Consumer: views on our stream, on another stream and on stream -1, stream 0 refused, and
 * a private device copy refused. */
static void variants_consumer(int in, int out)
{
    cons c;
    ts_err err = {0};
    ts_acquired a;
    msg m;
    CUstream other = NULL;
    if (cons_ready(&c, in, out, NULL) != 0) goto out;
    REQUIRE(CHECK_CU(c.api->StreamCreate(&other, CU_STREAM_NON_BLOCKING)));
    REQUIRE_OK(ts_ring_acquire(c.ring, deadline_ms(5000), &a, &err));
    CHECK_EQ(a.index, 3);
    uint64_t bit = 1ULL << c.index;
    ts_lease *l = ts_lease_new(c.ring, a.slot, a.seq);
    REQUIRE(l != NULL);
    int calls = fc_counter(c.api, "stream_wait_event") + fc_counter(c.api, "event_record");

    /* A view on our stream: the batch is on the device already (the producer waited for
     * its copy before publishing), no driver call is made. */
    void *tv = export_dev(l, 0, 1, 0, stream_arg(c.stream), &err);
    REQUIRE(CHECK_ST(tv != NULL ? TS_OK : err.code, TS_OK));
    CHECK(device_leaf_ok(&c, tensor_of(tv, 1), a.slot, 0, 3, 0));

    /* Another leaf on the same stream, then one on another stream: both streams recorded
     * for the release, once each. */
    void *tv2 = export_dev(l, 1, 1, 0, stream_arg(c.stream), &err);
    REQUIRE(CHECK_ST(tv2 != NULL ? TS_OK : err.code, TS_OK));
    CHECK_EQ(l->n_streams, 1);
    CHECK(device_leaf_ok(&c, tensor_of(tv2, 1), a.slot, 1, 3, 0));
    ts_export_delete(tv2, 1);
    void *to = export_dev(l, 1, 1, 0, stream_arg(other), &err);
    REQUIRE(CHECK_ST(to != NULL ? TS_OK : err.code, TS_OK));
    CHECK_EQ(l->n_streams, 2);
    CHECK(l->streams[1] == (ts_device_stream)other);
    CHECK_EQ(l->unnamed, 0);

    /* stream -1: names no stream; the release also waits for the legacy stream. */
    void *tn = export_dev(l, 1, 1, 0, -1, &err);
    REQUIRE(CHECK_ST(tn != NULL ? TS_OK : err.code, TS_OK));
    CHECK_EQ(((DLManagedTensorVersioned *)tn)->flags, TS_DLPACK_FLAG_READ_ONLY);
    CHECK(device_leaf_ok(&c, tensor_of(tn, 1), a.slot, 1, 3, 0));
    CHECK_EQ(l->n_streams, 2);
    CHECK_EQ(l->unnamed, 1);
    CHECK_EQ(fc_counter(c.api, "stream_wait_event") + fc_counter(c.api, "event_record"), calls);

    /* stream 0 is not a DLPack stream. */
    CHECK(export_dev(l, 0, 1, 0, 0, &err) == NULL);
    CHECK_EQ(err.code, TS_E_INVALID);

    /* A private device copy is the framework's to make (its caching allocator). */
    int allocs = fc_counter(c.api, "alloc");
    CHECK(export_dev(l, 0, 1, 1, stream_arg(c.stream), &err) == NULL);
    CHECK_EQ(err.code, TS_E_INVALID);
    CHECK(strstr(err.msg, "does not allocate GPU memory") != NULL);
    CHECK_EQ(fc_counter(c.api, "alloc"), allocs);
    CHECK_EQ(atomic_load(&l->refs), 4); /* ours + three views */

    /* Dropping the views and the lease releases the slot: one event on each of the
     * streams named (ours, the other, the legacy one). */
    int records = fc_counter(c.api, "event_record");
    ts_export_delete(tv, 1);
    ts_export_delete(to, 1);
    ts_export_delete(tn, 1);
    ts_lease_unref(l, TS_USE_WHOLE);
    CHECK_ST(flush_releases(c.ring, 5000, &err), TS_OK);
    CHECK(wait_bit_clear(c.ring, a.slot, bit, 5000));
    CHECK_EQ(fc_counter(c.api, "event_record"), records + 3);
    CHECK_EQ(fc_counter(c.api, "ctx_record_event") + fc_counter(c.api, "ctx_sync"), 0);
    SEND(out, M_DONE, 0, 0);
    RECV(in, M_BYE, m);
out:
    if (other != NULL) CHECK_CU(c.api->StreamDestroy(other));
    cons_close(&c);
}

/* Exports on two streams and stream -1, a refused stream 0 and a refused device copy. */
static void test_export_variants(void)
{
    prod p = {0};
    peer c = {0};
    ts_err err = {0};
    msg m;
    uint32_t index = 0;
    REQUIRE(prod_start(&p, &c, variants_consumer, &index) == 0);
    REQUIRE_OK(publish_batch(p.ring, 3, &err));
    RECV(c.from, M_DONE, m);
    CHECK(prod_finish(&p, &c) == 0);
out:
    reap(&c, 1);
    prod_close(&p);
}

/* ==========================================================================
 * 5. The release thread drops the last ring reference (it frees the GPU state itself)
 * ========================================================================== */

#define LAST_REF_KERNEL_US 300000

/* Consumer: drop the ring while a release is pending; the release thread then tears the GPU state down. */
static void last_ref_consumer(int in, int out)
{
    cons c;
    ts_err err = {0};
    ts_acquired a;
    msg m;
    launch_read_fn launch = NULL;
    unsigned long long sum = 0;
    uint8_t want[32];
    size_t n = leaf_bytes(5, 0, want);
    if (cons_ready(&c, in, out, &launch) != 0) goto out;
    REQUIRE_OK(ts_ring_acquire(c.ring, deadline_ms(5000), &a, &err));
    REQUIRE(launch_and_drop(&c, launch, &a, n, &sum, LAST_REF_KERNEL_US, NULL) == 0);
    CHECK_EQ(atomic_load(&c.ring->refs), 2);
    int threads = thread_count(); /* with the release thread */
    /* Our reference goes: the pending release now holds the last one. */
    ts_ring_unref(c.ring);
    c.ring = NULL;
    CHECK_EQ(thread_count(), threads);
    SEND(out, M_DONE, a.slot, 0);
    /* The producer sees the release and the pool unmapped (by the release thread). */
    RECV(in, M_GO, m);
    CHECK_EQ(sum, fnv1a(want, n));
    /* The release thread exits once it has torn the state down. */
    uint64_t dl = deadline_ms(5000);
    while (thread_count() != threads - 1 && ts_now_ns() < dl) sleep_us(500);
    CHECK_EQ(thread_count(), threads - 1);
    CHECK_EQ(atomic_load(&c.api->base.refs), 1); /* the ring's state gave its reference back */
    CHECK_EQ(fc_counter(c.api, "ipc_close_mem"), SLOTS);
    CHECK_CU(c.api->StreamSynchronize(c.stream));
    CHECK_EQ(sum, fnv1a(want, n));
    SEND(out, M_DONE, 0, 0);
    RECV(in, M_BYE, m);
out:
    cons_close(&c); /* then exit(): LeakSanitizer checks the freed state */
}

/* The release thread drops the last ring reference: slot and pool are released, the consumer lives on. */
static void test_release_thread_last_ref(void)
{
    prod p = {0};
    peer c = {0};
    ts_err err = {0};
    msg m;
    uint32_t index = 0;
    REQUIRE(prod_start(&p, &c, last_ref_consumer, &index) == 0);
    REQUIRE_OK(publish_batch(p.ring, 5, &err));
    RECV(c.from, M_DONE, m);
    uint32_t slot = (uint32_t)m.a;
    /* The consumer has no ring handle any more, yet its release is still pending. */
    CHECK(readers_of(p.ring, slot) & (1ULL << index));
    CHECK_EQ(ts_ring_importers(p.ring), 1);
    uint64_t t0 = ts_now_ns();
    CHECK_ST(ts_ring_wait_released(p.ring, deadline_ms(5000), &err), TS_OK);
    CHECK(ts_now_ns() - t0 < 5000 * MS);
    CHECK_EQ(readers_of(p.ring, slot), 0);
    CHECK_EQ(ts_ring_importers(p.ring), 0);
    CHECK(kill(c.pid, 0) == 0); /* it is the release thread's doing, not an exit */
    SEND(c.to, M_GO, 0, 0);
    RECV(c.from, M_DONE, m);
    SEND(c.to, M_BYE, 0, 0);
out:
    reap(&c, 1);
    prod_close(&p);
}

/* ==========================================================================
 * 6. ts_ring_wait_released waits for the importers, live ones only
 * ========================================================================== */

/* Consumer: import, then on GO drop the ring (closing its mapping) and stay alive. */
static void leaver_consumer(int in, int out)
{
    cons c;
    msg m;
    if (cons_ready(&c, in, out, NULL) != 0) goto out;
    RECV(in, M_GO, m);
    ts_ring_unref(c.ring);
    c.ring = NULL;
    SEND(out, M_DONE, 0, 0);
    RECV(in, M_BYE, m);
out:
    cons_close(&c);
}

/* Consumer: import and wait; the producer SIGKILLs it with its mapping open. */
static void victim_consumer(int in, int out)
{
    cons c;
    msg m;
    if (cons_ready(&c, in, out, NULL) != 0) goto out;
    RECV(in, M_BYE, m); /* SIGKILLed before */
out:
    cons_close(&c);
}

/* ts_ring_wait_released waits for live importers only: a closed or a killed one does not count. */
static void test_wait_released(void)
{
    prod p = {0};
    peer A = {0}, B = {0};
    ts_err err = {0};
    msg m;
    uint32_t ia = 0, ib = 0;
    REQUIRE(spawn(&A, leaver_consumer) == 0);
    REQUIRE(spawn(&B, victim_consumer) == 0);
    REQUIRE(prod_open(&p) == 0);
    CHECK_ST(ts_ring_wait_released(p.ring, deadline_ms(1000), &err), TS_OK);
    REQUIRE(prod_add(&p, &A, &ia) == 0);
    REQUIRE(prod_add(&p, &B, &ib) == 0);
    RECV(A.from, M_READY, m);
    RECV(B.from, M_READY, m);
    CHECK_EQ(ts_ring_importers(p.ring), 2);

    /* No slot is held, but two processes map the pool. */
    uint64_t dl = deadline_ms(150);
    CHECK_ST(ts_ring_wait_released(p.ring, dl, &err), TS_E_TIMEOUT);
    CHECK(ts_now_ns() >= dl);

    /* A closes its mapping (and stays alive): B still maps it. */
    SEND(A.to, M_GO, 0, 0);
    RECV(A.from, M_DONE, m);
    CHECK_EQ(ts_ring_importers(p.ring), 1);
    CHECK_ST(ts_ring_wait_released(p.ring, deadline_ms(150), &err), TS_E_TIMEOUT);

    /* B dies with its mapping open: a dead importer does not count. */
    REQUIRE(kill(B.pid, SIGKILL) == 0);
    pid_t bpid = B.pid;
    reap(&B, 0);
    fakecuda_objects(bpid, 1); /* a killed process cannot clean up after itself */
    uint64_t t0 = ts_now_ns();
    CHECK_ST(ts_ring_wait_released(p.ring, deadline_ms(5000), &err), TS_OK);
    CHECK(ts_now_ns() - t0 < 2000 * MS);
    CHECK_EQ(ts_ring_importers(p.ring), 0);
    for (int i = 0; i < TS_MAX_CONSUMERS; i++)
        CHECK_EQ(importer_state(&p.ring->hdr->importers[i], NULL), 0);
    ts_ring_evict(p.ring, ib);
    SEND(A.to, M_BYE, 0, 0);
out:
    if (B.pid > 0) kill(B.pid, SIGKILL);
    reap(&B, 0);
    reap(&A, 1);
    prod_close(&p);
}

/* ==========================================================================
 * 7. Errors
 * ========================================================================== */

/* GPUs without CUDA IPC (MIG): no ring, no segment, no device memory left. */
static void test_mig(void)
{
    ts_cuda_api *api = NULL;
    ts_ring *ring = NULL;
    ts_err err = {0};
    ts_geometry g = {SLOTS, 2, 4096, 1};
    /* This process never loaded the driver: the double reads the setting at cuInit. */
    setenv("FAKECUDA_MIG", "1", 1);
    REQUIRE_OK(ts_cuda_load(&api, &err));
    ts_ring_unlink_name(g_name, NULL);
    CHECK_ST(ts_ring_create_on_device(g_name, &g, &api->base, 0, &ring, &err), TS_E_GPU_UNAVAILABLE);
    CHECK_EQ(err.code, TS_E_GPU_UNAVAILABLE);
    CHECK(strstr(err.msg, "MIG") != NULL);
    CHECK(strstr(err.msg, "CUDA_ERROR_NOT_SUPPORTED") != NULL);
    CHECK(ring == NULL);
    CHECK(no_segment());
    /* The slot allocated before the export failed was freed again. */
    CHECK_EQ(fc_counter(api, "alloc"), 1);
    CHECK_EQ(fc_counter(api, "free"), 1);
    CHECK_EQ(fakecuda_objects(getpid(), 0), 0);
    CHECK_EQ(atomic_load(&api->base.refs), 1); /* the failed ring gave its references back */
    /* A host ring still works with the same driver loaded. */
    g.on_device = 0;
    CHECK_ST(ts_ring_create(g_name, &g, &ring, &err), TS_OK);
    if (ring != NULL) ts_ring_unref(ring);
    ts_ring_unlink_name(g_name, NULL);
out:
    ts_cuda_unref(api);
    unsetenv("FAKECUDA_MIG");
}

/* GPUs without interprocess events, and drivers that do not know the attribute (11.x):
 * the ring needs none, so it works there. */
static void test_no_ipc_events(void)
{
    ts_cuda_api *api = NULL;
    ts_ring *ring = NULL;
    ts_err err = {0};
    ts_geometry g = {SLOTS, 2, 4096, 1};
    setenv("FAKECUDA_NO_IPC_EVENTS", "1", 1);
    setenv("FAKECUDA_REJECT_ATTRIBUTES", "125", 1);
    REQUIRE_OK(ts_cuda_load(&api, &err));
    ts_ring_unlink_name(g_name, NULL);
    CHECK_ST(ts_ring_create_on_device(g_name, &g, &api->base, 0, &ring, &err), TS_OK);
    CHECK(ring != NULL);
    CHECK_EQ(fc_counter(api, "event_create"), SLOTS); /* the local copy events only */
    if (ring != NULL) ts_ring_unref(ring);
    ring = NULL;
    ts_ring_unlink_name(g_name, NULL);
    CHECK(no_segment());
    CHECK_EQ(fakecuda_objects(getpid(), 0), 0);
    CHECK_EQ(atomic_load(&api->base.refs), 1);
    /* And a device this process does not see. */
    g.slot_count = SLOTS;
    CHECK_ST(ts_ring_create_on_device(g_name, &g, &api->base, 3, &ring, &err), TS_E_GPU_UNAVAILABLE);
    CHECK(strstr(err.msg, "no CUDA device 3") != NULL);
    CHECK(no_segment());
out:
    ts_cuda_unref(api);
    unsetenv("FAKECUDA_NO_IPC_EVENTS");
    unsetenv("FAKECUDA_REJECT_ATTRIBUTES");
}

/* Consumer: read batch 9 through device views of both leaves and release its slot. */
static void reader_consumer(int in, int out)
{
    cons c;
    ts_err err = {0};
    ts_acquired a;
    msg m;
    if (cons_ready(&c, in, out, NULL) != 0) goto out;
    REQUIRE_OK(ts_ring_acquire(c.ring, deadline_ms(5000), &a, &err));
    ts_lease *l = ts_lease_new(c.ring, a.slot, a.seq);
    REQUIRE(l != NULL);
    for (uint32_t i = 0; i < 2; i++) {
        void *t = export_dev(l, i, 1, 0, stream_arg(c.stream), &err);
        if (!CHECK_ST(t != NULL ? TS_OK : err.code, TS_OK)) continue;
        CHECK_CU(c.api->StreamSynchronize(c.stream));
        CHECK(device_leaf_ok(&c, tensor_of(t, 1), a.slot, i, 9, 0));
        ts_export_delete(t, 1);
    }
    ts_lease_unref(l, TS_USE_WHOLE);
    CHECK_ST(flush_releases(c.ring, 0, &err), TS_OK);
    CHECK(wait_bit_clear(c.ring, a.slot, 1ULL << c.index, 5000));
    SEND(out, M_DONE, 0, 0);
    RECV(in, M_BYE, m);
out:
    cons_close(&c);
}

/* Importing in the exporting process fails cleanly, and disturbs nothing. */
static void test_import_in_exporter(void)
{
    prod p = {0};
    peer c = {0};
    ts_ring *mine = NULL;
    ts_err err = {0};
    msg m;
    uint32_t index = 0;
    REQUIRE(spawn(&c, reader_consumer) == 0);
    REQUIRE(prod_open(&p) == 0);
    /* The producer's own handle is refused outright, and its pool stays untouched. */
    CHECK_ST(ts_ring_import_device(p.ring, &p.api->base, 0, &err), TS_E_INVALID);
    CHECK(strstr(err.msg, "only in other processes") != NULL);
    for (uint32_t k = 0; k < SLOTS; k++) CHECK(ts_ring_device_ptr(p.ring, k) != 0);
    REQUIRE_OK(ts_ring_open(g_name, &mine, &err));
    int opens = fc_counter(p.api, "ipc_open_mem");
    for (int attempt = 0; attempt < 2; attempt++) {
        CHECK_ST(ts_ring_import_device(mine, &p.api->base, 0, &err), TS_E_GPU_UNAVAILABLE);
        CHECK(strstr(err.msg, "runs in the producer's own process") != NULL);
        CHECK_EQ(fc_counter(p.api, "ipc_open_mem"), opens); /* not even tried */
        CHECK_EQ(ts_ring_imported_device(mine), -1);
        for (uint32_t k = 0; k < SLOTS; k++) CHECK_EQ(ts_ring_device_ptr(mine, k), 0);
        /* No importer entry is left behind, so the producer is not held up. */
        CHECK_EQ(ts_ring_importers(p.ring), 0);
        for (int i = 0; i < TS_MAX_CONSUMERS; i++)
            CHECK_EQ(importer_state(&p.ring->hdr->importers[i], NULL), 0);
        CHECK_ST(ts_ring_wait_released(p.ring, deadline_ms(1000), &err), TS_OK);
    }
    ts_ring_unref(mine);
    mine = NULL;

    /* The producer's pool is intact: a real consumer reads a batch from it. */
    REQUIRE(prod_add(&p, &c, &index) == 0);
    RECV(c.from, M_READY, m);
    REQUIRE_OK(publish_batch(p.ring, 9, &err));
    RECV(c.from, M_DONE, m);
    CHECK(prod_finish(&p, &c) == 0);
out:
    if (mine != NULL) ts_ring_unref(mine);
    reap(&c, 1);
    prod_close(&p);
}

/* ---- main ------------------------------------------------------------------------- */

/* ==========================================================================
 * 7. The release thread never breaks a capture (issue 23; issue 34)
 * ========================================================================== */

/* Consumer: a slot's release flushed behind a gate kernel on our stream (its event recorded
 * after the gate); then a capture begins on another stream before the gate opens, so the
 * release thread waits for the event and releases during the capture. */
static void relaxed_consumer(int in, int out)
{
    cons c;
    ts_err err = {0};
    ts_acquired a;
    msg m;
    CUstream other = NULL;
    int open = 0, capturing = 0;
    if (cons_ready(&c, in, out, NULL) != 0) goto out;
    gate_fn gate = NULL;
    capture_fn begin = NULL;
    end_capture_fn end = NULL;
    void *p1 = fc_sym(c.api, "fakecuda_launch_gate"), *p2 = fc_sym(c.api, "fakecuda_begin_capture"),
         *p3 = fc_sym(c.api, "fakecuda_end_capture");
    REQUIRE(p1 != NULL && p2 != NULL && p3 != NULL);
    memcpy(&gate, &p1, sizeof gate);
    memcpy(&begin, &p2, sizeof begin);
    memcpy(&end, &p3, sizeof end);
    REQUIRE(CHECK_CU(c.api->StreamCreate(&other, CU_STREAM_NON_BLOCKING)));
    REQUIRE_OK(ts_ring_acquire(c.ring, deadline_ms(5000), &a, &err));
    uint64_t bit = 1ULL << c.index;
    ts_lease *l = ts_lease_new(c.ring, a.slot, a.seq);
    REQUIRE(l != NULL);
    void *t = export_dev(l, 0, 1, 0, stream_arg(c.stream), &err);
    REQUIRE(CHECK_ST(t != NULL ? TS_OK : err.code, TS_OK));
    int calls = fc_counter(c.api, "event_record");
    ts_export_delete(t, 1);
    ts_lease_unref(l, TS_USE_WHOLE);
    CHECK_EQ(fc_counter(c.api, "event_record"), calls); /* the deleter made no driver call */
    REQUIRE(CHECK_CU(gate(c.stream, &open)));
    REQUIRE_OK(flush_releases(c.ring, 0, &err));
    CHECK_EQ(fc_counter(c.api, "event_record"), calls + 1); /* on our stream, after the gate */
    CHECK(readers_of(c.ring, a.slot) & bit);
    REQUIRE(CHECK_CU(begin(other, CU_STREAM_CAPTURE_MODE_GLOBAL)));
    capturing = 1;
    __atomic_store_n(&open, 1, __ATOMIC_RELEASE);
    /* Released after the gate, by the release thread, during the capture. */
    CHECK(wait_bit_clear(c.ring, a.slot, bit, 5000));
    capturing = 0;
    CHECK_CU(end(other)); /* CUDA_ERROR_STREAM_CAPTURE_INVALIDATED if it broke it */
    CHECK_EQ(fc_counter(c.api, "capture_invalidated"), 0);
    /* Every section of driver calls ran in RELAXED capture mode (set and restored). */
    CHECK(fc_counter(c.api, "exchange_capture_mode") >= 2);
    SEND(out, M_DONE, 0, 0);
    RECV(in, M_BYE, m);
out:
    __atomic_store_n(&open, 1, __ATOMIC_RELEASE);
    if (capturing) end(other);
    if (other != NULL) CHECK_CU(c.api->StreamDestroy(other));
    cons_close(&c);
}

/* The release thread's own calls (event waits) do not invalidate a capture. */
static void test_relaxed_release_thread(void)
{
    prod p = {0};
    peer c = {0};
    ts_err err = {0};
    msg m;
    uint32_t index = 0;
    REQUIRE(prod_start(&p, &c, relaxed_consumer, &index) == 0);
    REQUIRE_OK(publish_batch(p.ring, 3, &err));
    RECV(c.from, M_DONE, m);
    CHECK(prod_finish(&p, &c) == 0);
out:
    reap(&c, 1);
    prod_close(&p);
}

/* ==========================================================================
 * 8. A deferred release names the lease's incarnation, not the handle's (review 1)
 * ========================================================================== */

/* Consumer: drop a device view of entry A's slot (its release queued, not flushed), then,
 * detached for lag and retired, bind the same handle to a new entry B (as consumer.py's
 * rejoin does) and flush: the release must end entry A's hold. */
static void rebound_consumer(int in, int out)
{
    cons c;
    ts_err err = {0};
    ts_acquired a;
    msg m;
    if (cons_ready(&c, in, out, NULL) != 0) goto out;
    REQUIRE_OK(ts_ring_acquire(c.ring, deadline_ms(5000), &a, &err));
    uint32_t first = c.index;
    uint64_t first_inc = c.ring->incarnation;
    ts_lease *l = ts_lease_new(c.ring, a.slot, a.seq);
    REQUIRE(l != NULL);
    void *t = export_dev(l, 0, 1, 0, stream_arg(c.stream), &err);
    REQUIRE(CHECK_ST(t != NULL ? TS_OK : err.code, TS_OK));
    ts_export_delete(t, 1);
    ts_lease_unref(l, TS_USE_WHOLE); /* queued until the next flush */
    SEND(out, M_DONE, a.slot, 0);
    RECV(in, M_HELLO, m); /* the producer retired entry A (LEAVING) and reserved B */
    REQUIRE_OK(ts_ring_bind_consumer(c.ring, (uint32_t)m.a, m.b, &err));
    c.index = (uint32_t)m.a;
    CHECK(c.index != first && c.ring->incarnation != first_inc); /* the test's premise */
    REQUIRE_OK(flush_releases(c.ring, 5000, &err));
    CHECK_EQ(readers_of(c.ring, a.slot) & (1ULL << first), 0);
    CHECK_EQ(atomic_load(&c.ring->hdr->late_releases), 0);
    SEND(out, M_DONE, 0, 0);
    RECV(in, M_BYE, m);
out:
    cons_close(&c);
}

/* A release queued before the handle was bound to another entry ends the old entry's hold:
 * the slot goes back and the old entry does not stay LEAVING. */
static void test_rebound_release(void)
{
    prod p = {0};
    peer c = {0};
    ts_err err = {0};
    msg m;
    uint32_t dummy = 0, ia = 0, ib = 0;
    uint64_t token = 0;
    REQUIRE(spawn(&c, rebound_consumer) == 0);
    REQUIRE(prod_open(&p) == 0);
    /* Entry 0 handed out and given back once: the consumer gets it at incarnation 2, and
     * entry 1 later at incarnation 1 (a release naming the handle's would be late). */
    REQUIRE_OK(ts_ring_reserve(p.ring, getpid(), ts_proc_start_time(getpid()), 0, &dummy, &token,
                               &err));
    ts_ring_retire(p.ring, dummy);
    REQUIRE(prod_add(&p, &c, &ia) == 0);
    RECV(c.from, M_READY, m);
    REQUIRE_OK(publish_batch(p.ring, 5, &err));
    RECV(c.from, M_DONE, m);
    uint32_t slot = (uint32_t)m.a;
    ts_ring_detach(p.ring, ia, TS_REASON_LAGGED);
    ts_ring_retire(p.ring, ia);
    CHECK_EQ(atomic_load(&p.ring->hdr->consumers[ia].state), TS_CONSUMER_LEAVING);
    REQUIRE(prod_add(&p, &c, &ib) == 0);
    CHECK(ib != ia);
    RECV(c.from, M_DONE, m);
    CHECK_EQ(readers_of(p.ring, slot), 0);
    CHECK_EQ(atomic_load(&p.ring->hdr->late_releases), 0);
    CHECK(prod_finish(&p, &c) == 0);
out:
    reap(&c, 1);
    prod_close(&p);
}

/* ==========================================================================
 * 9. A release whose stream is being captured waits, it fails nothing (review 6)
 * ========================================================================== */

/* Consumer: a release queued, then flushed while a capture runs on our stream (the one the
 * view was exported to, captured by another thread as far as the flush knows): the flush
 * records nothing there, keeps the slot, and the capture stays valid; once the capture
 * ended, the next flush releases it. old_driver: the same on a driver without
 * cuCtxRecordEvent (12.4): nothing here depends on it. */
static void capture_flush(int in, int out, int old_driver)
{
    cons c;
    ts_err err = {0};
    ts_acquired a;
    msg m;
    int capturing = 0;
    capture_fn begin = NULL;
    end_capture_fn end = NULL;
    if (old_driver) setenv("FAKECUDA_DRIVER_VERSION", "12040", 1); /* read at cuInit */
    if (cons_ready(&c, in, out, NULL) != 0) goto out;
    void *p2 = fc_sym(c.api, "fakecuda_begin_capture"), *p3 = fc_sym(c.api, "fakecuda_end_capture");
    REQUIRE(p2 != NULL && p3 != NULL);
    memcpy(&begin, &p2, sizeof begin);
    memcpy(&end, &p3, sizeof end);
    CHECK_EQ(c.api->base.version, old_driver ? 12040 : 12080);
    REQUIRE_OK(ts_ring_acquire(c.ring, deadline_ms(5000), &a, &err));
    uint64_t bit = 1ULL << c.index;
    ts_lease *l = ts_lease_new(c.ring, a.slot, a.seq);
    REQUIRE(l != NULL);
    void *t = export_dev(l, 0, 1, 0, stream_arg(c.stream), &err);
    REQUIRE(CHECK_ST(t != NULL ? TS_OK : err.code, TS_OK));
    ts_export_delete(t, 1);
    ts_lease_unref(l, TS_USE_WHOLE);
    REQUIRE(CHECK_CU(begin(c.stream, CU_STREAM_CAPTURE_MODE_GLOBAL)));
    capturing = 1;
    int records = fc_counter(c.api, "event_record");
    CHECK_ST(flush_releases(c.ring, 0, &err), TS_OK);
    CHECK_EQ(fc_counter(c.api, "event_record"), records); /* nothing on the capturing stream */
    CHECK(readers_of(c.ring, a.slot) & bit); /* not released under the capture */
    capturing = 0;
    CHECK_CU(end(c.stream)); /* still valid: nothing invalidated it */
    CHECK_EQ(fc_counter(c.api, "capture_invalidated"), 0);
    CHECK_ST(flush_releases(c.ring, 5000, &err), TS_OK);
    CHECK(wait_bit_clear(c.ring, a.slot, bit, 5000));
    CHECK_EQ(fc_counter(c.api, "ctx_record_event") + fc_counter(c.api, "ctx_sync"), 0);
    SEND(out, M_DONE, 0, 0);
    RECV(in, M_BYE, m);
out:
    if (capturing) end(c.stream);
    cons_close(&c);
}

/* capture_flush on a CUDA 12.8 driver. */
static void capture_flush_consumer(int in, int out)
{
    capture_flush(in, out, 0);
}

/* capture_flush on a CUDA 12.4 driver (no cuCtxRecordEvent). */
static void capture_old_driver_consumer(int in, int out)
{
    capture_flush(in, out, 1);
}

/* Run a capture_flush consumer against one batch. */
static void capture_flush_test(child_fn fn)
{
    prod p = {0};
    peer c = {0};
    ts_err err = {0};
    msg m;
    uint32_t index = 0;
    REQUIRE(prod_start(&p, &c, fn, &index) == 0);
    REQUIRE_OK(publish_batch(p.ring, 4, &err));
    RECV(c.from, M_DONE, m);
    CHECK_EQ(readers_of(p.ring, 0), 0);
    CHECK(prod_finish(&p, &c) == 0);
out:
    reap(&c, 1);
    prod_close(&p);
}

/* A release whose stream is being captured waits for a later flush; the capture stays valid. */
static void test_capture_deferred_flush(void)
{
    capture_flush_test(capture_flush_consumer);
}

/* The same on a driver without cuCtxRecordEvent. */
static void test_capture_deferred_old_driver(void)
{
    capture_flush_test(capture_old_driver_consumer);
}

/* ==========================================================================
 * 10. Views dropped after the handle was closed are released all the same (review 3)
 * ========================================================================== */

/* Consumer: keep a device view, close the handle (orphan, then drop its reference), then
 * drop the view: nothing of ours flushes any more, the release thread does it. */
static void orphan_consumer(int in, int out)
{
    cons c;
    ts_err err = {0};
    ts_acquired a;
    msg m;
    if (cons_ready(&c, in, out, NULL) != 0) goto out;
    REQUIRE_OK(ts_ring_acquire(c.ring, deadline_ms(5000), &a, &err));
    ts_lease *l = ts_lease_new(c.ring, a.slot, a.seq);
    REQUIRE(l != NULL);
    void *t = export_dev(l, 0, 1, 0, stream_arg(c.stream), &err);
    REQUIRE(CHECK_ST(t != NULL ? TS_OK : err.code, TS_OK));
    ts_lease_unref(l, TS_USE_WHOLE); /* the view keeps the lease */
    ts_ring_orphan(c.ring);           /* Ring.close() */
    ts_ring_unref(c.ring);
    c.ring = NULL;
    ts_export_delete(t, 1); /* its release is queued; no flush will come from us */
    SEND(out, M_DONE, a.slot, 0);
    RECV(in, M_BYE, m);
out:
    cons_close(&c);
}

/* The slot of a view dropped after close() goes back, and the consumer's mapping of the
 * pool closes (its importer entry goes), while the consumer process lives on. */
static void test_release_after_close(void)
{
    prod p = {0};
    peer c = {0};
    ts_err err = {0};
    msg m;
    uint32_t index = 0;
    REQUIRE(prod_start(&p, &c, orphan_consumer, &index) == 0);
    REQUIRE_OK(publish_batch(p.ring, 6, &err));
    RECV(c.from, M_DONE, m);
    uint32_t slot = (uint32_t)m.a;
    CHECK(wait_bit_clear(p.ring, slot, 1ULL << index, 10000));
    CHECK_ST(ts_ring_wait_released(p.ring, deadline_ms(10000), &err), TS_OK);
    CHECK_EQ(ts_ring_importers(p.ring), 0);
    SEND(c.to, M_BYE, 0, 0);
out:
    reap(&c, 1);
    prod_close(&p);
}

/* ==========================================================================
 * 11. The producer's handle goes while a consumer maps the pool (review 7, 8a)
 * ========================================================================== */

/* Consumer B: opens and binds the ring but imports only on GO, after the producer's handle
 * began to go: the import is refused, and its importer entry given back. */
static void late_importer_consumer(int in, int out)
{
    ts_ring *ring = NULL;
    ts_cuda_api *api = NULL;
    ts_err err = {0};
    msg m;
    RECV(in, M_HELLO, m);
    REQUIRE_OK(ts_ring_open(g_name, &ring, &err));
    REQUIRE_OK(ts_ring_bind_consumer(ring, (uint32_t)m.a, m.b, &err));
    REQUIRE_OK(ts_cuda_load(&api, &err));
    SEND(out, M_READY, 0, 0);
    RECV(in, M_GO, m);
    uint32_t before = ts_ring_importers(ring);
    CHECK_ST(ts_ring_import_device(ring, &api->base, 0, &err), TS_E_PRODUCER_GONE);
    CHECK(strstr(err.msg, "freeing its GPU memory") != NULL);
    CHECK_EQ(ts_ring_importers(ring), before); /* the claim was given back */
    CHECK_EQ(ts_ring_imported_device(ring), -1);
    SEND(out, M_DONE, 0, 0);
    RECV(in, M_BYE, m);
out:
    if (ring != NULL) ts_ring_unref(ring);
    if (api != NULL) ts_cuda_unref(api);
}

/* A: imported; B: not yet. The producer's handle goes: the pool stays (A maps it), its host
 * slot data is unpinned before its mapping goes, and B can no longer begin an import. */
static void test_close_while_imported(void)
{
    prod p = {0};
    peer A = {0}, B = {0};
    msg m;
    uint32_t ia = 0, ib = 0;
    ts_device_state *kept = NULL;
    REQUIRE(spawn(&A, leaver_consumer) == 0);
    REQUIRE(spawn(&B, late_importer_consumer) == 0);
    REQUIRE(prod_open(&p) == 0);
    REQUIRE(prod_add(&p, &A, &ia) == 0);
    REQUIRE(prod_add(&p, &B, &ib) == 0);
    RECV(A.from, M_READY, m);
    RECV(B.from, M_READY, m);
    CHECK_EQ(ts_ring_importers(p.ring), 1);
    int pinned = p.ring->hdr->host_pinned != 0;
    int frees = fc_counter(p.api, "free"), unpins = fc_counter(p.api, "host_unregister");
    kept = p.ring->dev; /* left to the process's exit: closed below instead (leak check) */
    ts_ring_unref(p.ring);
    p.ring = NULL;
    CHECK_EQ(fc_counter(p.api, "free"), frees); /* the pool stays while A maps it */
    CHECK_EQ(fc_counter(p.api, "host_unregister"), unpins + pinned);
    SEND(B.to, M_GO, 0, 0);
    RECV(B.from, M_DONE, m);
    SEND(A.to, M_GO, 0, 0);
    RECV(A.from, M_DONE, m);
    SEND(A.to, M_BYE, 0, 0);
    SEND(B.to, M_BYE, 0, 0);
out:
    reap(&A, 1);
    reap(&B, 1);
    if (kept != NULL) kept->device->close(kept); /* nobody maps the pool any more */
    prod_close(&p);
}

/* ==========================================================================
 * 12. Importer entries and the seal of the pool (issue 34, item 5)
 * ========================================================================== */

/* An importer entry claimed by a process that died before it mapped the pool (the claim
 * carries the pid from its first store): not counted, and freed, with its start time;
 * nothing waits for it, and the next claimer is judged as itself. */
static void test_claimed_importer_dies(void)
{
    prod p = {0};
    ts_err err = {0};
    REQUIRE(prod_open(&p) == 0);
    pid_t dead = fork();
    if (dead == 0) _exit(0);
    REQUIRE(dead > 0);
    int status = 0;
    while (waitpid(dead, &status, 0) < 0 && errno == EINTR) {}
    ts_importer *e = &p.ring->hdr->importers[3];
    /* Died right after its claim (start time not written yet) ... */
    atomic_store(&e->claim, (uint64_t)dead << 2 | TS_IMPORTER_CLAIMED);
    CHECK_EQ(ts_ring_importers(p.ring), 0);
    CHECK_EQ(importer_state(e, NULL), 0);
    /* ... or after it wrote its start time, still claiming. */
    atomic_store(&e->start_time, ts_proc_start_time(getpid()));
    atomic_store(&e->claim, (uint64_t)dead << 2 | TS_IMPORTER_CLAIMED);
    uint64_t t0 = ts_now_ns();
    CHECK_ST(ts_ring_wait_released(p.ring, deadline_ms(5000), &err), TS_OK);
    CHECK(ts_now_ns() - t0 < 1000 * MS);
    /* The freed entry kept no start time: a live process that claims it next, and has not
     * written its own yet, is judged by its pid alone, not by the dead one's start time. */
    CHECK_EQ(atomic_load(&e->start_time), 0);
    atomic_store(&e->claim, (uint64_t)getpid() << 2 | TS_IMPORTER_CLAIMED);
    CHECK_EQ(ts_ring_importers(p.ring), 1);
    CHECK_EQ(importer_state(e, NULL), TS_IMPORTER_CLAIMED);
    atomic_store(&e->claim, 0); /* it backs out */
    CHECK_EQ(ts_ring_seal_pool(p.ring), 0);
    /* Sealed, nobody maps it: the pool goes with the handle, not with the process. */
    int frees = fc_counter(p.api, "free");
    ts_ring_unref(p.ring);
    p.ring = NULL;
    CHECK_EQ(fc_counter(p.api, "free"), frees + SLOTS);
out:
    prod_close(&p);
}

/* The keeper's race: it saw no importer, then a consumer imported, then the producer's
 * handle went. The decision is taken on the count after the seal (Ring.seal_pool): the
 * late import is counted, the pool is kept for it; once it closed its mapping, the sealed
 * pool is freed with the handle (not left to the process's exit, with nobody to free it). */
static void test_seal_counts_a_late_import(void)
{
    prod p = {0};
    peer A = {0};
    msg m;
    uint32_t ia = 0;
    REQUIRE(spawn(&A, leaver_consumer) == 0);
    REQUIRE(prod_open(&p) == 0);
    CHECK_EQ(ts_ring_importers(p.ring), 0); /* the look before */
    REQUIRE(prod_add(&p, &A, &ia) == 0);
    RECV(A.from, M_READY, m); /* A imported meanwhile */
    CHECK_EQ(ts_ring_seal_pool(p.ring), 1); /* the decision: keep */
    SEND(A.to, M_GO, 0, 0);
    RECV(A.from, M_DONE, m); /* A closed its mapping */
    CHECK_EQ(ts_ring_seal_pool(p.ring), 0);
    int frees = fc_counter(p.api, "free");
    ts_ring_unref(p.ring);
    p.ring = NULL;
    CHECK_EQ(fc_counter(p.api, "free"), frees + SLOTS);
    SEND(A.to, M_BYE, 0, 0);
out:
    reap(&A, 1);
    prod_close(&p);
}

static const ts_test g_tests[] = {
    {"import", test_import},
    {"device_views", test_device_views},
    {"deferred_release", test_deferred_release},
    {"unfollowed_streams", test_unfollowed_streams},
    {"export_variants", test_export_variants},
    {"release_thread_last_ref", test_release_thread_last_ref},
    {"wait_released", test_wait_released},
    {"mig", test_mig},
    {"no_ipc_events", test_no_ipc_events},
    {"import_in_exporter", test_import_in_exporter},
    {"relaxed_release_thread", test_relaxed_release_thread},
    {"rebound_release", test_rebound_release},
    {"capture_deferred_flush", test_capture_deferred_flush},
    {"capture_deferred_old_driver", test_capture_deferred_old_driver},
    {"release_after_close", test_release_after_close},
    {"close_while_imported", test_close_while_imported},
    {"claimed_importer_dies", test_claimed_importer_dies},
    {"seal_counts_a_late_import", test_seal_counts_a_late_import},
};

/* Run one group in a fresh process (it is the producer; the driver is loaded there
 * only). 1 if it passed. */
static int run_group(const ts_test *tests, size_t i)
{
    snprintf(g_name, sizeof g_name, "/tensorsocket-ctest-%d-gpu-%zu", (int)getpid(), i);
    fflush(stdout);
    pid_t pid = fork();
    if (pid < 0) {
        printf("  fork failed: %s\n", strerror(errno));
        return 0;
    }
    if (pid == 0) {
        g_role = "producer";
        alarm(120); /* a hung group dies and fails */
        tests[i].fn();
        ts_ring_unlink_name(g_name, NULL);
        exit_checked();
    }
    int status = 0;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {}
    ts_ring_unlink_name(g_name, NULL);
    if (WIFEXITED(status) && WEXITSTATUS(status) == 0) return 1;
    if (WIFSIGNALED(status))
        printf("  the %s process died of signal %d\n", tests[i].name, WTERMSIG(status));
    else if (WEXITSTATUS(status) != 1)
        printf("  the %s process exited with status %d\n", tests[i].name,
               WEXITSTATUS(status));
    return 0;
}

/* Run the groups whose name contains argv[1] (all without it); needs TENSORSOCKET_LIBCUDA. */
int main(int argc, char **argv)
{
    g_role = "main";
    setvbuf(stdout, NULL, _IOLBF, 0);
    signal(SIGPIPE, SIG_IGN); /* a dead peer shows as a failed write */
    const char *lib = getenv("TENSORSOCKET_LIBCUDA");
    if (lib == NULL || lib[0] == '\0') {
        printf("TENSORSOCKET_LIBCUDA must name the CUDA test double (libfakecuda.so)\n");
        printf("0 passed, 1 failed\n");
        return 1;
    }
    return ts_run_tests(g_tests, sizeof g_tests / sizeof g_tests[0], argc > 1 ? argv[1] : NULL,
                        run_group);
}
