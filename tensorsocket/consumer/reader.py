"""The batches of a consumer's epoch: the loader batches its cursor places in the
epoch, taken from the ring (pull), cut by its re-batcher, or, in a resumed epoch, the
samples not taken yet (dealt between the ranks of a group)."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from ..data import sample_ids
from ..data.epoch_cursor import Step
from ..data.rebatch import EpochEnd, batch_samples, combine, consumer_len
from ..data.sample_ids import IdMask
from ..errors import TensorSocketError
from ..loader.loader_info import LoaderShape
from .acquire import SlotAcquirer
from .cache_notice import CacheNotice
from .epoch_state import EpochState
from .options import ConsumerOptions
from .place import RingPlace
from .siblings import SIBLINGS, ParkingMember

log = logging.getLogger("tensorsocket")


class EpochReader:
    """Reads one consumer's epochs out of the ring: next_batch() makes the next batch of
    the current epoch; length() is the batches of one epoch.

    samples_per_epoch: the producer's loader's samples per epoch (None: unknown);
    loader_batch_size: its batch size; dataset_len: its dataset's length."""

    def __init__(self, place: RingPlace, state: EpochState, acquirer: SlotAcquirer,
                 member: ParkingMember, options: ConsumerOptions) -> None:
        """The reader of the consumer with this place and state."""
        welcome = place.welcome
        self._place = place
        self._state = state
        self._acquirer = acquirer
        self._member = member
        self._options = options
        self.shape = LoaderShape.of_reply(welcome)  # what the producer's loader yields
        self.samples_per_epoch: int | None = welcome.samples
        self.loader_batch_size: int | None = welcome.loader_batch_size
        self.dataset_len: int | None = welcome.dataset_len
        self._skipped_to_align = 0  # entries skipped waiting for an epoch start
        self._cache_notice = CacheNotice()  # what the producer's cache note told this job
        self._said_waiting = False  # a resumed windowed epoch said it waits for a pass

    @property
    def batch_size(self) -> int | None:
        """Samples per batch: batch_size= if given, else the producer's loader's."""
        return self._options.batch_size or self.loader_batch_size

    def length(self) -> int:
        """Batches in one epoch of this consumer; TypeError if that is unknown (see the
        TensorConsumer docstring)."""
        own, world = self._options.batch_size, self._options.world_size
        if self.shape.length is None:
            raise TypeError(
                "len() of this consumer is unknown: the producer's loader has no len() (a "
                "generator or an iterable without __len__, as a DataLoader over an "
                "IterableDataset without __len__); iterate without len(), or give the "
                "producer a loader with __len__"
            )
        if own is None:
            return self.shape.length // world
        if self.samples_per_epoch is None:
            raise TypeError(
                f"len() of this consumer is unknown: the producer's loader does not tell "
                f"its sample count (it is not a DataLoader and has no int batch_size), so "
                f"the number of batch_size={own} batches per epoch is unknown"
            )
        return consumer_len(self.rank_samples(), own, self._options.drop_last)

    def rank_samples(self) -> int:
        """Samples one epoch brings this consumer (its rank's share in a group)."""
        return self.shape.rank_samples(self._options.rank, self._options.world_size)

    def resume_quota(self) -> float:
        """Batches of this consumer's resumed epoch, counting those delivered before the
        interruption: one epoch's (len()), or no limit if that is unknown."""
        try:
            return self.length()
        except TypeError:
            return float("inf")

    def next_batch(self, end_epoch: bool = True) -> Any:
        """The batch next() returns next, made into ``flow.ready`` (where it stays until
        EpochIterator.__next__ counts it as delivered); StopIteration at the epoch's end,
        which ends the epoch unless end_epoch is False (a transform stage whose batches of
        the epoch are still in flight: it asks again, ending it, once they are delivered).

        A KeyboardInterrupt (Ctrl-C caught by the loop, which goes on) may land anywhere
        here; the next call goes on from the state it left: a ring entry taken stays in
        flow.entry (Ring.acquire puts it there), the cursor places an entry placed already
        as before and takes it once (see epoch_cursor), the batch made of it waits in
        flow.loaded, then flow.ready, each moved on in a step with no call in it, and the
        end of an epoch is counted last, once its other steps (which may be repeated) are
        done."""
        self._place.check_process()
        state = self._state
        cursor, flow = state.cursor, state.flow
        self._place.flush_releases()
        if flow.ready is None or cursor.resuming and self._options.world_size > 1:
            if not cursor.in_epoch:
                raise StopIteration
            if cursor.fresh():
                SIBLINGS.park_idle(self._member)  # nobody waits for our idle consumers
            try:
                self.make_ready()
            except EpochEnd:
                if not end_epoch:  # (make_ready() says so again: source_done)
                    raise StopIteration from None
                if state.batcher is not None:
                    state.batcher.reset()
                self._take_end_marker()
                cursor.end()
                self._place.flush_releases()
                if self._place.attached and not self._place.closed:
                    self._cache_notice.check(self._place.ring, self._place.index)
                raise StopIteration from None
        return flow.ready[0]  # type: ignore[index]

    def make_ready(self) -> None:
        """Make the next batch of this epoch into flow.ready (see next_batch); EpochEnd
        after its last. In a resumed epoch, the batches it still owes (see resume_quota);
        in a resumed group epoch, the batches dealt to this rank."""
        state, world = self._state, self._options.world_size
        cursor, flow, taken = state.cursor, state.flow, state.taken
        batcher = state.batcher
        dealing = cursor.resuming and world > 1 and batcher is not None
        while True:
            if flow.ready is not None:
                if not dealing:
                    return
                # Which rank's it is follows from the count of batches made (the same
                # after an interrupt before this step: the batch is dealt once).
                assert batcher is not None
                index = batcher.handed_over - 1 - taken.deal_base
                taken.deal(index, flow.ready[2])
                if index % world == self._options.rank:
                    return
                flow.ready = None  # another rank's batch of the deal
                continue
            if cursor.resuming and cursor.delivered >= self.resume_quota():
                raise EpochEnd
            if batcher is None:
                batch, n, ids = self.pull()
                # (n None: neither the loader nor a tensor with a dimension tells)
                flow.ready, flow.loaded = (batch, n or 0, ids), None
            else:
                if cursor.resuming and world > 1:
                    batcher.batch_size = taken.deal_batch_size(self.batch_size or 1)
                batcher.next_batch(self.pull, flow)
            if cursor.skip:  # taken before the state resumed from: as delivered
                cursor.skip -= 1
                cursor.delivered += 1
                flow.ready = None

    def read_to_next_batch(self) -> None:
        """Make this rank's next batch ready (not delivered), reading the group's batches
        before it; nothing if the epoch ends first (its next next() ends it)."""
        state = self._state
        if state.epoch_complete():
            return
        try:
            self.make_ready()
        except EpochEnd:
            return
        if state.cursor.resuming or self._options.batch_size is None:
            return
        # Own batch sizes: the other ranks' batches up to this rank's next loader batch
        # (kept, placed, for its next next()), which hold the rest of their samples taken.
        entry = state.flow.entry
        while entry[0] is None and not state.cursor.source_done:
            try:
                slot = self._acquirer.acquire()
            except (TensorSocketError, TimeoutError):
                return  # (the producer finished or is gone: the state says what is known)
            step = state.cursor.place(slot)
            if step is not Step.DROP:
                return  # a batch of ours (TAKE), or the epoch's end: kept for next()
            if not slot.is_end_of_epoch:
                state.taken.group_batch(slot.index, sample_ids.split(slot.meta)[1])
            entry[0] = None
            slot.release()

    def _take_end_marker(self) -> None:
        """After an epoch that ended with its last batch (len() known), take the
        producer's end-of-epoch marker now if it is already published, so that nothing
        of the finished epoch stays unread (an entry of the next epoch is kept for it)."""
        cursor = self._state.cursor
        if not cursor.wants_end_marker() or not self._place.attached:
            return
        entry = self._state.flow.entry
        slot = entry[0]  # an entry of the next epoch, or the marker (taken, then interrupted)
        if slot is None:
            try:
                slot = self._place.ring.acquire(0, entry)
            except Exception:  # nothing published yet (or the producer is gone): later
                cursor.marker_unpublished()
                return
        if cursor.ends_finished_epoch(slot):
            entry[0] = None
            slot.release()

    # -- the loader batches of this consumer's epoch ----------------------------------

    def pull(self) -> tuple[Any, int | None, Any]:
        """The next loader batch of this consumer's epoch and its sample count if the
        loader tells, made into flow.loaded unless one is there; EpochEnd after its last.
        It leaves flow.loaded in the caller's step that hands it on."""
        state = self._state
        flow, cursor = state.flow, state.cursor
        while flow.loaded is None:
            if cursor.resuming and state.taken.unclaimed(self.dataset_len) == 0:
                raise EpochEnd  # every sample of the resumed epoch was read
            self._place.ensure_attached()
            if self._place.aligned and not (cursor.resuming and self._options.world_size == 1):
                self._pull_aligned()
            else:
                self._pull_window()
        return flow.loaded  # type: ignore[return-value]

    def _place_next(self) -> tuple[Any, Step] | None:
        """The next entry placed in the epoch: taken (None) if it is the next batch, else
        (its slot, the step the cursor says) for the caller's loop."""
        slot = self._next_entry()
        step = self._state.cursor.place(slot)
        if step is Step.TAKE:
            self._take(slot)
            return None
        return slot, step

    def _pull_aligned(self) -> None:
        """pull() for aligned epochs: each epoch of this consumer is one whole epoch of
        the producer, from its first batch; a consumer that attached mid-epoch skips to
        the next epoch's start. In a group, this rank's share of it (see EpochCursor)."""
        entry = self._state.flow.entry
        while (placed := self._place_next()) is not None:
            slot, step = placed
            if step is Step.END_BEFORE:
                raise EpochEnd  # the entry stays: the next epoch's first
            if step is Step.DROP and self._options.world_size > 1 and \
                    not slot.is_end_of_epoch:
                self._state.taken.group_batch(slot.index, sample_ids.split(slot.meta)[1])
            entry[0] = None
            slot.release()
            if step is Step.SKIP:
                self._skip_to_align(slot)
            elif step is Step.END:
                raise EpochEnd

    def _pull_window(self) -> None:
        """pull() with align_epochs=False: a late joiner's epoch is the next len() batches
        from where it started (see docs/usage.md)."""
        entry = self._state.flow.entry
        while (placed := self._place_next()) is not None:
            slot, step = placed
            if step is Step.SKIP and not self._said_waiting:
                self._said_waiting = True
                log.warning("consumer %d resumes by count from the first batch of a producer "
                            "epoch: the producer is at batch %d of its epoch %d, so it waits "
                            "for the producer's next pass (a stream that never ends one "
                            "never gives it: load no state for such a stream)",
                            self._place.index, slot.index, slot.epoch)
            entry[0] = None
            slot.release()
            if step is Step.END:
                raise EpochEnd

    def _next_entry(self) -> Any:
        """The entry taken and not yet used (flow.entry), else the next one from the ring;
        EpochEnd when there is none and the producer's epoch is over."""
        slot = self._state.flow.entry[0]
        if slot is None:
            if self._state.cursor.source_done:
                raise EpochEnd
            slot = self._acquirer.acquire()
        return slot

    def _take(self, slot: Any) -> None:
        """Make the batch of a slot of this epoch into flow.loaded, with its sample count
        if known: the loader's, or else (without a re-batcher, whose own rules count the
        rest) dim 0 of the batch's first tensor with a dimension; None otherwise. Made
        again if an interrupt comes before it is there (the slot stays in flow.entry)."""
        n = self.shape.samples_in(slot.index)
        state = self._state
        cursor, taken = state.cursor, state.taken
        batch, leading, ids = self._place.delivery.build(slot, n is None and
                                                         state.batcher is None)
        n = leading if n is None else n
        cursor.taken(slot)
        loaded: tuple | None = (batch, n, ids)
        if cursor.resuming and ids is None and taken.known:
            log.warning("consumer %d resumes from a state that names the samples taken, but "
                        "the producer does not tell the samples of its batches: its resumed "
                        "epoch takes %s batches as they come", self._place.index,
                        self.resume_quota() - cursor.delivered)
        if cursor.resuming and ids is not None:
            loaded = _kept_samples(batch, n, ids, taken.claimed)  # type: ignore[arg-type]
        elif self._options.world_size > 1:
            taken.group_batch(slot.index, ids)
        flow = state.flow
        # One step (no call): the entry is used up, its batch is made and counted.
        flow.loaded, flow.entry[0] = loaded, None
        if loaded is not None and cursor.resuming and ids is not None:
            taken.claim(loaded[2])  # read: not kept again (from the next producer epoch)
        flow.loader_batches += 1
        flow.bytes += slot.nbytes
        slot.release()

    def _skip_to_align(self, slot: Any) -> None:
        """Drop an entry taken while waiting for the start of an epoch."""
        slot.release()
        if self._skipped_to_align == 0 or self._skipped_to_align % 1000 == 0:
            log.info("consumer %d attached in the middle of the producer's epoch %d: waiting "
                     "for the start of epoch %d, so that its epochs are whole (entries "
                     "skipped so far: %d)", self._place.index, slot.epoch,
                     self._state.cursor.want_epoch, self._skipped_to_align + 1)
        self._skipped_to_align += 1


def _kept_samples(batch: Any, n: int | None, ids: np.ndarray,
                  claimed: IdMask) -> tuple[Any, int, np.ndarray] | None:
    """A loader batch read in a resumed epoch, with only the samples not taken yet:
    (batch, samples, ids); the batch itself when all are kept, None when none is (a copy
    of the samples kept otherwise)."""
    keep = ~claimed.contains(ids)
    if keep.all():
        return batch, ids.size, ids
    if not keep.any():
        return None
    if n is None or n != ids.size:
        n = batch_samples(batch)
        if n != ids.size:  # a collate_fn that changes the number of samples
            log.warning("a batch of %d samples came with %d sample ids: it is kept whole in "
                        "the resumed epoch", n, ids.size)
            return batch, n, ids
    runs = _runs(keep)
    return combine([(batch, start, stop, n) for start, stop in runs]), \
        int(keep.sum()), ids[keep]


def _runs(keep: np.ndarray) -> list[tuple[int, int]]:
    """The (start, stop) ranges of the True runs of `keep`."""
    edges = np.flatnonzero(np.diff(np.concatenate(([0], keep.astype(np.int8), [0]))))
    return list(zip(edges[0::2].tolist(), edges[1::2].tolist()))
