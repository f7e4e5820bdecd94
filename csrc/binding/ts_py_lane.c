/* ts_py_lane.c - the Lane type of tensorsocket._core (see ts_py.h): the common path of a
 * consumer's next(), in one call.
 *
 * Lane is the base class of tensorsocket's EpochIterator (consumer/iterator.py). Its
 * tp_iternext, which a for loop calls directly, takes the consumer's next ring entry and,
 * when that is a plain loader batch of the epoch being read (not its last) for a consumer
 * in the common case (set up by Python: host ring, no re-batching, no transform, alone,
 * whole epochs), builds the batch, counts it delivered in the consumer's parts and returns
 * it. Everything else goes to the subclass's _next_slow(), with the entry taken left in
 * the consumer's entry box, unplaced, as Ring.acquire leaves it.
 *
 * A KeyboardInterrupt cannot split the count: what can fail or run Python code (the wait,
 * the build) comes first, with the entry in the box; then the counts are set in one run of
 * attribute stores, with no Python code in between (plain and __slots__ attributes), the
 * entry used up, and the batch returned. The cursor's placed and taken_seq are not set:
 * they make a repeated place() of an entry answer as before, and an entry used up here is
 * never placed again. The names it reads and sets are the consumer's parts, as
 * BatchFlow.lane_setup (tensorsocket/consumer/flow.py) hands them over: cursor
 * (EpochCursor), flow (InFlight), taken (EpochTaken), place (RingPlace). */
#include "binding/ts_py.h"

#include <string.h>

#include "base/ts_dlpack.h"

/* The meta blob of an entry with sample ids: the mark, the structure's length (u32 LE),
 * the structure, then int64 LE ids (tensorsocket/data/sample_ids.py, with_ids). */
#define TS_IDS_MARK 0xc1
#define TS_IDS_HEADER 5

typedef struct LaneObject {
    PyObject_HEAD
    PyObject *module;      /* owns: the module, whose state is below */
    ts_state *state;       /* the module's state */
    PyObject *place;       /* owns: the RingPlace (attached, closed); None: no common path */
    PyObject *ring_box;    /* owns: [Ring] the consumer reads through (set-aside replaces it) */
    PyObject *entry_box;   /* owns: flow.entry, [Slot or None] */
    PyObject *cursor;      /* owns: the EpochCursor */
    PyObject *flow;        /* owns: the InFlight */
    PyObject *taken;       /* owns: the EpochTaken */
    PyObject *builder;     /* owns: structure blob -> build(leaves), or None: not common */
    PyObject *from_dlpack; /* owns: a DLPack capsule -> a tensor */
    PyObject *pid_box;     /* owns: [pid of this process] (a forked child sets its own) */
    PyObject *structure;   /* owns: the structure blob last built (NULL: none yet) */
    PyObject *build;       /* owns: its build function (NULL: not common) */
    long pid;              /* the process the consumer reads in */
    long long epoch;       /* the consumer epoch this iterator reads */
    long long length;      /* loader batches per producer epoch (-1: unknown) */
    long long batch_samples; /* samples of a loader batch but the last (-1: dim 0 of one) */
    int with_index;        /* return (index, batch) pairs */
    uint64_t wait_ns;      /* how long next() waits in the core before _wait_entry() */
} LaneObject;

/* What the common check read of the cursor, for the count. */
typedef struct ts_lane_view {
    long long producer_epoch;
    long long pulled;
} ts_lane_view;

/* Intern the lane's attribute names (see ts_py.h). */
int ts_py_lane_names(PyObject **names)
{
    static const char *const text[TS_LANE_NAMES] = {
        "epoch", "in_epoch", "source_done", "resuming", "skip", "pulled", "delivered",
        "producer_epoch", "end_marker_unread", "after_end_marker", "ready", "loaded",
        "batches", "samples", "loader_batches", "bytes", "mine", "bits", "grow",
        "mine_samples", "known", "attached", "closed", "_next_slow", "_wait_entry",
        "waited"};
    for (int i = 0; i < TS_LANE_NAMES; i++) {
        names[i] = PyUnicode_InternFromString(text[i]);
        if (names[i] == NULL) return -1;
    }
    return 0;
}

