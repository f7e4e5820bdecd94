/* ts_py_ring.c - the Ring type of tensorsocket._core (see ts_py.h): a process's handle on a
 * ring segment, producer or consumer. Every blocking call releases the GIL, sleeps at most
 * one slice (TS_SLICE_NS, ts_clock.h) at a time, and checks for signals (Ctrl-C) between
 * slices (ts_wait). */
#include "binding/ts_py.h"

#include "base/ts_clock.h"

/* Raise if the ring was closed. */
static int ts_ring_check(RingObject *self)
{
    if (self->ring != NULL) return 0;
    PyErr_SetString(PyExc_ValueError, "this ring is closed");
    return -1;
}

/* Raise unless the ring is a producer's (want=1) or a consumer's (want=0). */
static int ts_role_check(RingObject *self, int want)
{
    if (ts_ring_check(self) < 0) return -1;
    if (ts_ring_is_producer(self->ring) == want) return 0;
    PyErr_SetString(PyExc_ValueError, want ? "only the producer's ring handle can do this"
                                           : "only a consumer's ring handle can do this");
    return -1;
}

/* The status of a core call as the method's result: None, or the exception. */
static PyObject *ts_done(RingObject *self, ts_status st, const ts_err *err)
{
    if (st != TS_OK) return ts_py_raise(ts_py_state((PyObject *)self), err);
    Py_RETURN_NONE;
}

/* ==========================================================================
 * Blocking calls
 * ========================================================================== */

/* One slice of a blocking core call: until deadline at the latest. */
typedef ts_status (*ts_wait_fn)(ts_ring *ring, void *arg, uint64_t deadline, ts_err *err);

/* Run fn in slices with the GIL released until it is done or the deadline passes; between
 * slices Ctrl-C is honoured, and a close of the object by another thread noticed (ring, the
 * caller's own reference, kept the mapping valid). With try_first, the first slice is a try
 * with a past deadline (TS_DEADLINE_NOW: it never sleeps) and the GIL kept: for a call that
 * only looks (acquire, the waits), most calls find what they wait for at once, and giving up
 * the GIL costs more than looking; never for one that works once it may (publish copies the
 * batch). 0 with the last slice's status in *st and err, or -1 with a Python exception set
 * (*st: the last slice's status). */
static int ts_wait(RingObject *self, ts_ring *ring, ts_wait_fn fn, void *arg, int try_first,
                   uint64_t deadline, ts_status *st, ts_err *err)
{
    if (try_first) {
        *st = fn(ring, arg, TS_DEADLINE_NOW, err);
        if (*st != TS_E_INTR && *st != TS_E_TIMEOUT) return 0;
        if (*st == TS_E_TIMEOUT && ts_now_ns() >= deadline) return 0; /* timeout 0: a try */
    }
    for (;;) {
        uint64_t slice = ts_slice_end(deadline);
        Py_BEGIN_ALLOW_THREADS
        *st = fn(ring, arg, slice, err);
        Py_END_ALLOW_THREADS
        if (self->ring != ring) {
            PyErr_SetString(ts_py_state((PyObject *)self)->TensorSocketError,
                            "the ring was closed by another thread while this call waited");
            return -1;
        }
        if (*st != TS_E_INTR && *st != TS_E_TIMEOUT) return 0;
        if (PyErr_CheckSignals() < 0) return -1;
        if (*st == TS_E_TIMEOUT && ts_now_ns() >= deadline) return 0;
    }
}

/* A producer's wait that answers True, or False on timeout. */
static PyObject *ts_wait_bool(RingObject *self, ts_wait_fn fn, void *arg, PyObject *timeout)
{
    uint64_t deadline;
    ts_status st;
    ts_err err = {0};
    if (ts_role_check(self, 1) < 0 || ts_py_timeout(timeout, &deadline) < 0) return NULL;
    ts_ring *ring = self->ring;
    ts_ring_ref(ring);
    int rc = ts_wait(self, ring, fn, arg, 1, deadline, &st, &err);
    ts_ring_unref(ring);
    if (rc < 0) return NULL;
    if (st == TS_OK || st == TS_E_TIMEOUT) return PyBool_FromLong(st == TS_OK);
    return ts_py_raise(ts_py_state((PyObject *)self), &err);
}

/* Slice of wait_consumers: arg is the uint32_t count. */
static ts_status ts_wait_consumers_fn(ts_ring *ring, void *arg, uint64_t deadline, ts_err *err)
{
    return ts_ring_wait_consumers(ring, *(const uint32_t *)arg, deadline, err);
}

/* Slice of wait_drained. */
static ts_status ts_wait_drained_fn(ts_ring *ring, void *arg, uint64_t deadline, ts_err *err)
{
    (void)arg;
    return ts_ring_wait_drained(ring, deadline, err);
}

/* Slice of wait_released. */
static ts_status ts_wait_released_fn(ts_ring *ring, void *arg, uint64_t deadline, ts_err *err)
{
    (void)arg;
    return ts_ring_wait_released(ring, deadline, err);
}

/* Ring.wait_consumers(n, timeout=None) -> True, or False on timeout */
static PyObject *Ring_wait_consumers(RingObject *self, PyObject *const *args, Py_ssize_t nargs,
                                     PyObject *kwnames)
{
    static const char *const names[] = {"n", "timeout"};
    PyObject *a[2];
    uint32_t want = 0;
    if (ts_py_args("wait_consumers", args, nargs, kwnames, names, 2, 2, 1, a) < 0 ||
        ts_py_u32(a[0], &want) < 0)
        return NULL;
    return ts_wait_bool(self, ts_wait_consumers_fn, &want, a[1]);
}

/* Ring.wait_drained(timeout=None) -> True, or False on timeout */
static PyObject *Ring_wait_drained(RingObject *self, PyObject *const *args, Py_ssize_t nargs,
                                   PyObject *kwnames)
{
    static const char *const names[] = {"timeout"};
    PyObject *a[1];
    if (ts_py_args("wait_drained", args, nargs, kwnames, names, 1, 1, 0, a) < 0) return NULL;
    return ts_wait_bool(self, ts_wait_drained_fn, NULL, a[0]);
}

/* Ring.wait_released(timeout=None) -> True, or False on timeout */
static PyObject *Ring_wait_released(RingObject *self, PyObject *const *args, Py_ssize_t nargs,
                                    PyObject *kwnames)
{
    static const char *const names[] = {"timeout"};
    PyObject *a[1];
    if (ts_py_args("wait_released", args, nargs, kwnames, names, 1, 1, 0, a) < 0) return NULL;
    return ts_wait_bool(self, ts_wait_released_fn, NULL, a[0]);
}

/* ==========================================================================
 * Life cycle
 * ========================================================================== */

/* Wrap a core ring handle in a new Ring object (steals the reference). */
static PyObject *ts_wrap_ring(ts_state *state, ts_ring *ring)
{
    RingObject *obj = PyObject_New(RingObject, state->Ring_type);
    if (obj == NULL) {
        ts_ring_unref(ring);
        return NULL;
    }
    obj->ring = ring;
    return (PyObject *)obj;
}

/* Ring.create(name, slot_count, slot_bytes, max_leaves, *, device=-1) -> producer Ring */
static PyObject *Ring_create(PyTypeObject *cls, PyObject *const *args, Py_ssize_t nargs,
                             PyObject *kwnames)
{
    static const char *const names[] = {"name", "slot_count", "slot_bytes", "max_leaves",
                                        "device"};
    PyObject *a[5];
    const char *name = NULL;
    ts_geometry g = {0};
    int device = -1;
    ts_state *state = PyType_GetModuleState(cls);
    if (ts_py_args("create", args, nargs, kwnames, names, 5, 4, 4, a) < 0 ||
        ts_py_str(a[0], 0, &name) < 0 || ts_py_u32(a[1], &g.slot_count) < 0 ||
        ts_py_u64(a[2], &g.slot_bytes) < 0 || ts_py_u32(a[3], &g.max_leaves) < 0 ||
        ts_py_int(a[4], &device) < 0)
        return NULL;
    g.on_device = device >= 0;
    ts_device_driver *driver = NULL;
    if (device >= 0 && (driver = ts_py_cuda(state)) == NULL) return NULL;
    ts_ring *ring = NULL;
    ts_err err = {0};
    ts_status st;
    Py_BEGIN_ALLOW_THREADS
    st = ts_ring_create_on_device(name, &g, driver, device, &ring, &err);
    Py_END_ALLOW_THREADS
    if (st != TS_OK) return ts_py_raise(state, &err);
    return ts_wrap_ring(state, ring);
}

