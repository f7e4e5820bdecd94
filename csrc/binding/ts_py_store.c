/* ts_py_store.c - the Store type of tensorsocket._core (see ts_py.h): a handle on a store
 * of decoded samples (csrc/store, docs/decoded-store.md), made by Store.create(name,
 * samples, budget) or Store.open(name). A sample goes in as one block of bytes (put: the
 * pieces the Python layer encodes, copied in without the GIL, then committed) and comes
 * out as a private copy (get: a bytearray, copied out without the GIL while the entry is
 * pinned), so no view of the store outlives a call: an entry is pinned for a copy's
 * length only. Every core call that takes the store's lock runs without the GIL (the lock
 * waits TS_STORE_LOCK_SECONDS at most). A handle is its opener's: a forked child (a
 * DataLoader worker) opens its own. */
#include "binding/ts_py.h"

#include <string.h>
#include <unistd.h>

#include "store/ts_store.h"

#define TS_PY_STORE_BUSY (TS_STORE_NO_ROOM + 1) /* put's outcome when the lock was not to be had */

typedef struct StoreObject {
    PyObject_HEAD
    ts_store *st;     /* owns the handle; NULL once closed */
    long opener;      /* the process that opened it */
    int in_use;       /* calls running without the GIL (close waits for them) */
    int closing;      /* close() was called while calls ran: the last one closes */
} StoreObject;

/* ==========================================================================
 * Guards
 * ========================================================================== */

/* The handle, or NULL with ValueError (closed) or RuntimeError (another process's). */
static ts_store *ts_store_of(StoreObject *self)
{
    if (self->st == NULL || self->closing) {
        PyErr_SetString(PyExc_ValueError, "this sample store handle is closed");
        return NULL;
    }
    if (self->opener != (long)getpid()) {
        PyErr_Format(PyExc_RuntimeError,
                     "this sample store handle was opened by process %ld, which forked this "
                     "one (%ld): open the store again here", self->opener, (long)getpid());
        return NULL;
    }
    return self->st;
}

/* Close the core handle (its job leaves the store). */
static void ts_store_obj_close(StoreObject *self)
{
    ts_store *st = self->st;
    self->st = NULL;
    if (st == NULL) return;
    Py_BEGIN_ALLOW_THREADS
    ts_store_close(st);
    Py_END_ALLOW_THREADS
}

/* A call without the GIL is over: a close() asked for meanwhile happens now. */
static void ts_store_obj_done(StoreObject *self)
{
    if (--self->in_use == 0 && self->closing) ts_store_obj_close(self);
}

/* ==========================================================================
 * Making and closing
 * ========================================================================== */

/* A new Store object owning st. */
static PyObject *ts_store_obj_new(PyTypeObject *type, ts_store *st)
{
    StoreObject *self = PyObject_New(StoreObject, type);
    if (self == NULL) {
        ts_store_close(st);
        return NULL;
    }
    self->st = st;
    self->opener = (long)getpid();
    self->in_use = 0;
    self->closing = 0;
    return (PyObject *)self;
}

/* Store.create(name, samples, budget): a new store (FileExistsError if the name is taken). */
static PyObject *Store_create(PyObject *type, PyObject *const *args, Py_ssize_t nargs,
                              PyObject *kwnames)
{
    static const char *const names[] = {"name", "samples", "budget"};
    PyObject *a[3];
    const char *name;
    uint64_t samples = 0, budget = 0;
    if (ts_py_args("create", args, nargs, kwnames, names, 3, 3, 3, a) < 0 ||
        ts_py_str(a[0], 0, &name) < 0 || ts_py_u64(a[1], &samples) < 0 ||
        ts_py_u64(a[2], &budget) < 0)
        return NULL;
    ts_err err = {0};
    ts_store *st = NULL;
    ts_status s;
    Py_BEGIN_ALLOW_THREADS
    s = ts_store_create(name, samples, budget, &st, &err);
    Py_END_ALLOW_THREADS
    if (s != TS_OK) return ts_py_raise(ts_py_state(type), &err);
    return ts_store_obj_new((PyTypeObject *)type, st);
}

/* Store.open(name): the existing store (FileNotFoundError if none, VersionMismatch if it
 * is of another layout). */