/* ==========================================================================
 * Reading the consumer's parts
 * ========================================================================== */

/* 1 if obj.<name> is `want` (an identity test), 0 if not, -1 with an exception. */
static int ts_attr_is(LaneObject *self, PyObject *obj, int name, PyObject *want)
{
    PyObject *v = PyObject_GetAttr(obj, self->state->lane_names[name]);
    if (v == NULL) return -1;
    int is = v == want;
    Py_DECREF(v);
    return is;
}

/* obj.<name> as a long long into *out: 1, 0 if it is not an int (None), -1 with an
 * exception. */
static int ts_attr_ll(LaneObject *self, PyObject *obj, int name, long long *out)
{
    PyObject *v = PyObject_GetAttr(obj, self->state->lane_names[name]);
    if (v == NULL) return -1;
    int ok = PyLong_CheckExact(v);
    if (ok) {
        *out = PyLong_AsLongLong(v);
        if (*out == -1 && PyErr_Occurred()) ok = -1;
    }
    Py_DECREF(v);
    return ok;
}

/* Whether the consumer is in the common case now: the common path on (bound, not cleared
 * by the GC), its process, attached, its epoch under way and anchored (a batch of it taken), nothing of it in flight (entry_free: nor an
 * entry in the box). 1/0, or -1 with an exception; *view gets what the count needs. */
static int ts_lane_common(LaneObject *self, int entry_free, ts_lane_view *view)
{
    if (self->place == NULL || self->place == Py_None) return 0; /* (cleared, or off) */
    if (PyLong_AsLong(PyList_GET_ITEM(self->pid_box, 0)) != self->pid)
        return PyErr_Occurred() ? -1 : 0;
    if (entry_free && PyList_GET_ITEM(self->entry_box, 0) != Py_None) return 0;
    long long epoch = -1, skip = -1;
    int r;
    if ((r = ts_attr_is(self, self->place, TS_N_ATTACHED, Py_True)) != 1 ||
        (r = ts_attr_is(self, self->place, TS_N_CLOSED, Py_False)) != 1 ||
        (r = ts_attr_ll(self, self->cursor, TS_N_EPOCH, &epoch)) != 1)
        return r;
    if (epoch != self->epoch) return 0; /* (the slow path ends this iterator) */
    if ((r = ts_attr_is(self, self->cursor, TS_N_IN_EPOCH, Py_True)) != 1 ||
        (r = ts_attr_is(self, self->cursor, TS_N_SOURCE_DONE, Py_False)) != 1 ||
        (r = ts_attr_is(self, self->cursor, TS_N_RESUMING, Py_False)) != 1 ||
        (r = ts_attr_is(self, self->cursor, TS_N_END_MARKER_UNREAD, Py_False)) != 1 ||
        (r = ts_attr_is(self, self->cursor, TS_N_AFTER_END_MARKER, Py_False)) != 1 ||
        (r = ts_attr_ll(self, self->cursor, TS_N_SKIP, &skip)) != 1)
        return r;
    if (skip != 0) return 0;
    if ((r = ts_attr_ll(self, self->cursor, TS_N_PULLED, &view->pulled)) != 1) return r;
    if (view->pulled <= 0) return 0; /* an epoch's first batch anchors it: the slow path */
    if ((r = ts_attr_ll(self, self->cursor, TS_N_PRODUCER_EPOCH, &view->producer_epoch)) != 1)
        return r;
    if ((r = ts_attr_is(self, self->flow, TS_N_READY, Py_None)) != 1) return r;
    return ts_attr_is(self, self->flow, TS_N_LOADED, Py_None);
}

/* ==========================================================================
 * Taking and building
 * ========================================================================== */

/* Add waited_ns to flow.waited (seconds the common path waited in the core: stats()'s
 * wait_seconds counts them). 0, or -1 with an exception. */
