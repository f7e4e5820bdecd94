"""A consumer's epoch and resume bookkeeping: the epochs it begins and leaves, and where
it is in them for state_dict() and load_state_dict() (tensorsocket.data.resume): the
place loaded and not yet resumed from, the place of an epoch left mid-way, and in a
group the deal of a resumed epoch's samples between the ranks."""

from __future__ import annotations

import logging
import warnings
from typing import Any, Callable

import numpy as np

from ..data import resume, sample_ids
from ..data.epoch_cursor import Abandon
from ..data.rebatch import Rebatcher, consumer_len
from ..data.resume import EpochShape, SavedPlace
from ..data.sample_ids import IdMask
from ..errors import TensorSocketError, TensorSocketWarning
from .acquire import SlotAcquirer
from .epoch_state import EpochState
from .options import ConsumerOptions
from .place import RingPlace
from .reader import EpochReader

log = logging.getLogger("tensorsocket")


class ResumeBook:
    """Begins and leaves a consumer's epochs (begin(), abandon()) and says where it is
    in them (state_dict()), or where to resume (load_state_dict())."""

    def __init__(self, place: RingPlace, state: EpochState, reader: EpochReader,
                 acquirer: SlotAcquirer, options: ConsumerOptions,
                 loader_drop_last: bool) -> None:
        """The book of the consumer with this place, state and reader. loader_drop_last:
        the caller's loader's drop_last (share()), for a resumed epoch's batches."""
        self._place = place
        self._state = state
        self._reader = reader
        self._acquirer = acquirer
        self._options = options
        self._loader_drop_last = loader_drop_last
        self._resume_place: SavedPlace | None = None  # loaded, not yet resumed from
        self._left_place: SavedPlace | None = None  # of an epoch left mid-way (break)
        self._left_source: int | None = None  # the producer epoch it was left in
        self._cut_place: SavedPlace | None = None  # of an epoch the producer's end cut
        # Loaded in the middle of an epoch: resumed from when the next epoch begins.
        self._pending_place: SavedPlace | None = None
        # A resumed group epoch left: the sample ids read and not yet dealt, in order.
        self._left_stream: list | None = None
        # Batches counted in the cursor's delivered but not returned by next() (a
        # transform's in flight): the consumer's BatchFlow counts them (count_in_flight).
        self._in_flight: Callable[[], int] = lambda: 0

    def count_in_flight(self, undelivered: Callable[[], int]) -> None:
        """`undelivered()` says how many of the cursor's delivered batches next() has not
        returned yet: the places this book says leave them out."""
        self._in_flight = undelivered

    def _delivered(self) -> int:
        """Batches next() returned of the current epoch (the cursor's count, less those
        still in flight)."""
        return self._state.cursor.delivered - self._in_flight()

    def begin(self) -> None:
        """An epoch begins (the cursor's and the book's): what it takes is recorded from
        nothing, or from the place loaded by load_state_dict() (a resumed epoch). The
        place of an epoch the producer's end cut short is read first, as it is reset
        here (see cut_place)."""
        state, world = self._state, self._options.world_size
        if self._pending_place is not None and not state.cursor.in_epoch:
            pending, self._pending_place = self._pending_place, None
            self._resume_from(pending)
        self.cut_place()
        state.cursor.begin()
        place, self._resume_place = self._resume_place, None
        if not state.cursor.resuming:
            place = None  # (none loaded, or one that resumes by count)
        taken = state.taken
        taken.begin(place)
        self._left_place, self._left_stream = None, None
        batch_size = self._reader.loader_batch_size
        state.resume_batcher = Rebatcher(batch_size, self._loader_drop_last) \
            if place is not None and state.rebatcher is None and batch_size else None
        if place is not None and place.taken is not None and world > 1:
            # What the ranks' deal hands out: the samples not taken, at most the batches
            # each rank is still owed.
            size = place.dataset_len if place.dataset_len is not None \
                else place.taken.bits.size
            owed = self._reader.resume_quota() - place.batches
            taken.deal_base = state.batcher.handed_over if state.batcher is not None else 0
            taken.deal_total = int(min(size - place.taken.count(),
                                       owed * world * (self._reader.batch_size or 1)))

    def abandon(self, epoch: int, batches_dropped: bool = False) -> None:
        """The epoch's iterator was dropped or replaced before StopIteration (see
        EpochCursor.abandon). Left mid-way (break), the consumer parks, and its next
        batch comes from the start of the producer's next epoch. Aligned, it keeps its
        place while parked (for park_hold seconds once others read; it skips the rest of
        the epoch it left when it reads again), so that its next epoch is the one the jobs
        it started with read: a loop left early (Lightning's sanity check of a validation
        loader) would otherwise come back as a late joiner, an epoch later than the
        others. Safe from a finalizer: it only sets flags and events."""
        place, state = self._place, self._state
        if place.closed or place.in_forked_child():
            return
        cursor = state.cursor
        here = self.place_now() if cursor.in_epoch and cursor.epoch == epoch else None
        source = cursor.producer_epoch
        batcher = state.batcher
        stream = None
        if cursor.resuming and self._options.world_size > 1 and batcher is not None:
            loaded = state.flow.loaded
            stream = batcher.held_ids() + ([loaded[2]] if loaded is not None else [])
        outcome = cursor.abandon(epoch, state.holding(), batches_dropped)
        if outcome in (Abandon.COMPLETE, Abandon.LEFT):
            state.flow.drop()
            if batcher is not None:
                batcher.reset()
        if outcome is not Abandon.LEFT:
            return
        # What state_dict() says until the next epoch begins.
        self._left_place, self._left_source, self._left_stream = here, source, stream
        if self._options.world_size > 1 and place.aligned:
            # A rank stays attached and skips the rest of the epoch as it reads on, so
            # that every rank of its group starts the same next epoch.
            return
        place.park(hold=place.aligned, skip_epoch=True)

    # -- state_dict() -------------------------------------------------------------------

    def state_dict(self) -> dict:
        """TensorConsumer.state_dict(): the place loaded until its epoch begins, the
        epoch left mid-way until the next begins, the epoch the producer's end cut short
        (for good), else the current place."""
        if self._pending_place is not None:
            place = self._pending_place
        elif self._resume_place is not None and not self._state.cursor.in_epoch:
            place = self._resume_place
        elif self._left_place is not None:
            place = self._left_place_now(self._left_place)
        else:
            place = self.cut_place() or self.place_now(look_ahead=True)
        return resume.encode(place, self.shape())

    def cut_place(self) -> SavedPlace | None:
        """The place of the epoch that the producer's end (ProducerFailed, ProducerGone,
        a ProducerFinished mid-epoch) cut short, see RingPlace.mark_cut; None if none was.
        It is what state_dict() said just before the end (without reading on: nothing
        more comes), so that a checkpoint written where the error is caught resumes
        exactly. Read once and kept until load_state_dict(): a consumer whose producer
        ended reads nothing more (a new iter() raises again), and that new epoch, which
        resets the cursor and the samples taken, must not make the job forget them."""
        cursor = self._state.cursor
        if self._cut_place is None and not cursor.in_epoch and \
                self._place.cut_epoch == cursor.epoch:
            self._cut_place = self._place_in_epoch(look_ahead=False)
        return self._cut_place

    def shape(self) -> EpochShape:
        """What this consumer's epochs are made of (what its state depends on). Its
        epoch_batches is the most batches an epoch of any rank of its group has (len():
        with batch_size=, the ranks' parts of a loader epoch may differ), so that it is the
        same for every rank: any rank's state resumes every rank."""
        options, reader = self._options, self._reader
        world, own = options.world_size, options.batch_size
        try:
            length: int | None = reader.length()
        except TypeError:
            length = None
        if length is not None and own is not None and world > 1:
            length = max(consumer_len(reader.shape.rank_samples(rank, world), own,
                                      options.drop_last) for rank in range(world))
        return EpochShape(own, world, reader.loader_batch_size, length, reader.dataset_len)

    def load_state_dict(self, state: dict) -> None:
        """TensorConsumer.load_state_dict(), for a state that is not empty (LoaderSurface
        ignores an empty one). A state that does not fit this consumer is refused
        (ValueError naming the field, resume.decode) before anything changes: the consumer
        stays as it was. In the middle of an epoch, the state is for the next one (as
        torchdata's StatefulDataLoader loads a state for the next iterator): the epoch
        being read goes on, and the next iter() resumes from the state, which state_dict()
        says until then."""
        shape = self.shape()
        place = resume.decode(state, shape)
        exact = place.taken is not None
        unchecked = resume.unchecked(place, shape)
        if unchecked is not None:
            log.warning("%s", unchecked)
            warnings.warn(unchecked, TensorSocketWarning, stacklevel=4)
        if not exact and place.batches:
            message = (
                "this state does not say which samples were taken (the producer's loader "
                "does not tell the samples of its batches: it has no sampler, or the state "
                "is from an older tensorsocket), so the resumed epoch skips its first "
                f"{place.batches} batches by count; with a shuffling loader some samples "
                "of the epoch may come twice and others not at all")
            log.warning("%s", message)
            warnings.warn(message, TensorSocketWarning, stacklevel=4)
        if self._state.cursor.in_epoch:
            log.info("consumer %d: a state loaded in the middle of an epoch resumes the next "
                     "one (%d epochs done, %d batches of the next taken); this one goes on",
                     self._place.index, place.epoch, place.batches)
            self._pending_place = place
            return
        self._pending_place = None
        self._resume_from(place)

    def _resume_from(self, place: SavedPlace) -> None:
        """The next epoch resumes from `place` (a state loaded, checked already)."""
        exact = place.taken is not None
        cursor = self._state.cursor
        # The epoch count is the job's (as a training loop's): carried as it is. It names
        # this consumer's epochs and selects no samples, and no producer's epoch bounds
        # it (a producer started after the job's restart counts from 0).
        log.info("consumer %d resumes after %d epochs (the state's count; the producer was "
                 "at its epoch %d when the consumer attached), %d batches of the next taken",
                 self._place.index, place.epoch, self._place.welcome.epoch, place.batches)
        cursor.resume(place.epoch, place.batches, exact)
        self._resume_place = place  # (what state_dict() says until the epoch begins)
        self._left_place = self._cut_place = self._place.cut_epoch = None

    def place_now(self, look_ahead: bool = False) -> SavedPlace:
        """Where this consumer is in its epochs, for state_dict(): epochs completed, batches
        delivered of the current one and the samples of it taken (by the group). In a
        group, look_ahead reads on to this rank's next batch when the group's batches
        taken are not all seen yet (the ranks ahead of it in the deal)."""
        cursor = self._state.cursor
        if not cursor.in_epoch or self._delivered() == 0:
            # Nothing delivered (iter() and no next() yet, too): the next epoch is a whole
            # one, counted from a producer epoch's start (an empty set of samples taken
            # would resume from wherever the producer is, in a rotated order).
            return SavedPlace(cursor.epoch, 0, None, self._reader.dataset_len)
        return self._place_in_epoch(look_ahead)

    def _place_in_epoch(self, look_ahead: bool) -> SavedPlace:
        """place_now() of the epoch the cursor counts in (iterated, or cut short by the
        producer's end): the batches delivered of it and the samples they took."""
        state, world, size = self._state, self._options.world_size, self._reader.dataset_len
        cursor, taken_by = state.cursor, state.taken
        batches = self._delivered()
        if world > 1 and taken_by.known and size is not None and state.epoch_complete():
            # Every rank's batches of the epoch were delivered (ranks step together): all
            # of it is taken, what no rank takes (the tail a group leaves) included.
            return SavedPlace(cursor.epoch, batches, IdMask.whole(size), size, size)
        part = taken_by.part(batches)
        if part is None and look_ahead and world > 1 and taken_by.known:
            self._reader.read_to_next_batch()
            part = taken_by.part(batches)
            if part is None and taken_by.known:
                log.warning("consumer %d (rank %d of %d): the group's batches before its "
                            "own next one did not all come; its state counts batches only",
                            self._place.index, self._options.rank, world)
        return resume.place_of(cursor.epoch, batches, part, size)

    def _left_place_now(self, place: SavedPlace) -> SavedPlace:
        """The place of the epoch left mid-way (`place`, as left), for state_dict(). A
        rank of a group reads on through the rest of the producer epoch it left (it skips
        it anyway) until the group's batches taken are all seen; the entry after that
        epoch stays for the next."""
        taken = self._state.taken
        if place.taken is not None or self._options.world_size == 1 or \
                not taken.known or self._left_source is None or self._place.closed:
            return place
        if self._left_stream is not None:
            self._deal_on(place.batches)
        else:
            while taken.taken(place.batches) is None:
                read = self._read_on_in_left_epoch()
                if read is None:
                    break
                taken.group_batch(*read)
        self._left_place = place = resume.place_of(
            place.epoch, place.batches, taken.part(place.batches), place.dataset_len)
        return place

    def _read_on_in_left_epoch(self) -> tuple[int, Any] | None:
        """The next entry of the producer epoch left mid-way, skipped (as reading on would
        skip it): (its index, its sample ids); None once that epoch is over (the entry
        after it stays in flow.entry, for the next epoch to place) or reading stopped."""
        entry = self._state.flow.entry
        slot = entry[0]
        if slot is None:
            try:
                slot = self._acquirer.acquire()
            except (TensorSocketError, TimeoutError) as e:  # the state says less
                log.info("consumer %d: reading on for its state stopped: %s",
                         self._place.index, e)
                return None
        if slot.is_end_of_epoch or slot.epoch != self._left_source:
            return None
        read = slot.index, sample_ids.split(slot.meta)[1]
        self._state.cursor.place(slot)  # (the rest of the epoch left: skipped)
        entry[0] = None
        slot.release()
        return read

    def _deal_on(self, batches: int) -> None:
        """A resumed group epoch was left: go on with the deal (reading on in the
        producer epoch it read, keeping the samples not taken, cutting them as the deal
        does) until the group's batches taken by `batches` of each rank are known."""
        taken, stream = self._state.taken, self._left_stream
        assert stream is not None
        ended = False
        while taken.taken(batches) is None:
            size = taken.deal_batch_size(self._reader.batch_size or 1)
            while sum(0 if ids is None else ids.size for ids in stream) < size and not ended:
                read = None if taken.unclaimed(self._reader.dataset_len) == 0 \
                    else self._read_on_in_left_epoch()
                if read is None:
                    ended = True
                elif read[1] is None:
                    stream.append(None)
                else:
                    stream.append(read[1][taken.keep(read[1])])
            if any(ids is None for ids in stream):
                taken.known = False  # (a batch without sample ids: the state counts)
                return
            joined = np.concatenate(stream) if stream else np.empty(0, np.int64)
            if joined.size == 0:
                return
            stream[:] = [joined[size:]]
            taken.deal(taken.dealt, joined[:size])

    def delivered_and_pending(self) -> tuple[list[list[int]], list[list[int]]] | None:
        """For a sampler view (consumer.batch_sampler): the samples of the batches this
        consumer delivered of its current (or resumed) epoch, and those it is still owed,
        each in batches of its batch size (in a group, this rank's deal of the samples not
        taken); None when the samples are not known. The batches delivered are told by
        their samples, not their order."""
        world, rank = self._options.world_size, self._options.rank
        if self._resume_place is not None and not self._state.cursor.in_epoch:
            place, mine = self._resume_place, None
        else:
            place = self._left_place or self.cut_place() or self.place_now()
            mine = self._state.taken.mine
        size, batch_size = place.dataset_len, self._reader.batch_size
        if place.taken is None or size is None or not batch_size:
            return None
        taken = place.taken.bits[:size]
        own = mine.bits[:size] if mine is not None and world > 1 else taken
        delivered = _chunks(np.flatnonzero(own), batch_size)[:place.batches]
        pending = _chunks(np.flatnonzero(~np.pad(taken, (0, size - taken.size))),
                          batch_size)
        owed = max(self._reader.resume_quota() - place.batches, 0)
        dealt = pending[rank::world]
        return delivered, dealt[:int(min(owed, len(dealt)))]


def _chunks(ids: np.ndarray, size: int) -> list[list[int]]:
    """`ids` in lists of `size` (the last one shorter)."""
    values = ids.tolist()
    return [values[i:i + size] for i in range(0, len(values), size)]
