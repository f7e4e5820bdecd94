"""The worker processes that run a consumer's transform, as a DataLoader's workers run its
dataset: forked from the training process (so the transform need not be picklable),
persistent for the consumer's life, one batch per task.

A task is (task id, the pickled inputs and seeds: a SharedTensorRef or a tensor, the
samples' seeds); its result is (task id, the pickled stacked outputs, a WorkerFailure or a
SendTensor). Both are pickled where a failure can be told (the worker pickles its result
itself, before it sends it: an output that cannot be pickled, a tensor that requires grad
say, becomes a WorkerFailure of that task instead of a result a queue's feeder thread
drops), and tensors travel through torch's shared memory, as DataLoader workers send
theirs. Tasks go out through one queue that the workers share; each worker sends its
results through a pipe of its own.

In the training process no queue is touched by the thread that calls next(): a courier
thread hands the tasks to the queue and receives the results (unpickling them there:
torch fetches a result's shared memory from the worker that made it), filing each under
its task id. A KeyboardInterrupt, which lands in the main thread only, can then cut no
message in two nor leave a queue's lock held: what the main thread does is appending to a
deque, reading the filed results and waiting on a pipe the courier writes to. A result
that cannot be received (its worker was killed after sending it) is filed as lost, and
told as the TensorSocketError naming that worker. A worker ends when told (None), when its
parent is gone, or with its parent (daemon processes). Starting the pool, and the steps of
stopping it that take the task queue's lock, hold Ctrl-C back until they are done
(interrupts_held): cut there, they leaked workers or hung the process at its exit.
"""

from __future__ import annotations

import collections
import contextlib
import multiprocessing
import multiprocessing.connection
import os
import queue
import signal
import sys
import threading
import time
import traceback
import weakref
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.multiprocessing as tmp

from ..errors import TensorSocketError, TransformError
from .samples import describe, transform_error, transform_samples
from .shared_views import materialise

_PARENT_CHECK_S = 1.0  # a worker waiting for a task checks this often that its parent lives
_COURIER_WAIT_S = 0.5  # the courier looks at its deque of tasks at least this often


@dataclass
class WorkerFailure:
    """A transform's error in a worker: its type, message and the worker's traceback.
    sending: the transform ran, but its output could not be pickled to be sent. origin:
    (module, qualified name) of the class the transform raised (None: not the
    transform's own error), which the training process raises too where it finds it."""

    kind: str
    message: str
    trace: str
    worker: int
    sending: bool = False
    origin: tuple[str, str] | None = None


class SendTensor:
    """A worker's answer to a task whose inputs it could not map (the ring's file lost its
    name: the producer ended): send the tensor itself."""


@dataclass
class _Lost:
    """A result that came from worker `worker` and could not be received (unpickled):
    its worker died after sending it, say. `error`: what unpickling raised."""

    worker: int
    error: str


@dataclass
class _Unsent:
    """A task the courier could not pickle for the workers; `error`: what it raised."""

    error: str