static int ts_lane_note_wait(LaneObject *self, uint64_t waited_ns)
{
    PyObject *name = self->state->lane_names[TS_N_WAITED];
    PyObject *was = PyObject_GetAttr(self->flow, name);
    if (was == NULL) return -1;
    double seconds = PyFloat_AsDouble(was);
    Py_DECREF(was);
    if (seconds == -1.0 && PyErr_Occurred()) return -1;
    PyObject *now = PyFloat_FromDouble(seconds + (double)waited_ns / 1e9);
    if (now == NULL) return -1;
    int rc = PyObject_SetAttr(self->flow, name, now);
    Py_DECREF(now);
    return rc;
}

/* Put the next entry in the entry box: taken at once if published, else after a short
 * wait in the core (wait_ns, see bind_lane), else after the subclass's _wait_entry() (the
 * consumer's waits). 1 with the entry peeked into *e, 0
 * where the slow path takes over (with or without an entry in the box), -1 with an
 * exception. */
static int ts_lane_take(LaneObject *self, ts_lane_view *view, ts_py_entry *e)
{
    uint64_t waited_ns = 0;
    int r = ts_py_ring_poll(self->state, PyList_GET_ITEM(self->ring_box, 0), self->entry_box,
                            self->wait_ns, &waited_ns);
    if (r < 0 || (waited_ns > 0 && ts_lane_note_wait(self, waited_ns) < 0)) return -1;
    if (r == 2) return 0;
    /* Other threads ran during a wait (a park, a close): look again, as after a wait in
     * Python; an entry taken stays in the box for the slow path if this is no longer the
     * common case. */
    if (r == 1 && waited_ns > 0 && (r = ts_lane_common(self, 0, view)) != 1) return r;
    if (r == 0) {
        PyObject *got = PyObject_CallMethodNoArgs((PyObject *)self,
                                                  self->state->lane_names[TS_N_WAIT_ENTRY]);
        if (got == NULL) return -1;
        int waited = got == Py_True;
        Py_DECREF(got);
        if (!waited) return 0;
        /* Python code ran: look again (the entry now in the box is unplaced). */
        if ((r = ts_lane_common(self, 0, view)) != 1) return r;
    }
    return ts_py_slot_peek(self->state, PyList_GET_ITEM(self->entry_box, 0), e);
}

/* The build function for the structure blob of an entry (borrowed; NULL: not the common
 * case), compiled by the builder when the blob changes. 0, or -1 with an exception. */
static int ts_lane_build_fn(LaneObject *self, const char *blob, Py_ssize_t n, PyObject **build)
{
    PyObject *known = self->structure;
    if (known != NULL && PyBytes_GET_SIZE(known) == n &&
        memcmp(PyBytes_AS_STRING(known), blob, (size_t)n) == 0) {
        *build = self->build;
        return 0;
    }
    PyObject *structure = PyBytes_FromStringAndSize(blob, n);
    if (structure == NULL) return -1;
    PyObject *fn = PyObject_CallOneArg(self->builder, structure);
    if (fn == NULL) {
        Py_DECREF(structure);
        return -1;
    }
    Py_XSETREF(self->structure, structure);
    Py_CLEAR(self->build);
    if (fn != Py_None) self->build = fn;
    else Py_DECREF(fn);
    *build = self->build;
    return 0;
}

/* The batch of entry e: a tensor per leaf (DLPack views that hold the slot), built into
 * the loader's structure. NULL with an exception. */
static PyObject *ts_lane_batch(LaneObject *self, const ts_py_entry *e, PyObject *build)
{
    ts_export_opts opts = {.versioned = 1, .minor = TS_DLPACK_MINOR};
    PyObject *leaves = PyList_New(e->n_leaves);
    if (leaves == NULL) return NULL;
    for (uint32_t i = 0; i < e->n_leaves; i++) {
        PyObject *cap = ts_py_capsule(self->state, e->lease, i, &opts);
        PyObject *tensor = cap != NULL ? PyObject_CallOneArg(self->from_dlpack, cap) : NULL;
        Py_XDECREF(cap);
        if (tensor == NULL) {
            Py_DECREF(leaves);
            return NULL;
        }
        PyList_SET_ITEM(leaves, i, tensor);
    }
    PyObject *batch = PyObject_CallOneArg(build, leaves);
    Py_DECREF(leaves);
    return batch;
}

