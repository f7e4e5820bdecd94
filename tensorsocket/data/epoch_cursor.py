"""Where a consumer is in its epochs, and which ring entries belong to them.

The ring carries the producer's stream: loader batches, each labelled with
its producer epoch and index, and one end-of-epoch marker after each epoch.
A consumer's epoch is cut out of that stream:

- aligned (the default, for a loader with ``len()``): one whole producer
  epoch, from its first batch. A consumer that attached mid-epoch skips to
  the next epoch's start; in a group of ``world_size`` ranks, rank r takes
  batches r, r + world_size, ... of the first ``len // world_size *
  world_size``. The epoch ends with its last batch (len() known), without
  waiting for the producer's marker, which is taken later if it is not
  published yet; or at the marker, or at a batch of the next epoch, when the
  producer's epoch was cut short.
- windowed (``align_epochs=False``, or a loader without ``len()``): the next
  ``len()`` batches from where the consumer started, wrapping into the
  producer's next epoch (docs/usage.md).

``EpochCursor`` holds that state and makes those decisions; it never touches
the ring. The consumer shows it each entry it takes (``place()``) and does
what the answer says (deliver the batch, drop the entry, end the epoch).

A KeyboardInterrupt (a Ctrl-C the loop catches, going on) may land anywhere in the
consumer's next(), and the next next() must go on as if it had not. So every change of
the cursor is one step that an interrupt cannot split (the new values are worked out
first, then set in one statement of plain attribute stores, see ``_apply``), and each is done
at most once per entry (``place()`` of an entry it placed already answers as before;
``taken()`` of one it took already does nothing): the consumer repeats the steps of an
entry it still holds (see ``InFlight``) after an interrupt.
"""

from __future__ import annotations

import enum
from typing import Protocol


class Entry(Protocol):
    """What the cursor reads of a ring entry (a Slot has these)."""

    is_end_of_epoch: bool
    seq: int  # its place in the ring's stream (one entry, one seq)
    epoch: int  # the producer epoch it belongs to
    index: int  # its batch index in that epoch (the batch count, for an end marker)


class Step(enum.Enum):
    """What to do with an entry the consumer took (see EpochCursor.place)."""

    TAKE = "take"  # a batch of this epoch: make it, call taken(), and deliver it
    DROP = "drop"  # not this consumer's (another rank's batch, an end marker): next one
    SKIP = "skip"  # a batch before the epoch start this consumer waits for: next one
    END = "end"  # the epoch ended here; the entry (its end marker) is used up
    END_BEFORE = "end_before"  # the epoch ended before this entry: keep it for the next


class Abandon(enum.Enum):
    """What leaving an epoch before its StopIteration amounts to (EpochCursor.abandon)."""

    NOTHING = "nothing"  # not the current epoch (an old iterator): nothing to do
    UNSTARTED = "unstarted"  # iter() without next(): as if never started
    KEPT = "kept"  # nothing delivered, but batches taken: the next iterator goes on with it
    COMPLETE = "complete"  # every batch was delivered: the epoch is done
    LEFT = "left"  # left mid-way (break): done; the next starts at a producer epoch start