static PyObject *Store_open(PyObject *type, PyObject *const *args, Py_ssize_t nargs,
                            PyObject *kwnames)
{
    static const char *const names[] = {"name"};
    PyObject *a[1];
    const char *name;
    if (ts_py_args("open", args, nargs, kwnames, names, 1, 1, 1, a) < 0 ||
        ts_py_str(a[0], 0, &name) < 0)
        return NULL;
    ts_err err = {0};
    ts_store *st = NULL;
    ts_status s;
    Py_BEGIN_ALLOW_THREADS
    s = ts_store_open(name, &st, &err);
    Py_END_ALLOW_THREADS
    if (s != TS_OK) return ts_py_raise(ts_py_state(type), &err);
    return ts_store_obj_new((PyTypeObject *)type, st);
}

/* close(): this job leaves the store (its pins and needs go); the segment stays. */
static PyObject *Store_close(StoreObject *self, PyObject *Py_UNUSED(ignored))
{
    if (self->in_use > 0) self->closing = 1; /* the last running call closes */
    else ts_store_obj_close(self);
    Py_RETURN_NONE;
}

/* Free; a handle of another process (a forked child's copy) is only unmapped. */
static void Store_dealloc(StoreObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    if (self->st != NULL) ts_store_close(self->st); /* (ts_store_close checks the owner) */
    PyObject_Free(self);
    Py_DECREF(tp);
}

/* ==========================================================================
 * Jobs
 * ========================================================================== */

/* attach() -> this process's job slot (TooManyConsumers when every slot is taken). */
static PyObject *Store_attach(StoreObject *self, PyObject *Py_UNUSED(ignored))
{
    ts_store *st = ts_store_of(self);
    if (st == NULL) return NULL;
    if (st->job != TS_STORE_NONE) return PyLong_FromUnsignedLong(st->job);
    ts_err err = {0};
    ts_status s;
    self->in_use++;
    Py_BEGIN_ALLOW_THREADS
    s = ts_store_attach(st, &err);
    Py_END_ALLOW_THREADS
    ts_store_obj_done(self);
    if (s != TS_OK) return ts_py_raise(ts_py_state((PyObject *)self), &err);
    return PyLong_FromUnsignedLong(st->job);
}

/* need(job, samples): job slot `job` needs these samples this epoch (a buffer of 64-bit
 * ints: its epoch's order). */
static PyObject *Store_need(StoreObject *self, PyObject *const *args, Py_ssize_t nargs,
                            PyObject *kwnames)
{
    static const char *const names[] = {"job", "samples"};
    PyObject *a[2];
    uint32_t job = 0;
    if (ts_py_args("need", args, nargs, kwnames, names, 2, 2, 2, a) < 0 ||
        ts_py_u32(a[0], &job) < 0)
        return NULL;
    ts_store *st = ts_store_of(self);
    if (st == NULL) return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(a[1], &view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return NULL;
    if (view.itemsize != 8 || view.format == NULL || strchr("qQlL", view.format[0]) == NULL ||
        view.format[1] != '\0') {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_TypeError, "need(): samples must be a buffer of 64-bit ints "
                        "(a numpy int64 array)");
        return NULL;
    }
    ts_err err = {0};
    ts_status s;
    self->in_use++;
    Py_BEGIN_ALLOW_THREADS
    s = ts_store_need(st, job, view.buf, (uint64_t)(view.len / 8), &err);
    Py_END_ALLOW_THREADS
    ts_store_obj_done(self);
    PyBuffer_Release(&view);
    /* (A busy lock: the needs go unrecorded; eviction then knows less, nothing is wrong.) */
    if (s != TS_OK && s != TS_E_TIMEOUT) return ts_py_raise(ts_py_state((PyObject *)self), &err);
    Py_RETURN_NONE;
}