/* The samples of loader batch e: the loader's batch size, else dim 0 of its first leaf
 * with a dimension, else 0 (as the slow path counts them). */
static long long ts_lane_samples(const LaneObject *self, const ts_py_entry *e)
{
    if (self->batch_samples >= 0) return self->batch_samples;
    for (uint32_t i = 0; i < e->n_leaves; i++) {
        const ts_leaf *leaf = ts_lease_leaf(e->lease, i);
        if (leaf != NULL && leaf->ndim > 0) return leaf->shape[0];
    }
    return 0;
}

/* ==========================================================================
 * The count
 * ========================================================================== */

/* The new counts of one delivered batch, made before any is set. */
typedef struct ts_lane_counts {
    PyObject *value[8]; /* owns: pulled, delivered, batches, samples, loader_batches, bytes,
                         * mine_samples (NULL: the batch told no ids), the index */
} ts_lane_counts;

/* obj.<name> + add as a new int into *out; 0, or -1 with an exception. */
static int ts_attr_plus(LaneObject *self, PyObject *obj, int name, long long add, PyObject **out)
{
    long long v = 0;
    int r = ts_attr_ll(self, obj, name, &v);
    if (r == 0) PyErr_Format(PyExc_TypeError, "consumer count %U is not an int",
                             self->state->lane_names[name]);
    if (r != 1) return -1;
    *out = PyLong_FromLongLong(v + add);
    return *out == NULL ? -1 : 0;
}

/* The bits of taken.mine (a numpy bool array, grown by mine.grow(top) first when top is
 * past its end), as a writable buffer into view; 0, or -1 with an exception. */
static int ts_lane_mine_bits(LaneObject *self, long long top, Py_buffer *view)
{
    PyObject **names = self->state->lane_names;
    PyObject *mine = PyObject_GetAttr(self->taken, names[TS_N_MINE]);
    if (mine == NULL) return -1;
    for (int grown = 0;; grown = 1) {
        PyObject *bits = PyObject_GetAttr(mine, names[TS_N_BITS]);
        int rc = bits != NULL ? PyObject_GetBuffer(bits, view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS)
                              : -1;
        Py_XDECREF(bits);
        if (rc < 0) break;
        if (view->itemsize != 1 || (view->len < top && grown)) {
            PyBuffer_Release(view);
            PyErr_SetString(PyExc_RuntimeError, "taken.mine.bits is not one byte per sample "
                                                "id, up to the largest id delivered");
            break;
        }
        if (view->len >= top) {
            Py_DECREF(mine);
            return 0;
        }
        PyBuffer_Release(view);
        PyObject *size = PyLong_FromLongLong(top);
        PyObject *none = size != NULL ? PyObject_CallMethodOneArg(mine, names[TS_N_GROW], size)
                                      : NULL;
        Py_XDECREF(size);
        if (none == NULL) break;
        Py_DECREF(none);
    }
    Py_DECREF(mine);
    return -1;
}

/* Deliver entry e (in the entry box, unplaced): build its batch and count it. 1 with the
 * batch (or (index, batch)) in *out, 0 where it is not the common case (the slow path
 * places it), -1 with an exception (the entry stays in the box). */