class EpochCursor:
    """The epoch state of one consumer (see the module docstring).

    aligned: whole producer epochs (needs ``length``). length: loader batches per
    producer epoch (None: no len()). rank, world_size: this consumer's place in a
    group (0, 1 alone).

    State, read by the consumer: ``epoch`` (epochs completed), ``in_epoch`` (an
    epoch is being iterated), ``source_done`` (it had its last loader batch),
    ``pulled`` / ``delivered`` (loader batches taken, batches returned in this
    epoch), ``skip`` (batches of this epoch still to skip, from load_state_dict),
    ``end_marker_unread`` (the epoch ended with its last batch before the
    producer's end marker came: the next entry is that marker, an entry of the
    ring but no batch).
    """

    def __init__(self, aligned: bool, length: int | None, rank: int = 0,
                 world_size: int = 1) -> None:
        """A consumer before its first epoch."""
        self.aligned = aligned
        self.length = length
        self.rank = rank
        self.world_size = world_size
        self.epoch = 0
        self.in_epoch = False
        self.source_done = False
        self.pulled = 0
        self.delivered = 0
        self.group_taken = 0  # batches this rank took in the current epoch
        self.skip = 0
        self.resume_skip = 0  # batches of the next epoch to skip (load_state_dict)
        # Windowed, resumed by count: the next epoch starts at a producer epoch's first
        # batch (`from_start` while it looks for it), where the batches counted were taken.
        self.from_start_next = False
        self.from_start = False
        # Exact resume (load_state_dict with the samples taken): the next epoch is a
        # resumed one, and `resuming` while it is iterated. A resumed epoch reads every
        # batch (the consumer keeps the samples not yet taken): alone, from where it is
        # for one producer epoch (windowed); in a group, one producer epoch from its start.
        self.resume_next = False
        self.resume_delivered = 0  # batches delivered before the interruption
        self.resuming = False
        self.last_epoch_seen: int | None = None  # producer epoch of the last entry placed
        self.after_end_marker = False  # the last entry taken ended a producer epoch
        self.end_marker_unread = False
        # Aligned: the producer epoch this epoch reads (None: not anchored yet), and the
        # first producer epoch the next one may read.
        self.producer_epoch: int | None = None
        self.want_epoch = 0
        # Windowed: the first producer position (epoch, index) past this epoch.
        self.epoch_end: tuple[int, int] | None = None
        # (seq, step) of the last entry placed in this epoch, and the seq of the last one
        # taken: place() and taken() of the same entry again change nothing.
        self.placed: tuple[int, Step] | None = None
        self.taken_seq = -1

    # -- epochs ------------------------------------------------------------------------

    def begin(self) -> None:
        """A new epoch is iterated (an earlier one was ended or abandoned first)."""
        self.in_epoch = True
        self.source_done = False
        self.pulled = 0
        self.delivered = 0
        self.group_taken = 0
        self.skip, self.resume_skip = self.resume_skip, 0
        self.from_start, self.from_start_next = self.from_start_next, False
        if self.from_start and not self.aligned:
            self.epoch_end = None  # (anchored at the producer epoch start it waits for)
        self.resuming, self.resume_next = self.resume_next, False
        if self.resuming:
            self.delivered = self.resume_delivered
        self.placed = None  # an entry kept for this epoch (END_BEFORE) is placed anew

    def fresh(self) -> bool:
        """Nothing of the current epoch was taken or delivered yet."""
        return self.pulled == 0 and self.delivered == 0

    def end(self) -> None:
        """The current epoch is over (its StopIteration, or left): count it."""
        if self.resuming:
            self.finish_resumed()
        self.in_epoch = False
        self.epoch += 1

    def complete(self, holding: bool) -> bool:
        """Every batch of the current epoch was delivered (its end not reported yet);
        holding: samples of it are still held back (a re-batcher's partial batch)."""
        return self.source_done and not holding

    def idle(self, holding: bool) -> bool:
        """Between epochs: none iterated, or every batch of it delivered (a loop that
        stops at len() leaves the epoch open)."""
        return not self.in_epoch or self.complete(holding)

    def deliver(self) -> int:
        """A batch is returned: its index in this epoch. (The consumer counts its batches
        itself, in the step that returns one; see EpochIterator.__next__.)"""
        index = self.delivered
        self.delivered += 1
        return index

    def abandon(self, epoch: int, holding: bool, dropped: bool = False) -> Abandon:
        """The iterator of `epoch` was dropped or replaced before StopIteration. An epoch
        that delivered nothing is as if never started, or, if it took batches already
        (its first next() was interrupted), goes on with them in the next iterator; one
        that delivered all its batches (a loop that takes exactly len() of them) counts as
        done; otherwise it was left mid-way and the next epoch starts at the producer's
        next one. dropped: batches taken were dropped undelivered (a transform's in
        flight, no longer counted in `delivered`): the epoch is then neither done nor
        kept (the next iterator would go on past them), but left."""
        if not self.in_epoch or self.epoch != epoch:
            return Abandon.NOTHING
        if self.fresh():
            self.in_epoch = False
            return Abandon.UNSTARTED
        if self.delivered == 0 and not dropped:
            return Abandon.KEPT
        complete = self.complete(holding) and not dropped
        self.end()
        if complete:
            return Abandon.COMPLETE
        self._apply(self._next_epoch_whole())
        return Abandon.LEFT

    # -- entries -----------------------------------------------------------------------

    def place(self, entry: Entry) -> Step:
        """Where `entry`, the next ring entry this consumer took, stands in its epoch. The
        same answer, with no change, for the entry placed last (placed again after an
        interrupt); END_BEFORE for any other once the epoch had its last batch."""
        placed, seq = self.placed, entry.seq
        if placed is not None and placed[0] == seq:
            return placed[1]
        if self.source_done and self.in_epoch:
            return Step.END_BEFORE
        self.last_epoch_seen = entry.epoch
        if self.world_size == 1 and self.aligned and entry.epoch == self.producer_epoch \
                and not entry.is_end_of_epoch and not self.resuming:
            # The common case, a batch of the producer epoch being read: in one step of
            # plain stores (no call), as _place_aligned's changes would be.
            self.end_marker_unread = self.after_end_marker = False
            self.pulled += 1
            self.placed = (seq, Step.TAKE)
            return Step.TAKE
        if self._windowed_now():
            step, changes = self._place_windowed(entry)
        else:
            step, changes = self._place_aligned(entry)
        changes["after_end_marker"] = entry.is_end_of_epoch
        changes["placed"] = (entry.seq, step)
        self._apply(changes)
        return step

    def _place_aligned(self, entry: Entry) -> tuple[Step, dict]:
        """place(), aligned: the step and the changes of the cursor, not yet made."""
        want = self.want_epoch
        if entry.is_end_of_epoch:
            if self.producer_epoch is not None and entry.epoch == self.producer_epoch:
                return Step.END, self._source_finished(end_marker_unread=False)
            return Step.DROP, {"want_epoch": max(want, entry.epoch + 1),
                               "end_marker_unread": False}
        changes: dict = {"end_marker_unread": False}
        if self.producer_epoch is None:
            if entry.index != 0 or entry.epoch < want:
                if entry.index != 0:
                    changes["want_epoch"] = max(want, entry.epoch + 1)
                return Step.SKIP, changes
            changes["producer_epoch"] = entry.epoch
        elif entry.epoch != self.producer_epoch:
            # The next epoch began with no end marker for ours: ours ends here.
            return Step.END_BEFORE, self._source_finished(end_marker_unread=False)
        if self.world_size > 1 and not self.resuming:
            if entry.index % self.world_size != self.rank or \
                    entry.index >= self.group_batches() * self.world_size:
                return Step.DROP, changes  # another rank's batch, or one no rank takes
            changes["group_taken"] = self.group_taken + 1
        changes["pulled"] = self.pulled + 1
        return Step.TAKE, changes

    def _place_windowed(self, entry: Entry) -> tuple[Step, dict]:
        """place(), windowed: the step and the changes of the cursor, not yet made."""
        if entry.is_end_of_epoch:
            if self.epoch_end is not None and (entry.epoch + 1, 0) >= self.epoch_end:
                # The producer's epoch ended here (perhaps cut short): the next of ours
                # starts with its next epoch, aligned with it from now on.
                return Step.END, {"source_done": True, "epoch_end": (entry.epoch + 2, 0)}
            return Step.DROP, {}
        if self.epoch_end is None and self.from_start and entry.index != 0:
            return Step.SKIP, {}  # (a producer epoch under way: the count is of another)
        changes: dict = {"pulled": self.pulled + 1}
        if self.epoch_end is None and self.resuming:
            # A resumed epoch looks for its samples to the end of the producer epoch after
            # this one: those before this entry in this epoch are somewhere in the next.
            changes["epoch_end"] = (entry.epoch + (1 if entry.index == 0 else 2), 0)
        elif self.epoch_end is None:  # the first batch since we attached: anchor epochs
            changes["epoch_end"] = (entry.epoch + 1, entry.index)
        return Step.TAKE, changes

    def taken(self, entry: Entry) -> None:
        """The batch of `entry`, which place() said to TAKE, is made: if it was the last of
        this epoch, the source of the epoch is done. Nothing for an entry taken already."""
        seq = entry.seq
        if seq == self.taken_seq:
            return
        changes: dict = {"taken_seq": seq}
        if not self._windowed_now():
            if not self.last_of_epoch(entry.index):
                self.taken_seq = seq  # (the only change: one step)
                return
            changes.update(self._source_finished())
        else:
            assert self.epoch_end is not None
            if (entry.epoch, entry.index + 1) >= self.epoch_end:
                # The next epoch ends a producer epoch later.
                changes.update(source_done=True,
                               epoch_end=(self.epoch_end[0] + 1, self.epoch_end[1]))
        self._apply(changes)

    def _windowed_now(self) -> bool:
        """Whether entries are placed in a window from where the consumer is (align_epochs
        off, or the resumed epoch of a consumer alone), rather than in whole producer
        epochs."""
        if self.resuming:
            return self.world_size == 1
        return not self.aligned

    def finish_resumed(self) -> None:
        """The resumed epoch ends (its rest delivered, or its producer epoch read): the next
        is a whole one, from the start of the producer epoch after the last entry read."""
        changes: dict = {"epoch_end": None, "producer_epoch": None}
        if self.last_epoch_seen is not None:
            changes["want_epoch"] = max(self.want_epoch, self.last_epoch_seen + 1)
        self._apply(changes)
        self.resuming = False

    def group_batches(self) -> int:
        """Loader batches each rank of the group takes per epoch (the same for every
        rank, as DistributedSampler(drop_last=True) gives: the last len % world_size
        loader batches of an epoch go to no rank)."""
        assert self.length is not None
        return self.length // self.world_size

    def last_of_epoch(self, index: int) -> bool:
        """Whether loader batch `index` was this consumer's last of the epoch (known
        only when the loader has a len())."""
        if self.length is None:
            return False
        if self.world_size > 1 and not self.resuming:
            return self.group_taken >= self.group_batches()
        return index >= self.length - 1

    def _apply(self, changes: dict) -> None:
        """Make `changes` (attribute: new value) in one statement of plain stores, which
        no KeyboardInterrupt can split (an interrupt comes at a call, or at a jump back;
        ``self.__dict__.update`` would do too, but it slows every later attribute read of
        the cursor)."""
        get = changes.get
        new = (get("end_marker_unread", self.end_marker_unread),
               get("after_end_marker", self.after_end_marker),
               get("want_epoch", self.want_epoch), get("producer_epoch", self.producer_epoch),
               get("source_done", self.source_done), get("group_taken", self.group_taken),
               get("pulled", self.pulled), get("epoch_end", self.epoch_end),
               get("placed", self.placed), get("taken_seq", self.taken_seq))
        (self.end_marker_unread, self.after_end_marker, self.want_epoch, self.producer_epoch,
         self.source_done, self.group_taken, self.pulled, self.epoch_end, self.placed,
         self.taken_seq) = new

    def _source_finished(self, **more: object) -> dict:
        """The changes for: this epoch had its last loader batch; the next starts with the
        producer's next (with `more` changes)."""
        return {"source_done": True, **self._next_epoch_whole(), **more}

    def _next_epoch_whole(self) -> dict:
        """The changes for: the next epoch is the producer's next one, from its start."""
        if self.producer_epoch is None:
            return {}
        return {"want_epoch": max(self.want_epoch, self.producer_epoch + 1),
                "producer_epoch": None}

    # -- the producer's end marker -----------------------------------------------------

    def wants_end_marker(self) -> bool:
        """After an aligned epoch that ended with its last batch, before the producer's
        end marker: the marker should be taken now if it is published already, so that
        nothing of the finished epoch stays unread."""
        return self.aligned and not self.after_end_marker

    def marker_unpublished(self) -> None:
        """The end marker wanted is not published yet: it is the next entry."""
        self.end_marker_unread = True

    def ends_finished_epoch(self, entry: Entry) -> bool:
        """Whether `entry`, taken right after an epoch ended, is the end marker of that
        epoch (used up), rather than an entry of the next epoch (to keep for it)."""
        if entry.is_end_of_epoch and entry.epoch < self.want_epoch:
            self.after_end_marker = True
            return True
        return False

    # -- leaving and attaching again ---------------------------------------------------

    def parked(self) -> None:
        """The consumer left the ring: the producer drops or keeps the marker unread."""
        self.end_marker_unread = False

    def attached_again(self) -> None:
        """The consumer took a new place in the ring: epochs are anchored again at the
        next batch; an epoch cut short is followed by a whole one."""
        self._apply({"epoch_end": None, **self._next_epoch_whole()})

    def rejoined(self) -> bool:
        """The consumer was detached for lagging and took a new place as a late joiner:
        whether the current epoch, which had batches, ends here (its source is done)."""
        if self.pulled > 0:
            self.source_done = True
            return True
        return False

    def finished_between_windows(self) -> bool:
        """The producer finished: whether this was a windowed epoch that spans two producer
        epochs and the producer stopped after the first (the epoch ends with what came,
        with a warning); else the epoch is over (the consumer raises)."""
        if self.pulled > 0 and self.after_end_marker:
            self.source_done = True
            return True
        self.in_epoch = False
        return False

    def resume(self, epoch: int, skip: int, exact: bool) -> None:
        """load_state_dict(): continue after `epoch` epochs, `skip` batches of the next one
        taken before the state was saved. exact: the consumer knows which samples those
        were, and the next epoch is a resumed one (see __init__) that starts counting at
        `skip`; else its first `skip` batches are skipped, counted from the first batch
        of a producer epoch (windowed, a consumer skips to the next one: the count is of
        an epoch from its start)."""
        if self.in_epoch:
            raise RuntimeError("load_state_dict() in the middle of an epoch: call it before "
                               "iterating the consumer")
        self.epoch = epoch
        self.resume_skip = 0 if exact else skip
        self.resume_next, self.resume_delivered = exact, skip if exact else 0
        self.from_start_next = not exact


