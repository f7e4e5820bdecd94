/* ts_cuda_release.c - a consumer's releases of GPU-read slots (see ts_cuda_release.h). */
#define _GNU_SOURCE
#include "device/ts_cuda_release.h"

#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/ts_futex.h"
#include "base/ts_proc.h"

/* A queued release: what it waits for, and whom it calls back. */
typedef struct ts_pending {
    struct ts_pending *next;
    ts_device_done_fn done; /* called once the work it waits for finished */
    void *arg;              /* for done (the ring's, holding what it needs) */
    uint32_t slot;
    uint32_t consumer;
    uint64_t token;  /* the incarnation that took the hold, for done */
    int unnamed;     /* also the legacy default stream (a raw pointer, DLPack -1 or 2) */
    uint32_t n;      /* streams the views were exported to */
    ts_device_stream streams[]; /* n of them */
} ts_pending;

/* One flush handed to the release thread: its events, and the releases after them. */
typedef struct ts_flush {
    struct ts_flush *next;
    CUevent *events;   /* owns the array; the events are the pool's (given back after) */
    uint32_t n_events;
    ts_pending *items; /* owns: the releases, oldest first */
} ts_flush;

/* A stream a flush records on, and what became of it. */
typedef struct ts_flush_stream {
    CUstream named;  /* the stream releases name */
    CUstream stream; /* where the event is recorded: named, or the legacy stream if the
                      * driver no longer knows named */
    CUevent event;   /* recorded there, or NULL */
    int blocked;   /* being captured: its releases wait for a later flush */
} ts_flush_stream;

struct ts_cuda_releases {
    ts_cuda_api *api; /* owns one reference */
    CUcontext ctx;    /* borrowed: the consumer's retain of the primary context, which ends
                       * only after ts_cuda_releases_free destroyed the events */
    pid_t owner;      /* the process of the thread: a forked child's copy only leaks */
    struct ts_cuda_releases *reg_next, *reg_prev; /* under ts_registry_lock: the queues with
                                                   * a thread, for the exit handler */
    pthread_mutex_t lock;
    pthread_cond_t cond; /* a flush or a release was queued, stop, or the queue drained */
    pthread_t thread;
    int stop;        /* under lock: the thread exits once nothing is handed to it */
    int self_free;   /* under lock: the thread frees this struct when it exits */
    int busy;        /* under lock: the thread works on a flush it took */
    int orphaned;    /* under lock: no consumer call flushes any more: the thread does */
    ts_pending *unflushed; /* owns, under lock: queued, newest first */
    ts_flush *head;  /* owns, under lock: flushes for the thread, oldest first */
    ts_flush *tail;
    int failed;      /* under lock: a release's wait failed (sticky) */
    char failure[sizeof(((ts_err *)0)->msg)]; /* under lock: what failed */
    CUevent *pool;   /* owns, under lock: idle events */
    uint32_t pool_n;
    uint32_t pool_cap;
};

static void *ts_releases_main(void *arg);

/* ==========================================================================
 * The process's release threads, for exit (process-wide by nature, as exit() is)
 * ========================================================================== */

static pthread_mutex_t ts_registry_lock = PTHREAD_MUTEX_INITIALIZER;
static ts_cuda_releases *ts_registry;     /* under ts_registry_lock */
static _Atomic uint32_t ts_release_threads; /* release threads that have not ended */
static pthread_once_t ts_registry_once = PTHREAD_ONCE_INIT;

/* The exit handler's hook (ts_cuda_on_exit): wake every release thread (each ends at once,
 * making no driver call: ts_cuda_exiting), and wait until they have ended, or deadline. */
static void ts_releases_stop_all(uint64_t deadline)
{
    pthread_mutex_lock(&ts_registry_lock);
    for (ts_cuda_releases *r = ts_registry; r != NULL; r = r->reg_next) {
        pthread_mutex_lock(&r->lock);
        pthread_cond_broadcast(&r->cond);
        pthread_mutex_unlock(&r->lock);
    }
    pthread_mutex_unlock(&ts_registry_lock);
    ts_futex_wait_zero(&ts_release_threads, deadline);
}

