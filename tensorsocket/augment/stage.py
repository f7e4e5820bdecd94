"""The batches between the ring and the training step of a consumer with a transform.

next() keeps up to ``depth`` batches in flight: taken from the ring (counted there as
taken, as any batch next() made), their transforms queued on the workers, delivered in
order. Worker processes read each batch's inputs in place, in the ring slot, which the
batch holds until its outputs are back; so ``depth`` stays below the ring's slots, leaving
the producer room to publish. A batch counts as delivered (state_dict()'s samples taken)
only when next() returns it, or when its transform raised (it is lost then, as a
DataLoader's batch whose worker raised: passed, not delivered again on resume). A Ctrl-C
in a transform run at next() keeps the batch for the next call; a dead worker stops the
workers, the batches in flight staying undelivered, until a new iter() starts new ones.
Without workers, depth is one and the transform runs here, at next(), with the caller's
random generators left as they were.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Protocol

import torch

from ..errors import TensorSocketError, TransformError
from .options import TransformOptions
from .samples import Rebuild, first_sample_check, split_inputs, transform_samples
from .seeding import callers_generators_kept, sample_keys, sample_seed
from .shared_views import shared_ref
from .workers import WorkerPool

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


class TransformStage:
    """One consumer's transform of every sample it delivers (see the module)."""

    def __init__(self, options: TransformOptions, slot_count: Callable[[], int]) -> None:
        """No batch in flight; the workers start at the first batch. slot_count: the
        ring's slots (read when the workers start)."""
        self.options = options
        self._slot_count = slot_count
        self._pool: WorkerPool | None = None
        self._pending: collections.deque[_InFlight] = collections.deque()
        self._owner = -1  # serial of the iterator whose epoch is in flight
        self._ended = False  # that epoch's last batch was taken
        self._checked = False  # the first sample's check ran
        self._depth = 1
        self._tasks = 0
        self._position = 0  # samples of the epoch taken so far (the seeds' positions)
        self._interrupted: tuple[Any, Any, int] | None = None  # a batch taken whose start a
        # KeyboardInterrupt cut: (batch, ids, index), started again at the next next()
        self._broken: str | None = None  # a worker died: why next() raises until discard()
        self.wait_seconds = 0.0  # next() waiting for workers' outputs (stats())
        self.transform_seconds = 0.0  # transforms run here, at next() (stats())

    @classmethod
    def of(cls, options: TransformOptions | None,
           slot_count: Callable[[], int]) -> "TransformStage | None":
        """The stage of these options, or None without a transform."""
        return None if options is None else cls(options, slot_count)

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
        if self._broken is not None:  # (before _fill: it would start new workers)
            raise TensorSocketError(self._broken)
        self._fill(source)
        if not self._pending:
            raise StopIteration
        entry = self._pending[0]
        try:
            batch = self._finish(entry, source.deadline())
        except TransformError as e:  # its transform raised in a worker: the batch is lost,
            self._pending.popleft()  # as a DataLoader's whose worker raised, and passed
            entry.inputs = None
            source.delivered(entry.ids)
            _clear_frames(e)
            raise
        except TensorSocketError as e:  # a worker died: the workers stop, the batches in
            self._broken = f"{e} (a new iter() starts new transform workers)"  # flight
            self._stop_pool()  # stay undelivered (state_dict() leaves them out)
            _clear_frames(e)
            raise
        # (An interrupt or a batch_timeout before here leaves the entry first, its
        # result kept by the pool, for the next call.)
        self._pending.popleft()
        source.delivered(entry.ids)
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
                (batch, ids, index), self._interrupted = self._interrupted, None
            else:
                try:
                    batch, ids, index = source.take(end_epoch=not self._pending)
                except StopIteration:
                    self._ended = not self._pending  # else asked again once they are
                    return  # delivered
            position = self._position
            try:
                started = self._start(batch, ids, index, source.epoch)
            except Exception as e:
                # The batch is lost, as a DataLoader's whose fetch raised: passed (its
                # samples count as taken with its place, not delivered again on resume).
                # The error's frames must not keep its views alive (and its ring slot
                # held) for as long as the caller keeps the exception.
                del batch
                source.delivered(ids)
                _clear_frames(e)
                raise
            except BaseException:  # Ctrl-C: the batch is started again at the next next()
                self._interrupted, self._position = (batch, ids, index), position
                raise
            self._pending.append(started)

    @contextlib.contextmanager
    def undelivered_left_out(self, cursor: Any) -> Iterator[None]:
        """While the block runs (state_dict()), the batches in flight, taken from the ring
        and not delivered, do not count in the epoch cursor's delivered batches (their
        samples are not in the samples delivered either)."""
        undelivered = len(self._pending) + (self._interrupted is not None)
        cursor.delivered -= undelivered
        try:
            yield
        finally:
            cursor.delivered += undelivered

    def stats(self) -> dict:
        """A consumer's stats() of its transform: transform_seconds (run at next(), here),
        transform_wait_seconds (next() waiting for the workers: they are the bottleneck
        where it grows), transform_workers (their pids), transform_seed (the job's)."""
        return {"transform_seconds": self.transform_seconds,
                "transform_wait_seconds": self.wait_seconds,
                "transform_workers": self.worker_pids, "transform_seed": self.options.seed}

    def _start(self, batch: Any, ids: Any, index: int, epoch: int) -> _InFlight:
        """Begin one batch's transform: here (no workers, or a GPU batch) or on a worker."""
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
            with callers_generators_kept(devices):
                out = transform_samples(o.transform, inputs, seeds, o.pil)
            self.transform_seconds += time.perf_counter() - start
            return _InFlight(index, ids, rebuild, None, batch=rebuild(out))
        pool = self._pool or self._start_workers()
        task, self._tasks = self._tasks, self._tasks + 1
        ref = shared_ref(inputs)
        pool.submit(task, ref if ref is not None else inputs, seeds)
        return _InFlight(index, ids, rebuild, task, inputs=inputs, seeds=seeds)

    def _start_workers(self) -> WorkerPool:
        """Start the worker processes; in flight: prefetch per worker, below the ring's
        slots."""
        o = self.options
        slots = self._slot_count()
        self._depth = max(1, min(o.workers * o.prefetch, slots - 2))
        if self._depth < o.workers:
            log.info("transform: %d batches in flight for %d workers (the ring has %d slots; "
                     "TensorProducer(ring_slots=) gives more)", self._depth, o.workers, slots)
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
            out = pool.result(entry.task, deadline)
            while out is None:  # the worker could not map the ring's file: send the inputs
                entry.task, self._tasks = self._tasks, self._tasks + 1
                pool.submit(entry.task, entry.inputs, entry.seeds or [])
                out = pool.result(entry.task, deadline)
        finally:
            self.wait_seconds += time.perf_counter() - start
        # One step: the batch made, the entry done (an interrupt after it loses nothing),
        # its ring slot going back (the batch's other leaves are copies).
        entry.batch, entry.task, entry.inputs = entry.rebuild(out), None, None
        return entry.batch

    def discard(self) -> None:
        """Drop the batches in flight (an epoch left mid-way, a new iter()): their slots go
        back now; results still coming are dropped. After a worker died, the next batch
        starts new workers (as a DataLoader's next iterator does)."""
        if self._pool is not None:
            self._pool.forget([e.task for e in self._pending if e.task is not None])
        self._pending.clear()
        self._interrupted, self._broken = None, None

    def _stop_pool(self) -> None:
        """Stop the workers (one died): the batches in flight stay, undelivered, their
        ring slots given back."""
        for entry in self._pending:
            entry.inputs = None
        if self._pool is not None:
            self._pool.close()
            self._pool = None

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