/* Ring.open(name) -> consumer Ring */
static PyObject *Ring_open(PyTypeObject *cls, PyObject *const *args, Py_ssize_t nargs,
                           PyObject *kwnames)
{
    static const char *const names[] = {"name"};
    PyObject *a[1];
    const char *name = NULL;
    ts_state *state = PyType_GetModuleState(cls);
    if (ts_py_args("open", args, nargs, kwnames, names, 1, 1, 1, a) < 0 ||
        ts_py_str(a[0], 0, &name) < 0)
        return NULL;
    ts_ring *ring = NULL;
    ts_err err = {0};
    if (ts_ring_open(name, &ring, &err) != TS_OK) return ts_py_raise(state, &err);
    return ts_wrap_ring(state, ring);
}

/* Ring.unlink_name(name): remove a segment name (missing is fine). */
static PyObject *Ring_unlink_name(PyTypeObject *cls, PyObject *const *args, Py_ssize_t nargs,
                                  PyObject *kwnames)
{
    static const char *const names[] = {"name"};
    PyObject *a[1];
    const char *name = NULL;
    if (ts_py_args("unlink_name", args, nargs, kwnames, names, 1, 1, 1, a) < 0 ||
        ts_py_str(a[0], 0, &name) < 0)
        return NULL;
    ts_err err = {0};
    if (ts_ring_unlink_name(name, &err) != TS_OK)
        return ts_py_raise(PyType_GetModuleState(cls), &err);
    Py_RETURN_NONE;
}

/* Drop a ring reference without the GIL: the last one of a GPU ring joins the release
 * thread (which may wait for queued kernels) and frees device memory. */
static void ts_ring_unref_nogil(ts_ring *ring)
{
    if (ring == NULL) return;
    Py_BEGIN_ALLOW_THREADS
    ts_ring_unref(ring);
    Py_END_ALLOW_THREADS
}

/* Ring.close(): drop this handle (views keep the mapping alive; the GPU releases of views
 * dropped from now on are flushed by the release thread itself, ts_ring_orphan). */
static PyObject *Ring_close(RingObject *self, PyObject *Py_UNUSED(ignored))
{
    ts_ring *ring = self->ring;
    self->ring = NULL;
    ts_ring_orphan(ring); /* views dropped from now on are released without a flush */
    ts_ring_unref_nogil(ring);
    Py_RETURN_NONE;
}

/* Ring.flush_releases(wait_ms=0, stream=None): hand the GPU releases queued by dropped
 * views to the release thread, each after the work queued so far on the streams its views
 * were used on and on `stream` (the DLPack number of the calling thread's current stream on
 * the consumer's GPU; None if unknown); with wait_ms, also wait for them to finish. A failed
 * release of an earlier flush raises here; a release whose stream is being captured (CUDA
 * graphs) stays queued for a later call, and nothing is raised. */
static PyObject *Ring_flush_releases(RingObject *self, PyObject *const *args, Py_ssize_t nargs,
                                     PyObject *kwnames)
{
    static const char *const names[] = {"wait_ms", "stream"};
    PyObject *a[2];
    uint32_t wait_ms = 0;
    long long stream = 0;
    if (ts_py_args("flush_releases", args, nargs, kwnames, names, 2, 2, 0, a) < 0 ||
        ts_py_u32(a[0], &wait_ms) < 0 || ts_ring_check(self) < 0)
        return NULL;
    if (a[1] != NULL && a[1] != Py_None) {
        stream = PyLong_AsLongLong(a[1]);
        if (stream == -1 && PyErr_Occurred()) return NULL;
        if (stream == 0 || stream < -1) {
            PyErr_Format(PyExc_ValueError,
                         "stream=%lld is not a DLPack CUDA stream (1: legacy default, 2: "
                         "per-thread default, a cudaStream_t, or -1)",
                         stream);
            return NULL;
        }
    }
    ts_ring *ring = self->ring;
    ts_err err = {0};
    ts_status st;
    /* Our own reference while the GIL is released: another thread's close() may drop the
     * handle's meanwhile, and the ring's last reference frees dev (as Ring_acquire does). */
    ts_ring_ref(ring);
    Py_BEGIN_ALLOW_THREADS
    st = ts_ring_flush_releases(ring, (int64_t)stream, wait_ms, &err);
    ts_ring_unref(ring);
    Py_END_ALLOW_THREADS
    return ts_done(self, st, &err);
}

/* Ring.seal_pool() -> int: producer of a GPU ring: no import begins from now on, and the
 * live processes that map the pool, once the imports under way settled (ts_ring_seal_pool):
 * the pool may be freed (close()) once this is 0. */
static PyObject *Ring_seal_pool(RingObject *self, PyObject *Py_UNUSED(ignored))
{
    if (ts_role_check(self, 1) < 0) return NULL;
    ts_ring *ring = self->ring;
    uint32_t n;
    ts_ring_ref(ring); /* another thread's close() may drop the handle's meanwhile */
    Py_BEGIN_ALLOW_THREADS
    n = ts_ring_seal_pool(ring);
    ts_ring_unref(ring);
    Py_END_ALLOW_THREADS
    return PyLong_FromUnsignedLong(n);
}

/* Ring.closed */
static PyObject *Ring_get_closed(RingObject *self, void *Py_UNUSED(closure))
{
    return PyBool_FromLong(self->ring == NULL);
}

/* Ring.slot_count: the ring's slots (its geometry does not change: no info() needed). */
static PyObject *Ring_get_slot_count(RingObject *self, void *Py_UNUSED(closure))
{
    if (ts_ring_check(self) < 0) return NULL;
    return PyLong_FromUnsignedLong(ts_ring_slot_count(self->ring));
}

/* Drop the handle's reference. */
static void Ring_dealloc(RingObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    ts_ring_orphan(self->ring);
    ts_ring_unref_nogil(self->ring);
    tp->tp_free(self);
    Py_DECREF(tp);
}

/* ==========================================================================
 * Producer: the consumer table
 * ========================================================================== */

/* A sequence number argument that may be None or not given (then TS_SEQ_NONE); -1 with an
 * exception (an int out of range included: no mask here). */
static int ts_optional_seq(PyObject *obj, uint64_t *out)
{
    *out = TS_SEQ_NONE;
    if (obj == NULL || obj == Py_None) return 0;
    *out = PyLong_AsUnsignedLongLong(obj);
    return *out == (uint64_t)-1 && PyErr_Occurred() ? -1 : 0;
}

/* Ring.reserve(pid, start_time, batch_size=0) -> (index, token) */
static PyObject *Ring_reserve(RingObject *self, PyObject *const *args, Py_ssize_t nargs,
                              PyObject *kwnames)
{
    static const char *const names[] = {"pid", "start_time", "batch_size"};
    PyObject *a[3];
    int pid = 0;
    uint64_t start_time = 0;
    uint32_t batch_size = 0;
    if (ts_py_args("reserve", args, nargs, kwnames, names, 3, 3, 2, a) < 0 ||
        ts_py_int(a[0], &pid) < 0 || ts_py_u64(a[1], &start_time) < 0 ||
        ts_py_u32(a[2], &batch_size) < 0 || ts_role_check(self, 1) < 0)
        return NULL;
    uint32_t index = 0;
    uint64_t token = 0;
    ts_err err = {0};
    if (ts_ring_reserve(self->ring, pid, start_time, batch_size, &index, &token, &err) != TS_OK)
        return ts_py_raise(ts_py_state((PyObject *)self), &err);
    return Py_BuildValue("(IK)", index, (unsigned long long)token);
}

/* Ring.activate(index, align=False, start=None) -> first sequence number the consumer
 * receives (start: exactly that entry, which must still be in the ring) */