static int ts_lane_deliver(LaneObject *self, const ts_lane_view *view, const ts_py_entry *e,
                           PyObject **out)
{
    if (!e->is_batch || (long long)e->epoch != view->producer_epoch ||
        (self->length >= 0 && (long long)e->index >= self->length - 1))
        return 0; /* an end marker, another epoch, or the epoch's last batch */
    const char *meta = PyBytes_AS_STRING(e->meta);
    Py_ssize_t meta_n = PyBytes_GET_SIZE(e->meta), blob_n = meta_n, n_ids = -1;
    const char *blob = meta;
    if (meta_n > 0 && (unsigned char)meta[0] == TS_IDS_MARK) {
        if (meta_n < TS_IDS_HEADER) return 0;
        const unsigned char *h = (const unsigned char *)meta + 1;
        blob_n = (Py_ssize_t)((uint32_t)h[0] | (uint32_t)h[1] << 8 | (uint32_t)h[2] << 16 |
                              (uint32_t)h[3] << 24);
        blob = meta + TS_IDS_HEADER;
        Py_ssize_t rest = meta_n - TS_IDS_HEADER - blob_n;
        if (blob_n > meta_n - TS_IDS_HEADER || rest % 8 != 0) return 0;
        n_ids = rest / 8;
    }
    const char *ids = blob + blob_n; /* int64 LE, n_ids of them (unaligned: memcpy) */
    long long top = 0;
    for (Py_ssize_t i = 0; i < n_ids; i++) {
        int64_t id;
        memcpy(&id, ids + 8 * i, 8);
        if (id < 0) return 0;
        if (id >= top) top = id + 1;
    }
    PyObject *build = NULL;
    if (ts_lane_build_fn(self, blob, blob_n, &build) < 0) return -1;
    if (build == NULL) return 0;
    Py_buffer bits = {0};
    if (n_ids >= 0 && ts_lane_mine_bits(self, top, &bits) < 0) return -1;

    int rc = -1;
    ts_lane_counts c = {{NULL}};
    PyObject *batch = ts_lane_batch(self, e, build);
    if (batch == NULL) goto done;
    PyObject **names = self->state->lane_names;
    c.value[0] = PyLong_FromLongLong(view->pulled + 1);
    if (c.value[0] == NULL ||
        ts_attr_plus(self, self->cursor, TS_N_DELIVERED, 0, &c.value[7]) < 0 ||
        (c.value[1] = PyLong_FromLongLong(PyLong_AsLongLong(c.value[7]) + 1)) == NULL ||
        ts_attr_plus(self, self->flow, TS_N_BATCHES, 1, &c.value[2]) < 0 ||
        ts_attr_plus(self, self->flow, TS_N_SAMPLES, ts_lane_samples(self, e), &c.value[3]) < 0 ||
        ts_attr_plus(self, self->flow, TS_N_LOADER_BATCHES, 1, &c.value[4]) < 0 ||
        ts_attr_plus(self, self->flow, TS_N_BYTES, (long long)e->nbytes, &c.value[5]) < 0 ||
        (n_ids >= 0 &&
         ts_attr_plus(self, self->taken, TS_N_MINE_SAMPLES, n_ids, &c.value[6]) < 0))
        goto done;
    if (self->with_index) {
        PyObject *pair = PyTuple_Pack(2, c.value[7], batch);
        if (pair == NULL) goto done;
        Py_SETREF(batch, pair);
    }
    /* The count: from here to the return, no Python code runs (no interrupt lands). */
    for (Py_ssize_t i = 0; i < n_ids; i++) {
        int64_t id;
        memcpy(&id, ids + 8 * i, 8);
        ((char *)bits.buf)[id] = 1;
    }
    if (PyObject_SetAttr(self->cursor, names[TS_N_PULLED], c.value[0]) < 0 ||
        PyObject_SetAttr(self->cursor, names[TS_N_DELIVERED], c.value[1]) < 0 ||
        PyObject_SetAttr(self->flow, names[TS_N_BATCHES], c.value[2]) < 0 ||
        PyObject_SetAttr(self->flow, names[TS_N_SAMPLES], c.value[3]) < 0 ||
        PyObject_SetAttr(self->flow, names[TS_N_LOADER_BATCHES], c.value[4]) < 0 ||
        PyObject_SetAttr(self->flow, names[TS_N_BYTES], c.value[5]) < 0 ||
        (n_ids >= 0
             ? PyObject_SetAttr(self->taken, names[TS_N_MINE_SAMPLES], c.value[6])
             : PyObject_SetAttr(self->taken, names[TS_N_KNOWN], Py_False)) < 0)
        goto done; /* (a store of a plain attribute fails only without memory) */
    PyList_SetItem(self->entry_box, 0, Py_NewRef(Py_None)); /* the entry is used up */
    *out = batch;
    batch = NULL;
    rc = 1;
done:
    for (int i = 0; i < 8; i++) Py_XDECREF(c.value[i]);
    Py_XDECREF(batch);
    if (n_ids >= 0) PyBuffer_Release(&bits);
    return rc;
}