/* visited(job, sample): job slot `job` needs the sample no more this epoch. */
static PyObject *Store_visited(StoreObject *self, PyObject *const *args, Py_ssize_t nargs,
                               PyObject *kwnames)
{
    static const char *const names[] = {"job", "sample"};
    PyObject *a[2];
    uint32_t job = 0;
    uint64_t sample = 0;
    if (ts_py_args("visited", args, nargs, kwnames, names, 2, 2, 2, a) < 0 ||
        ts_py_u32(a[0], &job) < 0 || ts_py_u64(a[1], &sample) < 0)
        return NULL;
    ts_store *st = ts_store_of(self);
    if (st == NULL) return NULL;
    ts_err err = {0};
    ts_status s;
    self->in_use++;
    Py_BEGIN_ALLOW_THREADS
    s = ts_store_visited(st, job, sample, &err);
    Py_END_ALLOW_THREADS
    ts_store_obj_done(self);
    if (s != TS_OK && s != TS_E_TIMEOUT) return ts_py_raise(ts_py_state((PyObject *)self), &err);
    Py_RETURN_NONE;
}

/* progress(epoch, position, length): where this job is, for status. */
static PyObject *Store_progress(StoreObject *self, PyObject *const *args, Py_ssize_t nargs,
                                PyObject *kwnames)
{
    static const char *const names[] = {"epoch", "position", "length"};
    PyObject *a[3];
    uint64_t epoch = 0, position = 0, length = 0;
    if (ts_py_args("progress", args, nargs, kwnames, names, 3, 3, 3, a) < 0 ||
        ts_py_u64(a[0], &epoch) < 0 || ts_py_u64(a[1], &position) < 0 ||
        ts_py_u64(a[2], &length) < 0)
        return NULL;
    ts_store *st = ts_store_of(self);
    if (st == NULL) return NULL;
    ts_store_progress(st, epoch, position, length);
    Py_RETURN_NONE;
}

/* ==========================================================================
 * Samples in and out
 * ========================================================================== */

/* The pieces of a put: (offset, buffer) pairs, each inside nbytes, as Py_buffers in
 * views (n of them); 0, or -1 with an exception (no buffer held then). */
static int ts_pieces_get(PyObject *pieces, uint64_t nbytes, Py_buffer *views,
                         Py_ssize_t n, uint64_t *offsets)
{
    Py_ssize_t got = 0;
    for (; got < n; got++) {
        PyObject *pair = PySequence_Fast_GET_ITEM(pieces, got);
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
            PyErr_SetString(PyExc_TypeError, "put(): each piece is an (offset, buffer) tuple");
            goto error;
        }
        if (ts_py_u64(PyTuple_GET_ITEM(pair, 0), &offsets[got]) < 0) goto error;
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(pair, 1), &views[got], PyBUF_C_CONTIGUOUS) < 0)
            goto error;
        if (offsets[got] > nbytes || (uint64_t)views[got].len > nbytes - offsets[got]) {
            PyErr_Format(PyExc_ValueError, "put(): a piece of %zd bytes at offset %llu "
                         "overruns the sample's %llu bytes", views[got].len,
                         (unsigned long long)offsets[got], (unsigned long long)nbytes);
            got++;
            goto error;
        }
    }
    return 0;

error:
    while (got-- > 0) PyBuffer_Release(&views[got]);
    return -1;
}

/* put(sample, nbytes, pieces) -> outcome: the sample's nbytes made of pieces ((offset,
 * buffer) pairs) stored, if the store has room for them: STORE_STORED (copied in and
 * committed: visible to every job), STORE_PRESENT (another process stored it first),
 * STORE_RACED (another process stores it now), STORE_NO_ROOM (the budget is taken by
 * pinned samples, or the store was dropped), STORE_BUSY (its lock is held by a stopped
 * process: nothing stored). Bytes between pieces are zeros. */
