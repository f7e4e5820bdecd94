/* ts_module.c - tensorsocket._core: module state, errors, the device driver, module
 * functions and init. The Ring type is in ts_py_ring.c, Slot and SlotView in ts_py_slot.c
 * (ts_py.h says what the binding files share). */
#include "binding/ts_py.h"

#include <errno.h>
#include <limits.h>
#include <string.h>
#include <unistd.h>

#include "base/ts_clock.h"
#include "base/ts_copy.h"
#include "base/ts_fault.h"
#include "base/ts_proc.h"

static struct PyModuleDef ts_module_def;

/* ==========================================================================
 * Shared by the binding (ts_py.h)
 * ========================================================================== */

/* The module state of one of our objects (our types are not subclassable). */
ts_state *ts_py_state(PyObject *self)
{
    return PyType_GetModuleState(Py_TYPE(self));
}

/* The one error funnel: turn a core error into the matching exception. */
PyObject *ts_py_raise(ts_state *state, const ts_err *err)
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

/* The CUDA driver, loaded on first use (see ts_py.h). */
ts_device_driver *ts_py_cuda(ts_state *state)
{
    char why[sizeof state->cuda_why];
    if (ts_cuda_forked(state, why, sizeof why)) {
        PyErr_SetString(state->GPUUnavailable, why);
        return NULL;
    }
    if (state->cuda != NULL) return state->cuda;
    if (!state->cuda_tried) {
        ts_device_driver *driver = NULL;
        ts_err err = {0};
        ts_status st;
        Py_BEGIN_ALLOW_THREADS
        st = ts_device_cuda.load(&driver, &err);
        Py_END_ALLOW_THREADS
        if (state->cuda != NULL) { /* another thread loaded it meanwhile */
            ts_device_driver_unref(driver);
            return state->cuda;
        }
        state->cuda_tried = 1;
        if (st == TS_OK) {
            state->cuda = driver;
            state->cuda_pid = (long)getpid();
        }
        else snprintf(state->cuda_why, sizeof state->cuda_why, "%s", err.msg);
    }
    if (state->cuda == NULL) PyErr_SetString(state->GPUUnavailable, state->cuda_why);
    return state->cuda;
}

/* Parse a timeout in seconds (NULL or None: forever) into an absolute deadline. */
int ts_py_timeout(PyObject *obj, uint64_t *deadline)
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

/* Bind METH_FASTCALL | METH_KEYWORDS arguments to names (see ts_py.h). */
int ts_py_args(const char *fn, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
               const char *const *names, int n, int npos, int nreq, PyObject **out)
{
    for (int i = 0; i < n; i++) out[i] = NULL;
    if (nargs > npos) {
        PyErr_Format(PyExc_TypeError, "%s() takes at most %d positional argument%s (%zd given)",
                     fn, npos, npos == 1 ? "" : "s", nargs);
        return -1;
    }
    for (Py_ssize_t i = 0; i < nargs; i++) out[i] = args[i];
    Py_ssize_t nkw = kwnames != NULL ? PyTuple_GET_SIZE(kwnames) : 0;
    for (Py_ssize_t k = 0; k < nkw; k++) {
        PyObject *key = PyTuple_GET_ITEM(kwnames, k);
        int i = 0;
        while (i < n && PyUnicode_CompareWithASCIIString(key, names[i]) != 0) i++;
        if (i == n) {
            PyErr_Format(PyExc_TypeError, "%s() got an unexpected keyword argument '%U'", fn,
                         key);
            return -1;
        }
        if (out[i] != NULL) {
            PyErr_Format(PyExc_TypeError, "%s() got multiple values for argument '%s'", fn,
                         names[i]);
            return -1;
        }
        out[i] = args[nargs + k];
    }
    for (int i = 0; i < nreq; i++) {
        if (out[i] == NULL) {
            PyErr_Format(PyExc_TypeError, "%s() missing required argument '%s' (pos %d)", fn,
                         names[i], i + 1);
            return -1;
        }
    }
    return 0;
}

/* Truth of an optional argument (NULL: 0). */
int ts_py_bool(PyObject *obj)
{
    return obj == NULL ? 0 : PyObject_IsTrue(obj);
}

/* An int masked to 32 bits, unless not given. */
int ts_py_u32(PyObject *obj, uint32_t *out)
{
    if (obj == NULL) return 0;
    unsigned long v = PyLong_AsUnsignedLongMask(obj);
    if (v == (unsigned long)-1 && PyErr_Occurred()) return -1;
    *out = (uint32_t)v;
    return 0;
}

/* An int masked to 64 bits, unless not given. */
int ts_py_u64(PyObject *obj, uint64_t *out)
{
    if (obj == NULL) return 0;
    unsigned long long v = PyLong_AsUnsignedLongLongMask(obj);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) return -1;
    *out = (uint64_t)v;
    return 0;
}

