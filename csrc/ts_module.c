/* ts_module.c - tensorsocket._core: the CPython binding of the ring.
 *
 * The only file of the core that includes Python.h. Types (all heap types,
 * created per module with multi-phase init):
 *   Ring      a process's handle on a ring segment (producer or consumer)
 *   Slot      a consumer's lease on one published slot
 *   SlotView  one tensor of a slot, exported with __dlpack__
 * Every blocking call releases the GIL, sleeps at most one slice at a time,
 * and checks for signals (Ctrl-C) between slices.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <unistd.h>

#include "ts_clock.h"
#include "ts_copy.h"
#include "ts_cuda.h"
#include "ts_export.h"
#include "ts_gpu.h"
#include "ts_proc.h"
#include "ts_ring.h"

/* How long a blocking call may sleep before it checks for signals. */
#define TS_SIGNAL_SLICE_NS 100000000ULL

/* ==========================================================================
 * Module state
 * ========================================================================== */

typedef struct {
    PyTypeObject *Ring_type;
    PyTypeObject *Slot_type;
    PyTypeObject *SlotView_type;
    PyObject *TensorSocketError;
    PyObject *ProducerGone;
    PyObject *ProducerFinished;
    PyObject *ConsumerDetached;
    PyObject *BatchTooLarge;
    PyObject *SharedMemoryTooSmall;
    PyObject *TooManyConsumers;
    PyObject *VersionMismatch;
    PyObject *GPUUnavailable;
    PyObject *CudaError;
    ts_cuda_api *cuda;   /* owns one reference once loaded, else NULL */
    long cuda_pid;       /* the process that loaded it (a forked child cannot use it) */
    int cuda_tried;      /* loading was attempted (cuda_why says why it failed) */
    char cuda_why[512];
} ts_state;

static struct PyModuleDef ts_module_def;

/* Module state of one of our objects (our types are not subclassable). */
static ts_state *ts_get_state(PyObject *self)
{
    return PyType_GetModuleState(Py_TYPE(self));
}

/* The one error funnel: turn a core error into the matching exception. */
static PyObject *ts_raise(ts_state *state, const ts_err *err)
{
    PyObject *type;
    switch (err->code) {
    case TS_E_SYS: {
        /* OSError(errno, msg) picks the subclass (PermissionError, ...) from errno. */
        PyObject *args = Py_BuildValue("(is)", err->sys_errno, err->msg);
        if (args != NULL) PyErr_SetObject(PyExc_OSError, args);
        Py_XDECREF(args);
        return NULL;
    }
    case TS_E_INVALID: type = PyExc_ValueError; break;
    case TS_E_TOO_BIG: type = state->BatchTooLarge; break;
    case TS_E_NOSPACE: type = state->SharedMemoryTooSmall; break;
    case TS_E_TIMEOUT: type = PyExc_TimeoutError; break;
    case TS_E_FINISHED: type = state->ProducerFinished; break;
    case TS_E_PRODUCER_GONE: type = state->ProducerGone; break;
    case TS_E_DETACHED: type = state->ConsumerDetached; break;
    case TS_E_FULL: type = state->TooManyConsumers; break;
    case TS_E_VERSION: type = state->VersionMismatch; break;
    case TS_E_EXISTS: type = PyExc_FileExistsError; break;
    case TS_E_NOT_FOUND: type = PyExc_FileNotFoundError; break;
    case TS_E_INTR: type = PyExc_InterruptedError; break;
    case TS_E_GPU_UNAVAILABLE: type = state->GPUUnavailable; break;
    case TS_E_CUDA: type = state->CudaError; break;
    default: type = state->TensorSocketError; break;
    }
    PyErr_SetString(type, err->msg);
    return NULL;
}

/* 1 (and why, in buf) if the driver was loaded by the process that forked this one. */
static int ts_cuda_forked(const ts_state *state, char *buf, size_t n)
{
    if (state->cuda == NULL || state->cuda_pid == (long)getpid()) return 0;
    snprintf(buf, n,
             "the CUDA driver was initialised in process %ld, which forked this one (pid %ld), "
             "and a forked process cannot use it: create GPU rings and GPU consumers only in "
             "processes started before anything initialised CUDA (or with the spawn start "
             "method)",
             state->cuda_pid, (long)getpid());
    return 1;
}

/* The CUDA driver, loaded on first use; NULL with GPUUnavailable set if it
 * cannot be loaded (the reason is kept, and loading is not retried). */
static ts_cuda_api *ts_state_cuda(ts_state *state)
{
    char why[sizeof state->cuda_why];
    if (ts_cuda_forked(state, why, sizeof why)) {
        PyErr_SetString(state->GPUUnavailable, why);
        return NULL;
    }
    if (state->cuda != NULL) return state->cuda;
    if (!state->cuda_tried) {
        ts_cuda_api *api = NULL;
        ts_err err = {0};
        ts_status st;
        Py_BEGIN_ALLOW_THREADS
        st = ts_cuda_load(&api, &err);
        Py_END_ALLOW_THREADS
        if (state->cuda != NULL) { /* another thread loaded it meanwhile */
            ts_cuda_unref(api);
            return state->cuda;
        }
        state->cuda_tried = 1;
        if (st == TS_OK) {
            state->cuda = api;
            state->cuda_pid = (long)getpid();
        }
        else snprintf(state->cuda_why, sizeof state->cuda_why, "%s", err.msg);
    }
    if (state->cuda == NULL) PyErr_SetString(state->GPUUnavailable, state->cuda_why);
    return state->cuda;
}

/* Parse a timeout in seconds (None: forever) into an absolute deadline. */
static int ts_parse_timeout(PyObject *obj, uint64_t *deadline)
{
    if (obj == NULL || obj == Py_None) {
        *deadline = TS_NO_DEADLINE;
        return 0;
    }
    double t = PyFloat_AsDouble(obj);
    if (t == -1.0 && PyErr_Occurred()) return -1;
    if (t < 0) t = 0;
    *deadline = ts_deadline_after(t);
    return 0;
}

/* Deadline of the next slice: the overall deadline or one slice from now. */
static uint64_t ts_slice(uint64_t deadline)
{
    uint64_t s = ts_now_ns() + TS_SIGNAL_SLICE_NS;
    return s < deadline ? s : deadline;
}

/* After a slice ended: 1 to sleep again, 0 to report st, -1 on a Python
 * exception (Ctrl-C). */
static int ts_slice_again(ts_status st, uint64_t deadline)
{
    if (st != TS_E_INTR && st != TS_E_TIMEOUT) return 0;
    if (PyErr_CheckSignals() < 0) return -1;
    if (st == TS_E_TIMEOUT && ts_now_ns() >= deadline) return 0;
    return 1;
}

/* After a wait with the GIL released: -1 with an exception set if another
 * thread closed the Ring object meanwhile (our own reference kept the mapping
 * valid), else 0. */
static int ts_check_not_closed(PyObject *self, void *ring_now, void *ring_before)
{
    if (ring_now == ring_before) return 0;
    PyErr_SetString(ts_get_state(self)->TensorSocketError,
                    "the ring was closed by another thread while this call waited");
    return -1;
}

/* ==========================================================================
 * SlotView: one tensor of a leased slot
 * ========================================================================== */

typedef struct {
    PyObject_HEAD
    ts_lease *lease; /* owns one lease reference */
    uint32_t leaf;
    int device; /* exports the slot's device copy (CUDA rings) */
} SlotViewObject;

/* Capsule destructor for legacy "dltensor" capsules never consumed. */
static void ts_capsule_destructor_legacy(PyObject *capsule)
{
    if (PyCapsule_IsValid(capsule, "used_dltensor")) return;
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    void *m = PyCapsule_GetPointer(capsule, "dltensor");
    if (m != NULL) ts_export_delete(m, 0);
    else PyErr_WriteUnraisable(capsule);
    PyErr_Restore(type, value, tb);
}

/* Capsule destructor for "dltensor_versioned" capsules never consumed. */
static void ts_capsule_destructor_versioned(PyObject *capsule)
{
    if (PyCapsule_IsValid(capsule, "used_dltensor_versioned")) return;
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    void *m = PyCapsule_GetPointer(capsule, "dltensor_versioned");
    if (m != NULL) ts_export_delete(m, 1);
    else PyErr_WriteUnraisable(capsule);
    PyErr_Restore(type, value, tb);
}

/* Wrap leaf i of lease in a new DLPack capsule. */
static PyObject *ts_make_capsule(ts_state *state, ts_lease *lease, uint32_t i,
                                 const ts_export_opts *opts)
{
    ts_err err = {0};
    int versioned = opts->versioned;
    void *m = ts_export_leaf(lease, i, opts, &err);
    if (m == NULL) return ts_raise(state, &err);
    PyObject *cap = versioned
                        ? PyCapsule_New(m, "dltensor_versioned", ts_capsule_destructor_versioned)
                        : PyCapsule_New(m, "dltensor", ts_capsule_destructor_legacy);
    if (cap == NULL) ts_export_delete(m, versioned);
    return cap;
}

/* Parse a DLPack stream argument. Host tensors take None or -1. Device
 * tensors: None is the legacy default stream (1), 2 the per-thread default
 * stream, a larger int a CUstream, -1 "do not synchronize"; 0 is invalid. */
