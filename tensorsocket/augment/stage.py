"""The batches between the ring and the training step of a consumer with a transform.

next() keeps up to ``depth`` batches in flight: taken from the ring (counted there as
taken, as any batch next() made), their transforms queued on the workers, delivered in
order. Worker processes read each batch's inputs in place, in the ring slot, which the
batch holds until its outputs are back; so ``depth`` stays below the ring's slots, leaving
the producer room to publish. A hold lasts only while the consumer reads through the ring
handle the batch was taken through: when the consumer sets its held batches aside (copies
them privately and hands their slots back, so as not to wait for itself: more batches are
alive than in flight, say in the tracebacks of interrupts), the producer may refill those
slots, and a worker that read one afresh would have read the next batch; the inputs then
go to the workers as a tensor (the private copy), and a result made before is made again.

A transform's error is raised as one TransformError whatever transform_workers is (at
the first sample's check, at next(), or in a worker): also an instance of the class the
transform raised, where Python can make a class of both (samples.transform_error), as a
DataLoader re-raises its worker's exception type; run here, the transform's own error is
its __cause__, and a worker's traceback is in its message.

A batch counts as delivered (state_dict()'s samples taken) only when next() returns it, or
when its transform raised at a batch after the first sample's check passed (it is lost
then, as a DataLoader's batch whose worker raised: passed, not delivered again on resume;
a result a worker cannot send, an output that requires grad say, is such an error). A
batch that fails before the check ever passed (the transform does not fit the shared
samples: a job stopped, fixed and resumed) is not counted until the loop goes on: a
state_dict() taken before the next next() call (in the error handler) leaves it out, and
a job resumed from it gets it again; the next next() call passes it. A dead worker, or a result lost with its worker,
stops the workers, the batches in flight staying undelivered, until a new iter() starts
new ones. Without workers, depth is one and the transform runs here, at next(), with the
caller's random generators left as they were.

A KeyboardInterrupt (Ctrl-C caught by a loop that goes on) may land anywhere in next();
nothing is lost or done twice. A batch leaves the batches in flight in one step with the
return that delivers it (no call in between), after the steps that may be repeated;
until then the next call finds it where it was. The workers' results are received by a
thread of the pool (workers.py), where no interrupt lands, and a transform run here that
was cut short goes on at the next call from the row it was on, each row transformed from
a copy of the sample (a transform that writes into its input is applied once to each
sample, whatever interrupts it).
"""

from __future__ import annotations

import collections
import logging
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Protocol

import torch

from ..errors import TensorSocketError, TransformError
from ..ring import RESERVE_SLOTS
from .options import TransformOptions
from .samples import Rebuild, first_sample_check, raised_here, split_inputs, \
    transform_samples
from .seeding import callers_generators_kept, sample_keys, sample_seed
from .shared_views import shared_ref
from .workers import WorkerPool, interrupts_held

log = logging.getLogger("tensorsocket")


class EpochSource(Protocol):
    """What the stage needs of one epoch's iterator (tensor_consumer.EpochIterator)."""

    @property
    def serial(self) -> int:
        """Which iter() of the consumer made it."""

    @property
    def epoch(self) -> int:
        """The consumer's epoch it reads."""

    def take(self, end_epoch: bool = True) -> tuple[Any, Any, int]:
        """The next batch of the epoch, taken but not delivered: (batch, sample ids or
        None, its index in the epoch); StopIteration at the epoch's end, which ends the
        consumer's epoch unless end_epoch is False."""

    def delivered(self, ids: Any) -> None:
        """Count a batch as delivered (its sample ids, or None)."""

    def deadline(self) -> float | None:
        """time.monotonic() by which a batch must come (batch_timeout), or None."""

    def length(self) -> int | None:
        """Batches in the epoch, or None if unknown."""