static PyObject *Ring_activate(RingObject *self, PyObject *const *args, Py_ssize_t nargs,
                               PyObject *kwnames)
{
    static const char *const names[] = {"index", "align", "start"};
    PyObject *a[3];
    uint32_t index = 0;
    int align = 0;
    uint64_t from, start = 0;
    ts_err err = {0};
    if (ts_py_args("activate", args, nargs, kwnames, names, 3, 3, 1, a) < 0 ||
        ts_py_u32(a[0], &index) < 0 || ts_py_flag(a[1], &align) < 0 ||
        ts_role_check(self, 1) < 0 || ts_optional_seq(a[2], &from) < 0)
        return NULL;
    ts_status st = from == TS_SEQ_NONE
                       ? ts_ring_activate(self->ring, index, align, &start, &err)
                       : ts_ring_activate_from(self->ring, index, from, &start, &err);
    if (st != TS_OK) return ts_py_raise(ts_py_state((PyObject *)self), &err);
    return PyLong_FromUnsignedLongLong(start);
}

/* Ring.activate_group(indices, align=False, start=None) -> the entry every one of the
 * consumers starts at (the ranks of a group, in one step) */
static PyObject *Ring_activate_group(RingObject *self, PyObject *const *args, Py_ssize_t nargs,
                                     PyObject *kwnames)
{
    static const char *const names[] = {"indices", "align", "start"};
    PyObject *a[3], *fast = NULL, *result = NULL;
    int align = 0;
    uint32_t indices[TS_MAX_CONSUMERS];
    if (ts_py_args("activate_group", args, nargs, kwnames, names, 3, 3, 1, a) < 0 ||
        ts_py_flag(a[1], &align) < 0 || ts_role_check(self, 1) < 0)
        return NULL;
    fast = PySequence_Fast(a[0], "activate_group: indices must be a sequence");
    if (fast == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    if (n < 1 || n > TS_MAX_CONSUMERS) {
        PyErr_Format(PyExc_ValueError, "activate_group: %zd consumers (1 to %d)", n,
                     TS_MAX_CONSUMERS);
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned long v = PyLong_AsUnsignedLong(PySequence_Fast_GET_ITEM(fast, i));
        if (v == (unsigned long)-1 && PyErr_Occurred()) goto done;
        indices[i] = (uint32_t)(v > UINT32_MAX ? UINT32_MAX : v);
    }
    uint64_t from;
    if (ts_optional_seq(a[2], &from) < 0) goto done;
    uint64_t start = 0;
    ts_err err = {0};
    if (ts_ring_activate_group(self->ring, indices, (uint32_t)n, align, from, &start, &err) !=
        TS_OK) {
        ts_py_raise(ts_py_state((PyObject *)self), &err);
        goto done;
    }
    result = PyLong_FromUnsignedLongLong(start);
done:
    Py_XDECREF(fast);
    return result;
}

/* Ring.await_next_epoch(index): the consumer skips the rest of the producer's epoch,
 * keeping its place (it receives again from the next epoch's first entry). */
static PyObject *Ring_await_next_epoch(RingObject *self, PyObject *const *args,
                                       Py_ssize_t nargs, PyObject *kwnames)
{
    static const char *const names[] = {"index"};
    PyObject *a[1];
    uint32_t index = 0;
    ts_err err = {0};
    if (ts_py_args("await_next_epoch", args, nargs, kwnames, names, 1, 1, 1, a) < 0 ||
        ts_py_u32(a[0], &index) < 0 || ts_role_check(self, 1) < 0)
        return NULL;
    return ts_done(self, ts_ring_await_next_epoch(self->ring, index, &err), &err);
}

/* Ring.set_policy(window, max_lag): late-joiner window and lag limit (0: off). */
static PyObject *Ring_set_policy(RingObject *self, PyObject *const *args, Py_ssize_t nargs,
                                 PyObject *kwnames)
{
    static const char *const names[] = {"window", "max_lag"};
    PyObject *a[2];
    uint64_t window = 0, max_lag = 0;
    ts_err err = {0};
    if (ts_py_args("set_policy", args, nargs, kwnames, names, 2, 2, 2, a) < 0 ||
        ts_py_u64(a[0], &window) < 0 || ts_py_u64(a[1], &max_lag) < 0 ||
        ts_role_check(self, 1) < 0)
        return NULL;
    return ts_done(self, ts_ring_set_policy(self->ring, window, max_lag, &err), &err);
}

/* Ring.detach(index, reason=REASON_LAGGED): take a live consumer off, keeping the
 * slots it holds held (a laggard, or one that never read). */
static PyObject *Ring_detach(RingObject *self, PyObject *const *args, Py_ssize_t nargs,
                             PyObject *kwnames)
{
    static const char *const names[] = {"index", "reason"};
    PyObject *a[2];
    uint32_t index = 0, reason = TS_REASON_LAGGED;
    if (ts_py_args("detach", args, nargs, kwnames, names, 2, 2, 1, a) < 0 ||
        ts_py_u32(a[0], &index) < 0 || ts_py_u32(a[1], &reason) < 0)
        return NULL;
    if (reason != TS_REASON_LAGGED && reason != TS_REASON_UNREAD) {
        PyErr_Format(PyExc_ValueError,
                     "detach reason must be REASON_LAGGED or REASON_UNREAD, got %u", reason);
        return NULL;
    }
    if (ts_role_check(self, 1) < 0) return NULL;
    ts_ring_detach(self->ring, index, reason);
    Py_RETURN_NONE;
}

/* Ring.retire(index): a live consumer left. */
static PyObject *Ring_retire(RingObject *self, PyObject *const *args, Py_ssize_t nargs,
                             PyObject *kwnames)
{
    static const char *const names[] = {"index"};
    PyObject *a[1];
    uint32_t index = 0;
    if (ts_py_args("retire", args, nargs, kwnames, names, 1, 1, 1, a) < 0 ||
        ts_py_u32(a[0], &index) < 0 || ts_role_check(self, 1) < 0)
        return NULL;
    ts_ring_retire(self->ring, index);
    Py_RETURN_NONE;
}

/* Ring.retire_silent(index, silent, limit): a consumer that sent no heartbeat for `silent`
 * seconds, longer than `limit`, while its process lives; its held slots stay held. */
static PyObject *Ring_retire_silent(RingObject *self, PyObject *const *args, Py_ssize_t nargs,
                                    PyObject *kwnames)
{
    static const char *const names[] = {"index", "silent", "limit"};
    PyObject *a[3];
    uint32_t index = 0;
    double silent = 0, limit = 0;
    if (ts_py_args("retire_silent", args, nargs, kwnames, names, 3, 3, 3, a) < 0 ||
        ts_py_u32(a[0], &index) < 0 || ts_py_double(a[1], &silent) < 0 ||
        ts_py_double(a[2], &limit) < 0)
        return NULL;
    if (!(silent >= 0 && limit >= 0 && silent < 1e12 && limit < 1e12)) {
        PyErr_SetString(PyExc_ValueError, "retire_silent: silent and limit are seconds >= 0");
        return NULL;
    }
    if (ts_role_check(self, 1) < 0) return NULL;
    ts_ring_retire_silent(self->ring, index, (uint64_t)(silent * 1e3), (uint64_t)(limit * 1e3));
    Py_RETURN_NONE;
}

/* Ring.evict(index, reason=REASON_DIED): a dead (or silent) consumer. */
static PyObject *Ring_evict(RingObject *self, PyObject *const *args, Py_ssize_t nargs,
                            PyObject *kwnames)
{
    static const char *const names[] = {"index", "reason"};
    PyObject *a[2];
    uint32_t index = 0, reason = TS_REASON_DIED;
    if (ts_py_args("evict", args, nargs, kwnames, names, 2, 2, 1, a) < 0 ||
        ts_py_u32(a[0], &index) < 0 || ts_py_u32(a[1], &reason) < 0)
        return NULL;
    if (reason != TS_REASON_DIED && reason != TS_REASON_SILENT) {
        PyErr_Format(PyExc_ValueError,
                     "evict reason must be REASON_DIED or REASON_SILENT, got %u", reason);
        return NULL;
    }
    if (ts_role_check(self, 1) < 0) return NULL;
    ts_ring_evict_for(self->ring, index, reason);
    Py_RETURN_NONE;
}

/* Ring.finish(failure=None): no more entries; wake every consumer. failure: why the
 * producer failed, for the consumers to read with failure() (None: a normal end). */
static PyObject *Ring_finish(RingObject *self, PyObject *const *args, Py_ssize_t nargs,
                             PyObject *kwnames)
{
    static const char *const names[] = {"failure"};
    PyObject *a[1];
    const char *failure = NULL;
    if (ts_py_args("finish", args, nargs, kwnames, names, 1, 1, 0, a) < 0 ||
        ts_py_str(a[0], 1, &failure) < 0 || ts_role_check(self, 1) < 0)
        return NULL;
    if (failure != NULL && failure[0] != '\0')
        ts_ring_fail(self->ring, failure);
    else
        ts_ring_finish(self->ring);
    Py_RETURN_NONE;
}

/* ==========================================================================
 * Producer: publishing
 * ========================================================================== */

/* Ring.note_publish_cpu(ns): add ns of this thread's CPU time spent publishing a batch
 * (encoding it and the publish call) to the header's publish_cpu_ns (status reads it). */
static PyObject *Ring_note_publish_cpu(RingObject *self, PyObject *const *args,
                                       Py_ssize_t nargs, PyObject *kwnames)
{
    static const char *const names[] = {"ns"};
    PyObject *a[1];
    uint64_t ns = 0;
    if (ts_py_args("note_publish_cpu", args, nargs, kwnames, names, 1, 1, 1, a) < 0 ||
        ts_py_u64(a[0], &ns) < 0 || ts_role_check(self, 1) < 0)
        return NULL;
    ts_ring_note_publish_cpu(self->ring, ns);
    Py_RETURN_NONE;
}

/* Ring.note_setup_cpu(ns): set the header's setup_cpu_ns, this process's CPU time before
 * its loader's first epoch began (status leaves it out of the loader's CPU). */
static PyObject *Ring_note_setup_cpu(RingObject *self, PyObject *const *args,
                                     Py_ssize_t nargs, PyObject *kwnames)
{
    static const char *const names[] = {"ns"};
    PyObject *a[1];
    uint64_t ns = 0;
    if (ts_py_args("note_setup_cpu", args, nargs, kwnames, names, 1, 1, 1, a) < 0 ||
        ts_py_u64(a[0], &ns) < 0 || ts_role_check(self, 1) < 0)
        return NULL;
    ts_ring_note_setup_cpu(self->ring, ns);
    Py_RETURN_NONE;
}

/* Ring.note_cache(budget, bytes, samples, epochs, off): note the producer's decoded-sample
 * cache in the header (off: why there is none, "" if there is one); the text is cut to
 * what the header holds. */
static PyObject *Ring_note_cache(RingObject *self, PyObject *const *args, Py_ssize_t nargs,
                                 PyObject *kwnames)
{
    static const char *const names[] = {"budget", "bytes", "samples", "epochs", "off"};
    PyObject *a[5];
    ts_cache_note note = {0};
    if (ts_py_args("note_cache", args, nargs, kwnames, names, 5, 5, 5, a) < 0 ||
        ts_py_u64(a[0], &note.budget) < 0 || ts_py_u64(a[1], &note.bytes) < 0 ||
        ts_py_u64(a[2], &note.samples) < 0 || ts_py_u64(a[3], &note.epochs) < 0 ||
        ts_role_check(self, 1) < 0)
        return NULL;
    Py_ssize_t len = 0;
    const char *off = PyUnicode_AsUTF8AndSize(a[4], &len);
    if (off == NULL) return NULL;
    /* Cut at a character boundary: the reader decodes what fits. */
    size_t n = (size_t)len < TS_CACHE_OFF_BYTES - 1 ? (size_t)len : TS_CACHE_OFF_BYTES - 1;
    while (n > 0 && n < (size_t)len && ((unsigned char)off[n] & 0xC0) == 0x80) n--;
    memcpy(note.off, off, n);
    ts_ring_note_cache(self->ring, &note);
    Py_RETURN_NONE;
}

/* Ring.locate(address): (path, offset) of the segment file's bytes at address, for another
 * process to map them (a transform worker), or None where address is not in a slot this
 * handle sees through the shared mapping, or the file lost its name (ts_ring_locate). */
static PyObject *Ring_locate(RingObject *self, PyObject *const *args, Py_ssize_t nargs,
                             PyObject *kwnames)
{
    static const char *const names[] = {"address"};
    PyObject *a[1];
    uint64_t address = 0, offset = 0;
    if (ts_py_args("locate", args, nargs, kwnames, names, 1, 1, 1, a) < 0 ||
        ts_py_u64(a[0], &address) < 0 || ts_ring_check(self) < 0)
        return NULL;
    char path[300];
    int found;
    Py_BEGIN_ALLOW_THREADS /* two stat calls */
    found = ts_ring_locate(self->ring, address, path, sizeof path, &offset);
    Py_END_ALLOW_THREADS
    if (!found) Py_RETURN_NONE;
    return Py_BuildValue("(sK)", path, (unsigned long long)offset);
}

/* Ring.cache(): the header's cache note as a dict (budget, bytes, samples, epochs, off:
 * None while there is a cache or none was decided), or None if it could not be read
 * whole. */
static PyObject *Ring_cache(RingObject *self, PyObject *Py_UNUSED(ignored))
{
    if (ts_ring_check(self) < 0) return NULL;
    ts_cache_note note;
    if (!ts_ring_cache(self->ring, &note)) Py_RETURN_NONE;
    PyObject *off = note.off[0] == '\0' ? Py_NewRef(Py_None)
        : PyUnicode_DecodeUTF8(note.off, (Py_ssize_t)strlen(note.off), "replace");
    if (off == NULL) return NULL;
    PyObject *out = Py_BuildValue("{sKsKsKsKsN}", "budget", (unsigned long long)note.budget,
                                  "bytes", (unsigned long long)note.bytes,
                                  "samples", (unsigned long long)note.samples,
                                  "epochs", (unsigned long long)note.epochs, "off", off);
    return out;
}

/* What one publish call copies (the argument of its slices). */
typedef struct ts_publish_args {
    uint32_t kind;
    uint64_t epoch;
    uint64_t index;
    const ts_src_leaf *leaves; /* borrowed: the callers' buffers */
    uint32_t n_leaves;
    const void *meta;          /* borrowed */
    uint64_t meta_bytes;
} ts_publish_args;

/* Slice of publish. */
static ts_status ts_publish_fn(ts_ring *ring, void *arg, uint64_t deadline, ts_err *err)
{
    const ts_publish_args *p = arg;
    return ts_ring_publish(ring, p->kind, p->epoch, p->index, p->leaves, p->n_leaves, p->meta,
                           p->meta_bytes, deadline, err);
}

/* Fill src (dims: its shape and stride storage) from a DLPack capsule ("dltensor", not
 * consumed: its owner frees it) of a CPU tensor whose dtype is src->dtype; 0, or -1 with
 * an exception. */
static int ts_parse_capsule(PyObject *capsule, Py_ssize_t i, ts_src_leaf *src, int64_t *dims)
{
    DLManagedTensor *m = PyCapsule_GetPointer(capsule, "dltensor");
    if (m == NULL) return -1;
    const DLTensor *t = &m->dl_tensor;
    if (t->device.device_type != kDLCPU) {
        PyErr_Format(PyExc_TypeError, "leaf %zd: a DLPack tensor on device type %d, not the "
                     "CPU", i, (int)t->device.device_type);
        return -1;
    }
    if (t->dtype.code != src->dtype.code || t->dtype.bits != src->dtype.bits ||
        t->dtype.lanes != src->dtype.lanes || t->dtype.bits % 8 != 0) {
        PyErr_Format(PyExc_ValueError, "leaf %zd: the DLPack tensor's dtype (%d, %d, %d) is "
                     "not the leaf's (%d, %d, %d)", i, t->dtype.code, t->dtype.bits,
                     t->dtype.lanes, src->dtype.code, src->dtype.bits, src->dtype.lanes);
        return -1;
    }
    if (t->ndim < 0 || t->ndim > TS_MAX_NDIM) {
        PyErr_Format(PyExc_ValueError, "a tensor has %d dimensions, at most %d are supported",
                     t->ndim, TS_MAX_NDIM);
        return -1;
    }
    uint64_t itemsize = (uint64_t)t->dtype.bits / 8 * t->dtype.lanes;
    int64_t step = (int64_t)itemsize; /* the stride of a compact row-major tensor's dim */
    for (int d = t->ndim - 1; d >= 0; d--) {
        dims[d] = t->shape[d];
        dims[TS_MAX_NDIM + d] = t->strides != NULL ? t->strides[d] * (int64_t)itemsize : step;
        step *= t->shape[d];
    }
    src->data = (const char *)t->data + t->byte_offset;
    src->ndim = t->ndim;
    src->shape = dims;
    src->strides = dims + TS_MAX_NDIM;
    src->itemsize = itemsize;
    return 0;
}

/* Fill src (dims: its shape and stride storage) from one (buffer or DLPack capsule,
 * (code, bits, lanes)) leaf, taking a buffer into buf; 0, or -1 with an exception (buf
 * taken only on 0). */
static int ts_parse_leaf(PyObject *item, Py_ssize_t i, Py_buffer *buf, ts_src_leaf *src,
                         int64_t *dims)
{
    int dtype[3]; /* code, bits, lanes */
    if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 2) {
        PyErr_SetString(PyExc_TypeError, "each leaf must be (buffer, (code, bits, lanes))");
        return -1;
    }
    if (ts_py_ints(PyTuple_GET_ITEM(item, 1), 3, "a leaf's dtype (code, bits, lanes)", dtype) < 0)
        return -1;
    src->dtype = (DLDataType){(uint8_t)dtype[0], (uint8_t)dtype[1], (uint16_t)dtype[2]};
    if (PyCapsule_CheckExact(PyTuple_GET_ITEM(item, 0)))
        return ts_parse_capsule(PyTuple_GET_ITEM(item, 0), i, src, dims);
    if (PyObject_GetBuffer(PyTuple_GET_ITEM(item, 0), buf, PyBUF_RECORDS_RO) < 0) return -1;
    if (buf->ndim > TS_MAX_NDIM) {
        PyErr_Format(PyExc_ValueError, "a tensor has %d dimensions, at most %d are supported",
                     buf->ndim, TS_MAX_NDIM);
        goto error;
    }
    if ((uint64_t)buf->itemsize * 8 != (uint64_t)src->dtype.bits * src->dtype.lanes) {
        PyErr_Format(PyExc_ValueError,
                     "leaf %zd: buffer item size %zd does not match dtype bits %d", i,
                     buf->itemsize, src->dtype.bits);
        goto error;
    }
    for (int d = 0; d < buf->ndim; d++) {
        dims[d] = buf->shape[d];
        dims[TS_MAX_NDIM + d] = buf->strides[d];
    }
    src->data = buf->buf;
    src->ndim = buf->ndim;
    src->shape = dims;
    src->strides = dims + TS_MAX_NDIM;
    src->itemsize = (uint64_t)buf->itemsize;
    return 0;
error:
    PyBuffer_Release(buf);
    return -1;
}