static int ts_parse_stream(PyObject *stream, int device, int64_t *out)
{
    long long v = device ? 1 : -1;
    if (stream != Py_None) {
        if (!PyLong_Check(stream)) {
            PyErr_SetString(PyExc_TypeError, "stream must be None or an int");
            return -1;
        }
        v = PyLong_AsLongLong(stream);
        if (v == -1 && PyErr_Occurred()) return -1;
    }
    if (!device && v != -1) {
        PyErr_SetString(PyExc_BufferError, "tensorsocket host tensors take stream=None (or -1)");
        return -1;
    }
    if (device && (v == 0 || v < -1)) {
        PyErr_Format(PyExc_BufferError,
                     "stream=%lld is not a DLPack CUDA stream (1: legacy default, 2: "
                     "per-thread default, a cudaStream_t, or -1)",
                     v);
        return -1;
    }
    *out = v;
    return 0;
}

/* SlotView.__dlpack__(*, stream=None, max_version=None, dl_device=None, copy=None) */
static PyObject *SlotView_dlpack(SlotViewObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"stream", "max_version", "dl_device", "copy", NULL};
    PyObject *stream = Py_None, *max_version = Py_None, *dl_device = Py_None, *copy = Py_None;
    ts_state *state = ts_get_state((PyObject *)self);
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|$OOOO:__dlpack__", kwlist, &stream,
                                     &max_version, &dl_device, &copy))
        return NULL;
    ts_export_opts opts = {.device = self->device, .stream = 1};
    if (ts_parse_stream(stream, self->device, &opts.stream) < 0) return NULL;
    if (dl_device != Py_None) {
        int dev_type = 0, dev_id = 0;
        if (!PyArg_ParseTuple(dl_device, "ii:dl_device", &dev_type, &dev_id)) return NULL;
        int here_type = self->device ? kDLCUDA : kDLCPU;
        int here_id = self->device ? ts_gpu_imported_device(self->lease->ring) : 0;
        if (dev_type != here_type || dev_id != here_id) {
            PyErr_Format(PyExc_BufferError,
                         "tensorsocket cannot export a tensor on device (%d, %d) to device "
                         "(%d, %d); move it after import (e.g. .to() in torch)",
                         here_type, here_id, dev_type, dev_id);
            return NULL;
        }
    }
    int do_copy = 0;
    if (copy != Py_None) {
        do_copy = PyObject_IsTrue(copy);
        if (do_copy < 0) return NULL;
    }
    int versioned = 0;
    uint32_t minor = 0;
    if (max_version != Py_None) {
        int major = 0, mv = 0;
        if (!PyArg_ParseTuple(max_version, "ii:max_version", &major, &mv)) return NULL;
        if (major >= 1) {
            versioned = 1;
            minor = (major > 1 || mv > TS_DLPACK_MINOR) ? TS_DLPACK_MINOR : (uint32_t)mv;
        }
    }
    opts.versioned = versioned;
    opts.minor = minor;
    opts.copy = do_copy;
    return ts_make_capsule(state, self->lease, self->leaf, &opts);
}

/* SlotView.__dlpack_device__() -> (device_type, device_id) */
static PyObject *SlotView_dlpack_device(SlotViewObject *self, PyObject *Py_UNUSED(ignored))
{
    if (self->device)
        return Py_BuildValue("(ii)", (int)kDLCUDA, ts_gpu_imported_device(self->lease->ring));
    return Py_BuildValue("(ii)", (int)kDLCPU, 0);
}

/* SlotView.shape */
static PyObject *SlotView_get_shape(SlotViewObject *self, void *Py_UNUSED(closure))
{
    const ts_leaf *leaf = ts_lease_leaf(self->lease, self->leaf);
    PyObject *shape = PyTuple_New(leaf->ndim);
    if (shape == NULL) return NULL;
    for (int32_t d = 0; d < leaf->ndim; d++) {
        PyObject *v = PyLong_FromLongLong(leaf->shape[d]);
        if (v == NULL) {
            Py_DECREF(shape);
            return NULL;
        }
        PyTuple_SET_ITEM(shape, d, v);
    }
    return shape;
}

/* SlotView.dtype -> (code, bits, lanes) */
static PyObject *SlotView_get_dtype(SlotViewObject *self, void *Py_UNUSED(closure))
{
    const ts_leaf *leaf = ts_lease_leaf(self->lease, self->leaf);
    return Py_BuildValue("(iii)", leaf->dtype.code, leaf->dtype.bits, leaf->dtype.lanes);
}

/* SlotView.nbytes */
static PyObject *SlotView_get_nbytes(SlotViewObject *self, void *Py_UNUSED(closure))
{
    return PyLong_FromUnsignedLongLong(ts_lease_leaf(self->lease, self->leaf)->nbytes);
}

/* SlotView.data_ptr: address of the first element in this process. */
static PyObject *SlotView_get_data_ptr(SlotViewObject *self, void *Py_UNUSED(closure))
{
    const ts_leaf *leaf = ts_lease_leaf(self->lease, self->leaf);
    if (self->device)
        return PyLong_FromUnsignedLongLong(
            ts_gpu_slot_ptr(self->lease->ring, self->lease->slot) + leaf->offset);
    uint8_t *base = ts_ring_slot_data(self->lease->ring, self->lease->slot);
    return PyLong_FromVoidPtr(base + leaf->offset);
}

/* Drop the lease reference. */
static void SlotView_dealloc(SlotViewObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    if (self->lease != NULL) ts_lease_unref(self->lease);
    tp->tp_free(self);
    Py_DECREF(tp);
}