/* A forked child has none of its parent's release threads (their queues are left). */
static void ts_releases_forked_child(void)
{
    pthread_mutex_t fresh = PTHREAD_MUTEX_INITIALIZER;
    ts_registry_lock = fresh;
    ts_registry = NULL;
    atomic_store_explicit(&ts_release_threads, 0, memory_order_relaxed);
}

/* Once per process: the exit hook and the fork reset. */
static void ts_releases_register_exit(void)
{
    ts_cuda_on_exit(ts_releases_stop_all);
    pthread_atfork(NULL, NULL, ts_releases_forked_child);
}

/* Add r to the registry (its thread is about to start). */
static void ts_registry_add(ts_cuda_releases *r)
{
    pthread_once(&ts_registry_once, ts_releases_register_exit);
    pthread_mutex_lock(&ts_registry_lock);
    r->reg_prev = NULL;
    r->reg_next = ts_registry;
    if (ts_registry != NULL) ts_registry->reg_prev = r;
    ts_registry = r;
    pthread_mutex_unlock(&ts_registry_lock);
}

/* Take r out of the registry (its thread is ending or gone; not r->lock held). */
static void ts_registry_remove(ts_cuda_releases *r)
{
    pthread_mutex_lock(&ts_registry_lock);
    if (r->reg_prev != NULL) r->reg_prev->reg_next = r->reg_next;
    else if (ts_registry == r) ts_registry = r->reg_next;
    if (r->reg_next != NULL) r->reg_next->reg_prev = r->reg_prev;
    r->reg_next = r->reg_prev = NULL;
    pthread_mutex_unlock(&ts_registry_lock);
}

/* A release thread has ended (its last step); the exit handler may be waiting for that. */
static void ts_release_thread_ended(void)
{
    atomic_fetch_sub_explicit(&ts_release_threads, 1, memory_order_acq_rel);
    if (ts_cuda_exiting()) ts_futex_wake_all(&ts_release_threads);
}

/* ==========================================================================
 * The queue and its thread
 * ========================================================================== */

/* A release queue and its thread (see the header). */
ts_cuda_releases *ts_cuda_releases_new(const ts_cuda_api *api, CUcontext ctx, ts_err *err)
{
    ts_cuda_releases *r = calloc(1, sizeof *r);
    if (r == NULL) {
        ts_err_set(err, TS_E_SYS, ENOMEM, "out of memory");
        return NULL;
    }
    pthread_mutex_init(&r->lock, NULL);
    pthread_cond_init(&r->cond, NULL);
    r->api = (ts_cuda_api *)api;
    r->ctx = ctx;
    r->owner = ts_proc_self();
    ts_cuda_ref(r->api);
    /* Asynchronous signals stay with the Python threads (Ctrl-C reaches the interpreter,
     * not this thread); a fault of this thread's own still goes to its handlers. */
    sigset_t async, old;
    sigfillset(&async);
    const int faults[] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGTRAP, SIGSYS, SIGABRT};
    for (size_t i = 0; i < sizeof faults / sizeof faults[0]; i++) sigdelset(&async, faults[i]);
    ts_registry_add(r);
    atomic_fetch_add_explicit(&ts_release_threads, 1, memory_order_acq_rel);
    pthread_sigmask(SIG_SETMASK, &async, &old);
    int rc = pthread_create(&r->thread, NULL, ts_releases_main, r);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (rc != 0) {
        ts_release_thread_ended();
        ts_registry_remove(r);
        ts_cuda_unref(r->api);
        pthread_cond_destroy(&r->cond);
        pthread_mutex_destroy(&r->lock);
        free(r);
        ts_err_set(err, TS_E_SYS, rc, "cannot start the GPU release thread");
        return NULL;
    }
    return r;
}

/* Free the struct (the thread is gone or is this thread, on its way out). */
static void ts_releases_free_struct(ts_cuda_releases *r)
{
    ts_cuda_unref(r->api);
    pthread_mutex_destroy(&r->lock);
    pthread_cond_destroy(&r->cond);
    free(r->pool);
    free(r);
}

/* Destroy the idle events (inside the context; nothing if the process is exiting). */
static void ts_releases_destroy_events(ts_cuda_releases *r)
{
    if (r->pool_n > 0 && ts_cuda_enter(r->api, r->ctx, NULL) == TS_OK) {
        for (uint32_t i = 0; i < r->pool_n; i++) r->api->EventDestroy(r->pool[i]);
        ts_cuda_leave(r->api);
    }
    r->pool_n = 0;
}