/* ==========================================================================
 * The type
 * ========================================================================== */

/* next(iterator): the common path, else the subclass's _next_slow(). */
static PyObject *Lane_next(LaneObject *self)
{
    ts_lane_view view;
    ts_py_entry e;
    PyObject *out = NULL;
    int r = ts_lane_common(self, 1, &view);
    if (r == 1) r = ts_lane_take(self, &view, &e);
    if (r == 1) r = ts_lane_deliver(self, &view, &e, &out);
    if (r < 0) return NULL;
    if (r == 1) return out;
    return PyObject_CallMethodNoArgs((PyObject *)self, self->state->lane_names[TS_N_NEXT_SLOW]);
}

/* Lane.bind_lane(*, place, ring_box, entry_box, cursor, flow, taken, builder, from_dlpack,
 * pid_box, pid, epoch, length, batch_samples, with_index, wait_ns): what the common path
 * reads and counts in (see the file's comment); place None turns it off (every next() is
 * _next_slow()). wait_ns: how long next() waits in the core for an entry not yet
 * published before it calls _wait_entry() (0: it does not). */
static PyObject *Lane_bind(LaneObject *self, PyObject *const *args, Py_ssize_t nargs,
                           PyObject *kwnames)
{
    static const char *const names[] = {"place", "ring_box", "entry_box", "cursor", "flow",
                                        "taken", "builder", "from_dlpack", "pid_box", "pid",
                                        "epoch", "length", "batch_samples", "with_index",
                                        "wait_ns"};
    enum { N = 15 };
    PyObject *a[N];
    uint64_t pid = 0, epoch = 0, length = 0, batch_samples = 0, wait_ns = 0;
    int with_index = 0;
    if (ts_py_args("bind_lane", args, nargs, kwnames, names, N, 0, N, a) < 0 ||
        ts_py_u64(a[9], &pid) < 0 || ts_py_u64(a[10], &epoch) < 0 ||
        ts_py_u64(a[11], &length) < 0 || ts_py_u64(a[12], &batch_samples) < 0 ||
        ts_py_flag(a[13], &with_index) < 0 || ts_py_u64(a[14], &wait_ns) < 0)
        return NULL;
    const int boxes[] = {1, 2, 8};
    for (int i = 0; i < 3; i++) {
        PyObject *box = a[boxes[i]];
        if (!PyList_CheckExact(box) || PyList_GET_SIZE(box) != 1) {
            PyErr_Format(PyExc_TypeError, "bind_lane(): %s must be a list of one item",
                         names[boxes[i]]);
            return NULL;
        }
    }
    Py_XSETREF(self->place, Py_NewRef(a[0]));
    Py_XSETREF(self->ring_box, Py_NewRef(a[1]));
    Py_XSETREF(self->entry_box, Py_NewRef(a[2]));
    Py_XSETREF(self->cursor, Py_NewRef(a[3]));
    Py_XSETREF(self->flow, Py_NewRef(a[4]));
    Py_XSETREF(self->taken, Py_NewRef(a[5]));
    Py_XSETREF(self->builder, Py_NewRef(a[6]));
    Py_XSETREF(self->from_dlpack, Py_NewRef(a[7]));
    Py_XSETREF(self->pid_box, Py_NewRef(a[8]));
    Py_CLEAR(self->structure);
    Py_CLEAR(self->build);
    /* (masked to 64 bits, as ts_py_u64 takes them: -1, "unknown", stays -1) */
    self->pid = (long)(int64_t)pid;
    self->epoch = (long long)(int64_t)epoch;
    self->length = (long long)(int64_t)length;
    self->batch_samples = (long long)(int64_t)batch_samples;
    self->with_index = with_index;
    self->wait_ns = wait_ns;
    Py_RETURN_NONE;
}

