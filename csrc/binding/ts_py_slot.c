/* ts_py_slot.c - the Slot and SlotView types of tensorsocket._core (see ts_py.h).
 *
 *   Slot      a consumer's lease on one published slot
 *   SlotView  one tensor of a slot, exported with __dlpack__
 */
#include "binding/ts_py.h"

/* ==========================================================================
 * SlotView: one tensor of a leased slot
 * ========================================================================== */

typedef struct {
    PyObject_HEAD
    ts_lease *lease; /* owns one lease reference, using leaf */
    uint32_t leaf;
    int device; /* exports the slot's device copy */
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

/* Wrap leaf i of lease in a new DLPack capsule (see ts_py.h). */
PyObject *ts_py_capsule(ts_state *state, ts_lease *lease, uint32_t i,
                        const ts_export_opts *opts)
{
    ts_err err = {0};
    int versioned = opts->versioned;
    void *m = ts_export_leaf(lease, i, opts, &err);
    if (m == NULL) return ts_py_raise(state, &err);
    PyObject *cap = versioned
                        ? PyCapsule_New(m, "dltensor_versioned", ts_capsule_destructor_versioned)
                        : PyCapsule_New(m, "dltensor", ts_capsule_destructor_legacy);
    if (cap == NULL) ts_export_delete(m, versioned);
    return cap;
}

/* BufferError for copy=True of a device view: the array API's answer of a producer that
 * cannot copy. Device memory of its own (cuMemAlloc) would compete with the consumer
 * framework's caching allocator, which cannot lend what it keeps reserved. */
static PyObject *ts_device_copy_refused(void)
{
    PyErr_SetString(PyExc_BufferError,
                    "tensorsocket does not allocate GPU memory for copies: export the view "
                    "and copy it with your framework's allocator (torch: "
                    "torch.from_dlpack(view).clone()), or use TensorConsumer(copy=True)");
    return NULL;
}

/* Parse a DLPack stream argument (NULL: None). Host tensors take None or -1. Device
 * tensors: None is the legacy default stream (1), 2 the per-thread default stream, a
 * larger int a CUstream, -1 "do not synchronize"; 0 is invalid. */
static int ts_parse_stream(PyObject *stream, int device, int64_t *out)
{
    long long v = device ? 1 : -1;
    if (stream != NULL && stream != Py_None) {
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

/* The (major, minor) DLPack version a max_version argument asks for: versioned (and the
 * minor to report) for major >= 1. */
static int ts_parse_max_version(PyObject *obj, ts_export_opts *opts)
{
    int version[2]; /* major, minor */
    if (obj == NULL || obj == Py_None) return 0;
    if (ts_py_ints(obj, 2, "max_version", version) < 0) return -1;
    int major = version[0], minor = version[1];
    if (major >= 1) {
        opts->versioned = 1;
        opts->minor = (major > 1 || minor > TS_DLPACK_MINOR) ? TS_DLPACK_MINOR : (uint32_t)minor;
    }
    return 0;
}

/* SlotView.__dlpack__(*, stream=None, max_version=None, dl_device=None, copy=None) */
static PyObject *SlotView_dlpack(SlotViewObject *self, PyObject *const *args, Py_ssize_t nargs,
                                 PyObject *kwnames)
{
    static const char *const names[] = {"stream", "max_version", "dl_device", "copy"};
    PyObject *a[4];
    if (ts_py_args("__dlpack__", args, nargs, kwnames, names, 4, 0, 0, a) < 0) return NULL;
    ts_export_opts opts = {.device = self->device, .stream = 1};
    if (ts_parse_stream(a[0], self->device, &opts.stream) < 0) return NULL;
    if (a[2] != NULL && a[2] != Py_None) {
        int dl_device[2];
        if (ts_py_ints(a[2], 2, "dl_device", dl_device) < 0) return NULL;
        int dev_type = dl_device[0], dev_id = dl_device[1];
        DLDevice here = ts_ring_dl_device(self->lease->ring, self->device);
        if (dev_type != here.device_type || dev_id != here.device_id) {
            PyErr_Format(PyExc_BufferError,
                         "tensorsocket cannot export a tensor on device (%d, %d) to device "
                         "(%d, %d); move it after import (e.g. .to() in torch)",
                         here.device_type, here.device_id, dev_type, dev_id);
            return NULL;
        }
    }
    if ((opts.copy = ts_py_bool(a[3])) < 0) return NULL;
    if (opts.copy && self->device) return ts_device_copy_refused();
    if (ts_parse_max_version(a[1], &opts) < 0) return NULL;
    return ts_py_capsule(ts_py_state((PyObject *)self), self->lease, self->leaf, &opts);
}

/* SlotView.__dlpack_device__() -> (device_type, device_id) */
static PyObject *SlotView_dlpack_device(SlotViewObject *self, PyObject *Py_UNUSED(ignored))
{
    DLDevice d = ts_ring_dl_device(self->lease->ring, self->device);
    return Py_BuildValue("(ii)", (int)d.device_type, (int)d.device_id);
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

/* SlotView.data_ptr: address of the first element in this process. A device address read
 * so is used by work on a stream nobody names (CuPy, Triton, a kernel of one's own): the
 * slot's release then also waits for the legacy default stream (ts_lease_use_raw). */
static PyObject *SlotView_get_data_ptr(SlotViewObject *self, void *Py_UNUSED(closure))
{
    const ts_leaf *leaf = ts_lease_leaf(self->lease, self->leaf);
    if (self->device) {
        ts_lease_use_raw(self->lease);
        return PyLong_FromUnsignedLongLong(
            ts_ring_device_ptr(self->lease->ring, self->lease->slot) + leaf->offset);
    }
    uint8_t *base = ts_ring_slot_data(self->lease->ring, self->lease->slot);
    return PyLong_FromVoidPtr(base + leaf->offset);
}

/* Drop the lease reference. */
static void SlotView_dealloc(SlotViewObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    if (self->lease != NULL) ts_lease_unref(self->lease, self->leaf);
    tp->tp_free(self);
    Py_DECREF(tp);
}

static PyMethodDef SlotView_methods[] = {
    {"__dlpack__", (PyCFunction)(void (*)(void))SlotView_dlpack, METH_FASTCALL | METH_KEYWORDS,
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

PyType_Spec ts_py_view_spec = {
    .name = "tensorsocket._core.SlotView",
    .basicsize = sizeof(SlotViewObject),
    .flags = TS_PY_TYPE_FLAGS,
    .slots = SlotView_slots,
};

/* ==========================================================================
 * Slot: a consumer's lease on one published entry
 * ========================================================================== */

typedef struct {
    PyObject_HEAD
    ts_lease *lease; /* owns one lease reference (using every leaf) until release() */
    uint32_t kind;
    uint32_t n_leaves;
    uint64_t seq;
    uint64_t epoch;
    uint64_t index;
    uint64_t nbytes; /* bytes of the entry in its slot */
    PyObject *meta;  /* owns: bytes of the structure blob */
} SlotObject;

/* A new Slot for what acquire took (see ts_py.h). */
PyObject *ts_py_slot_new(ts_state *state, ts_lease *lease, const ts_acquired *got)
{
    SlotObject *slot = PyObject_New(SlotObject, state->Slot_type);
    if (slot == NULL) {
        ts_lease_unref(lease, TS_USE_WHOLE);
        return NULL;
    }
    slot->lease = lease;
    slot->kind = got->kind;
    slot->n_leaves = got->n_leaves;
    slot->seq = got->seq;
    slot->epoch = got->epoch;
    slot->index = got->index;
    slot->nbytes = got->used_bytes;
    slot->meta = PyBytes_FromStringAndSize((const char *)got->meta, (Py_ssize_t)got->meta_bytes);
    if (slot->meta == NULL) Py_CLEAR(slot);
    return (PyObject *)slot;
}

/* What the Slot slot holds (see ts_py.h). */
int ts_py_slot_peek(ts_state *state, PyObject *slot, ts_py_entry *out)
{
    if (!Py_IS_TYPE(slot, state->Slot_type)) return 0;
    SlotObject *s = (SlotObject *)slot;
    if (s->lease == NULL) return 0;
    out->lease = s->lease;
    out->is_batch = s->kind != TS_ENTRY_END_EPOCH;
    out->n_leaves = s->n_leaves;
    out->seq = s->seq;
    out->epoch = s->epoch;
    out->index = s->index;
    out->nbytes = s->nbytes;
    out->meta = s->meta;
    return 1;
}

/* Raise if the slot was released, or (device) this consumer did not import the pool. */
static int ts_slot_check(SlotObject *self, int device)
{
    if (self->lease == NULL) {
        PyErr_SetString(PyExc_ValueError, "this slot was released");
        return -1;
    }
    if (!device || ts_ring_imported_device(self->lease->ring) >= 0) return 0;
    PyErr_SetString(PyExc_ValueError,
                    "device views need the ring's GPU memory: call Ring.import_device() first");
    return -1;
}

/* Slot.views(device=False) -> tuple of SlotView, one per tensor. */
static PyObject *Slot_views(SlotObject *self, PyObject *const *args, Py_ssize_t nargs,
                            PyObject *kwnames)
{
    static const char *const names[] = {"device"};
    PyObject *a[1];
    ts_state *state = ts_py_state((PyObject *)self);
    if (ts_py_args("views", args, nargs, kwnames, names, 1, 1, 0, a) < 0) return NULL;
    int device = ts_py_bool(a[0]);
    if (device < 0 || ts_slot_check(self, device) < 0) return NULL;
    PyObject *out = PyTuple_New(self->n_leaves);
    if (out == NULL) return NULL;
    if (device) ts_lease_use_device(self->lease); /* handed out: its release waits */
    for (uint32_t i = 0; i < self->n_leaves; i++) {
        SlotViewObject *v = PyObject_New(SlotViewObject, state->SlotView_type);
        if (v == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        ts_lease_ref(self->lease, i);
        v->lease = self->lease;
        v->leaf = i;
        v->device = device;
        PyTuple_SET_ITEM(out, i, (PyObject *)v);
    }
    return out;
}

/* Slot.capsules(versioned=False, copy=False, device=False, stream=None)
 * -> tuple of DLPack capsules. */
static PyObject *Slot_capsules(SlotObject *self, PyObject *const *args, Py_ssize_t nargs,
                               PyObject *kwnames)
{
    static const char *const names[] = {"versioned", "copy", "device", "stream"};
    PyObject *a[4];
    ts_state *state = ts_py_state((PyObject *)self);
    if (ts_py_args("capsules", args, nargs, kwnames, names, 4, 4, 0, a) < 0) return NULL;
    ts_export_opts opts = {.minor = TS_DLPACK_MINOR};
    if ((opts.versioned = ts_py_bool(a[0])) < 0 || (opts.copy = ts_py_bool(a[1])) < 0 ||
        (opts.device = ts_py_bool(a[2])) < 0)
        return NULL;
    if (opts.copy && opts.device) return ts_device_copy_refused();
    if (ts_slot_check(self, opts.device) < 0) return NULL;
    if (ts_parse_stream(a[3], opts.device, &opts.stream) < 0) return NULL;
    PyObject *out = PyTuple_New(self->n_leaves);
    if (out == NULL) return NULL;
    for (uint32_t i = 0; i < self->n_leaves; i++) {
        PyObject *cap = ts_py_capsule(state, self->lease, i, &opts);
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
    if (lease != NULL) ts_lease_unref(lease, TS_USE_WHOLE);
    Py_RETURN_NONE;
}

/* Slot.__enter__ */
static PyObject *Slot_enter(SlotObject *self, PyObject *Py_UNUSED(ignored))
{
    return Py_NewRef(self);
}

/* Slot.__exit__(*exc) releases. */
static PyObject *Slot_exit(SlotObject *self, PyObject *const *Py_UNUSED(args),
                           Py_ssize_t Py_UNUSED(nargs))
{
    return Slot_release(self, NULL);
}

/* Release and free. */
static void Slot_dealloc(SlotObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    if (self->lease != NULL) ts_lease_unref(self->lease, TS_USE_WHOLE);
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

/* Slot.seq, .epoch, .index, .n_leaves, .slot, .nbytes */
static PyObject *Slot_get_u64(SlotObject *self, void *closure)
{
    switch ((intptr_t)closure) {
    case 0: return PyLong_FromUnsignedLongLong(self->seq);
    case 1: return PyLong_FromUnsignedLongLong(self->epoch);
    case 2: return PyLong_FromUnsignedLongLong(self->index);
    case 3: return PyLong_FromUnsignedLong(self->n_leaves);
    case 5: return PyLong_FromUnsignedLongLong(self->nbytes);
    default:
        if (ts_slot_check(self, 0) < 0) return NULL;
        return PyLong_FromUnsignedLong(self->lease->slot);
    }
}

static PyMethodDef Slot_methods[] = {
    {"views", (PyCFunction)(void (*)(void))Slot_views, METH_FASTCALL | METH_KEYWORDS,
     "One SlotView per tensor (device=True: of the slot's GPU copy)."},
    {"capsules", (PyCFunction)(void (*)(void))Slot_capsules, METH_FASTCALL | METH_KEYWORDS,
     "One DLPack capsule per tensor."},
    {"release", (PyCFunction)Slot_release, METH_NOARGS,
     "Drop this object's hold on the slot (views and tensors keep their own)."},
    {"__enter__", (PyCFunction)Slot_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)(void (*)(void))Slot_exit, METH_FASTCALL, NULL},
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

PyType_Spec ts_py_slot_spec = {
    .name = "tensorsocket._core.Slot",
    .basicsize = sizeof(SlotObject),
    .flags = TS_PY_TYPE_FLAGS,
    .slots = Slot_slots,
};
