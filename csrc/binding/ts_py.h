/* ts_py.h - what the files of the CPython binding share (tensorsocket._core).
 *
 * The binding is ts_module.c (module state, errors, the device driver, module functions,
 * init), ts_py_ring.c (the Ring type), ts_py_slot.c (Slot and SlotView), ts_py_lane.c
 * (Lane, the common path of a consumer's next()), ts_py_watch.c (ProcessWatch, a
 * process's liveness by pidfd) and ts_py_store.c (Store, the decoded-sample store): the only files of the core that include Python.h. They
 * convert between Python objects and the core's structs and calls; the core does the rest.
 * Every type is a heap type made per module (multi-phase init), immutable, not
 * subclassable, not instantiable from Python; but Lane, the base class of the consumer's
 * epoch iterator, made and subclassed in Python. */
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

/* The attribute names the lane (ts_py_lane.c) reads and sets on the consumer's parts,
 * interned once per module (ts_py_lane_names). */
enum ts_lane_name {
    TS_N_EPOCH, TS_N_IN_EPOCH, TS_N_SOURCE_DONE, TS_N_RESUMING, TS_N_SKIP, TS_N_PULLED,
    TS_N_DELIVERED, TS_N_PRODUCER_EPOCH, TS_N_END_MARKER_UNREAD, TS_N_AFTER_END_MARKER,
    TS_N_READY, TS_N_LOADED, TS_N_BATCHES, TS_N_SAMPLES, TS_N_LOADER_BATCHES, TS_N_BYTES,
    TS_N_MINE, TS_N_BITS, TS_N_GROW, TS_N_MINE_SAMPLES, TS_N_KNOWN, TS_N_ATTACHED,
    TS_N_CLOSED, TS_N_NEXT_SLOW, TS_N_WAIT_ENTRY, TS_N_WAITED, TS_LANE_NAMES
};

/* The module's state. */
typedef struct ts_state {
    PyTypeObject *Ring_type;
    PyTypeObject *Slot_type;
    PyTypeObject *SlotView_type;
    PyTypeObject *Lane_type;
    PyTypeObject *Watch_type;
    PyTypeObject *Store_type;
    PyObject *lane_names[TS_LANE_NAMES]; /* owns: interned attribute names (ts_lane_name) */
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
extern PyType_Spec ts_py_lane_spec;
extern PyType_Spec ts_py_watch_spec;

/* Intern the lane's attribute names into names (TS_LANE_NAMES of them); 0, or -1 with an
 * exception. */
int ts_py_lane_names(PyObject **names);

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

/* ---- ts_py_store.c ------------------------------------------------------------ */

/* Make the Store type into state and add it and the store's constants to module; 0, or -1
 * with an exception. */
int ts_py_store_add(PyObject *module, ts_state *state);

/* ---- ts_py_slot.c ------------------------------------------------------------- */

/* A new Slot for what acquire took; steals the lease reference (released on failure). */
PyObject *ts_py_slot_new(ts_state *state, ts_lease *lease, const ts_acquired *got);

/* Leaf i of lease as a new DLPack capsule (opts: versioned, copy, device, stream); NULL
 * with an exception. */
PyObject *ts_py_capsule(ts_state *state, ts_lease *lease, uint32_t i, const ts_export_opts *opts);

/* What a Slot holds, read in place for the consumer's common path (ts_py_lane.c). */
typedef struct ts_py_entry {
    ts_lease *lease; /* borrowed from the Slot: valid while the Slot holds it */
    int is_batch;    /* a loader batch (not an end-of-epoch marker) */
    uint32_t n_leaves;
    uint64_t seq;
    uint64_t epoch;
    uint64_t index;
    uint64_t nbytes;
    PyObject *meta; /* borrowed: the Slot's meta bytes */
} ts_py_entry;

/* Fill out from slot: 1 if it is a Slot that still holds its entry, else 0. */
int ts_py_slot_peek(ts_state *state, PyObject *slot, ts_py_entry *out);

/* ---- ts_py_ring.c ------------------------------------------------------------- */

/* Take the next published entry of the consumer ring handle ring (a Ring object) into
 * box[0] (a list [None]), waiting up to wait_ns for it without the GIL (0: no wait; none
 * either while this handle's own held slots block the producer, which the caller's
 * waiting path sets aside): 1 when taken, 0 when there is none yet (or a signal came: the
 * caller's Python code honours it), 2 when the core says something else (finished, gone,
 * detached, closed: the caller's waiting path says what), -1 with an exception (no
 * memory). *waited_ns: how long it waited. */
int ts_py_ring_poll(ts_state *state, PyObject *ring, PyObject *box, uint64_t wait_ns,
                    uint64_t *waited_ns);

#endif /* TS_PY_H */