static PyMethodDef SlotView_methods[] = {
    {"__dlpack__", (PyCFunction)(void (*)(void))SlotView_dlpack, METH_VARARGS | METH_KEYWORDS,
     "Export this tensor as a DLPack capsule (zero-copy, read-only)."},
    {"__dlpack_device__", (PyCFunction)SlotView_dlpack_device, METH_NOARGS,
     "The (device_type, device_id) of this tensor."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef SlotView_getset[] = {
    {"shape", (getter)SlotView_get_shape, NULL, "Shape of the tensor.", NULL},
    {"dtype", (getter)SlotView_get_dtype, NULL, "DLPack (code, bits, lanes).", NULL},
    {"nbytes", (getter)SlotView_get_nbytes, NULL, "Bytes of data.", NULL},
    {"data_ptr", (getter)SlotView_get_data_ptr, NULL,
     "Address of the data in this process (a device address for device views).", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot SlotView_slots[] = {
    {Py_tp_doc, "One tensor of a ring slot; implements the DLPack protocol."},
    {Py_tp_dealloc, SlotView_dealloc},
    {Py_tp_methods, SlotView_methods},
    {Py_tp_getset, SlotView_getset},
    {0, NULL},
};

static PyType_Spec SlotView_spec = {
    .name = "tensorsocket._core.SlotView",
    .basicsize = sizeof(SlotViewObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = SlotView_slots,
};

/* ==========================================================================
 * Slot: a consumer's lease on one published entry
 * ========================================================================== */

typedef struct {
    PyObject_HEAD
    ts_lease *lease; /* owns one lease reference until release() */
    uint32_t kind;
    uint32_t n_leaves;
    uint64_t seq;
    uint64_t epoch;
    uint64_t index;
    uint64_t nbytes; /* bytes of the entry in its slot */
    PyObject *meta; /* owns: bytes of the structure blob */
} SlotObject;

/* Raise if the slot was released. */
static int ts_slot_check(SlotObject *self)
{
    if (self->lease != NULL) return 0;
    PyErr_SetString(PyExc_ValueError, "this slot was released");
    return -1;
}

/* Raise unless this consumer imported the ring's GPU memory. */
static int ts_device_check(SlotObject *self, int device)
{
    if (!device || ts_gpu_imported_device(self->lease->ring) >= 0) return 0;
    PyErr_SetString(PyExc_ValueError,
                    "device views need the ring's GPU memory: call Ring.import_device() first");
    return -1;
}

/* Slot.views(device=False) -> tuple of SlotView, one per tensor. */
static PyObject *Slot_views(SlotObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"device", NULL};
    int device = 0;
    ts_state *state = ts_get_state((PyObject *)self);
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|p:views", kwlist, &device)) return NULL;
    if (ts_slot_check(self) < 0 || ts_device_check(self, device) < 0) return NULL;
    PyObject *out = PyTuple_New(self->n_leaves);
    if (out == NULL) return NULL;
    for (uint32_t i = 0; i < self->n_leaves; i++) {
        SlotViewObject *v = PyObject_New(SlotViewObject, state->SlotView_type);
        if (v == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        ts_lease_ref(self->lease);
        v->lease = self->lease;
        v->leaf = i;
        v->device = device;
        PyTuple_SET_ITEM(out, i, (PyObject *)v);
    }
    return out;
}

/* Slot.capsules(versioned=False, copy=False, device=False, stream=None)
 * -> tuple of DLPack capsules. */
static PyObject *Slot_capsules(SlotObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"versioned", "copy", "device", "stream", NULL};
    int versioned = 0, copy = 0, device = 0;
    PyObject *stream = Py_None;
    ts_state *state = ts_get_state((PyObject *)self);
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|pppO:capsules", kwlist, &versioned, &copy,
                                     &device, &stream))
        return NULL;
    if (ts_slot_check(self) < 0 || ts_device_check(self, device) < 0) return NULL;
    ts_export_opts opts = {.versioned = versioned, .minor = TS_DLPACK_MINOR, .copy = copy,
                           .device = device};
    if (ts_parse_stream(stream, device, &opts.stream) < 0) return NULL;
    PyObject *out = PyTuple_New(self->n_leaves);
    if (out == NULL) return NULL;
    for (uint32_t i = 0; i < self->n_leaves; i++) {
        PyObject *cap = ts_make_capsule(state, self->lease, i, &opts);
        if (cap == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyTuple_SET_ITEM(out, i, cap);
    }
    return out;
}

/* Slot.release(): drop this object's hold; views and tensors keep theirs. */
static PyObject *Slot_release(SlotObject *self, PyObject *Py_UNUSED(ignored))
{
    ts_lease *lease = self->lease;
    self->lease = NULL;
    if (lease != NULL) ts_lease_unref(lease);
    Py_RETURN_NONE;
}

/* Slot.__enter__ */
static PyObject *Slot_enter(SlotObject *self, PyObject *Py_UNUSED(ignored))
{
    return Py_NewRef(self);
}

/* Slot.__exit__ releases. */
static PyObject *Slot_exit(SlotObject *self, PyObject *Py_UNUSED(args))
{
    return Slot_release(self, NULL);
}

/* Release and free. */
static void Slot_dealloc(SlotObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    if (self->lease != NULL) ts_lease_unref(self->lease);
    Py_XDECREF(self->meta);
    tp->tp_free(self);
    Py_DECREF(tp);
}

/* Slot.is_end_of_epoch */
static PyObject *Slot_get_end(SlotObject *self, void *Py_UNUSED(closure))
{
    return PyBool_FromLong(self->kind == TS_ENTRY_END_EPOCH);
}

/* Slot.meta */
static PyObject *Slot_get_meta(SlotObject *self, void *Py_UNUSED(closure))
{
    return Py_NewRef(self->meta);
}

/* Slot.seq, .epoch, .index, .n_leaves, .slot */
static PyObject *Slot_get_u64(SlotObject *self, void *closure)
{
    switch ((intptr_t)closure) {
    case 0: return PyLong_FromUnsignedLongLong(self->seq);
    case 1: return PyLong_FromUnsignedLongLong(self->epoch);
    case 2: return PyLong_FromUnsignedLongLong(self->index);
    case 3: return PyLong_FromUnsignedLong(self->n_leaves);
    case 5: return PyLong_FromUnsignedLongLong(self->nbytes);
    default:
        if (ts_slot_check(self) < 0) return NULL;
        return PyLong_FromUnsignedLong(self->lease->slot);
    }
}

static PyMethodDef Slot_methods[] = {
    {"views", (PyCFunction)(void (*)(void))Slot_views, METH_VARARGS | METH_KEYWORDS,
     "One SlotView per tensor (device=True: of the slot's GPU copy)."},
    {"capsules", (PyCFunction)(void (*)(void))Slot_capsules, METH_VARARGS | METH_KEYWORDS,
     "One DLPack capsule per tensor."},
    {"release", (PyCFunction)Slot_release, METH_NOARGS,
     "Drop this object's hold on the slot (views and tensors keep their own)."},
    {"__enter__", (PyCFunction)Slot_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)Slot_exit, METH_VARARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Slot_getset[] = {
    {"is_end_of_epoch", (getter)Slot_get_end, NULL, "This entry ends an epoch.", NULL},
    {"meta", (getter)Slot_get_meta, NULL, "The batch-structure blob.", NULL},
    {"seq", (getter)Slot_get_u64, NULL, "Ring sequence number.", (void *)0},
    {"epoch", (getter)Slot_get_u64, NULL, "Producer epoch.", (void *)1},
    {"index", (getter)Slot_get_u64, NULL, "Batch index in the epoch.", (void *)2},
    {"n_leaves", (getter)Slot_get_u64, NULL, "Number of tensors.", (void *)3},
    {"slot", (getter)Slot_get_u64, NULL, "Slot number in the ring.", (void *)4},
    {"nbytes", (getter)Slot_get_u64, NULL, "Bytes of the entry (tensors and structure).",
     (void *)5},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot Slot_slots[] = {
    {Py_tp_doc, "A consumer's hold on one published ring slot."},
    {Py_tp_dealloc, Slot_dealloc},
    {Py_tp_methods, Slot_methods},
    {Py_tp_getset, Slot_getset},
    {0, NULL},
};

static PyType_Spec Slot_spec = {
    .name = "tensorsocket._core.Slot",
    .basicsize = sizeof(SlotObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = Slot_slots,
};

/* ==========================================================================
 * Ring
 * ========================================================================== */

typedef struct {
    PyObject_HEAD
    ts_ring *ring; /* owns one ring reference; NULL once closed */
} RingObject;

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
    if (self->ring->is_producer == want) return 0;
    PyErr_SetString(PyExc_ValueError, want ? "only the producer's ring handle can do this"
                                           : "only a consumer's ring handle can do this");
    return -1;
}

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

/* Ring.create(name, slot_count, slot_bytes, max_leaves) -> producer Ring */
static PyObject *Ring_create(PyTypeObject *cls, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"name", "slot_count", "slot_bytes", "max_leaves", "device", NULL};
    const char *name;
    unsigned int slot_count, max_leaves;
    unsigned long long slot_bytes;
    int device = -1;
    ts_state *state = PyType_GetModuleState(cls);
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "sIKI|$i:create", kwlist, &name, &slot_count,
                                     &slot_bytes, &max_leaves, &device))
        return NULL;
    ts_geometry g = {slot_count, max_leaves, slot_bytes, device >= 0};
    ts_cuda_api *api = NULL;
    if (device >= 0 && (api = ts_state_cuda(state)) == NULL) return NULL;
    ts_ring *ring = NULL;
    ts_err err = {0};
    ts_status st;
    Py_BEGIN_ALLOW_THREADS
    st = ts_ring_create_on_device(name, &g, api, device, &ring, &err);
    Py_END_ALLOW_THREADS
    if (st != TS_OK) return ts_raise(state, &err);
    return ts_wrap_ring(state, ring);
}

/* Ring.open(name) -> consumer Ring */
static PyObject *Ring_open(PyTypeObject *cls, PyObject *args)
{
    const char *name;
    ts_state *state = PyType_GetModuleState(cls);
    if (!PyArg_ParseTuple(args, "s:open", &name)) return NULL;
    ts_ring *ring = NULL;
    ts_err err = {0};
    if (ts_ring_open(name, &ring, &err) != TS_OK) return ts_raise(state, &err);
    return ts_wrap_ring(state, ring);
}

/* Ring.unlink_name(name): remove a segment name (missing is fine). */
static PyObject *Ring_unlink_name(PyTypeObject *cls, PyObject *args)
{
    const char *name;
    ts_state *state = PyType_GetModuleState(cls);
    if (!PyArg_ParseTuple(args, "s:unlink_name", &name)) return NULL;
    ts_err err = {0};
    if (ts_ring_unlink_name(name, &err) != TS_OK) return ts_raise(state, &err);
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

/* Ring.close(): drop this handle (views keep the mapping alive). */
static PyObject *Ring_close(RingObject *self, PyObject *Py_UNUSED(ignored))
{
    ts_ring *ring = self->ring;
    self->ring = NULL;
    ts_ring_unref_nogil(ring);
    Py_RETURN_NONE;
}

/* A sequence number argument that may be None (then TS_SEQ_NONE); -1 with an exception. */
static int ts_optional_seq(PyObject *obj, uint64_t *out)
{
    *out = TS_SEQ_NONE;
    if (obj == Py_None) return 0;
    *out = PyLong_AsUnsignedLongLong(obj);
    return *out == (uint64_t)-1 && PyErr_Occurred() ? -1 : 0;
}

/* Ring.activate_group(indices, align=False, start=None) -> the entry every one of the
 * consumers starts at (the ranks of a group, in one step) */
static PyObject *Ring_activate_group(RingObject *self, PyObject *args)
{
    PyObject *seq_obj, *from_obj = Py_None, *fast = NULL, *result = NULL;
    int align = 0;
    uint32_t indices[TS_MAX_CONSUMERS];
    if (!PyArg_ParseTuple(args, "O|pO:activate_group", &seq_obj, &align, &from_obj)) return NULL;
    if (ts_role_check(self, 1) < 0) return NULL;
    fast = PySequence_Fast(seq_obj, "activate_group: indices must be a sequence");
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
    if (ts_optional_seq(from_obj, &from) < 0) goto done;
    uint64_t start = 0;
    ts_err err = {0};
    if (ts_ring_activate_group(self->ring, indices, (uint32_t)n, align, from, &start, &err) !=
        TS_OK) {
        ts_raise(ts_get_state((PyObject *)self), &err);
        goto done;
    }
    result = PyLong_FromUnsignedLongLong(start);
done:
    Py_XDECREF(fast);
    return result;
}

/* Ring.await_next_epoch(index): the consumer skips the rest of the producer's epoch,
 * keeping its place (it receives again from the next epoch's first entry). */
static PyObject *Ring_await_next_epoch(RingObject *self, PyObject *args)
{
    unsigned int index;
    if (!PyArg_ParseTuple(args, "I:await_next_epoch", &index)) return NULL;
    if (ts_role_check(self, 1) < 0) return NULL;
    ts_err err = {0};
    if (ts_ring_await_next_epoch(self->ring, index, &err) != TS_OK)
        return ts_raise(ts_get_state((PyObject *)self), &err);
    Py_RETURN_NONE;
}

/* Ring.set_aside(): copy the held slots privately and hand them back; reads no more. */
static PyObject *Ring_set_aside(RingObject *self, PyObject *Py_UNUSED(ignored))
{
    if (ts_role_check(self, 0) < 0) return NULL;
    ts_err err = {0};
    ts_status st;
    Py_BEGIN_ALLOW_THREADS /* copies whole slots */
    st = ts_ring_set_aside(self->ring, &err);
    Py_END_ALLOW_THREADS
    if (st != TS_OK) return ts_raise(ts_get_state((PyObject *)self), &err);
    Py_RETURN_NONE;
}

/* Ring.held_slots() -> slots this consumer handle holds (views of them are alive) */
static PyObject *Ring_held_slots(RingObject *self, PyObject *Py_UNUSED(ignored))
{
    if (ts_role_check(self, 0) < 0) return NULL;
    return PyLong_FromUnsignedLong(ts_ring_held_slots(self->ring));
}

/* Ring.reserve(pid, start_time, batch_size=0) -> (index, token) */
static PyObject *Ring_reserve(RingObject *self, PyObject *args)
{
    int pid;
    unsigned long long start_time;
    unsigned int batch_size = 0;
    if (!PyArg_ParseTuple(args, "iK|I:reserve", &pid, &start_time, &batch_size)) return NULL;
    if (ts_role_check(self, 1) < 0) return NULL;
    uint32_t index = 0;
    uint64_t token = 0;
    ts_err err = {0};
    if (ts_ring_reserve(self->ring, pid, start_time, batch_size, &index, &token, &err) != TS_OK)
        return ts_raise(ts_get_state((PyObject *)self), &err);
    return Py_BuildValue("(IK)", index, (unsigned long long)token);
}

/* Ring.activate(index, align=False, start=None) -> first sequence number the consumer
 * receives (start: exactly that entry, which must still be in the ring) */
static PyObject *Ring_activate(RingObject *self, PyObject *args)
{
    unsigned int index;
    int align = 0;
    PyObject *from_obj = Py_None;
    if (!PyArg_ParseTuple(args, "I|pO:activate", &index, &align, &from_obj)) return NULL;
    if (ts_role_check(self, 1) < 0) return NULL;
    uint64_t from;
    if (ts_optional_seq(from_obj, &from) < 0) return NULL;
    uint64_t start = 0;
    ts_err err = {0};
    ts_status st = from == TS_SEQ_NONE
                       ? ts_ring_activate(self->ring, index, align, &start, &err)
                       : ts_ring_activate_from(self->ring, index, from, &start, &err);
    if (st != TS_OK)
        return ts_raise(ts_get_state((PyObject *)self), &err);
    return PyLong_FromUnsignedLongLong(start);
}

/* Ring.set_policy(window, max_lag): late-joiner window and lag limit (0: off). */
static PyObject *Ring_set_policy(RingObject *self, PyObject *args)
{
    unsigned long long window, max_lag;
    if (!PyArg_ParseTuple(args, "KK:set_policy", &window, &max_lag)) return NULL;
    if (ts_role_check(self, 1) < 0) return NULL;
    ts_err err = {0};
    if (ts_ring_set_policy(self->ring, window, max_lag, &err) != TS_OK)
        return ts_raise(ts_get_state((PyObject *)self), &err);
    Py_RETURN_NONE;
}

/* Ring.detach(index): take a live consumer off, as for lagging. */
static PyObject *Ring_detach(RingObject *self, PyObject *args)
{
    unsigned int index;
    if (!PyArg_ParseTuple(args, "I:detach", &index)) return NULL;
    if (ts_role_check(self, 1) < 0) return NULL;
    ts_ring_detach(self->ring, index, TS_REASON_LAGGED);
    Py_RETURN_NONE;
}

/* Ring.retire(index): a live consumer left. */
static PyObject *Ring_retire(RingObject *self, PyObject *args)
{
    unsigned int index;
    if (!PyArg_ParseTuple(args, "I:retire", &index)) return NULL;
    if (ts_role_check(self, 1) < 0) return NULL;
    ts_ring_retire(self->ring, index);
    Py_RETURN_NONE;
}

/* Ring.evict(index, reason=REASON_DIED): a dead (or silent) consumer. */
static PyObject *Ring_evict(RingObject *self, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"index", "reason", NULL};
    unsigned int index, reason = TS_REASON_DIED;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "I|I:evict", kwlist, &index, &reason))
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

/* Map a DLPack (code, bits, lanes) from a Python tuple. */
static int ts_parse_dtype(PyObject *obj, DLDataType *out)
{
    int code, bits, lanes;
    if (!PyArg_ParseTuple(obj, "iii", &code, &bits, &lanes)) return -1;
    out->code = (uint8_t)code;
    out->bits = (uint8_t)bits;
    out->lanes = (uint16_t)lanes;
    return 0;
}

/* Ring.publish(leaves, meta, *, end_of_epoch=False, epoch=0, index=0, timeout=None)
 * leaves: sequence of (buffer, (code, bits, lanes)). Returns the sequence number. */
static PyObject *Ring_publish(RingObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"leaves", "meta", "end_of_epoch", "epoch", "index", "timeout",
                             NULL};
    PyObject *leaves_obj, *timeout = Py_None, *result = NULL, *seq_fast = NULL;
    Py_buffer meta = {0};
    int end = 0;
    unsigned long long epoch = 0, index = 0;
    Py_buffer *bufs = NULL;
    ts_src_leaf *src = NULL;
    int64_t *dims = NULL;
    Py_ssize_t n = 0, got = 0;
    ts_ring *ring = NULL; /* owns one reference while set */
    ts_state *state = ts_get_state((PyObject *)self);

    if (!PyArg_ParseTupleAndKeywords(args, kwds, "Oy*|$pKKO:publish", kwlist, &leaves_obj,
                                     &meta, &end, &epoch, &index, &timeout))
        return NULL;
    if (ts_role_check(self, 1) < 0) goto done;
    uint64_t deadline;
    if (ts_parse_timeout(timeout, &deadline) < 0) goto done;
    seq_fast = PySequence_Fast(leaves_obj, "leaves must be a sequence");
    if (seq_fast == NULL) goto done;
    n = PySequence_Fast_GET_SIZE(seq_fast);
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
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq_fast, i);
        PyObject *buf_obj, *dtype_obj;
        if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 2) {
            PyErr_SetString(PyExc_TypeError, "each leaf must be (buffer, (code, bits, lanes))");
            goto done;
        }
        buf_obj = PyTuple_GET_ITEM(item, 0);
        dtype_obj = PyTuple_GET_ITEM(item, 1);
        if (ts_parse_dtype(dtype_obj, &src[i].dtype) < 0) goto done;
        if (PyObject_GetBuffer(buf_obj, &bufs[i], PyBUF_RECORDS_RO) < 0) goto done;
        got = i + 1;
        Py_buffer *b = &bufs[i];
        if (b->ndim > TS_MAX_NDIM) {
            PyErr_Format(PyExc_ValueError, "a tensor has %d dimensions, at most %d are supported",
                         b->ndim, TS_MAX_NDIM);
            goto done;
        }
        int64_t *shape = dims + (size_t)i * 2 * TS_MAX_NDIM;
        int64_t *strides = shape + TS_MAX_NDIM;
        for (int d = 0; d < b->ndim; d++) {
            shape[d] = b->shape[d];
            strides[d] = b->strides[d];
        }
        src[i].data = b->buf;
        src[i].ndim = b->ndim;
        src[i].shape = shape;
        src[i].strides = strides;
        src[i].itemsize = (uint64_t)b->itemsize;
        if ((uint64_t)b->itemsize * 8 != (uint64_t)src[i].dtype.bits * src[i].dtype.lanes) {
            PyErr_Format(PyExc_ValueError,
                         "leaf %zd: buffer item size %zd does not match dtype bits %d", i,
                         b->itemsize, src[i].dtype.bits);
            goto done;
        }
    }

    ts_err err = {0};
    ts_status st;
    ring = self->ring; /* our own reference: another thread may close the object */
    ts_ring_ref(ring);
    uint64_t seq_before = atomic_load_explicit(&ring->hdr->published, memory_order_relaxed);
    for (;;) {
        uint64_t slice = ts_slice(deadline);
        Py_BEGIN_ALLOW_THREADS
        st = ts_ring_publish(ring, end ? TS_ENTRY_END_EPOCH : TS_ENTRY_BATCH, epoch, index, src,
                             (uint32_t)n, meta.buf, (uint64_t)meta.len, slice, &err);
        Py_END_ALLOW_THREADS
        if (ts_check_not_closed((PyObject *)self, self->ring, ring) < 0) goto done;
        int again = ts_slice_again(st, deadline);
        if (again < 0) goto done;
        if (again == 0) break;
    }
    if (st != TS_OK) {
        ts_raise(state, &err);
        goto done;
    }
    result = PyLong_FromUnsignedLongLong(seq_before);

