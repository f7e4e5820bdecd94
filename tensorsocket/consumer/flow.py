"""A consumer's batch flow: the one owner of a batch's way from the ring to the caller.

take (the reader: the next ring entry placed in the epoch, cut by the re-batcher) ->
transform (the job's TransformStage, when it has one) -> deliver (counted: the batch, its
samples, its index in the epoch). The epoch iterators (iterator.py) ask this object for
everything; the batches a transform holds in flight (taken, not delivered) are counted
here only (undelivered()): state_dict() leaves them out, and leaving an epoch drops them.

The common case (a host ring read in place, the loader's batches as they are, alone,
whole epochs, no transform, no unpack_fn) skips the Python steps: its iterator's next()
is the core's (tensorsocket._core.Lane), which takes, builds and counts in one call, and
comes back here only for an epoch's first and last batch, a wait, or anything else
(lane_setup() says what the lane reads)."""

from __future__ import annotations

import time
from typing import Any, Callable

from ..augment import TransformStage
from ..data.delivery import from_capsule
from ..data.rebatch import EpochEnd
from .acquire import SlotAcquirer
from .book import ResumeBook
from .epoch_state import EpochState
from .options import ConsumerOptions
from .place import RingPlace
from .reader import EpochReader


# How long the common path waits in the core for an entry not yet published before the
# acquirer's waits take over (what they look at between slices, Python's: kept batches
# that block, this process's idle consumers, the warnings, need none this soon). A
# consumer that keeps up finds its next entry within it, without leaving C.
LANE_WAIT = 0.002


