/* ts_py.h - what the files of the CPython binding share (tensorsocket._core).
 *
 * The binding is ts_module.c (module state, errors, the device driver, module functions,
 * init), ts_py_ring.c (the Ring type) and ts_py_slot.c (Slot and SlotView): the only
 * files of the core that include Python.h. They convert between Python objects and the
 * core's structs and calls; the core does the rest. Every type is a heap type made per
 * module (multi-phase init), immutable, not subclassable, not instantiable from Python. */
#ifndef TS_PY_H
#define TS_PY_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stddef.h>
#include <stdint.h>

#include "device/ts_device.h"
#include "base/ts_error.h"
#include "ring/ts_export.h"
#include "ring/ts_ring.h"

/* The module's state. */
typedef struct ts_state {
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
    ts_device_driver *cuda; /* owns one reference once loaded, else NULL */
    long cuda_pid;          /* the process that loaded it (a forked child cannot use it) */
    int cuda_tried;         /* loading was attempted (cuda_why says why it failed) */
    char cuda_why[512];
} ts_state;

/* A Ring object. */
typedef struct RingObject {
    PyObject_HEAD
    ts_ring *ring; /* owns one ring reference; NULL once closed */
} RingObject;

extern PyType_Spec ts_py_ring_spec;
extern PyType_Spec ts_py_slot_spec;
extern PyType_Spec ts_py_view_spec;

/* A method table entry's function and flags for a function that takes arguments. */
#define TS_PY_FASTCALL(fn) (PyCFunction)(void (*)(void))(fn), METH_FASTCALL | METH_KEYWORDS

/* The flags of every type of the module. */
#define TS_PY_TYPE_FLAGS \
    (Py_TPFLAGS_DEFAULT | Py_TPFLAGS_DISALLOW_INSTANTIATION | Py_TPFLAGS_IMMUTABLETYPE)

/* ---- ts_module.c -------------------------------------------------------------- */

/* The module state of one of our objects. */
ts_state *ts_py_state(PyObject *self);

/* Raise the exception that matches a core error; returns NULL. */
PyObject *ts_py_raise(ts_state *state, const ts_err *err);

/* The CUDA driver, loaded on first use; NULL with GPUUnavailable set if it cannot be
 * loaded here (the reason is kept, and loading is not retried). */
ts_device_driver *ts_py_cuda(ts_state *state);

/* Parse a timeout in seconds (NULL or None: forever) into an absolute deadline; -1 with an
 * exception. */
int ts_py_timeout(PyObject *obj, uint64_t *deadline);

/* Arguments, the one way the binding takes them: every function or method with arguments
 * is METH_FASTCALL | METH_KEYWORDS, binds them to their names with ts_py_args, then
 * converts each with one of the ts_py_* converters below (or uses the object itself). */

/* Bind METH_FASTCALL | METH_KEYWORDS arguments to the n names: out[i] is the argument
 * named names[i], or NULL when not given (the caller's default). The first npos may come
 * by position or keyword, the rest only by keyword; the first nreq are required. 0, or -1
 * with a TypeError. */
int ts_py_args(const char *fn, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
               const char *const *names, int n, int npos, int nreq, PyObject **out);

/* The converters: obj is an argument bound by ts_py_args (NULL: not given, *out keeps the
 * caller's default). 0, or -1 with an exception. */

/* An int, masked to 32 bits (as the "I" format of PyArg_ParseTuple takes it). */
int ts_py_u32(PyObject *obj, uint32_t *out);

/* An int, masked to 64 bits (as "K" takes it). */
int ts_py_u64(PyObject *obj, uint64_t *out);

/* An int that fits a C int (as "i" takes it: OverflowError beyond). */
int ts_py_int(PyObject *obj, int *out);

/* A float, or an object with __float__ or __index__ (as "d" takes it). */
int ts_py_double(PyObject *obj, double *out);

/* A str without NUL characters, as UTF-8 (as "s" takes it; borrowed from obj). With
 * none_ok, None gives NULL (as "z" takes it). */
int ts_py_str(PyObject *obj, int none_ok, const char **out);

/* Truth of an argument (as "p" takes it). */
int ts_py_flag(PyObject *obj, int *out);

/* Truth of an optional argument (NULL: 0); 0/1, or -1 with an exception. */
int ts_py_bool(PyObject *obj);

/* A tuple of n ints that fit C ints (what, in a TypeError: the argument it is), into out. */
int ts_py_ints(PyObject *obj, int n, const char *what, int *out);

/* One field of a core struct, as a dict item. */
typedef struct ts_py_field {
    const char *key;
    char kind; /* 'u' uint32_t, 'i' int, 'K' uint64_t, 'L' int64_t, 'b' int as a bool,
                * 's' char array, 'S' const char *, 'q' uint64_t sequence number
                * (TS_SEQ_NONE: None) */
    size_t offset;
} ts_py_field;

#define TS_PY_FIELD(type, field, kind) {#field, kind, offsetof(type, field)}

/* A new dict of the n fields of the struct at base. */
PyObject *ts_py_dict(const void *base, const ts_py_field *fields, size_t n);

/* ---- ts_py_slot.c ------------------------------------------------------------- */

/* A new Slot for what acquire took; steals the lease reference (released on failure). */
PyObject *ts_py_slot_new(ts_state *state, ts_lease *lease, const ts_acquired *got);

#endif /* TS_PY_H */