/* Lane.__new__: an object with the module of the Lane class it derives from. */
static PyObject *Lane_new(PyTypeObject *type, PyObject *Py_UNUSED(args),
                          PyObject *Py_UNUSED(kwargs))
{
    PyObject *module = NULL;
    for (PyTypeObject *t = type; t != NULL && module == NULL; t = t->tp_base) {
        if (!PyType_HasFeature(t, Py_TPFLAGS_HEAPTYPE)) continue;
        module = PyType_GetModule(t); /* borrowed; a Python subclass has none */
        if (module == NULL) PyErr_Clear();
    }
    if (module == NULL) {
        PyErr_SetString(PyExc_TypeError, "Lane: not a subclass of tensorsocket._core.Lane");
        return NULL;
    }
    LaneObject *self = (LaneObject *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    self->module = Py_NewRef(module);
    self->state = PyModule_GetState(module);
    self->place = Py_NewRef(Py_None);
    self->length = self->batch_samples = -1;
    return (PyObject *)self;
}

/* GC traversal. */
static int Lane_traverse(LaneObject *self, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->module);
    Py_VISIT(self->place);
    Py_VISIT(self->ring_box);
    Py_VISIT(self->entry_box);
    Py_VISIT(self->cursor);
    Py_VISIT(self->flow);
    Py_VISIT(self->taken);
    Py_VISIT(self->builder);
    Py_VISIT(self->from_dlpack);
    Py_VISIT(self->pid_box);
    Py_VISIT(self->structure);
    Py_VISIT(self->build);
    return 0;
}

/* Drop the references (GC; dealloc). The module stays: the state is read through it. */
static int Lane_clear(LaneObject *self)
{
    Py_CLEAR(self->place);
    Py_CLEAR(self->ring_box);
    Py_CLEAR(self->entry_box);
    Py_CLEAR(self->cursor);
    Py_CLEAR(self->flow);
    Py_CLEAR(self->taken);
    Py_CLEAR(self->builder);
    Py_CLEAR(self->from_dlpack);
    Py_CLEAR(self->pid_box);
    Py_CLEAR(self->structure);
    Py_CLEAR(self->build);
    return 0;
}

/* Free (a heap type: the type's reference goes too, for a subclass's instance as well). */
static void Lane_dealloc(LaneObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    Lane_clear(self);
    Py_CLEAR(self->module);
    tp->tp_free(self);
    Py_DECREF(tp);
}

static PyMethodDef Lane_methods[] = {
    {"bind_lane", TS_PY_FASTCALL(Lane_bind), "Set what the common path reads and counts in."},
    {NULL, NULL, 0, NULL},
};

/* Lane.epoch: the consumer epoch this iterator reads. */
static PyObject *Lane_get_epoch(LaneObject *self, void *Py_UNUSED(closure))
{
    return PyLong_FromLongLong(self->epoch);
}

static PyGetSetDef Lane_getset[] = {
    {"epoch", (getter)Lane_get_epoch, NULL, "The consumer epoch this iterator reads.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot Lane_slots[] = {
    {Py_tp_doc, "The common path of a consumer's next() (the epoch iterator's base class)."},
    {Py_tp_new, Lane_new},
    {Py_tp_methods, Lane_methods},
    {Py_tp_dealloc, Lane_dealloc},
    {Py_tp_traverse, Lane_traverse},
    {Py_tp_clear, Lane_clear},
    {Py_tp_iter, PyObject_SelfIter},
    {Py_tp_iternext, Lane_next},
    {Py_tp_getset, Lane_getset},
    {0, NULL},
};

PyType_Spec ts_py_lane_spec = {
    .name = "tensorsocket._core.Lane",
    .basicsize = sizeof(LaneObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .slots = Lane_slots,
};