/* Ring.publish(leaves, meta, *, end_of_epoch=False, epoch=0, index=0, timeout=None)
 * leaves: sequence of (buffer or "dltensor" capsule of a CPU tensor, (code, bits, lanes)).
 * Returns the sequence number. */
static PyObject *Ring_publish(RingObject *self, PyObject *const *args, Py_ssize_t nargs,
                              PyObject *kwnames)
{
    static const char *const names[] = {"leaves", "meta", "end_of_epoch", "epoch", "index",
                                        "timeout"};
    PyObject *a[6], *result = NULL, *fast = NULL;
    Py_buffer meta = {0}, *bufs = NULL;
    ts_src_leaf *src = NULL;
    int64_t *dims = NULL;
    Py_ssize_t n = 0, got = 0;
    ts_ring *ring = NULL; /* owns one reference while set */
    ts_publish_args p = {0};
    uint64_t deadline;
    int end;

    if (ts_py_args("publish", args, nargs, kwnames, names, 6, 2, 2, a) < 0) return NULL;
    if (PyObject_GetBuffer(a[1], &meta, PyBUF_SIMPLE) < 0) return NULL;
    if ((end = ts_py_bool(a[2])) < 0 || ts_py_u64(a[3], &p.epoch) < 0 ||
        ts_py_u64(a[4], &p.index) < 0 || ts_role_check(self, 1) < 0 ||
        ts_py_timeout(a[5], &deadline) < 0)
        goto done;
    fast = PySequence_Fast(a[0], "leaves must be a sequence");
    if (fast == NULL) goto done;
    n = PySequence_Fast_GET_SIZE(fast);
    if (n > (Py_ssize_t)UINT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "too many tensors");
        goto done;
    }
    bufs = PyMem_Calloc(n ? (size_t)n : 1, sizeof *bufs);
    src = PyMem_Calloc(n ? (size_t)n : 1, sizeof *src);
    dims = PyMem_Calloc(n ? (size_t)n * 2 * TS_MAX_NDIM : 1, sizeof *dims);
    if (bufs == NULL || src == NULL || dims == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (; got < n; got++)
        if (ts_parse_leaf(PySequence_Fast_GET_ITEM(fast, got), got, &bufs[got], &src[got],
                          dims + (size_t)got * 2 * TS_MAX_NDIM) < 0)
            goto done;

    p.kind = end ? TS_ENTRY_END_EPOCH : TS_ENTRY_BATCH;
    p.leaves = src;
    p.n_leaves = (uint32_t)n;
    p.meta = meta.buf;
    p.meta_bytes = (uint64_t)meta.len;
    ts_err err = {0};
    ts_status st;
    ring = self->ring; /* our own reference: another thread may close the object */
    ts_ring_ref(ring);
    uint64_t seq = ts_ring_published(ring); /* only this producer publishes */
    if (ts_wait(self, ring, ts_publish_fn, &p, 0, deadline, &st, &err) < 0) goto done;
    if (st != TS_OK) ts_py_raise(ts_py_state((PyObject *)self), &err);
    else result = PyLong_FromUnsignedLongLong(seq);

done:
    if (ring != NULL) ts_ring_unref(ring);
    for (Py_ssize_t i = 0; i < got; i++) PyBuffer_Release(&bufs[i]);
    PyMem_Free(bufs);
    PyMem_Free(src);
    PyMem_Free(dims);
    Py_XDECREF(fast);
    PyBuffer_Release(&meta);
    return result;
}