done:
    if (ring != NULL) ts_ring_unref(ring);
    for (Py_ssize_t i = 0; i < got; i++) PyBuffer_Release(&bufs[i]);
    PyMem_Free(bufs);
    PyMem_Free(src);
    PyMem_Free(dims);
    Py_XDECREF(seq_fast);
    PyBuffer_Release(&meta);
    return result;
}

/* Run a waiting core call in slices; 0 when done, 1 on timeout, -1 on error. */
typedef ts_status (*ts_wait_fn)(ts_ring *ring, uint32_t arg, uint64_t deadline, ts_err *err);

/* Slice a wait so that Ctrl-C is honoured; the GIL is released while asleep. */
static int ts_run_wait(RingObject *self, ts_wait_fn fn, uint32_t arg, PyObject *timeout)
{
    uint64_t deadline;
    ts_err err = {0};
    ts_status st;
    int rc = -1;
    if (ts_parse_timeout(timeout, &deadline) < 0) return -1;
    ts_ring *ring = self->ring; /* our own reference: another thread may close the object */
    ts_ring_ref(ring);
    for (;;) {
        uint64_t slice = ts_slice(deadline);
        Py_BEGIN_ALLOW_THREADS
        st = fn(ring, arg, slice, &err);
        Py_END_ALLOW_THREADS
        if (ts_check_not_closed((PyObject *)self, self->ring, ring) < 0) goto done;
        int again = ts_slice_again(st, deadline);
        if (again < 0) goto done;
        if (again == 0) break;
    }
    if (st == TS_OK) rc = 0;
    else if (st == TS_E_TIMEOUT) rc = 1;
    else ts_raise(ts_get_state((PyObject *)self), &err);
done:
    ts_ring_unref(ring);
    return rc;
}

