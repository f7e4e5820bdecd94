"""The worker processes that run a consumer's transform, as a DataLoader's workers run its
dataset: forked from the training process (so the transform need not be picklable),
persistent for the consumer's life, one batch per task.

A task is (task id, the inputs: a SharedTensorRef or a tensor, the samples' seeds); its
result is (task id, the stacked outputs) or (task id, a WorkerFailure). Results travel
through torch's multiprocessing queue (tensors in shared memory, as DataLoader workers send
theirs). A worker ends when told (None), when its parent is gone, or with its parent
(daemon processes).
"""

from __future__ import annotations

import logging
import multiprocessing
import queue
import signal
import time
import traceback
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.multiprocessing as tmp

from ..errors import TensorSocketError, TransformError
from .samples import describe, transform_samples
from .shared_views import materialise

log = logging.getLogger("tensorsocket")

_PARENT_CHECK_S = 1.0  # a worker waiting for a task checks this often that its parent lives


@dataclass
class WorkerFailure:
    """A transform's error in a worker: its type, message and the worker's traceback."""

    kind: str
    message: str
    trace: str
    worker: int


class SendTensor:
    """A worker's answer to a task whose inputs it could not map (the ring's file lost its
    name: the producer ended): send the tensor itself."""


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
        task_id, source, seeds = task
        out: Any
        try:
            inputs = materialise(source)
        except OSError:
            out = SendTensor()
        else:
            try:
                out = transform_samples(transform, inputs, seeds, pil)
            except Exception as e:  # told to the consumer, which raises it
                out = WorkerFailure(type(e).__name__, str(e), traceback.format_exc(), worker)
            del inputs
        del source
        results.put((task_id, out))


class WorkerPool:
    """`count` worker processes running `transform` on batches; submit() a batch, result()
    its outputs in any order."""

    def __init__(self, transform: Callable[[Any], Any], pil: bool, count: int,
                 context: Any = None) -> None:
        """Start the workers (forked unless `context` names another start method)."""
        ctx = tmp.get_context(context or "fork")
        self._transform = transform
        self._tasks = ctx.Queue()
        self._results = ctx.Queue()
        self._done: dict[int, Any] = {}
        self._unwanted: set[int] = set()  # tasks forgotten before their result came
        self._procs = []
        for k in range(count):
            p = ctx.Process(target=_worker_main, name=f"tensorsocket-transform-{k}",
                            args=(transform, pil, self._tasks, self._results, k),
                            daemon=True)
            p.start()
            self._procs.append(p)
        self.pids: list[int] = [int(p.pid or 0) for p in self._procs]
        # A consumer dropped without close() stops its workers (as a DataLoader iterator's
        # __del__ does); the finalizer holds the processes and queues, not the pool.
        self._stop = weakref.finalize(self, _stop_workers, self._procs, self._tasks,
                                      self._results)

    def submit(self, task_id: int, source: Any, seeds: Sequence[int]) -> None:
        """Queue one batch's transform."""
        self._tasks.put((task_id, source, list(seeds)))

    def result(self, task_id: int, deadline: float | None) -> torch.Tensor | None:
        """The outputs of task `task_id`, waiting for them (until `deadline`, a
        time.monotonic(); TimeoutError after); None if the worker could not map its inputs
        (send the tensor itself); a worker's error raised here as a TransformError with
        its traceback, a dead worker as a TensorSocketError."""
        while task_id not in self._done:
            wait = _PARENT_CHECK_S if deadline is None else \
                min(_PARENT_CHECK_S, deadline - time.monotonic())
            if wait <= 0:
                raise TimeoutError(f"no transformed batch within batch_timeout (transform "
                                   f"workers {self.pids})")
            try:
                got = self._results.get(timeout=wait)
            except queue.Empty:
                self._check_alive()
                continue
            if got[0] in self._unwanted:
                self._unwanted.discard(got[0])
            else:
                self._done[got[0]] = got[1]
        out = self._done.pop(task_id)
        if isinstance(out, SendTensor):
            return None
        if isinstance(out, WorkerFailure):
            raise TransformError(
                f"transform={describe(self._transform)} raised {out.kind} in transform "
                f"worker {out.worker}: {out.message}\n\nThe worker's traceback:\n{out.trace}")
        return out

    def forget(self, task_ids: Sequence[int]) -> None:
        """Results of these tasks are not wanted (an epoch left mid-way): dropped when they
        come (a worker may still be reading their inputs)."""
        for task_id in task_ids:
            if self._done.pop(task_id, None) is None:
                self._unwanted.add(task_id)

    def _check_alive(self) -> None:
        """TensorSocketError if a worker died (as a DataLoader's 'worker exited
        unexpectedly')."""
        for p in self._procs:
            if not p.is_alive():
                raise TensorSocketError(
                    f"transform worker (pid {p.pid}) exited unexpectedly with exit code "
                    f"{p.exitcode}; the batches in flight are not delivered")

    def close(self) -> None:
        """Stop the workers (see _stop_workers)."""
        self._stop()


def _stop_workers(procs: list, tasks: Any, results: Any) -> None:
    """Stop worker processes: told to end, then terminated if they do not within 5 s."""
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
    for q in (tasks, results):
        q.close()
        q.cancel_join_thread()