/* ==========================================================================
 * Consumer
 * ========================================================================== */

/* Ring.bind(index, token): make this handle the given consumer. */
static PyObject *Ring_bind(RingObject *self, PyObject *const *args, Py_ssize_t nargs,
                           PyObject *kwnames)
{
    static const char *const names[] = {"index", "token"};
    PyObject *a[2];
    uint32_t index = 0;
    uint64_t token = 0;
    ts_err err = {0};
    if (ts_py_args("bind", args, nargs, kwnames, names, 2, 2, 2, a) < 0 ||
        ts_py_u32(a[0], &index) < 0 || ts_py_u64(a[1], &token) < 0 ||
        ts_role_check(self, 0) < 0)
        return NULL;
    return ts_done(self, ts_ring_bind_consumer(self->ring, index, token, &err), &err);
}

/* Slice of acquire: arg is the ts_acquired to fill. */
static ts_status ts_acquire_fn(ts_ring *ring, void *arg, uint64_t deadline, ts_err *err)
{
    return ts_ring_acquire(ring, deadline, arg, err);
}

/* The box argument of acquire and try_acquire (NULL: none given): None, or a list of length
 * 1 whose item is None. 0, or -1 with a TypeError. */
static int ts_box_check(PyObject *box)
{
    if (box == NULL || box == Py_None) return 0;
    if (PyList_CheckExact(box) && PyList_GET_SIZE(box) == 1 && PyList_GET_ITEM(box, 0) == Py_None)
        return 0;
    PyErr_SetString(PyExc_TypeError, "box must be a list [None] (the slot taken is put in it)");
    return -1;
}