/* Stop the thread and free (see the header). */
void ts_cuda_releases_free(ts_cuda_releases *r)
{
    if (r == NULL || ts_proc_self() != r->owner) return; /* a forked child's copy: left */
    pthread_mutex_lock(&r->lock);
    r->stop = 1;
    if (pthread_equal(pthread_self(), r->thread)) {
        /* A callback of this thread dropped the ring's last reference: the events go
         * now, before the caller releases the context; the struct when the thread ends. */
        r->self_free = 1;
        ts_releases_destroy_events(r);
        pthread_mutex_unlock(&r->lock);
        ts_registry_remove(r);
        pthread_detach(r->thread);
        return;
    }
    pthread_cond_broadcast(&r->cond);
    pthread_mutex_unlock(&r->lock);
    pthread_join(r->thread, NULL);
    ts_registry_remove(r);
    ts_releases_destroy_events(r);
    ts_releases_free_struct(r);
}

/* Queue a release (see the header). */
void ts_cuda_releases_queue(ts_cuda_releases *r, uint32_t slot, uint32_t consumer,
                            uint64_t token, const ts_device_stream *streams, uint32_t n,
                            int unnamed, ts_device_done_fn done, void *arg)
{
    if (ts_proc_self() != r->owner) {
        /* A forked child dropped a view it inherited: its parent's queue and thread are
         * not here; the slot stays held (the parent's hold), only the reference goes. */
        done(arg, slot, consumer, token, 0);
        return;
    }
    ts_pending *p = calloc(1, sizeof *p + (size_t)n * sizeof p->streams[0]);
    if (p == NULL) {
        /* Nothing orders this release after the GPU work: keep the slot held (!ok) and
         * say so at the next flush. */
        pthread_mutex_lock(&r->lock);
        if (!r->failed)
            snprintf(r->failure, sizeof r->failure,
                     "out of memory queueing a GPU release: the slot stays held");
        r->failed = 1;
        pthread_mutex_unlock(&r->lock);
        done(arg, slot, consumer, token, 0);
        return;
    }
    p->done = done;
    p->arg = arg;
    p->slot = slot;
    p->consumer = consumer;
    p->token = token;
    p->unnamed = unnamed;
    p->n = n;
    if (n > 0) memcpy(p->streams, streams, (size_t)n * sizeof p->streams[0]);
    pthread_mutex_lock(&r->lock);
    p->next = r->unflushed;
    r->unflushed = p;
    if (r->orphaned) pthread_cond_broadcast(&r->cond); /* the thread flushes it */
    pthread_mutex_unlock(&r->lock);
}

/* The consumer's handle is closed (see the header). */
void ts_cuda_releases_orphan(ts_cuda_releases *r)
{
    pthread_mutex_lock(&r->lock);
    r->orphaned = 1;
    pthread_cond_broadcast(&r->cond);
    pthread_mutex_unlock(&r->lock);
}

/* ==========================================================================
 * Flushes
 * ========================================================================== */

/* An idle event of the pool, or a new one (caller holds the lock, inside the context). */
static CUevent ts_releases_take_event(ts_cuda_releases *r)
{
    if (r->pool_n > 0) return r->pool[--r->pool_n];
    CUevent ev = NULL;
    /* Blocking sync: the release thread sleeps instead of spinning while it waits. */
    if (r->api->EventCreate(&ev, CU_EVENT_DISABLE_TIMING | CU_EVENT_BLOCKING_SYNC) !=
        CUDA_SUCCESS)
        return NULL;
    return ev;
}

/* Give an event back to the pool (caller holds the lock). */
static void ts_releases_give_event(ts_cuda_releases *r, CUevent ev)
{
    if (r->pool_n == r->pool_cap) {
        uint32_t cap = r->pool_cap ? r->pool_cap * 2 : 16;
        CUevent *p = realloc(r->pool, cap * sizeof *p);
        if (p == NULL) return; /* out of memory: the event is left (no driver call here) */
        r->pool = p;
        r->pool_cap = cap;
    }
    r->pool[r->pool_n++] = ev;
}