/* Adapter: wait for n consumers. */
static ts_status ts_wait_consumers_fn(ts_ring *ring, uint32_t n, uint64_t deadline, ts_err *err)
{
    return ts_ring_wait_consumers(ring, n, deadline, err);
}

/* Adapter: wait for the consumers to drain. */
static ts_status ts_wait_drained_fn(ts_ring *ring, uint32_t unused, uint64_t deadline,
                                    ts_err *err)
{
    (void)unused;
    return ts_ring_wait_drained(ring, deadline, err);
}

/* Ring.wait_consumers(n, timeout=None) -> True, or False on timeout */
static PyObject *Ring_wait_consumers(RingObject *self, PyObject *args)
{
    unsigned int n;
    PyObject *timeout = Py_None;
    if (!PyArg_ParseTuple(args, "I|O:wait_consumers", &n, &timeout)) return NULL;
    if (ts_role_check(self, 1) < 0) return NULL;
    int rc = ts_run_wait(self, ts_wait_consumers_fn, n, timeout);
    if (rc < 0) return NULL;
    return PyBool_FromLong(rc == 0);
}

/* Ring.wait_drained(timeout=None) -> True, or False on timeout */
static PyObject *Ring_wait_drained(RingObject *self, PyObject *args)
{
    PyObject *timeout = Py_None;
    if (!PyArg_ParseTuple(args, "|O:wait_drained", &timeout)) return NULL;
    if (ts_role_check(self, 1) < 0) return NULL;
    int rc = ts_run_wait(self, ts_wait_drained_fn, 0, timeout);
    if (rc < 0) return NULL;
    return PyBool_FromLong(rc == 0);
}

/* Adapter: wait until no slot is held. */
static ts_status ts_wait_released_fn(ts_ring *ring, uint32_t unused, uint64_t deadline,
                                     ts_err *err)
{
    (void)unused;
    return ts_ring_wait_released(ring, deadline, err);
}

/* Ring.wait_released(timeout=None) -> True, or False on timeout */
static PyObject *Ring_wait_released(RingObject *self, PyObject *args)
{
    PyObject *timeout = Py_None;
    if (!PyArg_ParseTuple(args, "|O:wait_released", &timeout)) return NULL;
    if (ts_role_check(self, 1) < 0) return NULL;
    int rc = ts_run_wait(self, ts_wait_released_fn, 0, timeout);
    if (rc < 0) return NULL;
    return PyBool_FromLong(rc == 0);
}

/* Ring.finish(failure=None): no more entries; wake every consumer. failure: why the
 * producer failed, for the consumers to read with failure() (None: a normal end). */
static PyObject *Ring_finish(RingObject *self, PyObject *args)
{
    const char *failure = NULL;
    if (!PyArg_ParseTuple(args, "|z:finish", &failure)) return NULL;
    if (ts_role_check(self, 1) < 0) return NULL;
    if (failure != NULL && failure[0] != '\0')
        ts_ring_fail(self->ring, failure);
    else
        ts_ring_finish(self->ring);
    Py_RETURN_NONE;
}

/* Ring.failure() -> str or None: why the producer failed, once the ring is finished. */
static PyObject *Ring_failure(RingObject *self, PyObject *Py_UNUSED(ignored))
{
    if (ts_ring_check(self) < 0) return NULL;
    char buf[TS_FAILURE_BYTES];
    if (!ts_ring_failure(self->ring, buf)) Py_RETURN_NONE;
    return PyUnicode_DecodeUTF8(buf, (Py_ssize_t)strlen(buf), "replace");
}

/* Ring.bind(index, token): make this handle the given consumer. */
static PyObject *Ring_bind(RingObject *self, PyObject *args)
{
    unsigned int index;
    unsigned long long token;
    if (!PyArg_ParseTuple(args, "IK:bind", &index, &token)) return NULL;
    if (ts_role_check(self, 0) < 0) return NULL;
    ts_err err = {0};
    if (ts_ring_bind_consumer(self->ring, index, token, &err) != TS_OK)
        return ts_raise(ts_get_state((PyObject *)self), &err);
    Py_RETURN_NONE;
}

/* Ring.acquire(timeout=None) -> Slot; raises TimeoutError, ProducerFinished,
 * ProducerGone or ConsumerDetached. */
static PyObject *Ring_acquire(RingObject *self, PyObject *args)
{
    PyObject *timeout = Py_None;
    ts_state *state = ts_get_state((PyObject *)self);
    if (!PyArg_ParseTuple(args, "|O:acquire", &timeout)) return NULL;
    if (ts_role_check(self, 0) < 0) return NULL;
    uint64_t deadline;
    if (ts_parse_timeout(timeout, &deadline) < 0) return NULL;
    ts_acquired got;
    ts_err err = {0};
    ts_status st;
    SlotObject *slot = NULL;
    ts_ring *ring = self->ring; /* our own reference: another thread may close the object */
    ts_ring_ref(ring);
    for (;;) {
        uint64_t slice = ts_slice(deadline);
        Py_BEGIN_ALLOW_THREADS
        st = ts_ring_acquire(ring, slice, &got, &err);
        Py_END_ALLOW_THREADS
        if (ts_check_not_closed((PyObject *)self, self->ring, ring) < 0) {
            if (st == TS_OK) ts_ring_release(ring, got.slot, ring->consumer);
            goto done;
        }
        int again = ts_slice_again(st, deadline);
        if (again < 0) goto done;
        if (again == 0) break;
    }
    if (st != TS_OK) {
        ts_raise(state, &err);
        goto done;
    }

    ts_lease *lease = ts_lease_new(ring, got.slot, got.seq);
    if (lease == NULL) {
        ts_ring_release(ring, got.slot, ring->consumer);
        PyErr_NoMemory();
        goto done;
    }
    slot = PyObject_New(SlotObject, state->Slot_type);
    if (slot == NULL) {
        ts_lease_unref(lease);
        goto done;
    }
    const ts_slot *s = ts_ring_slot(ring, got.slot);
    slot->lease = lease;
    slot->kind = got.kind;
    slot->n_leaves = s->n_leaves;
    slot->seq = got.seq;
    slot->epoch = got.epoch;
    slot->index = got.index;
    slot->nbytes = s->used_bytes;
    slot->meta = PyBytes_FromStringAndSize(
        (const char *)ts_ring_slot_data(ring, got.slot) + s->meta_offset,
        (Py_ssize_t)s->meta_bytes);
    if (slot->meta == NULL) Py_CLEAR(slot);
done:
    ts_ring_unref(ring);
    return (PyObject *)slot;
}

/* One consumer table entry as a dict. */
static PyObject *ts_consumer_dict(const ts_header *h, uint32_t i)
{
    const ts_consumer *c = &h->consumers[i];
    uint64_t cursor = atomic_load_explicit(&c->cursor, memory_order_acquire);
    uint64_t published = atomic_load_explicit(&h->published, memory_order_acquire);
    uint64_t at = cursor & ~TS_CURSOR_DETACHED;
    long long lag = (cursor == TS_SEQ_NONE || at > published) ? 0 : (long long)(published - at);
    return Py_BuildValue(
        "{sIsIsIsisKsKsLsKsKsKsKsKsIsK}", "index", i, "state",
        atomic_load_explicit(&c->state, memory_order_acquire), "reason",
        atomic_load_explicit(&c->reason, memory_order_relaxed), "pid", c->pid, "cursor",
        (unsigned long long)(cursor == TS_SEQ_NONE ? cursor : at), "first_seq",
        (unsigned long long)atomic_load_explicit(&c->first_seq, memory_order_relaxed), "lag",
        lag, "delivered",
        (unsigned long long)atomic_load_explicit(&c->delivered, memory_order_relaxed),
        "delivered_bytes",
        (unsigned long long)atomic_load_explicit(&c->delivered_bytes, memory_order_relaxed),
        "wait_ns", (unsigned long long)atomic_load_explicit(&c->wait_ns, memory_order_relaxed),
        "progress_ns",
        (unsigned long long)atomic_load_explicit(&c->progress_ns, memory_order_relaxed),
        "start_time", (unsigned long long)c->start_time, "batch_size", c->batch_size, "token",
        (unsigned long long)c->token);
}