/* The Slot for what acquire took, also put in box (a list [None]; NULL or None: none):
 * there, a KeyboardInterrupt raised as the call returns cannot lose it. NULL with an
 * exception (the lease is released). */
static PyObject *ts_slot_out(ts_state *state, ts_ring *ring, const ts_acquired *got,
                             PyObject *box)
{
    ts_lease *lease = ts_lease_new(ring, got->slot, got->seq);
    if (lease == NULL) {
        ts_ring_release(ring, got->slot, ts_ring_consumer_index(ring), ts_ring_incarnation(ring));
        return PyErr_NoMemory();
    }
    PyObject *slot = ts_py_slot_new(state, lease, got);
    if (slot != NULL && box != NULL && box != Py_None)
        PyList_SetItem(box, 0, Py_NewRef(slot)); /* drops None: it cannot fail (checked) */
    return slot;
}

/* Ring.acquire(timeout=None, box=None) -> Slot; raises TimeoutError, ProducerFinished,
 * ProducerGone or ConsumerDetached. box: see ts_slot_out. */
static PyObject *Ring_acquire(RingObject *self, PyObject *const *args, Py_ssize_t nargs,
                              PyObject *kwnames)
{
    static const char *const names[] = {"timeout", "box"};
    ts_state *state = ts_py_state((PyObject *)self);
    ts_acquired got;
    ts_err err = {0};
    ts_status st;
    uint64_t deadline;
    PyObject *a[2], *slot = NULL;
    if (ts_py_args("acquire", args, nargs, kwnames, names, 2, 2, 0, a) < 0) return NULL;
    PyObject *box = a[1];
    if (ts_role_check(self, 0) < 0 || ts_box_check(box) < 0 || ts_py_timeout(a[0], &deadline) < 0)
        return NULL;
    ts_ring *ring = self->ring; /* our own reference: another thread may close the object */
    ts_ring_ref(ring);
    if (ts_wait(self, ring, ts_acquire_fn, &got, 1, deadline, &st, &err) < 0) {
        if (st == TS_OK) /* closed meanwhile */
            ts_ring_release(ring, got.slot, ts_ring_consumer_index(ring),
                            ts_ring_incarnation(ring));
    } else if (st != TS_OK) {
        ts_py_raise(state, &err);
    } else {
        slot = ts_slot_out(state, ring, &got, box);
    }
    ts_ring_unref(ring);
    return slot;
}

/* Ring.try_acquire(box=None) -> Slot, or None when no entry is published for us yet. It
 * never waits, so it keeps the GIL: the per-batch call of a consumer that keeps up. Raises
 * as acquire() does; box: see ts_slot_out. */
static PyObject *Ring_try_acquire(RingObject *self, PyObject *const *args, Py_ssize_t nargs,
                                  PyObject *kwnames)
{
    static const char *const names[] = {"box"};
    ts_state *state = ts_py_state((PyObject *)self);
    ts_acquired got;
    ts_err err = {0};
    PyObject *box;
    if (ts_py_args("try_acquire", args, nargs, kwnames, names, 1, 1, 0, &box) < 0 ||
        ts_role_check(self, 0) < 0 || ts_box_check(box) < 0)
        return NULL;
    ts_status st = ts_ring_acquire(self->ring, TS_DEADLINE_NOW, &got, &err);
    if (st == TS_E_TIMEOUT) Py_RETURN_NONE;
    if (st != TS_OK) return ts_py_raise(state, &err);
    return ts_slot_out(state, self->ring, &got, box);
}

/* Take the next published entry into box[0], waiting up to wait_ns for it (see ts_py.h). */
int ts_py_ring_poll(ts_state *state, PyObject *ring, PyObject *box, uint64_t wait_ns,
                    uint64_t *waited_ns)
{
    ts_acquired got;
    ts_err err = {0};
    RingObject *self = (RingObject *)ring;
    *waited_ns = 0;
    if (!Py_IS_TYPE(ring, state->Ring_type) || self->ring == NULL ||
        ts_ring_is_producer(self->ring))
        return 2;
    ts_ring *r = self->ring;
    ts_status st = ts_ring_acquire(r, TS_DEADLINE_NOW, &got, &err);
    int waits = st == TS_E_TIMEOUT && wait_ns > 0 && ts_ring_held_blocking(r) == 0;
    int closed = 0;
    if (waits) {
        /* A short wait, without the GIL. Other threads run meanwhile: the Ring object and
         * the box are held here (a set-aside may replace and close the object), and the
         * core ring by its own reference, which keeps the mapping valid if the object is
         * closed (then the caller's wait says so). */
        uint64_t start = ts_now_ns();
        Py_INCREF(ring);
        Py_INCREF(box);
        ts_ring_ref(r);
        Py_BEGIN_ALLOW_THREADS
        st = ts_ring_acquire(r, start + wait_ns, &got, &err);
        Py_END_ALLOW_THREADS
        *waited_ns = ts_now_ns() - start;
        closed = self->ring != r;
        if (closed && st == TS_OK) /* closed meanwhile: nobody reads it here */
            ts_ring_release(r, got.slot, ts_ring_consumer_index(r), ts_ring_incarnation(r));
        ts_ring_unref_nogil(r);
    }
    int rc = 1;
    if (closed || (st != TS_OK && st != TS_E_TIMEOUT && st != TS_E_INTR)) {
        rc = 2;
    } else if (st != TS_OK) {
        rc = 0;
    } else {
        PyObject *slot = ts_slot_out(state, r, &got, box);
        if (slot == NULL) rc = -1;
        Py_XDECREF(slot); /* box holds it */
    }
    if (waits) {
        Py_DECREF(box);
        Py_DECREF(ring);
    }
    return rc;
}

/* Ring.set_aside(box=None, successor=None): copy the held slots privately and hand them
 * back; reads no more. Once done, successor goes into box[0] (a list [handle]) in the same
 * call: a KeyboardInterrupt raised as the call returns cannot leave the caller reading
 * through a handle set aside. */
static PyObject *Ring_set_aside(RingObject *self, PyObject *const *args, Py_ssize_t nargs,
                                PyObject *kwnames)
{
    static const char *const names[] = {"box", "successor"};
    PyObject *a[2];
    if (ts_py_args("set_aside", args, nargs, kwnames, names, 2, 2, 0, a) < 0 ||
        ts_role_check(self, 0) < 0)
        return NULL;
    PyObject *box = a[0] != NULL ? a[0] : Py_None;
    PyObject *successor = a[1] != NULL ? a[1] : Py_None;
    if (box != Py_None && !(PyList_CheckExact(box) && PyList_GET_SIZE(box) == 1 &&
                            successor != Py_None)) {
        PyErr_SetString(PyExc_TypeError,
                        "box must be a list of one item, with a successor to put in it");
        return NULL;
    }
    ts_err err = {0};
    ts_status st;
    Py_BEGIN_ALLOW_THREADS /* copies whole slots */
    st = ts_ring_set_aside(self->ring, &err);
    Py_END_ALLOW_THREADS
    if (st == TS_OK && box != Py_None)
        PyList_SetItem(box, 0, Py_NewRef(successor)); /* cannot fail: checked above */
    return ts_done(self, st, &err);
}

/* Ring.held_slots() -> slots this consumer handle holds (views of them are alive) */
static PyObject *Ring_held_slots(RingObject *self, PyObject *Py_UNUSED(ignored))
{
    if (ts_role_check(self, 0) < 0) return NULL;
    return PyLong_FromUnsignedLong(ts_ring_held_slots(self->ring));
}

/* Ring.held_blocking() -> slots this consumer handle holds, if one is the slot the producer
 * must reuse next (its kept batches block everyone), else 0 */
static PyObject *Ring_held_blocking(RingObject *self, PyObject *Py_UNUSED(ignored))
{
    if (ts_role_check(self, 0) < 0) return NULL;
    return PyLong_FromUnsignedLong(ts_ring_held_blocking(self->ring));
}

/* Ring.producer_alive() -> whether the producer's process still runs (a consumer handle
 * polls the pidfd it took at attach, ts_ring_producer_alive). */