/* An int that fits a C int, unless not given. */
int ts_py_int(PyObject *obj, int *out)
{
    if (obj == NULL) return 0;
    long v = PyLong_AsLong(obj);
    if (v == -1 && PyErr_Occurred()) return -1;
    if (v < INT_MIN || v > INT_MAX) {
        PyErr_SetString(PyExc_OverflowError, "signed integer is out of the range of a C int");
        return -1;
    }
    *out = (int)v;
    return 0;
}

/* A float, unless not given. */
int ts_py_double(PyObject *obj, double *out)
{
    if (obj == NULL) return 0;
    double v = PyFloat_AsDouble(obj);
    if (v == -1.0 && PyErr_Occurred()) return -1;
    *out = v;
    return 0;
}

/* A str without NULs as UTF-8 (None: NULL, with none_ok), unless not given. */
int ts_py_str(PyObject *obj, int none_ok, const char **out)
{
    if (obj == NULL) return 0;
    if (none_ok && obj == Py_None) {
        *out = NULL;
        return 0;
    }
    if (!PyUnicode_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "expected str%s, not %.50s", none_ok ? " or None" : "",
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    Py_ssize_t n;
    const char *s = PyUnicode_AsUTF8AndSize(obj, &n);
    if (s == NULL) return -1;
    if ((size_t)n != strlen(s)) {
        PyErr_SetString(PyExc_ValueError, "embedded null character");
        return -1;
    }
    *out = s;
    return 0;
}

/* Truth of an argument, unless not given. */
int ts_py_flag(PyObject *obj, int *out)
{
    if (obj == NULL) return 0;
    int v = PyObject_IsTrue(obj);
    if (v < 0) return -1;
    *out = v;
    return 0;
}

/* A tuple of n C ints. */
int ts_py_ints(PyObject *obj, int n, const char *what, int *out)
{
    if (!PyTuple_Check(obj) || PyTuple_GET_SIZE(obj) != n) {
        PyErr_Format(PyExc_TypeError, "%s must be a tuple of %d ints", what, n);
        return -1;
    }
    for (int i = 0; i < n; i++)
        if (ts_py_int(PyTuple_GET_ITEM(obj, i), &out[i]) < 0) return -1;
    return 0;
}

/* One field of the struct at base as a new object. */
static PyObject *ts_py_field_value(const void *base, const ts_py_field *f)
{
    const char *p = (const char *)base + f->offset;
    switch (f->kind) {
    case 'u': return PyLong_FromUnsignedLong(*(const uint32_t *)(const void *)p);
    case 'i': return PyLong_FromLong(*(const int *)(const void *)p);
    case 'K': return PyLong_FromUnsignedLongLong(*(const uint64_t *)(const void *)p);
    case 'L': return PyLong_FromLongLong(*(const int64_t *)(const void *)p);
    case 'b': return PyBool_FromLong(*(const int *)(const void *)p);
    case 's': return PyUnicode_FromString(p);
    case 'S': return PyUnicode_FromString(*(const char *const *)(const void *)p);
    case 'q': {
        uint64_t seq = *(const uint64_t *)(const void *)p;
        return seq == TS_SEQ_NONE ? Py_NewRef(Py_None) : PyLong_FromUnsignedLongLong(seq);
    }
    default: return PyErr_Format(PyExc_SystemError, "field %s: kind %c", f->key, f->kind);
    }
}

/* A new dict of the n fields of the struct at base (see ts_py.h). */
PyObject *ts_py_dict(const void *base, const ts_py_field *fields, size_t n)
{
    PyObject *d = PyDict_New();
    for (size_t i = 0; d != NULL && i < n; i++) {
        PyObject *v = ts_py_field_value(base, &fields[i]);
        if (v == NULL || PyDict_SetItemString(d, fields[i].key, v) < 0) Py_CLEAR(d);
        Py_XDECREF(v);
    }
    return d;
}

/* ==========================================================================
 * Module functions and init
 * ========================================================================== */

/* process_start_time(pid) -> start time in clock ticks, 0 if no such process */
static PyObject *ts_py_process_start_time(PyObject *Py_UNUSED(module), PyObject *const *args,
                                          Py_ssize_t nargs, PyObject *kwnames)
{
    static const char *const names[] = {"pid"};
    PyObject *a[1];
    int pid = 0;
    if (ts_py_args("process_start_time", args, nargs, kwnames, names, 1, 1, 1, a) < 0 ||
        ts_py_int(a[0], &pid) < 0)
        return NULL;
    return PyLong_FromUnsignedLongLong(ts_proc_start_time((pid_t)pid));
}

/* process_stat(pid) -> dict of /proc/<pid>/stat's fields (ts_proc_stat), or None if the
 * process is gone or its file cannot be read or parsed */
static PyObject *ts_py_process_stat(PyObject *Py_UNUSED(module), PyObject *const *args,
                                    Py_ssize_t nargs, PyObject *kwnames)
{
    static const char *const names[] = {"pid"};
    PyObject *a[1];
    int pid = 0;
    if (ts_py_args("process_stat", args, nargs, kwnames, names, 1, 1, 1, a) < 0 ||
        ts_py_int(a[0], &pid) < 0)
        return NULL;
    ts_proc_stat st;
    if (pid <= 0 || ts_proc_read_stat((pid_t)pid, &st) != 0) Py_RETURN_NONE;
    return Py_BuildValue("{sCsisKsKsKsKsK}", "state", (int)(unsigned char)st.state, "ppid",
                         (int)st.ppid, "utime", (unsigned long long)st.utime, "stime",
                         (unsigned long long)st.stime, "cutime", (unsigned long long)st.cutime,
                         "cstime", (unsigned long long)st.cstime, "start_time",
                         (unsigned long long)st.start_time);
}

/* process_alive(pid, start_time) -> bool */
static PyObject *ts_py_process_alive(PyObject *Py_UNUSED(module), PyObject *const *args,
                                     Py_ssize_t nargs, PyObject *kwnames)
{
    static const char *const names[] = {"pid", "start_time"};
    PyObject *a[2];
    int pid = 0;
    uint64_t start = 0;
    if (ts_py_args("process_alive", args, nargs, kwnames, names, 2, 2, 2, a) < 0 ||
        ts_py_int(a[0], &pid) < 0 || ts_py_u64(a[1], &start) < 0)
        return NULL;
    return PyBool_FromLong(ts_proc_alive(pid, start));
}

/* segment_bytes(slot_count, slot_bytes, max_leaves) -> bytes a ring needs */
static PyObject *ts_py_segment_bytes(PyObject *Py_UNUSED(module), PyObject *const *args,
                                     Py_ssize_t nargs, PyObject *kwnames)
{
    static const char *const names[] = {"slot_count", "slot_bytes", "max_leaves"};
    PyObject *a[3];
    ts_geometry g = {0};
    if (ts_py_args("segment_bytes", args, nargs, kwnames, names, 3, 3, 3, a) < 0 ||
        ts_py_u32(a[0], &g.slot_count) < 0 || ts_py_u64(a[1], &g.slot_bytes) < 0 ||
        ts_py_u32(a[2], &g.max_leaves) < 0)
        return NULL;
    return PyLong_FromUnsignedLongLong(ts_ring_segment_bytes(&g, NULL));
}

/* cuda_status() -> dict: is the GPU path available here, and why not. */
static PyObject *ts_py_cuda_status(PyObject *module, PyObject *Py_UNUSED(ignored))
{
    ts_state *state = PyModule_GetState(module);
    char forked[sizeof state->cuda_why];
    int in_child = ts_cuda_forked(state, forked, sizeof forked);
    ts_device_driver *driver = ts_py_cuda(state);
    if (driver == NULL) {
        PyErr_Clear();
        return Py_BuildValue("{sOsssOsi}", "available", Py_False, "reason",
                             in_child ? forked : state->cuda_why, "devices", Py_None,
                             "driver_version", 0);
    }
    const ts_device *device = driver->device;
    int count = device->device_count(driver);
    if (count < 0) count = 0;
    PyObject *devices = PyList_New(0);
    for (int i = 0; devices != NULL && i < count; i++) {
        ts_device_desc desc;
        if (device->describe(driver, i, &desc) != 0) continue;
        PyObject *ipc = desc.ipc_events < 0 ? Py_None : desc.ipc_events ? Py_True : Py_False;
        PyObject *d = Py_BuildValue("{sisssssO}", "ordinal", i, "name", desc.name, "uuid",
                                    desc.uuid, "ipc_events", ipc);
        if (d == NULL || PyList_Append(devices, d) < 0) Py_CLEAR(devices);
        Py_XDECREF(d);
    }
    if (devices == NULL) return NULL;
    const char *reason = count > 0 ? NULL : "the CUDA driver sees no GPU";
    return Py_BuildValue("{sOszsNsisssi}", "available", count > 0 ? Py_True : Py_False,
                         "reason", reason, "devices", devices, "driver_version",
                         driver->version, "library", driver->path, "device_count", count);
}

/* copy_stream(dst, src) -> bool: the slot-fill streaming copy, for benchmarks. */
static PyObject *ts_py_copy_stream(PyObject *Py_UNUSED(module), PyObject *const *args,
                                   Py_ssize_t nargs, PyObject *kwnames)
{
    static const char *const names[] = {"dst", "src"};
    PyObject *a[2], *result = NULL;
    Py_buffer dst = {0}, src = {0};
    if (ts_py_args("copy_stream", args, nargs, kwnames, names, 2, 2, 2, a) < 0 ||
        PyObject_GetBuffer(a[0], &dst, PyBUF_WRITABLE) < 0)
        return NULL;
    if (PyObject_GetBuffer(a[1], &src, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&dst);
        return NULL;
    }
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
static PyObject *ts_py_set_process_name(PyObject *Py_UNUSED(module), PyObject *const *args,
                                        Py_ssize_t nargs, PyObject *kwnames)
{
    static const char *const names[] = {"name"};
    PyObject *a[1];
    const char *name = NULL;
    if (ts_py_args("set_process_name", args, nargs, kwnames, names, 1, 1, 1, a) < 0 ||
        ts_py_str(a[0], 0, &name) < 0)
        return NULL;
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
    {"set_process_name", TS_PY_FASTCALL(ts_py_set_process_name),
     "Name this process as ps and top show it (its first 15 bytes; Linux)."},
    {"cuda_loaded", ts_py_cuda_loaded, METH_NOARGS,
     "True once the CUDA driver was initialised here (or in the process that forked this "
     "one); it never loads the driver."},
    {"process_start_time", TS_PY_FASTCALL(ts_py_process_start_time),
     "Start time of a process in clock ticks (0 if it does not exist)."},
    {"process_stat", TS_PY_FASTCALL(ts_py_process_stat),
     "What /proc/<pid>/stat says of a process: state, ppid, utime, stime, cutime, cstime, start_time (clock "
     "ticks); None if it is gone or unreadable."},
    {"process_alive", TS_PY_FASTCALL(ts_py_process_alive),
     "True if pid exists and started at start_time."},
    {"segment_bytes", TS_PY_FASTCALL(ts_py_segment_bytes),
     "Bytes of shared memory a ring of this geometry needs."},
    {"copy_stream", TS_PY_FASTCALL(ts_py_copy_stream),
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

    st->Ring_type = (PyTypeObject *)PyType_FromModuleAndSpec(module, &ts_py_ring_spec, NULL);
    st->Slot_type = (PyTypeObject *)PyType_FromModuleAndSpec(module, &ts_py_slot_spec, NULL);
    st->SlotView_type = (PyTypeObject *)PyType_FromModuleAndSpec(module, &ts_py_view_spec, NULL);
    st->Lane_type = (PyTypeObject *)PyType_FromModuleAndSpec(module, &ts_py_lane_spec, NULL);
    st->Watch_type = (PyTypeObject *)PyType_FromModuleAndSpec(module, &ts_py_watch_spec, NULL);
    if (st->Ring_type == NULL || st->Slot_type == NULL || st->SlotView_type == NULL ||
        st->Lane_type == NULL || st->Watch_type == NULL || ts_py_lane_names(st->lane_names) < 0)
        goto done;
    if (PyModule_AddType(module, st->Ring_type) < 0 ||
        PyModule_AddType(module, st->Slot_type) < 0 ||
        PyModule_AddType(module, st->SlotView_type) < 0 ||
        PyModule_AddType(module, st->Lane_type) < 0 ||
        PyModule_AddType(module, st->Watch_type) < 0 || ts_py_store_add(module, st) < 0)
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
        PyModule_AddIntConstant(module, "MAX_SLOTS", TS_MAX_SLOTS) < 0 ||
        PyModule_AddIntConstant(module, "MIN_SLOTS", TS_MIN_SLOTS) < 0 ||
        PyModule_AddIntConstant(module, "RESERVE_SLOTS", TS_RESERVE_SLOTS) < 0 ||
        PyModule_AddIntConstant(module, "MAX_NDIM", TS_MAX_NDIM) < 0 ||
        PyModule_AddIntConstant(module, "DL_CPU", kDLCPU) < 0 ||
        PyModule_AddIntConstant(module, "DL_CUDA", kDLCUDA) < 0 ||
        PyModule_AddIntConstant(module, "DL_CUDA_HOST", kDLCUDAHost) < 0 ||
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
        PyModule_AddIntConstant(module, "REASON_UNREAD", TS_REASON_UNREAD) < 0 ||
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
    Py_VISIT(st->Lane_type);
    Py_VISIT(st->Watch_type);
    Py_VISIT(st->Store_type);
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
    Py_CLEAR(st->Lane_type);
    Py_CLEAR(st->Watch_type);
    Py_CLEAR(st->Store_type);
    for (int i = 0; i < TS_LANE_NAMES; i++) Py_CLEAR(st->lane_names[i]);
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
        ts_device_driver_unref(st->cuda);
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