/* Ring.consumers() -> list of dicts, one per used consumer entry. */
static PyObject *Ring_consumers(RingObject *self, PyObject *Py_UNUSED(ignored))
{
    if (ts_ring_check(self) < 0) return NULL;
    ts_header *h = self->ring->hdr;
    PyObject *out = PyList_New(0);
    if (out == NULL) return NULL;
    for (uint32_t i = 0; i < TS_MAX_CONSUMERS; i++) {
        if (atomic_load_explicit(&h->consumers[i].state, memory_order_acquire) ==
            TS_CONSUMER_FREE)
            continue;
        PyObject *d = ts_consumer_dict(h, i);
        if (d == NULL || PyList_Append(out, d) < 0) {
            Py_XDECREF(d);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(d);
    }
    return out;
}

/* Ring.consumer(index) -> dict of that consumer table entry. */
static PyObject *Ring_consumer(RingObject *self, PyObject *args)
{
    unsigned int index;
    if (!PyArg_ParseTuple(args, "I:consumer", &index)) return NULL;
    if (ts_ring_check(self) < 0) return NULL;
    if (index >= TS_MAX_CONSUMERS)
        return PyErr_Format(PyExc_IndexError, "no consumer %u", index);
    return ts_consumer_dict(self->ring->hdr, index);
}

/* Ring.slot_readers() -> tuple of reader bitmaps, one per slot. */
static PyObject *Ring_slot_readers(RingObject *self, PyObject *Py_UNUSED(ignored))
{
    if (ts_ring_check(self) < 0) return NULL;
    uint32_t k = self->ring->hdr->slot_count;
    PyObject *out = PyTuple_New(k);
    if (out == NULL) return NULL;
    for (uint32_t i = 0; i < k; i++) {
        ts_slot *s = ts_ring_slot(self->ring, i);
        PyObject *v = PyLong_FromUnsignedLongLong(
            atomic_load_explicit(&s->readers, memory_order_acquire));
        if (v == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyTuple_SET_ITEM(out, i, v);
    }
    return out;
}

/* Ring.import_device(device=None) -> ordinal: open the ring's GPU memory
 * (consumer). None picks the visible GPU that holds the pool. */
static PyObject *Ring_import_device(RingObject *self, PyObject *args)
{
    PyObject *device = Py_None;
    ts_state *state = ts_get_state((PyObject *)self);
    if (!PyArg_ParseTuple(args, "|O:import_device", &device)) return NULL;
    if (ts_role_check(self, 0) < 0) return NULL;
    if (self->ring->hdr->device_type != kDLCUDA) {
        PyErr_SetString(state->GPUUnavailable,
                        "the producer keeps this ring in host memory (it was not created "
                        "with device='cuda:N')");
        return NULL;
    }
    ts_cuda_api *api = ts_state_cuda(state);
    if (api == NULL) return NULL;
    int ordinal;
    if (device == Py_None) {
        CUuuid uuid;
        memcpy(uuid.bytes, self->ring->hdr->device_uuid, sizeof uuid.bytes);
        ordinal = ts_cuda_find_device(api, &uuid);
        if (ordinal < 0) {
            PyErr_SetString(state->GPUUnavailable,
                            "the producer's GPU is not visible to this process (check "
                            "CUDA_VISIBLE_DEVICES), pass device='cuda:N' to read the ring "
                            "from another GPU");
            return NULL;
        }
    } else {
        ordinal = PyLong_AsLong(device);
        if (ordinal == -1 && PyErr_Occurred()) return NULL;
    }
    ts_ring *ring = self->ring;
    ts_ring_ref(ring);
    ts_err err = {0};
    ts_status st;
    Py_BEGIN_ALLOW_THREADS
    st = ts_gpu_import(ring, api, ordinal, &err);
    Py_END_ALLOW_THREADS
    ts_ring_unref(ring);
    if (st != TS_OK) return ts_raise(state, &err);
    return PyLong_FromLong(ordinal);
}

/* Ring.pin_host(device=0): page-lock this process's mapping of the slot data. */
static PyObject *Ring_pin_host(RingObject *self, PyObject *args)
{
    int ordinal = 0;
    ts_state *state = ts_get_state((PyObject *)self);
    if (!PyArg_ParseTuple(args, "|i:pin_host", &ordinal)) return NULL;
    if (ts_role_check(self, 0) < 0) return NULL;
    ts_cuda_api *api = ts_state_cuda(state);
    if (api == NULL) return NULL;
    ts_ring *ring = self->ring;
    ts_ring_ref(ring);
    ts_err err = {0};
    ts_status st;
    Py_BEGIN_ALLOW_THREADS
    st = ts_gpu_pin_host(ring, api, ordinal, &err);
    Py_END_ALLOW_THREADS
    ts_ring_unref(ring);
    if (st != TS_OK) return ts_raise(state, &err);
    Py_RETURN_NONE;
}

/* The newest published entry's epoch, batch index and bytes, read without a
 * lock: 0 if the entry is not there or was overwritten while read. */
static int ts_newest_entry(const ts_ring *r, uint64_t published, uint64_t *epoch,
                           uint64_t *index, uint64_t *bytes)
{
    *epoch = *index = *bytes = 0;
    if (published == 0) return 0;
    uint64_t seq = published - 1;
    const ts_slot *s = ts_ring_slot(r, (uint32_t)(seq % r->hdr->slot_count));
    if (atomic_load_explicit(&s->seq, memory_order_acquire) != seq) return 0;
    *epoch = s->epoch;
    *index = s->index;
    *bytes = s->kind == TS_ENTRY_BATCH ? s->used_bytes : 0;
    atomic_thread_fence(memory_order_acquire);
    if (atomic_load_explicit(&s->seq, memory_order_relaxed) != seq) {
        *epoch = *index = *bytes = 0;
        return 0;
    }
    return 1;
}

/* Ring.info() -> dict of geometry and counters. */
static PyObject *Ring_info(RingObject *self, PyObject *Py_UNUSED(ignored))
{
    if (ts_ring_check(self) < 0) return NULL;
    ts_ring *r = self->ring;
    ts_header *h = r->hdr;
    uint32_t occupied = 0;
    for (uint32_t i = 0; i < h->slot_count; i++)
        if (atomic_load_explicit(&ts_ring_slot(r, i)->readers, memory_order_relaxed) != 0)
            occupied++;
    PyObject *info = Py_BuildValue(
        "{sssIsIsKsKsisKsIsKsKsKsnsnsKsi}", "name", r->name, "slot_count", h->slot_count,
        "max_leaves", h->max_leaves, "slot_bytes", (unsigned long long)h->slot_bytes,
        "segment_bytes", (unsigned long long)h->segment_bytes, "producer_pid", h->producer_pid,
        "producer_start_time", (unsigned long long)h->producer_start_time, "state",
        atomic_load_explicit(&h->state, memory_order_acquire), "published",
        (unsigned long long)atomic_load_explicit(&h->published, memory_order_acquire),
        "active_mask",
        (unsigned long long)atomic_load_explicit(&h->active_mask, memory_order_acquire),
        "bytes_copied", (unsigned long long)r->bytes_copied, "data_address",
        (Py_ssize_t)(intptr_t)r->data, "data_bytes", (Py_ssize_t)r->data_bytes,
        "consumer", (unsigned long long)r->consumer, "is_producer", r->is_producer);
    if (info == NULL) return NULL;
    PyObject *more = Py_BuildValue(
        "{sIsKsKsKsKsKsisI}", "occupied", occupied, "window",
        (unsigned long long)atomic_load_explicit(&h->window, memory_order_relaxed), "max_lag",
        (unsigned long long)atomic_load_explicit(&h->max_lag, memory_order_relaxed),
        "epoch_first_seq",
        (unsigned long long)atomic_load_explicit(&h->epoch_first_seq, memory_order_relaxed),
        "lag_detached",
        (unsigned long long)atomic_load_explicit(&h->lag_detached, memory_order_relaxed),
        "publish_wait_ns",
        (unsigned long long)atomic_load_explicit(&h->publish_wait_ns, memory_order_relaxed),
        "host_writable", ts_ring_host_writable(r), "private_slots",
        ts_fault_private_slots(&r->cow));
    if (more == NULL || PyDict_Update(info, more) < 0) {
        Py_XDECREF(more);
        Py_DECREF(info);
        return NULL;
    }
    Py_DECREF(more);
    uint64_t n_epoch, n_index, n_bytes;
    int n_valid = ts_newest_entry(
        r, atomic_load_explicit(&h->published, memory_order_acquire), &n_epoch, &n_index,
        &n_bytes);
    more = Py_BuildValue("{sOsKsKsK}", "newest_valid", n_valid ? Py_True : Py_False,
                         "newest_epoch", (unsigned long long)n_epoch, "newest_index",
                         (unsigned long long)n_index, "newest_bytes",
                         (unsigned long long)n_bytes);
    if (more == NULL || PyDict_Update(info, more) < 0) {
        Py_XDECREF(more);
        Py_DECREF(info);
        return NULL;
    }
    Py_DECREF(more);
    static const char hex[] = "0123456789abcdef";
    char uuid[33] = {0};
    for (int i = 0; i < 16; i++) {
        uuid[2 * i] = hex[h->device_uuid[i] >> 4];
        uuid[2 * i + 1] = hex[h->device_uuid[i] & 15];
    }
    more = Py_BuildValue("{sisisssisisisO}", "device_type", h->device_type, "device_ordinal",
                         h->device_ordinal, "device_uuid", h->device_type == kDLCUDA ? uuid : "",
                         "producer_host_pinned", (int)h->host_pinned, "imported_device",
                         ts_gpu_imported_device(r), "host_pinned", ts_gpu_host_pinned(r),
                         "same_pid_namespace", h->pid_ns == ts_proc_pid_ns() ? Py_True : Py_False);
    PyObject *importers =
        PyLong_FromUnsignedLong(h->device_type == kDLCUDA ? ts_ring_importers(r) : 0);
    if (importers == NULL ||
        (more != NULL && PyDict_SetItemString(more, "gpu_importers", importers) < 0))
        Py_CLEAR(more);
    Py_XDECREF(importers);
    if (more == NULL || PyDict_Update(info, more) < 0) {
        Py_XDECREF(more);
        Py_DECREF(info);
        return NULL;
    }
    Py_DECREF(more);
    return info;
}

/* Ring.closed */
static PyObject *Ring_get_closed(RingObject *self, void *Py_UNUSED(closure))
{
    return PyBool_FromLong(self->ring == NULL);
}

/* Drop the handle's reference. */
static void Ring_dealloc(RingObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    ts_ring_unref_nogil(self->ring);
    tp->tp_free(self);
    Py_DECREF(tp);
}

static PyMethodDef Ring_methods[] = {
    {"create", (PyCFunction)(void (*)(void))Ring_create,
     METH_VARARGS | METH_KEYWORDS | METH_CLASS, "Create a ring segment (producer)."},
    {"open", (PyCFunction)Ring_open, METH_VARARGS | METH_CLASS,
     "Open a ring segment (consumer)."},
    {"unlink_name", (PyCFunction)Ring_unlink_name, METH_VARARGS | METH_CLASS,
     "Remove a segment name."},
    {"close", (PyCFunction)Ring_close, METH_NOARGS, "Drop this handle."},
    {"set_aside", (PyCFunction)Ring_set_aside, METH_NOARGS,
     "Copy the slots this handle holds privately and hand them back; it reads no more."},
    {"held_slots", (PyCFunction)Ring_held_slots, METH_NOARGS,
     "Slots this consumer handle holds (views of them are alive)."},
    {"reserve", (PyCFunction)Ring_reserve, METH_VARARGS, "Reserve a consumer entry."},
    {"activate", (PyCFunction)Ring_activate, METH_VARARGS, "Start delivering to a consumer."},
    {"await_next_epoch", (PyCFunction)Ring_await_next_epoch, METH_VARARGS,
     "A consumer skips the rest of the producer's epoch, keeping its place."},
    {"activate_group", (PyCFunction)Ring_activate_group, METH_VARARGS,
     "Start delivering to several consumers, all from the same entry."},
    {"retire", (PyCFunction)Ring_retire, METH_VARARGS, "A live consumer left."},
    {"evict", (PyCFunction)(void (*)(void))Ring_evict, METH_VARARGS | METH_KEYWORDS,
     "A dead (or silent) consumer: drop its holds."},
    {"detach", (PyCFunction)Ring_detach, METH_VARARGS, "Take a live consumer off."},
    {"set_policy", (PyCFunction)Ring_set_policy, METH_VARARGS,
     "Set the late-joiner window and the lag limit."},
    {"publish", (PyCFunction)(void (*)(void))Ring_publish, METH_VARARGS | METH_KEYWORDS,
     "Copy a batch into the next slot and publish it."},
    {"wait_consumers", (PyCFunction)Ring_wait_consumers, METH_VARARGS,
     "Wait until n consumers are active."},
    {"wait_drained", (PyCFunction)Ring_wait_drained, METH_VARARGS,
     "Wait until the consumers read everything published."},
    {"finish", (PyCFunction)Ring_finish, METH_VARARGS,
     "Mark the ring finished (with the producer's failure, if it failed)."},
    {"failure", (PyCFunction)Ring_failure, METH_NOARGS,
     "Why the producer failed, once the ring is finished; None after a normal end."},
    {"bind", (PyCFunction)Ring_bind, METH_VARARGS, "Bind to a consumer entry."},
    {"acquire", (PyCFunction)Ring_acquire, METH_VARARGS, "Take the next entry."},
    {"consumers", (PyCFunction)Ring_consumers, METH_NOARGS, "The consumer table."},
    {"consumer", (PyCFunction)Ring_consumer, METH_VARARGS, "One consumer table entry."},
    {"slot_readers", (PyCFunction)Ring_slot_readers, METH_NOARGS, "Reader bitmaps."},
    {"info", (PyCFunction)Ring_info, METH_NOARGS, "Geometry and counters."},
    {"import_device", (PyCFunction)Ring_import_device, METH_VARARGS,
     "Open the ring's GPU memory (consumer); returns the device ordinal."},
    {"pin_host", (PyCFunction)Ring_pin_host, METH_VARARGS,
     "Page-lock this process's mapping of the host slot data."},
    {"wait_released", (PyCFunction)Ring_wait_released, METH_VARARGS,
     "Wait until no consumer holds any slot."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Ring_getset[] = {
    {"closed", (getter)Ring_get_closed, NULL, "True once closed.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot Ring_slots[] = {
    {Py_tp_doc, "A process's handle on a shared-memory ring segment."},
    {Py_tp_dealloc, Ring_dealloc},
    {Py_tp_methods, Ring_methods},
    {Py_tp_getset, Ring_getset},
    {0, NULL},
};

static PyType_Spec Ring_spec = {
    .name = "tensorsocket._core.Ring",
    .basicsize = sizeof(RingObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = Ring_slots,
};

/* ==========================================================================
 * Module functions and init
 * ========================================================================== */

/* process_start_time(pid) -> start time in clock ticks, 0 if no such process */
static PyObject *ts_py_process_start_time(PyObject *Py_UNUSED(module), PyObject *arg)
{
    long pid = PyLong_AsLong(arg);
    if (pid == -1 && PyErr_Occurred()) return NULL;
    return PyLong_FromUnsignedLongLong(ts_proc_start_time((pid_t)pid));
}

/* process_alive(pid, start_time) -> bool */
static PyObject *ts_py_process_alive(PyObject *Py_UNUSED(module), PyObject *args)
{
    int pid;
    unsigned long long start;
    if (!PyArg_ParseTuple(args, "iK:process_alive", &pid, &start)) return NULL;
    return PyBool_FromLong(ts_proc_alive(pid, start));
}

/* segment_bytes(slot_count, slot_bytes, max_leaves) -> bytes a ring needs */
static PyObject *ts_py_segment_bytes(PyObject *Py_UNUSED(module), PyObject *args)
{
    unsigned int slot_count, max_leaves;
    unsigned long long slot_bytes;
    if (!PyArg_ParseTuple(args, "IKI:segment_bytes", &slot_count, &slot_bytes, &max_leaves))
        return NULL;
    ts_geometry g = {slot_count, max_leaves, slot_bytes, 0};
    return PyLong_FromUnsignedLongLong(ts_ring_segment_bytes(&g, NULL));
}

/* cuda_status() -> dict: is the GPU path available here, and why not. */
static PyObject *ts_py_cuda_status(PyObject *module, PyObject *Py_UNUSED(ignored))
{
    ts_state *state = PyModule_GetState(module);
    char forked[sizeof state->cuda_why];
    int in_child = ts_cuda_forked(state, forked, sizeof forked);
    ts_cuda_api *api = ts_state_cuda(state);
    if (api == NULL) {
        PyErr_Clear();
        return Py_BuildValue("{sOsssOsi}", "available", Py_False, "reason",
                             in_child ? forked : state->cuda_why, "devices", Py_None,
                             "driver_version", 0);
    }
    PyObject *devices = PyList_New(0);
    if (devices == NULL) return NULL;
    int count = 0;
    api->DeviceGetCount(&count);
    for (int i = 0; i < count; i++) {
        CUdevice dev;
        char name[128] = "";
        int ipc_events = 0;
        CUuuid uuid;
        char hex[33] = {0};
        if (api->DeviceGet(&dev, i) != CUDA_SUCCESS) continue;
        api->DeviceGetName(name, (int)sizeof name - 1, dev);
        api->DeviceGetAttribute(&ipc_events, CU_DEVICE_ATTRIBUTE_IPC_EVENT_SUPPORTED, dev);
        if (api->DeviceGetUuid(&uuid, dev) == CUDA_SUCCESS)
            for (int b = 0; b < 16; b++)
                snprintf(hex + 2 * b, 3, "%02x", (unsigned char)uuid.bytes[b]);
        PyObject *d = Py_BuildValue("{sisssssO}", "ordinal", i, "name", name, "uuid", hex,
                                    "ipc_events", ipc_events ? Py_True : Py_False);
        if (d == NULL || PyList_Append(devices, d) < 0) {
            Py_XDECREF(d);
            Py_DECREF(devices);
            return NULL;
        }
        Py_DECREF(d);
    }
    const char *reason = count > 0 ? NULL : "the CUDA driver sees no GPU";
    return Py_BuildValue("{sOszsNsisssi}", "available", count > 0 ? Py_True : Py_False,
                         "reason", reason, "devices", devices, "driver_version",
                         api->driver_version, "library", api->path, "device_count", count);
}

/* copy_stream(dst, src) -> bool: the slot-fill streaming copy, for benchmarks. */
static PyObject *ts_py_copy_stream(PyObject *Py_UNUSED(module), PyObject *args)
{
    Py_buffer dst = {0}, src = {0};
    PyObject *result = NULL;
    if (!PyArg_ParseTuple(args, "w*y*:copy_stream", &dst, &src)) return NULL;
    if (dst.len < src.len) {
        PyErr_Format(PyExc_ValueError, "copy_stream: dst has %zd bytes, src %zd", dst.len,
                     src.len);
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    ts_copy_stream(dst.buf, src.buf, (size_t)src.len);
    Py_END_ALLOW_THREADS
    result = PyBool_FromLong(ts_copy_can_stream());
done:
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    return result;
}

/* set_process_name(name): what ps and top show for this process (15 bytes kept). */
static PyObject *ts_py_set_process_name(PyObject *Py_UNUSED(module), PyObject *arg)
{
    const char *name = PyUnicode_AsUTF8(arg);
    if (name == NULL) return NULL;
    if (ts_proc_set_name(name) != 0) return PyErr_SetFromErrno(PyExc_OSError);
    Py_RETURN_NONE;
}

/* cuda_loaded() -> bool: this process (or the one that forked it) initialised the driver. */
static PyObject *ts_py_cuda_loaded(PyObject *module, PyObject *Py_UNUSED(ignored))
{
    const ts_state *state = PyModule_GetState(module);
    return PyBool_FromLong(state->cuda != NULL);
}

/* fork_prepare(), fork_parent(), fork_child(): os.register_at_fork hooks (ts_fault.h). */
static PyObject *ts_py_fork_prepare(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(ignored))
{
    ts_fault_fork_prepare();
    Py_RETURN_NONE;
}

static PyObject *ts_py_fork_parent(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(ignored))
{
    ts_fault_fork_parent();
    Py_RETURN_NONE;
}

static PyObject *ts_py_fork_child(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(ignored))
{
    ts_fault_fork_child();
    Py_RETURN_NONE;
}

static PyMethodDef ts_module_methods[] = {
    {"fork_prepare", ts_py_fork_prepare, METH_NOARGS,
     "Before os.fork: copy the ring slots this process holds (the child gets the copies)."},
    {"fork_parent", ts_py_fork_parent, METH_NOARGS, "After os.fork, in the parent."},
    {"fork_child", ts_py_fork_child, METH_NOARGS,
     "After os.fork, in the child: its batches become private copies."},
    {"cuda_status", ts_py_cuda_status, METH_NOARGS,
     "Whether the GPU path is available: driver, devices, or the reason it is not."},
    {"set_process_name", ts_py_set_process_name, METH_O,
     "Name this process as ps and top show it (its first 15 bytes; Linux)."},
    {"cuda_loaded", ts_py_cuda_loaded, METH_NOARGS,
     "True once the CUDA driver was initialised here (or in the process that forked this "
     "one); it never loads the driver."},
    {"process_start_time", ts_py_process_start_time, METH_O,
     "Start time of a process in clock ticks (0 if it does not exist)."},
    {"process_alive", ts_py_process_alive, METH_VARARGS,
     "True if pid exists and started at start_time."},
    {"segment_bytes", ts_py_segment_bytes, METH_VARARGS,
     "Bytes of shared memory a ring of this geometry needs."},
    {"copy_stream", ts_py_copy_stream, METH_VARARGS,
     "Copy src into dst with the streaming copy that fills large slots (benchmarks); "
     "True if it streamed, False if this CPU has no streaming stores (memcpy)."},
    {NULL, NULL, 0, NULL},
};

/* Create exception name deriving from bases; store it in *slot and the module. */
static int ts_add_exception(PyObject *module, PyObject **slot, const char *name,
                            PyObject *bases, const char *doc)
{
    char qualname[128];
    snprintf(qualname, sizeof qualname, "tensorsocket.%s", name);
    *slot = PyErr_NewExceptionWithDoc(qualname, doc, bases, NULL);
    if (*slot == NULL) return -1;
    return PyModule_AddObjectRef(module, name, *slot);
}

/* Fill the module: types, exceptions, constants. */
static int ts_module_exec(PyObject *module)
{
    ts_state *st = PyModule_GetState(module);
    PyObject *bases = NULL;
    int rc = -1;

    st->Ring_type = (PyTypeObject *)PyType_FromModuleAndSpec(module, &Ring_spec, NULL);
    st->Slot_type = (PyTypeObject *)PyType_FromModuleAndSpec(module, &Slot_spec, NULL);
    st->SlotView_type = (PyTypeObject *)PyType_FromModuleAndSpec(module, &SlotView_spec, NULL);
    if (st->Ring_type == NULL || st->Slot_type == NULL || st->SlotView_type == NULL) goto done;
    if (PyModule_AddType(module, st->Ring_type) < 0 ||
        PyModule_AddType(module, st->Slot_type) < 0 ||
        PyModule_AddType(module, st->SlotView_type) < 0)
        goto done;

    if (ts_add_exception(module, &st->TensorSocketError, "TensorSocketError",
                         PyExc_RuntimeError, "Base class of tensorsocket errors.") < 0)
        goto done;
    PyObject *base = st->TensorSocketError;
    if (ts_add_exception(module, &st->ProducerGone, "ProducerGone", base,
                         "The producer process died.") < 0 ||
        ts_add_exception(module, &st->ProducerFinished, "ProducerFinished", base,
                         "The producer finished: no more batches will come.") < 0 ||
        ts_add_exception(module, &st->ConsumerDetached, "ConsumerDetached", base,
                         "The producer detached this consumer.") < 0 ||
        ts_add_exception(module, &st->TooManyConsumers, "TooManyConsumers", base,
                         "The ring has no free consumer place.") < 0 ||
        ts_add_exception(module, &st->VersionMismatch, "VersionMismatch", base,
                         "Producer and consumer speak different versions.") < 0)
        goto done;
    bases = PyTuple_Pack(2, base, PyExc_ValueError);
    if (bases == NULL ||
        ts_add_exception(module, &st->BatchTooLarge, "BatchTooLarge", bases,
                         "A batch does not fit in a ring slot.") < 0)
        goto done;
    Py_CLEAR(bases);
    if (ts_add_exception(module, &st->GPUUnavailable, "GPUUnavailable", base,
                         "The GPU path cannot work here; the message says why.") < 0 ||
        ts_add_exception(module, &st->CudaError, "CudaError", base,
                         "A CUDA driver call failed.") < 0)
        goto done;
    bases = PyTuple_Pack(2, base, PyExc_OSError);
    if (bases == NULL ||
        ts_add_exception(module, &st->SharedMemoryTooSmall, "SharedMemoryTooSmall", bases,
                         "/dev/shm cannot hold the ring.") < 0)
        goto done;

    if (PyModule_AddIntConstant(module, "MAX_CONSUMERS", TS_MAX_CONSUMERS) < 0 ||
        PyModule_AddIntConstant(module, "MAX_NDIM", TS_MAX_NDIM) < 0 ||
        PyModule_AddIntConstant(module, "LAYOUT_VERSION", TS_LAYOUT_VERSION) < 0 ||
        PyModule_AddIntConstant(module, "DLPACK_MAJOR", TS_DLPACK_MAJOR) < 0 ||
        PyModule_AddIntConstant(module, "DLPACK_MINOR", TS_DLPACK_MINOR) < 0 ||
        PyModule_AddIntConstant(module, "CONSUMER_FREE", TS_CONSUMER_FREE) < 0 ||
        PyModule_AddIntConstant(module, "CONSUMER_PENDING", TS_CONSUMER_PENDING) < 0 ||
        PyModule_AddIntConstant(module, "CONSUMER_ACTIVE", TS_CONSUMER_ACTIVE) < 0 ||
        PyModule_AddIntConstant(module, "CONSUMER_LEAVING", TS_CONSUMER_LEAVING) < 0 ||
        PyModule_AddIntConstant(module, "CONSUMER_DETACHED", TS_CONSUMER_DETACHED) < 0 ||
        PyModule_AddIntConstant(module, "REASON_LEFT", TS_REASON_LEFT) < 0 ||
        PyModule_AddIntConstant(module, "REASON_LAGGED", TS_REASON_LAGGED) < 0 ||
        PyModule_AddIntConstant(module, "REASON_DIED", TS_REASON_DIED) < 0 ||
        PyModule_AddIntConstant(module, "REASON_SILENT", TS_REASON_SILENT) < 0 ||
        PyModule_AddIntConstant(module, "RING_OPEN", TS_RING_OPEN) < 0 ||
        PyModule_AddIntConstant(module, "RING_FINISHED", TS_RING_FINISHED) < 0)
        goto done;
    rc = 0;
done:
    Py_XDECREF(bases);
    return rc;
}

/* GC traversal of the module state. */
static int ts_module_traverse(PyObject *module, visitproc visit, void *arg)
{
    ts_state *st = PyModule_GetState(module);
    Py_VISIT(st->Ring_type);
    Py_VISIT(st->Slot_type);
    Py_VISIT(st->SlotView_type);
    Py_VISIT(st->TensorSocketError);
    Py_VISIT(st->ProducerGone);
    Py_VISIT(st->ProducerFinished);
    Py_VISIT(st->ConsumerDetached);
    Py_VISIT(st->BatchTooLarge);
    Py_VISIT(st->SharedMemoryTooSmall);
    Py_VISIT(st->TooManyConsumers);
    Py_VISIT(st->VersionMismatch);
    Py_VISIT(st->GPUUnavailable);
    Py_VISIT(st->CudaError);
    return 0;
}

/* Drop the module state's references. */
static int ts_module_clear(PyObject *module)
{
    ts_state *st = PyModule_GetState(module);
    Py_CLEAR(st->Ring_type);
    Py_CLEAR(st->Slot_type);
    Py_CLEAR(st->SlotView_type);
    Py_CLEAR(st->TensorSocketError);
    Py_CLEAR(st->ProducerGone);
    Py_CLEAR(st->ProducerFinished);
    Py_CLEAR(st->ConsumerDetached);
    Py_CLEAR(st->BatchTooLarge);
    Py_CLEAR(st->SharedMemoryTooSmall);
    Py_CLEAR(st->TooManyConsumers);
    Py_CLEAR(st->VersionMismatch);
    Py_CLEAR(st->GPUUnavailable);
    Py_CLEAR(st->CudaError);
    return 0;
}

/* Module free hook. */
static void ts_module_free(void *module)
{
    ts_state *st = PyModule_GetState((PyObject *)module);
    ts_module_clear((PyObject *)module);
    if (st != NULL) {
        /* Rings and views still alive hold their own references. */
        ts_cuda_unref(st->cuda);
        st->cuda = NULL;
    }
}

static PyModuleDef_Slot ts_module_slots[] = {
    {Py_mod_exec, ts_module_exec},
    {0, NULL},
};

static struct PyModuleDef ts_module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "tensorsocket._core",
    .m_doc = "The C core of tensorsocket: a shared-memory ring of tensor slots.",
    .m_size = sizeof(ts_state),
    .m_methods = ts_module_methods,
    .m_slots = ts_module_slots,
    .m_traverse = ts_module_traverse,
    .m_clear = ts_module_clear,
    .m_free = ts_module_free,
};

/* Module entry point (multi-phase init). */
PyMODINIT_FUNC PyInit__core(void)
{
    return PyModuleDef_Init(&ts_module_def);
}