static PyObject *Ring_producer_alive(RingObject *self, PyObject *Py_UNUSED(ignored))
{
    if (ts_ring_check(self) < 0) return NULL;
    return PyBool_FromLong(ts_ring_producer_alive(self->ring));
}

/* Ring.failure() -> str or None: why the producer failed, once the ring is finished. */
static PyObject *Ring_failure(RingObject *self, PyObject *Py_UNUSED(ignored))
{
    if (ts_ring_check(self) < 0) return NULL;
    char buf[TS_FAILURE_BYTES];
    if (!ts_ring_failure(self->ring, buf)) Py_RETURN_NONE;
    return PyUnicode_DecodeUTF8(buf, (Py_ssize_t)strlen(buf), "replace");
}

/* ==========================================================================
 * Devices
 * ========================================================================== */

/* Run a device call (import, pin) of a consumer handle without the GIL. */
static PyObject *ts_device_call(RingObject *self, int import, int ordinal)
{
    ts_state *state = ts_py_state((PyObject *)self);
    ts_device_driver *driver = ts_py_cuda(state);
    if (driver == NULL) return NULL;
    ts_ring *ring = self->ring;
    ts_ring_ref(ring);
    ts_err err = {0};
    ts_status st;
    Py_BEGIN_ALLOW_THREADS
    st = import ? ts_ring_import_device(ring, driver, ordinal, &err)
                : ts_ring_pin_host(ring, driver, ordinal, &err);
    Py_END_ALLOW_THREADS
    if (st == TS_OK && import) ordinal = ts_ring_imported_device(ring);
    ts_ring_unref(ring);
    if (st != TS_OK) return ts_py_raise(state, &err);
    if (import) return PyLong_FromLong(ordinal);
    Py_RETURN_NONE;
}

/* Ring.import_device(device=None) -> ordinal: open the ring's GPU memory
 * (consumer). None picks the visible GPU that holds the pool. */
static PyObject *Ring_import_device(RingObject *self, PyObject *const *args, Py_ssize_t nargs,
                                    PyObject *kwnames)
{
    static const char *const names[] = {"device"};
    PyObject *device;
    int ordinal = -1;
    if (ts_py_args("import_device", args, nargs, kwnames, names, 1, 1, 0, &device) < 0 ||
        ts_role_check(self, 0) < 0)
        return NULL;
    if (ts_ring_device_type(self->ring) == kDLCPU) {
        PyErr_SetString(ts_py_state((PyObject *)self)->GPUUnavailable,
                        "the producer keeps this ring in host memory (it was not created "
                        "with device='cuda:N')");
        return NULL;
    }
    if (device != Py_None && ts_py_int(device, &ordinal) < 0) return NULL;
    return ts_device_call(self, 1, ordinal);
}

/* Ring.pin_host(device=0): page-lock this process's mapping of the slot data. */
static PyObject *Ring_pin_host(RingObject *self, PyObject *const *args, Py_ssize_t nargs,
                               PyObject *kwnames)
{
    static const char *const names[] = {"device"};
    PyObject *device;
    int ordinal = 0;
    if (ts_py_args("pin_host", args, nargs, kwnames, names, 1, 1, 0, &device) < 0 ||
        ts_py_int(device, &ordinal) < 0 || ts_role_check(self, 0) < 0)
        return NULL;
    return ts_device_call(self, 0, ordinal);
}

/* ==========================================================================
 * Status
 * ========================================================================== */

#define TS_CF(field, kind) TS_PY_FIELD(ts_consumer_info, field, kind)
static const ts_py_field ts_consumer_fields[] = {
    TS_CF(index, 'u'),     TS_CF(state, 'u'),           TS_CF(reason, 'u'),
    TS_CF(pid, 'i'),       TS_CF(cursor, 'q'),          TS_CF(first_seq, 'K'),
    TS_CF(lag, 'L'),       TS_CF(delivered, 'K'),       TS_CF(delivered_bytes, 'K'),
    TS_CF(wait_ns, 'K'),   TS_CF(progress_ns, 'K'),     TS_CF(start_time, 'K'),
    TS_CF(batch_size, 'u'), TS_CF(token, 'K'),      TS_CF(incarnation, 'K'),
    TS_CF(releasing, 'u'),
};

#define TS_RF(field, kind) TS_PY_FIELD(ts_ring_info, field, kind)
static const ts_py_field ts_ring_fields[] = {
    TS_RF(name, 'S'),            TS_RF(slot_count, 'u'),         TS_RF(max_leaves, 'u'),
    TS_RF(slot_bytes, 'K'),      TS_RF(segment_bytes, 'K'),      TS_RF(producer_pid, 'i'),
    TS_RF(producer_start_time, 'K'), TS_RF(state, 'u'),         TS_RF(published, 'K'),
    TS_RF(active_mask, 'K'),     TS_RF(bytes_copied, 'K'),       TS_RF(data_address, 'K'),
    TS_RF(data_bytes, 'K'),      TS_RF(consumer, 'u'),           TS_RF(is_producer, 'i'),
    TS_RF(occupied, 'u'),        TS_RF(window, 'K'),             TS_RF(max_lag, 'K'),
    TS_RF(epoch_first_seq, 'K'), TS_RF(lag_detached, 'K'),       TS_RF(publish_wait_ns, 'K'),
    TS_RF(holes, 'K'),           TS_RF(late_releases, 'K'),      TS_RF(incarnation, 'K'),
    TS_RF(publish_cpu_ns, 'K'),  TS_RF(setup_cpu_ns, 'K'),  TS_RF(batches_delivered, 'K'),
    TS_RF(host_writable, 'i'),   TS_RF(private_slots, 'u'),      TS_RF(newest_valid, 'b'),
    TS_RF(newest_epoch, 'K'),    TS_RF(newest_index, 'K'),       TS_RF(newest_bytes, 'K'),
    TS_RF(device_type, 'i'),     TS_RF(device_ordinal, 'i'),     TS_RF(device_uuid, 's'),
    TS_RF(producer_host_pinned, 'i'), TS_RF(imported_device, 'i'), TS_RF(host_pinned, 'i'),
    TS_RF(same_pid_namespace, 'b'), TS_RF(gpu_importers, 'u'),
};

/* Consumer table entry index as a dict. */
static PyObject *ts_consumer_dict(const ts_ring *ring, uint32_t index)
{
    ts_consumer_info c;
    ts_ring_consumer_snapshot(ring, index, &c);
    return ts_py_dict(&c, ts_consumer_fields, sizeof ts_consumer_fields / sizeof *ts_consumer_fields);
}

/* Ring.consumers() -> list of dicts, one per used consumer entry. */
static PyObject *Ring_consumers(RingObject *self, PyObject *Py_UNUSED(ignored))
{
    if (ts_ring_check(self) < 0) return NULL;
    PyObject *out = PyList_New(0);
    for (uint32_t i = 0; out != NULL && i < TS_MAX_CONSUMERS; i++) {
        ts_consumer_info c;
        ts_ring_consumer_snapshot(self->ring, i, &c);
        if (c.state == TS_CONSUMER_FREE) continue;
        PyObject *d = ts_py_dict(&c, ts_consumer_fields,
                                 sizeof ts_consumer_fields / sizeof *ts_consumer_fields);
        if (d == NULL || PyList_Append(out, d) < 0) Py_CLEAR(out);
        Py_XDECREF(d);
    }
    return out;
}

/* Ring.consumer(index) -> dict of that consumer table entry. */
static PyObject *Ring_consumer(RingObject *self, PyObject *const *args, Py_ssize_t nargs,
                               PyObject *kwnames)
{
    static const char *const names[] = {"index"};
    PyObject *a[1];
    uint32_t index = 0;
    if (ts_py_args("consumer", args, nargs, kwnames, names, 1, 1, 1, a) < 0 ||
        ts_py_u32(a[0], &index) < 0 || ts_ring_check(self) < 0)
        return NULL;
    if (index >= TS_MAX_CONSUMERS)
        return PyErr_Format(PyExc_IndexError, "no consumer %u", index);
    return ts_consumer_dict(self->ring, index);
}