class BatchFlow:
    """The batch flow of one consumer (see the module docstring).

    unpack_fn / with_index: as TensorConsumer's (applied to each batch, and pairs of
    (index, batch)); iterators: the iter() calls so far (the last one's iterator is the
    current one)."""

    def __init__(self, place: RingPlace, state: EpochState, reader: EpochReader,
                 acquirer: SlotAcquirer, book: ResumeBook, stage: TransformStage | None,
                 options: ConsumerOptions, unpack_fn: Callable[[Any], Any] | None) -> None:
        """The flow of the consumer with these parts (stage: its transform, or None)."""
        self._place = place
        self._state = state
        self._reader = reader
        self._acquirer = acquirer
        self._book = book
        self.stage = stage
        self._options = options
        self.unpack_fn = unpack_fn
        self.with_index = options.with_index
        self.iterators = 0

    # -- epochs ------------------------------------------------------------------------

    def begin_epoch(self) -> tuple[int, int]:
        """iter(consumer): an earlier iterator still mid-epoch ends here, and the next
        epoch begins (unless the last one's first next() was interrupted: it goes on).
        Returns (the epoch, the new iterator's serial)."""
        place, cursor = self._place, self._state.cursor
        with place.lock:
            if cursor.in_epoch:  # an earlier iterator is still mid-epoch: it ends here
                self._book.abandon(cursor.epoch, self._drop_in_flight())
            if not cursor.in_epoch:  # (else its first next() was interrupted: go on)
                self._drop_in_flight()  # (of an epoch the producer's end cut short)
                self._book.begin()
            self.iterators += 1
            return cursor.epoch, self.iterators

    def is_current(self, serial: int) -> bool:
        """Whether the iterator made by iter() number `serial` is the consumer's current
        one (a later iter() takes over)."""
        return serial == self.iterators

    def leave(self, epoch: int, serial: int) -> None:
        """The iterator `serial` of `epoch` was dropped or closed: leave its epoch, unless
        a later iterator took it over (one made after this one was interrupted before it
        returned a batch goes on with it)."""
        if self.is_current(serial):
            self._book.abandon(epoch, self._drop_in_flight())

    def _drop_in_flight(self) -> bool:
        """Drop the transform's batches in flight: they leave the batches delivered for
        good (the place the consumer keeps counts what next() returned: a resumed job
        gets them). Whether there were any (an epoch whose last batches were in flight is
        not complete)."""
        undelivered = self.undelivered()
        if self.stage is not None:
            self._state.cursor.delivered -= undelivered
            self.stage.discard()
        return undelivered > 0

    def undelivered(self) -> int:
        """Batches taken from the ring and counted in the cursor that next() has not
        returned: a transform's in flight (0 without one)."""
        return 0 if self.stage is None else self.stage.undelivered()

    # -- the common path (tensorsocket._core.Lane) --------------------------------------

    def lane_setup(self, epoch: int) -> dict:
        """The arguments of Lane.bind_lane for an iterator of `epoch`: what the common path
        reads and counts in; place None where this consumer is not a common case."""
        place, state, options = self._place, self._state, self._options
        shape = self._reader.shape
        common = self.stage is None and self.unpack_fn is None and \
            state.rebatcher is None and options.world_size == 1 and place.aligned and \
            place.delivery.zero_copy_host
        known = shape.batch_size is not None and shape.length is not None
        batch_wait = LANE_WAIT if options.batch_wait is None else options.batch_wait
        return {**place.lane_parts(), "place": place if common else None,
                "cursor": state.cursor, "flow": state.flow, "taken": state.taken,
                "builder": place.delivery.common_builder, "from_dlpack": from_capsule,
                "epoch": epoch, "with_index": self.with_index,
                "length": -1 if state.cursor.length is None else state.cursor.length,
                "batch_samples": shape.batch_size if known else -1,
                "wait_ns": int(min(LANE_WAIT, batch_wait) * 1e9)}

    def wait_entry(self) -> bool:
        """The common path found nothing published: wait for the next entry (the
        acquirer's waits), which goes into the entry box; False where the wait ended the
        epoch's reading instead (a rejoin: the slow path ends the epoch)."""
        try:
            self._acquirer.acquire()
        except EpochEnd:
            return False
        return True

    # -- the other batches -------------------------------------------------------------

    def next(self, source: Any) -> Any:
        """The next batch of `source`'s epoch (an EpochIterator: its epoch and serial),
        delivered; StopIteration at its end."""
        if self.stage is not None:
            if not self.is_current(source.serial):
                raise StopIteration  # a newer iter() took over (its batches in flight stay)
            index, batch = self.stage.next(source)
            return (index, batch) if self.with_index else batch
        state = self._state
        batch = self._ready_batch(source.epoch)
        out = (state.cursor.delivered, batch) if self.with_index else batch
        # Delivered: counted in one step with the return (no call in between, where a
        # KeyboardInterrupt could land: until here the batch stays for the next next()).
        flow = state.flow
        # (Recorded again after an interrupt before the count: no change.)
        state.taken.delivered(flow.ready[2])  # type: ignore[index]
        flow.samples += flow.ready[1]  # type: ignore[index]
        flow.ready = None
        flow.batches += 1
        state.cursor.delivered += 1
        return out

    def take(self, epoch: int, end_epoch: bool = True) -> tuple[Any, Any, int]:
        """The next batch of `epoch`, taken from the ring but not yet delivered (the
        transform's): (batch, its sample ids or None, its index in the epoch);
        StopIteration at the epoch's end (ending it unless end_epoch is False)."""
        state = self._state
        batch = self._ready_batch(epoch, end_epoch)
        flow, cursor = state.flow, state.cursor
        ready, index = flow.ready, cursor.delivered
        flow.samples += ready[1]  # type: ignore[index]
        flow.ready = None
        flow.batches += 1
        cursor.delivered += 1
        return batch, ready[2], index  # type: ignore[index]

    def delivered(self, ids: Any) -> None:
        """A batch taken is delivered now: its samples count as taken (state_dict())."""
        self._state.taken.delivered(ids)

    def deadline(self) -> float | None:
        """When a transformed batch must be there (batch_timeout), or None."""
        wait = self._options.batch_wait
        return None if wait is None else time.monotonic() + wait

    def epoch_length(self) -> int:
        """Batches in an epoch (len(consumer)); TypeError where that is unknown."""
        return self._reader.length()

    def length(self) -> int | None:
        """Batches in an epoch (len(consumer)), or None if unknown."""
        try:
            return self._reader.length()
        except TypeError:
            return None

    def _ready_batch(self, epoch: int, end_epoch: bool = True) -> Any:
        """The next batch of `epoch` made ready (flow.ready), unpacked; StopIteration at
        the epoch's end (ending it unless end_epoch is False), or if the consumer is in
        another epoch."""
        if self._state.cursor.epoch != epoch:
            raise StopIteration
        batch = self._reader.next_batch(end_epoch)
        if self.unpack_fn is not None:
            batch = self.unpack_fn(batch)
        return batch

    def close(self) -> None:
        """Stop the transform's workers (the consumer closes)."""
        if self.stage is not None:
            self.stage.close()