class InFlight:
    """What a consumer's next() took and has not yet returned, and its counts of what it
    did return: the state that a KeyboardInterrupt landing anywhere in next() must leave
    whole. Each field is set in a step with no Python call in it (a plain object's
    attributes: a share() consumer's own go through its __setattr__), so an interrupt
    finds a batch either returned and counted, or still here for the next next().

    entry: [Slot or None], the ring entry taken and not yet used up (Ring.acquire puts it
    there itself, so that an interrupt as the call returns cannot lose it; an entry kept
    for the next epoch, too). loaded: (batch, samples or None), the loader batch made of
    it, not yet handed on. ready: (batch, samples), the batch next() returns next.
    """

    __slots__ = ("entry", "loaded", "ready", "batches", "samples", "loader_batches", "bytes",
                 "waited")

    def __init__(self) -> None:
        """Nothing taken yet."""
        self.entry: list = [None]
        self.loaded: tuple | None = None
        self.ready: tuple | None = None
        self.batches = 0  # delivered
        self.samples = 0  # in the batches delivered
        self.loader_batches = 0  # ring entries made into batches
        self.bytes = 0  # ... and their bytes
        self.waited = 0.0  # seconds the common path (Lane) waited in the core for entries

    def drop(self) -> None:
        """Forget the batches made of the current epoch (it was left)."""
        self.loaded = self.ready = None