/* Ring.slot_readers() -> tuple of reader bitmaps, one per slot. */
static PyObject *Ring_slot_readers(RingObject *self, PyObject *Py_UNUSED(ignored))
{
    if (ts_ring_check(self) < 0) return NULL;
    uint32_t k = ts_ring_slot_count(self->ring);
    PyObject *out = PyTuple_New(k);
    for (uint32_t i = 0; out != NULL && i < k; i++) {
        PyObject *v = PyLong_FromUnsignedLongLong(ts_ring_slot_readers(self->ring, i));
        if (v == NULL) Py_CLEAR(out);
        else PyTuple_SET_ITEM(out, i, v);
    }
    return out;
}

#define TS_NF(field, kind) TS_PY_FIELD(ts_next_slot, field, kind)
static const ts_py_field ts_next_slot_fields[] = {
    TS_NF(published, 'K'), TS_NF(slot, 'u'), TS_NF(seq, 'q'), TS_NF(readers, 'K'),
};

/* Ring.next_slot() -> dict: the slot the producer fills next (ts_ring_next_slot). */
static PyObject *Ring_next_slot(RingObject *self, PyObject *Py_UNUSED(ignored))
{
    if (ts_ring_check(self) < 0) return NULL;
    ts_next_slot next;
    ts_ring_next_slot(self->ring, &next);
    return ts_py_dict(&next, ts_next_slot_fields,
                      sizeof ts_next_slot_fields / sizeof *ts_next_slot_fields);
}

/* Ring.info() -> dict of geometry, counters and this handle's state. */
static PyObject *Ring_info(RingObject *self, PyObject *Py_UNUSED(ignored))
{
    if (ts_ring_check(self) < 0) return NULL;
    ts_ring_info info;
    ts_ring_snapshot(self->ring, &info);
    return ts_py_dict(&info, ts_ring_fields, sizeof ts_ring_fields / sizeof *ts_ring_fields);
}

/* ==========================================================================
 * The type
 * ========================================================================== */

static PyMethodDef Ring_methods[] = {
    {"create", TS_PY_FASTCALL(Ring_create) | METH_CLASS, "Create a ring segment (producer)."},
    {"open", TS_PY_FASTCALL(Ring_open) | METH_CLASS,
     "Open a ring segment (consumer)."},
    {"unlink_name", TS_PY_FASTCALL(Ring_unlink_name) | METH_CLASS,
     "Remove a segment name."},
    {"close", (PyCFunction)Ring_close, METH_NOARGS, "Drop this handle."},
    {"set_aside", TS_PY_FASTCALL(Ring_set_aside),
     "set_aside(box=None, successor=None): copy the slots this handle holds privately and "
     "hand them back; it reads no more. Once done, successor is put in box[0]."},
    {"held_slots", (PyCFunction)Ring_held_slots, METH_NOARGS,
     "Slots this consumer handle holds (views of them are alive)."},
    {"producer_alive", (PyCFunction)Ring_producer_alive, METH_NOARGS,
     "Whether the producer's process still runs (by the pidfd taken at attach)."},
    {"held_blocking", (PyCFunction)Ring_held_blocking, METH_NOARGS,
     "Held slots, if one is the slot the producer must reuse next; else 0."},
    {"reserve", TS_PY_FASTCALL(Ring_reserve), "Reserve a consumer entry."},
    {"activate", TS_PY_FASTCALL(Ring_activate), "Start delivering to a consumer."},
    {"await_next_epoch", TS_PY_FASTCALL(Ring_await_next_epoch),
     "A consumer skips the rest of the producer's epoch, keeping its place."},
    {"activate_group", TS_PY_FASTCALL(Ring_activate_group),
     "Start delivering to several consumers, all from the same entry."},
    {"retire", TS_PY_FASTCALL(Ring_retire), "A live consumer left."},
    {"retire_silent", TS_PY_FASTCALL(Ring_retire_silent),
     "A live consumer fell silent: retire it, keeping the slots it holds."},
    {"evict", TS_PY_FASTCALL(Ring_evict),
     "A dead (or silent) consumer: drop its holds."},
    {"detach", TS_PY_FASTCALL(Ring_detach),
     "Take a live consumer off."},
    {"set_policy", TS_PY_FASTCALL(Ring_set_policy),
     "Set the late-joiner window and the lag limit."},
    {"publish", TS_PY_FASTCALL(Ring_publish),
     "Copy a batch into the next slot and publish it."},
    {"note_publish_cpu", TS_PY_FASTCALL(Ring_note_publish_cpu),
     "Add CPU nanoseconds the producer spent publishing (status reads the sum)."},
    {"note_setup_cpu", TS_PY_FASTCALL(Ring_note_setup_cpu),
     "Set the producer process's CPU nanoseconds before its loader began (status)."},
    {"wait_consumers", TS_PY_FASTCALL(Ring_wait_consumers),
     "Wait until n consumers are active."},
    {"wait_drained", TS_PY_FASTCALL(Ring_wait_drained),
     "Wait until the consumers read everything published."},
    {"finish", TS_PY_FASTCALL(Ring_finish),
     "Mark the ring finished (with the producer's failure, if it failed)."},
    {"note_cache", TS_PY_FASTCALL(Ring_note_cache),
     "Note the producer's decoded-sample cache in the header (status, consumers)."},
    {"locate", TS_PY_FASTCALL(Ring_locate),
     "(path, offset) of the segment file's bytes at an address of this handle, or None."},
    {"cache", (PyCFunction)Ring_cache, METH_NOARGS,
     "The producer's decoded-sample cache as noted: budget, bytes, samples, epochs, off."},
    {"failure", (PyCFunction)Ring_failure, METH_NOARGS,
     "Why the producer failed, once the ring is finished; None after a normal end."},
    {"bind", TS_PY_FASTCALL(Ring_bind), "Bind to a consumer entry."},
    {"acquire", TS_PY_FASTCALL(Ring_acquire),
     "Take the next entry (also put in box, a list [None], if given)."},
    {"try_acquire", TS_PY_FASTCALL(Ring_try_acquire),
     "Take the next entry if it is published (also put in box, a list [None], if given); "
     "None otherwise (never waits)."},
    {"consumers", (PyCFunction)Ring_consumers, METH_NOARGS, "The consumer table."},
    {"consumer", TS_PY_FASTCALL(Ring_consumer), "One consumer table entry."},
    {"slot_readers", (PyCFunction)Ring_slot_readers, METH_NOARGS, "Reader bitmaps."},
    {"next_slot", (PyCFunction)Ring_next_slot, METH_NOARGS,
     "The slot the producer fills next: published, slot, seq (the entry last there, None "
     "for a slot never used) and its readers."},
    {"info", (PyCFunction)Ring_info, METH_NOARGS, "Geometry and counters."},
    {"import_device", TS_PY_FASTCALL(Ring_import_device),
     "Open the ring's GPU memory (consumer); returns the device ordinal."},
    {"pin_host", TS_PY_FASTCALL(Ring_pin_host),
     "Page-lock this process's mapping of the host slot data."},
    {"flush_releases", TS_PY_FASTCALL(Ring_flush_releases),
     "Order the releases of dropped GPU views after the GPU work queued on their streams."},
    {"seal_pool", (PyCFunction)Ring_seal_pool, METH_NOARGS,
     "Producer of a GPU ring: stop new imports; the processes that map the pool."},
    {"wait_released", TS_PY_FASTCALL(Ring_wait_released),
     "Wait until no consumer holds any slot."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Ring_getset[] = {
    {"closed", (getter)Ring_get_closed, NULL, "True once closed.", NULL},
    {"slot_count", (getter)Ring_get_slot_count, NULL, "The ring's slots.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot Ring_slots[] = {
    {Py_tp_doc, "A process's handle on a shared-memory ring segment."},
    {Py_tp_dealloc, Ring_dealloc},
    {Py_tp_methods, Ring_methods},
    {Py_tp_getset, Ring_getset},
    {0, NULL},
};

PyType_Spec ts_py_ring_spec = {
    .name = "tensorsocket._core.Ring",
    .basicsize = sizeof(RingObject),
    .flags = TS_PY_TYPE_FLAGS,
    .slots = Ring_slots,
};