def _worker_main(transform: Callable[[Any], Any], pil: bool, tasks: Any, results: Any,
                 worker: int) -> None:
    """A worker's loop: transform the batches it is given until told to stop or orphaned
    (its parent gone, whatever the start method: the parent's sentinel)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    torch.set_num_threads(1)  # as DataLoader workers: the job's cores are for training
    parent = multiprocessing.parent_process()
    while True:
        try:
            task = tasks.get(timeout=_PARENT_CHECK_S)
        except queue.Empty:
            if parent is not None and not parent.is_alive():
                return
            continue
        if task is None:
            return
        task_id, message = task
        payload = _encoded(_run_task(transform, pil, message, worker), worker)
        try:
            results.send((task_id, payload))
        except OSError:  # the training process closed the pool (or is gone)
            return


def _run_task(transform: Callable[[Any], Any], pil: bool, message: bytes,
              worker: int) -> Any:
    """The stacked outputs of one task (a pickled (inputs, seeds)), a SendTensor if its
    inputs cannot be viewed in their file (gone, or not the size it was: the worker stays,
    the consumer sends the tensor), or the WorkerFailure of the transform."""
    try:
        source, seeds = ForkingPickler.loads(message)
    except Exception as e:
        return WorkerFailure(type(e).__name__, f"the batch's inputs could not be received: "
                             f"{e}", traceback.format_exc(), worker)
    try:
        inputs = materialise(source)
    except (OSError, ValueError):  # (mmap's ValueError: the file is shorter than that)
        return SendTensor()
    del source
    try:
        return transform_samples(transform, inputs, seeds, pil)
    except Exception as e:  # told to the consumer, which raises it
        return WorkerFailure(type(e).__name__, str(e), traceback.format_exc(), worker,
                             origin=(type(e).__module__, type(e).__qualname__))


def _encoded(out: Any, worker: int) -> bytes:
    """`out` pickled for the training process (tensors into shared memory); if it cannot
    be, the WorkerFailure saying why."""
    try:
        return bytes(ForkingPickler.dumps(out))
    except Exception as e:
        failure = WorkerFailure(type(e).__name__, str(e), traceback.format_exc(), worker,
                                sending=True)
    del out
    return bytes(ForkingPickler.dumps(failure))


class WorkerPool:
    """`count` worker processes running `transform` on batches; submit() a batch, result()
    its outputs in any order (see the module)."""

    def __init__(self, transform: Callable[[Any], Any], pil: bool, count: int,
                 context: Any = None) -> None:
        """Start the workers (forked unless `context` names another start method) and the
        courier thread. (The finalizer that stops them is set first: a KeyboardInterrupt
        that cuts this short leaves no worker running.)"""
        ctx = tmp.get_context(context or "fork")
        self._transform = transform
        self._tasks = ctx.Queue()
        pipes = [ctx.Pipe(duplex=False) for _ in range(count)]  # (reader, writer) each
        readers = [r for r, _ in pipes]
        # Filled by the courier: task id -> the result, a WorkerFailure, SendTensor, _Lost
        # or _Unsent; read and pruned by the caller's thread (single dict operations).
        self._done: dict[int, Any] = {}
        self._outbox: collections.deque = collections.deque()  # tasks for the courier
        to_courier, self._wake = _wake_pipe()
        self._woken, from_courier = _wake_pipe()
        stopping = threading.Event()
        self._failed: list[str] = []  # the courier's own error, if it ended on one
        self._courier = courier = threading.Thread(
            target=_courier_main, name="tensorsocket-transform-courier", daemon=True,
            args=(self._tasks, self._outbox, readers, self._done, to_courier, from_courier,
                  stopping, self._failed))
        self._procs: list = []
        # A consumer dropped without close() stops its workers (as a DataLoader iterator's
        # __del__ does); the finalizer holds the processes, queue, pipes and courier, not
        # the pool.
        self._stop = weakref.finalize(
            self, _stop_workers, os.getpid(), self._procs, self._tasks, courier, stopping,
            readers, (to_courier, self._wake, self._woken, from_courier))
        for k, (_, writer) in enumerate(pipes):
            p = ctx.Process(target=_worker_main, name=f"tensorsocket-transform-{k}",
                            args=(transform, pil, self._tasks, writer, k), daemon=True)
            p.start()
            self._procs.append(p)
        for _, writer in pipes:  # (each worker holds its own)
            writer.close()
        self.pids: list[int] = [int(p.pid or 0) for p in self._procs]
        self._sentinels = [p.sentinel for p in self._procs]
        courier.start()

    def submit(self, task_id: int, source: Any, seeds: Sequence[int]) -> None:
        """Queue one batch's transform (handed to the courier: a deque append and a byte
        to wake it, no lock; submitting a task again is harmless, its first result
        counts)."""
        task = (task_id, source, list(seeds))
        self._outbox.append(task)
        _poke(self._wake)

    def result(self, task_id: int, deadline: float | None) -> torch.Tensor | None:
        """The outputs of task `task_id`, waiting for them (until `deadline`, a
        time.monotonic(); TimeoutError after); None if the worker could not map its inputs
        (send the tensor itself); a worker's error raised here as a TransformError with
        its traceback, a dead worker (or a result lost with its worker) as a
        TensorSocketError. The result stays filed (a call again after an interrupt gets it
        again) until drop() or prune()."""
        while task_id not in self._done:
            wait = _PARENT_CHECK_S if deadline is None else \
                min(_PARENT_CHECK_S, deadline - time.monotonic())
            if wait <= 0:
                raise TimeoutError(f"no transformed batch within batch_timeout (transform "
                                   f"workers {self.pids})")
            # (connection.wait polls: select() refuses fds of 1024 and up)
            ready = multiprocessing.connection.wait([self._woken, *self._sentinels], wait)
            _drain(self._woken)
            if task_id not in self._done and (ready != [self._woken] or self._failed):
                self._check_alive()  # (a worker's end, the courier's, or a quiet wait)
        out = self._done[task_id]
        if isinstance(out, SendTensor):
            return None
        if isinstance(out, WorkerFailure):
            raise transform_error(_class_named(out.origin), self._failure_text(out))
        if isinstance(out, _Lost):
            raise TensorSocketError(self._lost_text(out))
        if isinstance(out, _Unsent):
            raise TransformError(
                f"the inputs of a batch could not be sent to the transform workers of "
                f"transform={describe(self._transform)}: {out.error}")
        return out

    def drop(self, task_id: int) -> None:
        """The result of `task_id` was used: forget it."""
        self._done.pop(task_id, None)

    def prune(self, wanted: set[int]) -> None:
        """Forget the results filed for tasks not in `wanted` (an epoch left mid-way, a
        task sent again, a result used): a result still to come is forgotten at a later
        call."""
        for task_id in list(self._done):
            if task_id not in wanted:
                self._done.pop(task_id, None)

    def _failure_text(self, out: WorkerFailure) -> str:
        """What a consumer's TransformError says of a worker's failure."""
        name = describe(self._transform)
        if not out.sending:
            return (f"transform={name} raised {out.kind} in transform worker {out.worker}: "
                    f"{out.message}\n\nThe worker's traceback:\n{out.trace}")
        hint = (" An output that requires grad (an nn.Module's with parameters) cannot leave "
                "its process: detach it in the transform (or run it under torch.no_grad()), "
                "or run the transform at next() (transform_workers=0)."
                if "requires_grad" in out.message else "")
        return (f"transform={name} made a batch that transform worker {out.worker} cannot "
                f"send to the training process: pickling it raised {out.kind}: "
                f"{out.message.rstrip('. ')}.{hint}\n\nThe worker's traceback:\n{out.trace}")

    def _lost_text(self, out: _Lost) -> str:
        """What a consumer's TensorSocketError says of a result it could not receive (its
        worker is dying, as a rule: given a second to be seen dead)."""
        p = self._procs[out.worker]
        p.join(1.0)
        state = ("sent a batch" if p.is_alive() else
                 f"exited unexpectedly with exit code {p.exitcode} after it sent a batch")
        return (f"transform worker (pid {p.pid}) {state} that could not be received from "
                f"it ({out.error}); the batches in flight are not delivered")

    def _check_alive(self) -> None:
        """TensorSocketError if a worker died (as a DataLoader's 'worker exited
        unexpectedly'), or the courier did."""
        if self._failed or not self._courier.is_alive():
            raise TensorSocketError(
                f"the thread that receives the transform workers' batches ended "
                f"({self._failed[0] if self._failed else 'no error'}); the batches in "
                "flight are not delivered")
        for p in self._procs:
            if not p.is_alive():
                raise TensorSocketError(
                    f"transform worker (pid {p.pid}) exited unexpectedly with exit code "
                    f"{p.exitcode}; the batches in flight are not delivered")

    def close(self) -> None:
        """Stop the workers and the courier (see _stop_workers)."""
        self._stop()


def _courier_main(tasks: Any, outbox: collections.deque, readers: list, done: dict,
                  wake: int, woken: int, stopping: threading.Event, failed: list) -> None:
    """The courier thread: hand the tasks of `outbox` to the workers' queue (pickled here:
    one that cannot be is filed as _Unsent), receive every result from the workers' pipes
    (unpickled here: one that cannot be is filed as _Lost) into `done`, and write a byte
    to `woken` after each. Ends when `stopping` is set; an error of its own goes into
    `failed` (the pool raises it) and ends it."""
    live = {r: k for k, r in enumerate(readers)}
    try:
        while not stopping.is_set():
            filed = False
            for r in multiprocessing.connection.wait([wake, *live], _COURIER_WAIT_S):
                if r == wake:
                    _drain(wake)
                    continue
                try:
                    task_id, payload = r.recv()
                except (EOFError, OSError):  # its worker is gone (forked ones: all of
                    # them, as each holds every pipe's writer), or died in the middle of a
                    # message (OSError); the pool sees it by the sentinels
                    del live[r]
                    continue
                try:
                    out = ForkingPickler.loads(payload)  # (always: the worker holds its
                except Exception as e:  # shared memory until it is fetched)
                    out = _Lost(live[r], f"{type(e).__name__}: {e}")
                done.setdefault(task_id, out)  # (a task sent twice: its first result)
                del out
                filed = True
            if filed:
                _poke(woken)
            while outbox:
                task_id, source, seeds = outbox.popleft()
                try:
                    tasks.put((task_id, bytes(ForkingPickler.dumps((source, seeds)))))
                except Exception as e:
                    done[task_id] = _Unsent(f"{type(e).__name__}: {e}")
                    _poke(woken)
                del source
    except BaseException as e:  # (a bug, or the pool closed under it)
        if not stopping.is_set():
            failed.append(f"{type(e).__name__}: {e}")
            _poke(woken)


@contextlib.contextmanager
def interrupts_held() -> Iterator[None]:
    """Ctrl-C held back for the block, then handled as it would have been: for the steps
    that an interrupt must not cut in two (a pool half started leaks the workers it forked;
    a KeyboardInterrupt inside a queue's put() can leave the queue's lock held, and its
    feeder thread, then the process at exit, waits for it for ever). SIGINT's handler is
    replaced for the block by one that notes the signal; the one it replaced then gets the
    first signal noted. Workers forked meanwhile inherit the noting handler until they
    ignore SIGINT. Nothing is held outside the main thread (no handler runs there), nor
    where SIGINT's handler was not set from Python."""
    held: list = []
    previous: Any = None
    if threading.current_thread() is threading.main_thread() and \
            signal.getsignal(signal.SIGINT) is not None:
        previous = signal.signal(signal.SIGINT, lambda signum, frame: held.append(frame))
    try:
        yield
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
            if held and callable(previous):
                previous(signal.SIGINT, held[0])  # (raises KeyboardInterrupt, as a rule)
            elif held and previous == signal.SIG_DFL:
                os.kill(os.getpid(), signal.SIGINT)


def _class_named(origin: tuple[str, str] | None) -> type | None:
    """The class a worker's transform raised, found here by its (module, qualified name)
    among the modules imported (a spawned worker's __main__ is named __mp_main__); None if
    it is not there (a class made inside a function), or `origin` is None."""
    if origin is None:
        return None
    module, qualname = origin
    found: Any = sys.modules.get("__main__" if module == "__mp_main__" else module)
    for part in qualname.split("."):
        found = getattr(found, part, None)
    return found if isinstance(found, type) and issubclass(found, BaseException) else None


def _wake_pipe() -> tuple[int, int]:
    """A pipe whose bytes only wake its reader: both ends non-blocking."""
    r, w = os.pipe()
    os.set_blocking(r, False)
    os.set_blocking(w, False)
    return r, w


def _poke(fd: int) -> None:
    """Wake the reader of wake pipe `fd` (a full pipe wakes it already)."""
    try:
        os.write(fd, b"\0")
    except (BlockingIOError, OSError):
        pass


def _drain(fd: int) -> None:
    """Empty wake pipe `fd`."""
    try:
        while os.read(fd, 4096):
            pass
    except (BlockingIOError, OSError):
        pass


def _stop_workers(owner: int, procs: list, tasks: Any, courier: threading.Thread,
                  stopping: threading.Event, readers: list, fds: tuple) -> None:
    """Stop the courier and the worker processes: told to end, then terminated if they do
    not within 5 s; a KeyboardInterrupt in the waits kills the workers left (a finalizer
    runs once: none may outlive it). Then the courier, which a worker stopped in the
    middle of a message may still hold in recv() until the last worker is gone. Nothing
    in a forked child of the pool's process (its workers are not the child's)."""
    if os.getpid() != owner:
        return
    stopping.set()
    _poke(fds[1])
    try:
        with interrupts_held():  # (see interrupts_held: a put() cut short hangs the exit)
            for _ in procs:
                try:
                    tasks.put(None)
                except (OSError, ValueError):
                    break
        end = time.monotonic() + 5.0
        for p in procs:
            p.join(max(0.0, end - time.monotonic()))
            if p.is_alive():
                p.terminate()
                p.join(1.0)
        if courier.ident is not None:  # (started)
            courier.join(5.0)
    finally:
        with interrupts_held():
            for p in procs:
                if p.is_alive():
                    p.kill()
            tasks.close()  # (its feeder thread takes the queue's lock)
            tasks.cancel_join_thread()
    if courier.is_alive():  # (still in recv() from a worker that will not end: its fds
        return  # stay, for it)
    for r in readers:
        r.close()
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