@dataclass
class _InFlight:
    """A batch taken from the ring whose transform is under way (task) or done (batch)."""

    index: int  # in the epoch
    ids: Any
    rebuild: Rebuild
    task: int | None  # the worker task; None: done (batch made)
    batch: Any = None  # the delivered batch, once made
    inputs: torch.Tensor | None = None  # the ring's inputs, held while a worker reads them
    seeds: list[int] | None = None  # of its samples, for a task sent again
    sent: bool = True  # its task was handed to the pool (False: to send at the next wait)
    via: Any = None  # the ring handle the worker reads its inputs through in the ring's
    # file (None: they went as a tensor); valid while it is the consumer's handle


class TransformStage:
    """One consumer's transform of every sample it delivers (see the module)."""

    def __init__(self, options: TransformOptions, ring: Callable[[], Any]) -> None:
        """No batch in flight; the workers start at the first batch. ring: the handle the
        consumer reads through now (another one after a set-aside: see the module; its
        slot count is read when the workers start)."""
        self.options = options
        self._ring = ring
        self._pool: WorkerPool | None = None
        self._pending: collections.deque[_InFlight] = collections.deque()
        self._owner = -1  # serial of the iterator whose epoch is in flight
        self._ended = False  # that epoch's last batch was taken
        self._checked = False  # the first sample's check ran
        self._depth = 1
        self._tasks = 0
        self._position = 0  # samples of the epoch taken so far (the seeds' positions)
        self._interrupted: tuple[Any, Any, int, Any, list] | None = None  # a batch taken
        # whose start a KeyboardInterrupt cut: (batch, ids, index, the ring handle it was
        # taken through, the outputs of the rows transformed here so far), started again
        # at the next next()
        self._broken: str | None = None  # a worker died: why next() raises until discard()
        self._unpassed: Any = None  # (sample ids,) of a batch that failed before the first
        # sample's check ever passed: taken, not counted until the next next() call
        self.wait_seconds = 0.0  # next() waiting for workers' outputs (stats())
        self.transform_seconds = 0.0  # transforms run here, at next() (stats())

    @classmethod
    def of(cls, options: TransformOptions | None,
           ring: Callable[[], Any]) -> "TransformStage | None":
        """The stage of these options, or None without a transform."""
        return None if options is None else cls(options, ring)

    @property
    def worker_pids(self) -> list[int]:
        """The worker processes' pids (none before the first batch, or without workers)."""
        return list(self._pool.pids) if self._pool is not None else []

    def next(self, source: EpochSource) -> tuple[int, Any]:
        """(index in the epoch, the next transformed batch) of `source`'s epoch;
        StopIteration at its end."""
        if source.serial != self._owner:
            self.discard()
            self._owner, self._ended, self._position = source.serial, False, 0
        self._pass_failed(source)
        if self._broken is not None:  # (before _fill: it would start new workers)
            raise TensorSocketError(self._broken)
        if self._pool is not None:  # results no batch in flight waits for any more
            self._pool.prune({e.task for e in self._pending if e.task is not None})
        self._fill(source)
        if not self._pending:
            raise StopIteration
        entry = self._pending[0]
        try:
            batch = self._finish(entry, source.deadline())
        except TransformError as e:  # its transform raised in a worker (or its result
            # cannot be sent): the batch is lost, as a DataLoader's whose worker raised,
            # and passed (counted again after an interrupt: no change); it leaves in one
            # step, its ring slot going back
            source.delivered(entry.ids)
            entry.inputs = None
            del self._pending[0]
            _clear_frames(e)
            raise
        except TensorSocketError as e:  # a worker died: the workers stop, the batches in
            self._broken = f"{e} (a new iter() starts new transform workers)"  # flight
            self._stop_pool()  # stay undelivered (state_dict() leaves them out)
            _clear_frames(e)
            raise
        # (An interrupt or a batch_timeout before here leaves the entry first, its
        # result kept, for the next call.) Counted as delivered (again after an interrupt
        # before the next step: no change); then delivered: the entry leaves in one step
        # with the return (no call in between, where a KeyboardInterrupt could land).
        source.delivered(entry.ids)
        del self._pending[0]
        return entry.index, batch

    def _fill(self, source: EpochSource) -> None:
        """Take batches from the ring until `depth` are in flight or the epoch's last is.
        The consumer's epoch ends only once nothing is in flight: until then it is the one
        its batches in flight are of (state_dict() names them as not delivered). With the
        epoch's length known, its end is not even asked for before."""
        length = source.length()
        while len(self._pending) < self._depth and not self._ended:
            if self._pending and length is not None and self._pending[-1].index + 1 >= length:
                return
            if self._interrupted is not None:
                (batch, ids, index, via, outputs), self._interrupted = self._interrupted, None
            else:
                via = self._ring()  # (before: a take that sets batches aside reads on
                # through a new handle, and its batch is then sent as a tensor)
                try:
                    batch, ids, index = source.take(end_epoch=not self._pending)
                except StopIteration:
                    self._ended = not self._pending  # else asked again once they are
                    return  # delivered
                outputs = []
            position = self._position
            try:
                started = self._start(batch, ids, index, source.epoch, via, outputs)
            except Exception as e:
                # The batch is lost, as a DataLoader's whose fetch raised: passed (its
                # samples count as taken with its place, not delivered again on resume);
                # before the first sample's check ever passed, only at the next call (see
                # the module). The error's frames must not keep its views alive (and its
                # ring slot held) for as long as the caller keeps the exception.
                del batch
                if self._checked:
                    source.delivered(ids)
                else:
                    self._unpassed = (ids,)
                _clear_frames(e)
                raise
            except BaseException:  # Ctrl-C: the batch is started again at the next next(),
                # from the row it was on
                self._interrupted, self._position = (batch, ids, index, via, outputs), \
                    position
                raise
            self._pending.append(started)

    def undelivered(self) -> int:
        """Batches taken from the ring that next() has not returned, nor passed: in
        flight, cut by an interrupt, or failed before the first sample's check passed (the
        consumer's BatchFlow leaves them out of state_dict(), and drops them with
        discard() when the epoch is left)."""
        return len(self._pending) + (self._interrupted is not None) + \
            (self._unpassed is not None)

    def stats(self) -> dict:
        """A consumer's stats() of its transform: transform_seconds (run at next(), here),
        transform_wait_seconds (next() waiting for the workers: they are the bottleneck
        where it grows), transform_workers (their pids), transform_seed (the job's)."""
        return {"transform_seconds": self.transform_seconds,
                "transform_wait_seconds": self.wait_seconds,
                "transform_workers": self.worker_pids, "transform_seed": self.options.seed}

    def _start(self, batch: Any, ids: Any, index: int, epoch: int, via: Any,
               outputs: list) -> _InFlight:
        """Begin one batch's transform: here (no workers, or a GPU batch; `outputs`: those
        of its first rows, made by a start an interrupt cut) or on a worker (reading the
        inputs in the ring's file while `via`, the handle the batch was taken through, is
        the consumer's). The first sample's check runs on a copy."""
        o = self.options
        inputs, rebuild = split_inputs(batch, o.key)
        keys = sample_keys(ids, self._position, inputs.shape[0])
        self._position += inputs.shape[0]
        seeds = [sample_seed(o.seed, epoch, k) for k in keys]
        devices = [inputs.device.index or 0] if inputs.device.type == "cuda" else []
        if not self._checked:
            with callers_generators_kept(devices):
                first_sample_check(o.transform, inputs, seeds[0], o.pil)
            self._checked = True
        if o.workers == 0 or devices:
            start = time.perf_counter()
            try:
                with callers_generators_kept(devices):
                    out = transform_samples(o.transform, inputs, seeds, o.pil, outputs,
                                            fresh=True)
            except TransformError:
                raise
            except Exception as e:  # (the same error as a worker's: see the module)
                raise raised_here(o.transform, e) from e
            finally:
                self.transform_seconds += time.perf_counter() - start
            return _InFlight(index, ids, rebuild, None, batch=rebuild(out))
        pool = self._pool or self._start_workers()
        task, self._tasks = self._tasks, self._tasks + 1
        ref = shared_ref(inputs, via) if via is self._ring() else None
        # (Not in the ring's file: a copy goes, since pickling moves a tensor's storage
        # into shared memory in place, where a transform that writes into its input would
        # change what a task sent again after an interrupt reads.)
        pool.submit(task, ref if ref is not None else inputs.clone(), seeds)
        return _InFlight(index, ids, rebuild, task, inputs=inputs, seeds=seeds,
                         via=via if ref is not None else None)

    def _pass_failed(self, source: EpochSource) -> None:
        """The loop went on after a batch that failed before the first sample's check
        passed: it counts as passed now (again after an interrupt: no change)."""
        if self._unpassed is not None:
            source.delivered(self._unpassed[0])
            self._unpassed = None

    def _start_workers(self) -> WorkerPool:
        """Start the worker processes; in flight: prefetch per worker, below the ring's
        slots."""
        o = self.options
        slots = self._ring().slot_count
        self._depth = max(1, min(o.workers * o.prefetch, slots - RESERVE_SLOTS))
        if self._depth < o.workers:
            log.info("transform: %d batches in flight for %d workers (the ring has %d slots; "
                     "TensorProducer(ring_slots=) gives more)", self._depth, o.workers, slots)
        with interrupts_held():  # (a pool made whole, and kept, or none: see interrupts_held)
            self._pool = WorkerPool(o.transform, o.pil, o.workers, o.context)
        log.info("transform: %d worker processes %s, %d batches in flight", o.workers,
                 self._pool.pids, self._depth)
        return self._pool

    def _finish(self, entry: _InFlight, deadline: float | None) -> Any:
        """The delivered batch of `entry`, waiting for its worker if needed."""
        if entry.task is None:
            return entry.batch
        pool = self._pool
        assert pool is not None
        start = time.perf_counter()
        try:
            while True:
                if not entry.sent:  # (sent again after an interrupt: its first result counts)
                    assert entry.inputs is not None
                    pool.submit(entry.task, entry.inputs.clone(), entry.seeds or [])
                    entry.sent = True
                stale = entry.via is not None and entry.via is not self._ring()
                try:
                    out = pool.result(entry.task, deadline)
                except TransformError:
                    if not stale:
                        raise
                    out = None  # (its transform raised on what may be another batch)
                if out is not None and not stale:
                    break
                # The worker could not map the ring's file, or it may have read a slot the
                # consumer set aside meanwhile (see the module): the inputs go, as a new
                # task (in one step: an interrupt leaves it to send at the next call).
                entry.task, entry.sent, entry.via, self._tasks = \
                    self._tasks, False, None, self._tasks + 1
        finally:
            self.wait_seconds += time.perf_counter() - start
        task, batch = entry.task, entry.rebuild(out)
        # One step: the batch made, the entry done (an interrupt after it loses nothing),
        # its ring slot going back (the batch's other leaves are copies).
        entry.batch, entry.task, entry.inputs = batch, None, None
        pool.drop(task)  # (else pruned at the next call)
        return batch

    def discard(self) -> None:
        """Drop the batches in flight (an epoch left mid-way, a new iter()): their slots go
        back now; results still coming are dropped. After a worker died, the next batch
        starts new workers (as a DataLoader's next iterator does)."""
        self._pending.clear()
        self._interrupted, self._broken, self._unpassed = None, None, None
        if self._pool is not None:
            self._pool.prune(set())

    def _stop_pool(self) -> None:
        """Stop the workers (one died): the batches in flight stay, undelivered, their
        ring slots given back."""
        for entry in self._pending:
            entry.inputs = None
        # (Let go of first: an interrupt in close() leaves no half-stopped pool in use.)
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()

    def close(self) -> None:
        """Drop what is in flight and stop the workers."""
        self.discard()
        self._stop_pool()


def _clear_frames(error: BaseException) -> None:
    """Drop the local variables of the finished frames in `error`'s tracebacks, and those
    of the errors it was raised from (a traceback keeps the frames it passed through, and
    with them the batch's tensors, for as long as the exception lives)."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [error]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        traceback.clear_frames(e.__traceback__)
        todo += [e.__cause__, e.__context__]