/* Record that a release's wait failed, said by e (sticky: every later flush reports it). */
static void ts_releases_failed(ts_cuda_releases *r, const ts_err *e)
{
    pthread_mutex_lock(&r->lock);
    if (!r->failed)
        snprintf(r->failure, sizeof r->failure,
                 "a GPU release of this consumer failed (%.300s): its slot stays held until the "
                 "producer evicts this consumer",
                 e->msg);
    r->failed = 1;
    pthread_mutex_unlock(&r->lock);
}

/* 1 if rc says that the stream was being captured (CUDA graphs), so nothing was recorded:
 * "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED: ... the operation is not permitted when the stream
 * is capturing", "..._INVALIDATED: ... the current capture sequence on the stream has been
 * invalidated due to a previous error", "..._IMPLICIT: ... a disallowed implicit dependency
 * on a current capture sequence from cudaStreamLegacy" (CUresult, cuda.h). */
static int ts_capture_refused(CUresult rc)
{
    return rc == CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED ||
           rc == CUDA_ERROR_STREAM_CAPTURE_INVALIDATED || rc == CUDA_ERROR_STREAM_CAPTURE_IMPLICIT;
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

/* Add s to the set of n streams (capacity cap, grown); 0, or -1 out of memory. */
static int ts_set_add(ts_flush_stream **set, uint32_t *n, uint32_t *cap, CUstream s)
{
    for (uint32_t i = 0; i < *n; i++)
        if ((*set)[i].named == s) return 0;
    if (*n == *cap) {
        uint32_t c = *cap ? *cap * 2 : 4;
        ts_flush_stream *p = realloc(*set, c * sizeof *p);
        if (p == NULL) return -1;
        *set = p;
        *cap = c;
    }
    (*set)[(*n)++] = (ts_flush_stream){s, s, NULL, 0};
    return 0;
}

/* The streams a release waits for (see the header), added to the set. */
static int ts_set_add_release(ts_flush_stream **set, uint32_t *n, uint32_t *cap,
                              const ts_pending *p, CUstream current)
{
    int rc = 0;
    for (uint32_t i = 0; i < p->n && rc == 0; i++)
        rc = ts_set_add(set, n, cap, (CUstream)p->streams[i]);
    if (current != NULL && rc == 0) rc = ts_set_add(set, n, cap, current);
    if ((p->unnamed || (p->n == 0 && current == NULL)) && rc == 0)
        rc = ts_set_add(set, n, cap, TS_CU_STREAM_LEGACY);
    return rc;
}

/* Whether one of the streams a release waits for is being captured. */
static int ts_release_blocked(const ts_pending *p, const ts_flush_stream *set, uint32_t n,
                              CUstream current)
{
    for (uint32_t i = 0; i < n; i++) {
        if (!set[i].blocked) continue;
        CUstream s = set[i].named;
        for (uint32_t k = 0; k < p->n; k++)
            if ((CUstream)p->streams[k] == s) return 1;
        if (s == current) return 1;
        if (s == TS_CU_STREAM_LEGACY && (p->unnamed || (p->n == 0 && current == NULL)))
            return 1;
    }
    return 0;
}

/* Whether rc says the driver does not know the stream (destroyed, or of another context). */
static int ts_unknown_stream(CUresult rc)
{
    return rc == CUDA_ERROR_INVALID_HANDLE || rc == CUDA_ERROR_INVALID_VALUE;
}

/* Record an event on fs's stream unless it is being captured (inside the context, lock not
 * held). A stream the driver no longer knows is replaced by the legacy stream, which waits
 * for the work of the context's blocking streams. */
static ts_status ts_record_on(ts_cuda_releases *r, ts_flush_stream *fs, ts_err *err)
{
    const ts_cuda_api *api = r->api;
    for (;;) {
        int status = CU_STREAM_CAPTURE_STATUS_NONE;
        /* "if this is called on CU_STREAM_LEGACY (the "null stream") while a blocking
         * stream in the same context is capturing, it will return
         * CUDA_ERROR_STREAM_CAPTURE_IMPLICIT ... The blocking stream capture is not
         * invalidated" (cuStreamIsCapturing): asking never breaks a capture. */
        CUresult rc = api->StreamIsCapturing(fs->stream, &status);
        const char *what = "cuStreamIsCapturing for a GPU release";
        if (ts_capture_refused(rc) ||
            (rc == CUDA_SUCCESS && status != CU_STREAM_CAPTURE_STATUS_NONE)) {
            fs->blocked = 1;
            return TS_OK;
        }
        if (rc == CUDA_SUCCESS) {
            pthread_mutex_lock(&r->lock);
            CUevent ev = ts_releases_take_event(r);
            pthread_mutex_unlock(&r->lock);
            if (ev == NULL) return ts_err_set(err, TS_E_CUDA, ENOMEM, "cuEventCreate failed");
            rc = api->EventRecord(ev, fs->stream);
            if (rc == CUDA_SUCCESS) {
                /* A capture that began on the stream between the question and the record
                 * took the record into its graph: asked again, the event is not used. */
                CUresult again = api->StreamIsCapturing(fs->stream, &status);
                if (ts_capture_refused(again) ||
                    (again == CUDA_SUCCESS && status != CU_STREAM_CAPTURE_STATUS_NONE)) {
                    pthread_mutex_lock(&r->lock);
                    ts_releases_give_event(r, ev);
                    pthread_mutex_unlock(&r->lock);
                    fs->blocked = 1;
                    return TS_OK;
                }
                fs->event = ev;
                return TS_OK;
            }
            pthread_mutex_lock(&r->lock);
            ts_releases_give_event(r, ev);
            pthread_mutex_unlock(&r->lock);
            if (ts_capture_refused(rc)) { /* a capture began since the question */
                fs->blocked = 1;
                return TS_OK;
            }
            what = "cuEventRecord for a GPU release";
        }
        if (!ts_unknown_stream(rc) || fs->stream == TS_CU_STREAM_LEGACY)
            return ts_cuda_fail(api, err, rc, what);
        fs->stream = TS_CU_STREAM_LEGACY;
    }
}

/* Put items (oldest first) back at the old end of the queue, behind the newer ones. */
static void ts_releases_requeue(ts_cuda_releases *r, ts_pending *items)
{
    ts_pending *back = ts_pending_reversed(items);
    pthread_mutex_lock(&r->lock);
    ts_pending **tail = &r->unflushed;
    while (*tail != NULL) tail = &(*tail)->next;
    *tail = back;
    pthread_mutex_unlock(&r->lock);
}

/* Record the events of what is queued and hand the releases that need no captured stream
 * to the thread (see the header; no wait). */
static ts_status ts_releases_flush_now(ts_cuda_releases *r, CUstream current, ts_err *err)
{
    pthread_mutex_lock(&r->lock);
    if (r->failed) {
        ts_status st = ts_err_set(err, TS_E_CUDA, 0, "%s", r->failure);
        pthread_mutex_unlock(&r->lock);
        return st;
    }
    ts_pending *items = r->unflushed;
    r->unflushed = NULL;
    pthread_mutex_unlock(&r->lock);
    if (items == NULL) return TS_OK;
    ts_pending *oldest = ts_pending_reversed(items); /* the queue was newest first */

    ts_flush_stream *set = NULL;
    uint32_t n = 0, cap = 0;
    ts_status st = TS_OK;
    for (ts_pending *p = oldest; p != NULL && st == TS_OK; p = p->next)
        if (ts_set_add_release(&set, &n, &cap, p, current) != 0)
            st = ts_err_set(err, TS_E_SYS, ENOMEM, "out of memory");
    if (st == TS_OK && (st = ts_cuda_enter(r->api, r->ctx, err)) == TS_OK) {
        for (uint32_t i = 0; i < n && st == TS_OK; i++) st = ts_record_on(r, &set[i], err);
        ts_cuda_leave(r->api);
    }
    if (st != TS_OK) {
        /* Nothing handed over (the process exits, or a driver call failed): the events
         * recorded go back, the releases stay queued. */
        pthread_mutex_lock(&r->lock);
        for (uint32_t i = 0; i < n; i++)
            if (set[i].event != NULL) ts_releases_give_event(r, set[i].event);
        pthread_mutex_unlock(&r->lock);
        free(set);
        ts_releases_requeue(r, oldest);
        return ts_cuda_exiting() ? TS_OK : st;
    }

    /* Split: the releases whose streams were all recorded go now, the others wait. */
    ts_pending *go = NULL, **go_tail = &go, *wait = NULL, **wait_tail = &wait;
    for (ts_pending *p = oldest, *next; p != NULL; p = next) {
        next = p->next;
        p->next = NULL;
        if (ts_release_blocked(p, set, n, current)) {
            *wait_tail = p;
            wait_tail = &p->next;
        } else {
            *go_tail = p;
            go_tail = &p->next;
        }
    }
    ts_flush *f = go != NULL ? calloc(1, sizeof *f) : NULL;
    CUevent *events = f != NULL && n > 0 ? calloc(n, sizeof *events) : NULL;
    if (go != NULL && (f == NULL || (n > 0 && events == NULL))) {
        free(f);
        f = NULL;
        st = ts_err_set(err, TS_E_SYS, ENOMEM, "out of memory");
    }
    pthread_mutex_lock(&r->lock);
    for (uint32_t i = 0; i < n; i++) {
        if (set[i].event == NULL) continue;
        if (f != NULL) events[f->n_events++] = set[i].event;
        else ts_releases_give_event(r, set[i].event);
    }
    pthread_mutex_unlock(&r->lock);
    free(set);
    if (f == NULL) {
        free(events);
        if (go != NULL) ts_releases_requeue(r, go); /* out of memory: they wait */
    } else {
        f->events = events;
        f->items = go;
        pthread_mutex_lock(&r->lock);
        if (r->tail != NULL) r->tail->next = f;
        else r->head = f;
        r->tail = f;
        pthread_cond_broadcast(&r->cond);
        pthread_mutex_unlock(&r->lock);
    }
    if (wait != NULL) ts_releases_requeue(r, wait);
    return st;
}

/* The CLOCK_REALTIME time ms milliseconds from now (pthread_cond_timedwait's clock). */
static struct timespec ts_realtime_in(uint32_t ms)
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

/* Flush, then wait up to wait_ms for the thread to finish (see the header). */
ts_status ts_cuda_releases_flush(ts_cuda_releases *r, ts_device_stream current,
                                 uint32_t wait_ms, ts_err *err)
{
    ts_status st = ts_releases_flush_now(r, (CUstream)current, err);
    if (st != TS_OK || wait_ms == 0) return st;
    struct timespec deadline = ts_realtime_in(wait_ms);
    int timed_out = 0;
    pthread_mutex_lock(&r->lock);
    while ((r->head != NULL || r->busy) && !timed_out)
        timed_out = pthread_cond_timedwait(&r->cond, &r->lock, &deadline) == ETIMEDOUT;
    pthread_mutex_unlock(&r->lock);
    if (timed_out)
        return ts_err_set(err, TS_E_TIMEOUT, 0,
                          "the GPU releases of this consumer did not finish within %u ms "
                          "(its GPU work is still running)",
                          wait_ms);
    return TS_OK;
}

/* ==========================================================================
 * The release thread
 * ========================================================================== */

/* How long an orphaned queue waits before it tries again a flush that a capture held. */
#define ORPHAN_RETRY_MS 100

/* The thread's own flush once the handle is closed (lock held; dropped meanwhile). */
static void ts_releases_orphan_flush(ts_cuda_releases *r)
{
    ts_err e = {0};
    pthread_mutex_unlock(&r->lock);
    ts_status st = ts_releases_flush_now(r, NULL, &e);
    pthread_mutex_lock(&r->lock);
    if (st != TS_OK && !r->failed) {
        /* Not a failed wait (that one is sticky already): say it as one, the slots
         * stay held; nobody is left to report it to. */
        snprintf(r->failure, sizeof r->failure, "%s", e.msg);
        r->failed = 1;
    }
    if (st == TS_OK && r->head == NULL && r->unflushed != NULL && !r->failed) {
        struct timespec dl = ts_realtime_in(ORPHAN_RETRY_MS); /* a capture holds them */
        pthread_cond_timedwait(&r->cond, &r->lock, &dl);
    }
}

/* What waiting for a flush's events came to. */
enum { TS_WAIT_FAILED = 0, TS_WAIT_DONE = 1, TS_WAIT_EXITING = 2, TS_WAIT_AGAIN = 3 };

/* Wait for a flush's events (outside the lock): DONE, FAILED (recorded: the slots stay
 * held), EXITING (the process's exit began: no more driver calls), or AGAIN (an event was
 * taken into a capture that began as it was recorded, "CUDA_ERROR_CAPTURED_EVENT: ... not
 * permitted on an event which was last recorded in a capturing stream": the releases go
 * back to the queue, for a later flush). */
static int ts_releases_wait(ts_cuda_releases *r, const ts_flush *f)
{
    ts_err e = {0};
    if (ts_cuda_enter(r->api, r->ctx, &e) != TS_OK) {
        if (ts_cuda_exiting()) return TS_WAIT_EXITING;
        ts_releases_failed(r, &e);
        return TS_WAIT_FAILED;
    }
    int outcome = TS_WAIT_DONE;
    for (uint32_t i = 0; i < f->n_events && outcome == TS_WAIT_DONE; i++) {
        CUresult rc = r->api->EventSynchronize(f->events[i]);
        if (rc == CUDA_SUCCESS) continue;
        if (ts_cuda_exiting()) {
            outcome = TS_WAIT_EXITING;
        } else if (rc == CUDA_ERROR_CAPTURED_EVENT) {
            outcome = TS_WAIT_AGAIN;
        } else {
            ts_cuda_fail(r->api, &e, rc, "cuEventSynchronize of the GPU work");
            ts_releases_failed(r, &e);
            outcome = TS_WAIT_FAILED;
        }
    }
    pthread_mutex_lock(&r->lock);
    for (uint32_t i = 0; i < f->n_events; i++) ts_releases_give_event(r, f->events[i]);
    pthread_mutex_unlock(&r->lock);
    ts_cuda_leave(r->api);
    return outcome;
}

/* The release thread: waits for each flush's events, then calls its releases back. From
 * the process's exit on it makes no driver call and ends (ts_releases_stop_all). */
static void *ts_releases_main(void *arg)
{
    ts_cuda_releases *r = arg;
    pthread_mutex_lock(&r->lock);
    for (;;) {
        while (r->head == NULL && !r->stop && !ts_cuda_exiting()) {
            if (r->orphaned && r->unflushed != NULL && !r->failed) {
                ts_releases_orphan_flush(r);
                continue;
            }
            pthread_cond_wait(&r->cond, &r->lock);
        }
        ts_flush *f = r->head;
        if (f == NULL || ts_cuda_exiting()) break; /* stopped and nothing left, or exit */
        r->head = f->next;
        if (r->head == NULL) r->tail = NULL;
        r->busy = 1;
        pthread_mutex_unlock(&r->lock);

        int outcome = ts_releases_wait(r, f);
        if (outcome == TS_WAIT_EXITING) { /* no more driver calls: the process ends */
            pthread_mutex_lock(&r->lock);
            r->busy = 0;
            break;
        }
        ts_pending *p = f->items;
        free(f->events);
        free(f);
        if (outcome == TS_WAIT_AGAIN) {
            ts_releases_requeue(r, p);
            pthread_mutex_lock(&r->lock);
            r->busy = 0;
            if (r->head == NULL) pthread_cond_broadcast(&r->cond);
            if (r->orphaned) { /* nobody flushes: try again after a while */
                struct timespec dl = ts_realtime_in(ORPHAN_RETRY_MS);
                pthread_cond_timedwait(&r->cond, &r->lock, &dl);
            }
            continue;
        }
        /* A callback may drop the ring's last reference: ts_cuda_releases_free then runs
         * on this thread (only with the last item: every item holds a reference). */
        while (p != NULL) {
            ts_pending *next = p->next;
            ts_pending fin = *p;
            free(p);
            fin.done(fin.arg, fin.slot, fin.consumer, fin.token, outcome == TS_WAIT_DONE);
            p = next;
        }
        pthread_mutex_lock(&r->lock);
        r->busy = 0;
        if (r->head == NULL) pthread_cond_broadcast(&r->cond); /* flush with wait_ms */
    }
    int self_free = r->self_free;
    pthread_mutex_unlock(&r->lock);
    if (self_free) ts_releases_free_struct(r);
    ts_release_thread_ended();
    return NULL;
}
