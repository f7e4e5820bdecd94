/* ts_py_watch.c - the ProcessWatch type of tensorsocket._core (see ts_py.h), made by
 * ProcessWatch.of(pid, start_time): whether one process still runs, by a pidfd taken once (pidfd_open(2): "a stable reference" to the
 * process, readable once it exits), so that each look is one poll and no /proc read; on
 * a kernel without pidfds (or with no fd left) each look reads /proc/<pid>/stat as
 * process_alive() does. The fd is the object's own: closed by close() or when the object
 * goes. */
#include "binding/ts_py.h"

#include <unistd.h>

#include "base/ts_proc.h"

typedef struct WatchObject {
    PyObject_HEAD
    int pid;              /* the process watched */
    uint64_t start_time;  /* its start time (clock ticks since boot), for the /proc looks */
    int fd;               /* owns: its pidfd, or -1 (none: /proc looks) */
    int closed;           /* close() was called: alive() raises */
} WatchObject;

/* ProcessWatch.of(pid, start_time): watch the process pid that started at start_time (0:
 * unknown: no pidfd, each look reads /proc as process_alive() does). A process already
 * gone (or another one with that pid) is never alive. */
static PyObject *Watch_of(PyObject *type, PyObject *const *args, Py_ssize_t nargs,
                          PyObject *kwnames)
{
    static const char *const names[] = {"pid", "start_time"};
    PyObject *a[2];
    int pid = 0;
    uint64_t start = 0;
    if (ts_py_args("of", args, nargs, kwnames, names, 2, 2, 2, a) < 0 ||
        ts_py_int(a[0], &pid) < 0 || ts_py_u64(a[1], &start) < 0)
        return NULL;
    WatchObject *self = PyObject_New(WatchObject, (PyTypeObject *)type);
    if (self == NULL) return NULL;
    self->pid = pid;
    self->start_time = start;
    self->closed = 0;
    self->fd = start != 0 ? ts_proc_pidfd((pid_t)pid, start) : -1;
    return (PyObject *)self;
}

/* Close the pidfd, if any. */
static void ts_watch_close_fd(WatchObject *self)
{
    if (self->fd >= 0) close(self->fd);
    self->fd = -1;
}

/* Free (a heap type: the type's reference goes too). */
static void Watch_dealloc(WatchObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    ts_watch_close_fd(self);
    PyObject_Free(self);
    Py_DECREF(tp);
}

/* alive() -> whether the process still runs (its pidfd's poll, else /proc). */
static PyObject *Watch_alive(WatchObject *self, PyObject *Py_UNUSED(ignored))
{
    if (self->closed) {
        PyErr_SetString(PyExc_ValueError, "this ProcessWatch is closed");
        return NULL;
    }
    if (self->fd >= 0) return PyBool_FromLong(ts_proc_pidfd_alive(self->fd));
    if (self->pid <= 0) Py_RETURN_FALSE;
    return PyBool_FromLong(ts_proc_alive((pid_t)self->pid, self->start_time));
}

/* close(): give the pidfd back now (alive() then raises); again: nothing. */
static PyObject *Watch_close(WatchObject *self, PyObject *Py_UNUSED(ignored))
{
    ts_watch_close_fd(self);
    self->closed = 1;
    Py_RETURN_NONE;
}

/* ProcessWatch.pidfd: whether it watches through a pidfd (else /proc). */
static PyObject *Watch_get_pidfd(WatchObject *self, void *Py_UNUSED(closure))
{
    return PyBool_FromLong(self->fd >= 0);
}

/* ProcessWatch.pid: the process watched. */
static PyObject *Watch_get_pid(WatchObject *self, void *Py_UNUSED(closure))
{
    return PyLong_FromLong(self->pid);
}

static PyMethodDef Watch_methods[] = {
    {"of", TS_PY_FASTCALL(Watch_of) | METH_CLASS, "Watch a process (pid, start_time)."},
    {"alive", (PyCFunction)Watch_alive, METH_NOARGS, "Whether the process still runs."},
    {"close", (PyCFunction)Watch_close, METH_NOARGS, "Give the pidfd back now."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Watch_getset[] = {
    {"pid", (getter)Watch_get_pid, NULL, "The process watched.", NULL},
    {"pidfd", (getter)Watch_get_pidfd, NULL, "Whether it watches through a pidfd.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot Watch_slots[] = {
    {Py_tp_doc, "Whether one process still runs, by a pidfd taken once (else /proc)."},
    {Py_tp_dealloc, Watch_dealloc},
    {Py_tp_methods, Watch_methods},
    {Py_tp_getset, Watch_getset},
    {0, NULL},
};

PyType_Spec ts_py_watch_spec = {
    .name = "tensorsocket._core.ProcessWatch",
    .basicsize = sizeof(WatchObject),
    .flags = TS_PY_TYPE_FLAGS,
    .slots = Watch_slots,
};