static PyObject *Store_put(StoreObject *self, PyObject *const *args, Py_ssize_t nargs,
                           PyObject *kwnames)
{
    static const char *const names[] = {"sample", "nbytes", "pieces"};
    PyObject *a[3];
    uint64_t sample = 0, nbytes = 0;
    if (ts_py_args("put", args, nargs, kwnames, names, 3, 3, 3, a) < 0 ||
        ts_py_u64(a[0], &sample) < 0 || ts_py_u64(a[1], &nbytes) < 0)
        return NULL;
    ts_store *st = ts_store_of(self);
    if (st == NULL) return NULL;
    PyObject *pieces = PySequence_Fast(a[2], "put(): pieces must be a sequence");
    if (pieces == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(pieces);
    Py_buffer *views = PyMem_Calloc((size_t)n + 1, sizeof *views);
    uint64_t *offsets = PyMem_Calloc((size_t)n + 1, sizeof *offsets);
    PyObject *result = NULL;
    if (views == NULL || offsets == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (ts_pieces_get(pieces, nbytes, views, n, offsets) < 0) goto done;
    ts_err err = {0};
    ts_status s;
    ts_store_outcome outcome = TS_STORE_NO_ROOM;
    uint32_t entry = 0;
    void *data = NULL;
    self->in_use++;
    Py_BEGIN_ALLOW_THREADS
    s = ts_store_reserve(st, sample, nbytes, &outcome, &entry, &data, &err);
    if (s == TS_OK && outcome == TS_STORE_RESERVED) {
        memset(data, 0, (size_t)nbytes); /* (a reused block: no old bytes between pieces) */
        for (Py_ssize_t i = 0; i < n; i++)
            memcpy((char *)data + offsets[i], views[i].buf, (size_t)views[i].len);
        s = ts_store_commit(st, entry, &err);
        if (s != TS_OK) ts_store_abort(st, entry, NULL);
    }
    Py_END_ALLOW_THREADS
    ts_store_obj_done(self);
    for (Py_ssize_t i = 0; i < n; i++) PyBuffer_Release(&views[i]);
    if (s == TS_E_TIMEOUT) {
        result = PyLong_FromLong(TS_PY_STORE_BUSY);
        goto done;
    }
    if (s != TS_OK) {
        ts_py_raise(ts_py_state((PyObject *)self), &err);
        goto done;
    }
    result = PyLong_FromLong(outcome == TS_STORE_RESERVED ? 0 : (long)outcome);
done:
    PyMem_Free(views);
    PyMem_Free(offsets);
    Py_DECREF(pieces);
    return result;
}

/* get(sample, *, counted=True) -> a bytearray copy of the sample's bytes, or None when
 * the store does not hold it (or was dropped, or its lock is held by a stopped process).
 * counted=False: the look is no hit nor miss (a check's). */
static PyObject *Store_get(StoreObject *self, PyObject *const *args, Py_ssize_t nargs,
                           PyObject *kwnames)
{
    static const char *const names[] = {"sample", "counted"};
    PyObject *a[2];
    uint64_t sample = 0;
    int counted = 1;
    if (ts_py_args("get", args, nargs, kwnames, names, 2, 1, 1, a) < 0 ||
        ts_py_u64(a[0], &sample) < 0 || (a[1] != NULL && ts_py_flag(a[1], &counted) < 0))
        return NULL;
    ts_store *st = ts_store_of(self);
    if (st == NULL) return NULL;
    if (st->job == TS_STORE_NONE) {
        PyErr_SetString(PyExc_ValueError, "get(): attach() to the sample store first");
        return NULL;
    }
    ts_err err = {0};
    ts_status s;
    uint32_t entry = 0;
    const void *data = NULL;
    uint64_t bytes = 0;
    self->in_use++;
    Py_BEGIN_ALLOW_THREADS
    s = ts_store_get(st, sample, counted, &entry, &data, &bytes, &err);
    Py_END_ALLOW_THREADS
    if (s != TS_OK) {
        ts_store_obj_done(self);
        if (s == TS_E_NOT_FOUND || s == TS_E_TIMEOUT) Py_RETURN_NONE; /* (busy: a miss) */
        return ts_py_raise(ts_py_state((PyObject *)self), &err);
    }
    PyObject *copy = PyByteArray_FromStringAndSize(NULL, (Py_ssize_t)bytes);
    if (copy != NULL) {
        char *to = PyByteArray_AS_STRING(copy);
        Py_BEGIN_ALLOW_THREADS
        memcpy(to, data, (size_t)bytes);
        Py_END_ALLOW_THREADS
    }
    ts_store_unpin(st, entry);
    ts_store_obj_done(self);
    return copy;
}

/* ==========================================================================
 * The store's state
 * ========================================================================== */

/* drop(reason): every job stops using the store (a prefix found not deterministic). */
static PyObject *Store_drop(StoreObject *self, PyObject *const *args, Py_ssize_t nargs,
                            PyObject *kwnames)
{
    static const char *const names[] = {"reason"};
    PyObject *a[1];
    const char *reason;
    if (ts_py_args("drop", args, nargs, kwnames, names, 1, 1, 1, a) < 0 ||
        ts_py_str(a[0], 0, &reason) < 0)
        return NULL;
    ts_store *st = ts_store_of(self);
    if (st == NULL) return NULL;
    ts_err err = {0};
    ts_status s;
    self->in_use++;
    Py_BEGIN_ALLOW_THREADS
    s = ts_store_drop(st, reason, &err);
    Py_END_ALLOW_THREADS
    ts_store_obj_done(self);
    if (s != TS_OK) return ts_py_raise(ts_py_state((PyObject *)self), &err);
    Py_RETURN_NONE;
}

/* Store.dropped: why the store was dropped, or None. */
static PyObject *Store_get_dropped(StoreObject *self, void *Py_UNUSED(closure))
{
    ts_store *st = ts_store_of(self);
    if (st == NULL) return NULL;
    char reason[TS_STORE_REASON_BYTES];
    if (!ts_store_dropped(st, reason, sizeof reason)) Py_RETURN_NONE;
    return PyUnicode_DecodeUTF8(reason, (Py_ssize_t)strlen(reason), "replace");
}

/* reap() -> (writers, jobs): free the entries of writers that died mid-insert and the
 * pins and needs of jobs that died. */
static PyObject *Store_reap(StoreObject *self, PyObject *Py_UNUSED(ignored))
{
    ts_store *st = ts_store_of(self);
    if (st == NULL) return NULL;
    ts_err err = {0};
    ts_status s;
    uint32_t writers = 0, jobs = 0;
    self->in_use++;
    Py_BEGIN_ALLOW_THREADS
    s = ts_store_reap(st, &writers, &jobs, &err);
    Py_END_ALLOW_THREADS
    ts_store_obj_done(self);
    if (s != TS_OK) return ts_py_raise(ts_py_state((PyObject *)self), &err);
    return Py_BuildValue("(II)", writers, jobs);
}

/* info() -> the store's figures: layout, occupancy and counters (read without the lock:
 * each figure is current, together they may be a moment apart). */
static PyObject *Store_info(StoreObject *self, PyObject *Py_UNUSED(ignored))
{
    ts_store *st = ts_store_of(self);
    if (st == NULL) return NULL;
    const ts_store_header *h = st->hdr;
    return Py_BuildValue(
        "{sKsKsKsIsKsIsKsKsKsKsKsKsKsKsN}",
        "samples", (unsigned long long)h->layout.samples,
        "budget", (unsigned long long)h->layout.arena_bytes,
        "segment_bytes", (unsigned long long)h->layout.segment_bytes,
        "capacity", h->layout.entries,
        "used_bytes", (unsigned long long)h->used_bytes,
        "stored", h->used_entries,
        "hits", (unsigned long long)atomic_load(&h->hits),
        "misses", (unsigned long long)atomic_load(&h->misses),
        "commits", (unsigned long long)atomic_load(&h->commits),
        "evictions", (unsigned long long)atomic_load(&h->evictions),
        "races", (unsigned long long)atomic_load(&h->races),
        "no_room", (unsigned long long)atomic_load(&h->no_room),
        "repairs", (unsigned long long)atomic_load(&h->repairs),
        "busy", (unsigned long long)atomic_load(&h->busy),
        "dropped", PyBool_FromLong(atomic_load(&h->dropped) != 0));
}

/* jobs() -> [(slot, pid, epoch, position, length)] of the attached jobs (and their
 * workers: a process each). */
static PyObject *Store_jobs(StoreObject *self, PyObject *Py_UNUSED(ignored))
{
    ts_store *st = ts_store_of(self);
    if (st == NULL) return NULL;
    PyObject *out = PyList_New(0);
    for (uint32_t j = 0; out != NULL && j < TS_STORE_MAX_JOBS; j++) {
        ts_store_job *job = &st->hdr->jobs[j];
        int pid = job->pid;
        if (pid == 0) continue;
        PyObject *row = Py_BuildValue("(IiKKK)", j, pid,
                                      (unsigned long long)atomic_load(&job->epoch),
                                      (unsigned long long)atomic_load(&job->position),
                                      (unsigned long long)atomic_load(&job->length));
        if (row == NULL || PyList_Append(out, row) < 0) Py_CLEAR(out);
        Py_XDECREF(row);
    }
    return out;
}

/* Store.job: this process's job slot, or None before attach(). */
static PyObject *Store_get_job(StoreObject *self, void *Py_UNUSED(closure))
{
    ts_store *st = ts_store_of(self);
    if (st == NULL) return NULL;
    if (st->job == TS_STORE_NONE) Py_RETURN_NONE;
    return PyLong_FromUnsignedLong(st->job);
}

/* Store.name: the segment's name. */
static PyObject *Store_get_name(StoreObject *self, void *Py_UNUSED(closure))
{
    ts_store *st = ts_store_of(self);
    if (st == NULL) return NULL;
    return PyUnicode_FromString(st->name);
}

/* Store.closed: whether close() was called. */
static PyObject *Store_get_closed(StoreObject *self, void *Py_UNUSED(closure))
{
    return PyBool_FromLong(self->st == NULL || self->closing);
}

static PyMethodDef Store_methods[] = {
    {"create", TS_PY_FASTCALL(Store_create) | METH_CLASS,
     "Create a store (name, samples, budget)."},
    {"open", TS_PY_FASTCALL(Store_open) | METH_CLASS, "Open an existing store (name)."},
    {"attach", (PyCFunction)Store_attach, METH_NOARGS, "Take a job slot; returns it."},
    {"close", (PyCFunction)Store_close, METH_NOARGS, "Leave the store (the segment stays)."},
    {"need", TS_PY_FASTCALL(Store_need), "A job's epoch needs these samples (job, samples)."},
    {"visited", TS_PY_FASTCALL(Store_visited), "A job visited a sample (job, sample)."},
    {"progress", TS_PY_FASTCALL(Store_progress),
     "Where this job is (epoch, position, length)."},
    {"put", TS_PY_FASTCALL(Store_put), "Store a sample (sample, nbytes, pieces)."},
    {"get", TS_PY_FASTCALL(Store_get), "A copy of a stored sample's bytes, or None."},
    {"drop", TS_PY_FASTCALL(Store_drop), "Stop every job using the store (reason)."},
    {"reap", (PyCFunction)Store_reap, METH_NOARGS, "Free what dead processes left."},
    {"info", (PyCFunction)Store_info, METH_NOARGS, "The store's figures."},
    {"jobs", (PyCFunction)Store_jobs, METH_NOARGS, "The attached jobs and where they are."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Store_getset[] = {
    {"job", (getter)Store_get_job, NULL, "This process's job slot, or None.", NULL},
    {"name", (getter)Store_get_name, NULL, "The segment's name.", NULL},
    {"dropped", (getter)Store_get_dropped, NULL, "Why the store was dropped, or None.", NULL},
    {"closed", (getter)Store_get_closed, NULL, "Whether close() was called.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot Store_slots[] = {
    {Py_tp_doc, "A handle on a store of decoded samples in shared memory."},
    {Py_tp_dealloc, Store_dealloc},
    {Py_tp_methods, Store_methods},
    {Py_tp_getset, Store_getset},
    {0, NULL},
};

static PyType_Spec ts_py_store_spec = {
    .name = "tensorsocket._core.Store",
    .basicsize = sizeof(StoreObject),
    .flags = TS_PY_TYPE_FLAGS,
    .slots = Store_slots,
};

int ts_py_store_add(PyObject *module, ts_state *state)
{
    state->Store_type = (PyTypeObject *)PyType_FromModuleAndSpec(module, &ts_py_store_spec, NULL);
    if (state->Store_type == NULL || PyModule_AddType(module, state->Store_type) < 0 ||
        PyModule_AddIntConstant(module, "STORE_STORED", TS_STORE_RESERVED) < 0 ||
        PyModule_AddIntConstant(module, "STORE_PRESENT", TS_STORE_PRESENT) < 0 ||
        PyModule_AddIntConstant(module, "STORE_RACED", TS_STORE_RACED) < 0 ||
        PyModule_AddIntConstant(module, "STORE_NO_ROOM", TS_STORE_NO_ROOM) < 0 ||
        PyModule_AddIntConstant(module, "STORE_BUSY", TS_PY_STORE_BUSY) < 0 ||
        PyModule_AddIntConstant(module, "STORE_MAX_JOBS", TS_STORE_MAX_JOBS) < 0)
        return -1;
    return 0;
}
